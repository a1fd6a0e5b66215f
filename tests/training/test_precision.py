"""``train.precision: auto`` on the CPU: bf16-mixed only where it trains faster (benchmarks/bench_precision.py)."""

import pytest

from recursive_lightning.config import RunConfig, TrainConfig
from recursive_lightning.model.config import preset
from recursive_lightning.training import parallel
from recursive_lightning.training.trainer import build_trainer


@pytest.mark.parametrize("native", [True, False])
def test_auto_picks_bf16_on_a_native_bf16_cpu_only_for_wide_models(monkeypatch, native):
    monkeypatch.setattr(parallel, "native_bf16", lambda: native)
    auto, bf16 = TrainConfig(), "bf16-mixed" if native else "32-true"
    for name, expected in {
        "cpu-tiny": "32-true",  # d_model 64: bf16 2.1x slower
        "cpu-small": bf16,  # 128
        "cpu-mela": "32-true",  # 128, Mela: bf16 1.14x slower
        "mela-400m": bf16,
        "pythia-160m": bf16,
    }.items():
        assert parallel.resolve_precision(auto, "cpu", preset(name)) == expected, name
    assert (
        parallel.resolve_precision(TrainConfig(precision="bf16-mixed"), "cpu", preset("cpu-tiny"))
        == "bf16-mixed"
    )


@pytest.mark.parametrize("preset_,expected", [("cpu-tiny", "32-true"), ("cpu-small", "bf16-mixed")])
def test_the_trainer_gets_the_precision_of_its_model_width(monkeypatch, preset_, expected):
    """The width is the run's model's (cpu-tiny: d_model 64; cpu-small: 128), on a CPU with native bf16."""
    monkeypatch.setattr(parallel, "native_bf16", lambda: True)
    cfg = RunConfig.from_dict({"model": {"preset": preset_}, "train": {"accelerator": "cpu"}})
    assert build_trainer(cfg, validate_only=True).precision == expected
