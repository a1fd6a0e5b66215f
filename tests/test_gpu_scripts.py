"""The GPU benchmark scripts run on the CPU (``--smoke``), so that a lent GPU's few minutes are not spent on a
script that no longer runs: every goal line and table is printed. Nothing here is timed."""

from __future__ import annotations

import subprocess
import sys

from conftest import ENV, ROOT


def _smoke(script: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_bench_gpu_smoke_prints_every_goal():
    out = _smoke("bench_gpu.py", "--goals", "--modes", "eager,graphs")
    for mode in ("eager", "graphs"):  # graphs: train.cuda_graphs' step, run eagerly on the CPU
        assert f"cpu-tiny L=64 x2 {mode}: spiral/looped time" in out
        rows = [r for r in out.splitlines() if r.startswith(f"| cpu-tiny | 64 | 2 | {mode} |")]
        assert [r.split(" | ")[4] for r in rows] == ["looped mesh", "spiral-B mesh", "looped base"]
    assert "causal FLOP ratio" in out and "+mesh" in out  # the goal lines, PASS or MISS


def test_bench_gpu_mela_smoke_prints_train_and_eval():
    out = _smoke("bench_gpu_mela.py")
    assert "failed" not in _smoke("bench_gpu_mela.py", "--part", "train", "--graphs")
    for model in ("| Mela |", "| Mela decoder alone |", "| Transformer++ |"):
        assert model in out
    assert "memory's wall-clock share" in out and "Mela / Transformer++ time" in out
    assert "pieces of 512 tokens" in out  # cpu-mela streams 8 chunks of 64 tokens
    assert "| 512 |" in out and "| 1,024 |" in out and "eval memory flat" in out
