"""``train.precision: auto`` on the CPU: bf16-mixed only where it trains faster (benchmarks/bench_precision.py)."""

import pytest
import torch

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


@pytest.fixture
def matmul_precision():
    """torch's float32 matmul precision, restored after the test."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize(
    "precision,device,chosen,switched",
    [
        ("bf16-mixed", "cuda", "highest", True),
        ("16-mixed", "cuda", "highest", True),
        ("32-true", "cuda", "highest", False),  # full float32 asked for
        ("bf16-mixed", "cpu", "highest", False),
        ("bf16-mixed", "cuda", "medium", False),  # the user's own choice
    ],
)
def test_tf32_for_the_float32_gemms_only_under_mixed_precision_on_cuda(
    matmul_precision, precision, device, chosen, switched
):
    """Mela's memory GEMMs stay float32 under autocast; on CUDA under bf16 / fp16 autocast they run on TF32
    (torch's float32 matmul precision ``high``) while training runs, whose error stays within the spread of the
    decoder's own rounding (docs/models.md: Mela); otherwise, and where the user chose a precision, nothing changes;
    the precision is the user's again afterwards."""
    torch.set_float32_matmul_precision(chosen)
    with parallel.tf32_under_mixed_precision(precision, device) as did:
        assert did is switched
        assert torch.get_float32_matmul_precision() == ("high" if switched else chosen)
    assert torch.get_float32_matmul_precision() == chosen


def test_training_on_the_cpu_leaves_float32_gemms_alone(matmul_precision, tmp_path, tiny_run, monkeypatch):
    """``train`` runs its fit inside ``tf32_under_mixed_precision`` with the trainer's precision and device."""
    from recursive_lightning.training.run import train

    seen = []
    real = parallel.tf32_under_mixed_precision

    def spy(precision, device):
        seen.append((precision, device))
        return real(precision, device)

    monkeypatch.setattr(parallel, "tf32_under_mixed_precision", spy)
    cfg = tiny_run()
    cfg["train"].update(
        max_steps=1, val_every=1, checkpoint_every=1, accelerator="cpu", precision="bf16-mixed"
    )
    train(RunConfig.from_dict(cfg), tmp_path / "run")
    assert seen == [("bf16-mixed", "cpu")]
    assert torch.get_float32_matmul_precision() == "highest"
