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


def test_a_resume_continues_in_the_precision_its_checkpoint_trained_in(monkeypatch, tmp_path, trained_run):
    """A checkpoint records what `auto` resolved to and a resume keeps it, whatever `auto` would pick now; a
    checkpoint written before the record existed resumes under the rule of its time (bf16-mixed on any CPU
    with native bf16). Explicit precisions are left to the config (fails with the record not read, or not
    written)."""
    import torch

    from recursive_lightning.training.resume import resumed_precision

    last = trained_run / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    assert (
        ckpt["recursive_lightning"]["precision"]
        == build_trainer(
            RunConfig.from_dict(ckpt["recursive_lightning"]["run"]), validate_only=True
        ).precision
    )
    cfg = RunConfig.from_dict({"model": {"preset": "cpu-tiny"}})
    for native in (True, False):
        monkeypatch.setattr(parallel, "native_bf16", lambda native=native: native)
        ckpt["recursive_lightning"]["precision"] = "bf16-mixed"
        torch.save(ckpt, tmp_path / "recorded.ckpt")
        assert resumed_precision(cfg, str(tmp_path / "recorded.ckpt")) == "bf16-mixed"
        del ckpt["recursive_lightning"]["precision"]
        torch.save(ckpt, tmp_path / "old.ckpt")
        assert resumed_precision(cfg, str(tmp_path / "old.ckpt")) == ("bf16-mixed" if native else "32-true")
    assert resumed_precision(cfg, None) is None
    explicit = RunConfig.from_dict({"model": {"preset": "cpu-tiny"}, "train": {"precision": "32-true"}})
    assert resumed_precision(explicit, str(tmp_path / "recorded.ckpt")) is None
