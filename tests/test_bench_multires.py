"""``benchmarks/bench_multires.py``'s diagnostic modes run and do what they say. Nothing here is timed."""

from __future__ import annotations

import subprocess
import sys

import torch
from conftest import ENV, ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_multires  # noqa: E402


def _args(*extra: str):
    p = bench_multires.argparse.ArgumentParser()
    p.add_argument("--preset", default="cpu-tiny")
    p.add_argument("--spiral", default="2+4x{1/8,1/4,1/2,1}+2")
    p.add_argument("--looped", default="2+4x{1,1}+2")
    p.add_argument("--topology", default="mesh")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--compile", default=None)
    p.add_argument("--free-glue", action="store_true")
    return p.parse_args(list(extra))


def test_free_glue_keeps_the_core_passes_and_drops_the_learned_glue():
    """The stand-ins feed the core the lengths the model's S_down does, return (b, L, d), and leave the scorer
    and allocator (Eqs. 17, 21) out of the graph: a bound on the glue, not the model."""
    real, free = bench_multires.build(_args(), "spiral"), bench_multires.build(_args("--free-glue"), "spiral")
    h = torch.randn(2, 128, real.cfg.d_model)
    for a, b in zip(real.steps, free.steps):
        if a.full_resolution:
            continue
        assert b.down(h).shape == a.down(h).shape  # L_t = floor((L + ω) / g) positions (Eq. 13)
        z = a.down(h)
        assert b.up(z, 128).shape == a.up(z, 128).shape == h.shape
    idx = torch.randint(0, real.cfg.vocab_size, (2, 128))
    free.loss(idx, idx).backward()
    steps = [s for s in free.steps if not s.full_resolution]
    assert all(p.grad is None for s in steps for p in (*s.scorer.parameters(), *s.allocator.parameters()))
    assert all(p.grad is not None for p in free.cores[0].parameters())


def test_attention_table_and_both_goals_printed():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_multires.py"),
            *("--preset", "cpu-tiny", "--seq-len", "64", "--batch", "2", "--reps", "1", "--warmup", "0"),
            *("--threads", "1", "--one-process", "--free-glue", "--attention"),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "goal: <=" in out.stdout and "stricter: <=" in out.stdout
    lengths = [
        r.split(" | ")[0].strip("| ") for r in out.stdout.splitlines() if r.startswith("| ") and "|" in r
    ]
    for n in ("8", "16", "32", "64"):  # (64 + ω) // g for g = 8, 4, 2, 1
        assert n in lengths
