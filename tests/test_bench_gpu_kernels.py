"""``benchmarks/bench_gpu_kernels.py`` runs on the CPU (``--smoke``), so the script a lent GPU runs cannot rot: one
row per operation for both model kinds, and the comparison's plumbing (differences, verdicts) with a stand-in
for liger-kernel. Nothing here is timed."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gpu_kernels as bench  # noqa: E402


@pytest.mark.parametrize("preset", ["transformerpp-400m", "pythia-410m"])
def test_every_operation_runs_and_says_liger_is_missing(preset, capsys):
    assert bench.main(["--smoke", "--preset", preset]) == 0
    rows = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line
    ]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| loss", "| norm", "| mlp activation", "| rotary"]
    assert all("no liger-kernel" in r or "does not apply" in r for r in rows[1:])


def test_a_stand_in_for_liger_agrees_and_gets_a_verdict(monkeypatch, capsys):
    """Liger replaced by the model's own operations (what the GPU run compares): every difference is 0 and
    every operation gets a verdict line."""
    ops = {}

    def same(name, cfg, seq, dtype, device):
        return ops[name]

    real = bench.operations

    def remember(*args):
        found = real(*args)
        ops.update({liger: ours for _, ours, liger in found.values() if liger})
        return found

    monkeypatch.setattr(bench, "operations", remember)
    monkeypatch.setattr(bench, "liger_op", same)
    assert bench.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    verdicts = [line for line in out.splitlines() if line.startswith(("LIGER FASTER", "OURS FASTER"))]
    assert len(verdicts) == 4 and all("(agrees, 0.0e+00)" in v for v in verdicts), out
