"""train.loops (Huginn Sec. 3.3): loop counts drawn per (seed, step), their distribution, the config's
refusals, describe's expected training FLOPs, gradients under truncation, and an exact resume after a kill."""

import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from recursive_lightning.config import RunConfig
from recursive_lightning.errors import ConfigError
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.describe import describe
from recursive_lightning.sampled_loops import LoopSchedule
from recursive_lightning.training.loop_flops import LoopFlops, expected_training_flops
from recursive_lightning.training.module import RecursiveLMModule
from recursive_lightning.training.run import train

ROOT = Path(__file__).resolve().parents[2]
HUGINN = {"distribution": "poisson-lognormal", "mean": 4, "backprop": 2}


def test_loop_counts_are_a_pure_function_of_seed_and_step():
    a, b = LoopSchedule.parse(HUGINN), LoopSchedule.parse(dict(HUGINN))  # two "ranks", each its own schedule
    steps = range(500)
    first = [a.sample(7, s) for s in steps]
    assert first == [b.sample(7, s) for s in steps] == [a.sample(7, s) for s in steps]
    assert first != [a.sample(8, s) for s in steps]  # the seed matters
    assert len(set(first)) > 3  # and the step: not one constant


@pytest.mark.parametrize(
    "spec",
    [
        HUGINN,
        {"distribution": "poisson-lognormal", "mean": 6.5, "sigma": 0.3},
        {"distribution": "uniform", "low": 2, "high": 6},
    ],
    ids=["huginn-mean-4", "mean-6.5", "uniform-2-6"],
)
def test_draws_follow_the_distribution_and_its_mean(spec):
    schedule = LoopSchedule.parse(spec)
    pmf = schedule.pmf()
    assert abs(sum(pmf.values()) - 1) < 2e-9 and min(pmf) >= 1
    mean = schedule.expectation(float)
    target = spec.get("mean", (spec.get("low", 0) + spec.get("high", 0)) / 2)
    assert abs(mean - target) < 1e-6  # E[r] = M: r_bar = M - 1 in Huginn's Eq. 2
    n = 20000
    draws = [schedule.sample(0, s) for s in range(n)]
    sd = math.sqrt(schedule.expectation(lambda k: (k - mean) ** 2))
    assert abs(sum(draws) / n - target) < 4 * sd / math.sqrt(n)
    freq = Counter(draws)
    for k, p in pmf.items():  # each count's share within 4 standard errors of its probability
        assert abs(freq[k] / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3, k


@pytest.mark.parametrize(
    "loops,model,field",
    [
        ({"distribution": "gamma", "mean": 4}, {}, "train.loops.distribution"),
        ({"distribution": "poisson-lognormal", "mean": 0.5}, {}, "train.loops.mean"),
        ({"distribution": "poisson-lognormal"}, {}, "train.loops.mean"),
        ({"distribution": "poisson-lognormal", "mean": 4, "sigma": 0}, {}, "train.loops.sigma"),
        ({"distribution": "poisson-lognormal", "mean": 4, "low": 2}, {}, "train.loops.low"),
        ({"distribution": "uniform", "low": 5, "high": 2}, {}, "train.loops.low"),
        ({"distribution": "uniform", "low": 0, "high": 2}, {}, "train.loops.low"),
        ({"distribution": "uniform", "low": 1, "high": 2, "backprop": 0}, {}, "train.loops.backprop"),
        ({"distribution": "uniform", "low": 1, "high": 2, "backprop": 1.5}, {}, "train.loops.backprop"),
        ("poisson-lognormal", {}, "train.loops must be a mapping"),
        (HUGINN, {"layout": "4", "topology": "base"}, "model.layout '4'"),
        (HUGINN, {"layout": "1+2+2+1"}, "model.layout '1+2+2+1'"),
    ],
)
def test_every_bad_field_is_one_sentence_naming_it(loops, model, field, tiny_run):
    cfg = tiny_run(**model)
    cfg["train"]["loops"] = loops
    with pytest.raises(ConfigError, match=r"^[^\n]*$") as e:
        RunConfig.from_dict(cfg)
    assert field in str(e.value) and "train.loops" in str(e.value)


def test_mela_is_refused_with_its_own_dial(tiny_run):
    cfg = tiny_run(
        arch="mela", topology="base", layout="2", patch_size=2, chunk_size=4, h_cycles=2, l_cycles=2
    )
    cfg["train"]["loops"] = HUGINN
    with pytest.raises(ConfigError, match=r"Mela's depth dial is its high-level cycles \(model.h_cycles\)"):
        RunConfig.from_dict(cfg)


def test_resolved_config_gives_every_field():
    cfg = RunConfig.from_dict(
        {"model": {"preset": "cpu-tiny", "layout": "1+2R2+1"}, "train": {"loops": HUGINN}}
    )
    assert cfg.train.loops == {**HUGINN, "sigma": 0.5}
    assert RunConfig.from_dict(cfg.to_dict()).train.loops == cfg.train.loops  # round trip


def test_describe_expected_flops_are_the_hand_sum_for_a_uniform_distribution():
    cfg = ModelConfig.from_dict(
        {"preset": "cpu-tiny", "layout": "1+2R3+1", "topology": "anchor", "max_seq_len": 64}
    )
    seq = 32
    out = expected_training_flops(cfg, seq, {"distribution": "uniform", "low": 2, "high": 5, "backprop": 1})
    fwd = {k: describe(cfg, seq, loops=k)["flops_forward"] for k in range(1, 6)}
    # full resolution: the part with gradients of r steps, backprop 1, is the forward at one loop step
    hand = sum((fwd[k] + 2 * fwd[1]) / 4 for k in range(2, 6)) / seq
    assert out["flops_train_per_token_expected"] == pytest.approx(hand, rel=1e-12)
    assert out["flops_train_per_token_at_trained_depth"] == 3 * fwd[3] / seq
    assert out["train_loops_mean"] == 3.5


@pytest.mark.parametrize("layout,topology", [("1+2R2+1", "mesh"), ("1+2x{1/2,1}+1", "static")])
def test_extended_depths_equal_counted_ones(layout, topology):
    cfg = ModelConfig.from_dict(
        {"preset": "cpu-tiny", "layout": layout, "topology": topology, "max_seq_len": 64}
    )
    flops = LoopFlops(cfg, 32, backprop=2)
    for k in (flops.counted_up_to + 1, flops.counted_up_to + 3):
        assert flops.counts(k) == flops._count(k)  # extended (affine) vs a meta forward at k
        assert flops.counts(k)[0] == describe(cfg, 32, loops=k)["flops_forward"]


@pytest.mark.parametrize("topology", ["anchor", "base"])
def test_truncated_backprop_reaches_every_parameter_with_an_anchor(topology, tiny_run):
    cfg = tiny_run(layout="1+2R2+1", topology=topology)
    cfg["train"]["loops"] = {"distribution": "uniform", "low": 5, "high": 5, "backprop": 2}
    module = RecursiveLMModule(RunConfig.from_dict(cfg).to_dict())
    batch = torch.randint(0, 4096, (2, 17))
    loss, _ = module.training_loss(batch, module.loop_schedule.sample(0, 0))
    loss.backward()
    assert module.model.loops is None and module.model.backprop_loops is None  # back at K for validation
    dead = sorted(
        n for n, p in module.model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0
    )
    if topology == "anchor":  # h^(t+1) = f(h^(t)) + h^(0): the prelude reaches every differentiated step
        assert dead == []
    else:  # base: the state entering the first differentiated step is detached (docs/training.md's reading)
        assert any(n.startswith("prelude.") for n in dead)
        assert all(n.startswith(("prelude.", "embed.")) for n in dead)  # the embedding: through the prelude


def _history(run_dir: Path, key: str) -> dict[int, float]:
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    c = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    return {m.step: m.value for m in sorted(c.get_metric_history(run_id, key), key=lambda m: m.timestamp)}


def test_killed_run_resumes_to_identical_losses_and_loop_counts(tmp_path, tiny_run):
    cfg = tiny_run(topology="anchor")
    cfg["train"].update(
        max_steps=10, val_every=5, loops={"distribution": "poisson-lognormal", "mean": 2.5, "backprop": 1}
    )
    run = RunConfig.from_dict(cfg)
    straight = tmp_path / "straight"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the CLI runs so narrow a model (docs/training.md): the same float sums
    try:
        train(run, straight)
        _killed_and_resumed(cfg, run, tmp_path)
    finally:
        torch.set_num_threads(threads)
    killed = tmp_path / "killed"
    for key in ("train/loss", "train/loops"):
        a, b = _history(straight, key), _history(killed, key)
        assert sorted(a) == sorted(b) == list(range(10)), key
        assert a == b, key
    loops = _history(straight, "train/loops")
    schedule = LoopSchedule.parse(run.train.loops)
    assert loops == {s: schedule.sample(0, s) for s in range(10)} and len(set(loops.values())) > 1


def _killed_and_resumed(cfg: dict, run: RunConfig, tmp_path: Path) -> None:
    import yaml

    cfg_file, killed = tmp_path / "run.yaml", tmp_path / "killed"
    cfg_file.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env["RECURSIVE_LIGHTNING_FAULT"] = "training_step:7"  # SIGKILL inside step 7, after the step-4 checkpoint
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "recursive_lightning",
            "train",
            "--config",
            str(cfg_file),
            "--run-dir",
            str(killed),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == -9, p.stdout + p.stderr
    assert (killed / "checkpoints" / "step=000004.ckpt").exists()
    train(run, killed, resume=True)


def test_mfu_counts_each_steps_own_flops(tmp_path, tiny_run, monkeypatch):
    from recursive_lightning.training import module

    monkeypatch.setattr(module, "accelerator_peak_flops", lambda: 1e12)  # MFU on the CPU too
    cfg = tiny_run(topology="anchor")
    cfg["train"].update(
        max_steps=6, val_every=6, loops={"distribution": "uniform", "low": 1, "high": 4, "backprop": 1}
    )
    run = RunConfig.from_dict(cfg)
    train(run, tmp_path / "run")
    loops, tps, mfu = (
        _history(tmp_path / "run", k) for k in ("train/loops", "train/tokens_per_sec", "train/mfu")
    )
    assert sorted(mfu) == list(range(1, 6)) and len({loops[s] for s in mfu}) > 1  # the first step: warm-up
    flops = LoopFlops(run.model, run.data.seq_len, backprop=1)
    for s in mfu:  # MFU = tokens/s x the step's FLOPs per token at its sampled depth / peak
        per_token = flops.training(int(loops[s])) / run.data.seq_len
        assert mfu[s] == pytest.approx(tps[s] * per_token / 1e12, rel=1e-6), s
