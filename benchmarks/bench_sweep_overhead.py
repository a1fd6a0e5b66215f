"""Overhead of the ablation runner per trial: a one-trial sweep vs `train` of the same config, side by side.

    .venv/bin/python benchmarks/bench_sweep_overhead.py [--steps 300] [--reps 2]

Both are launched as fresh processes (the way a user runs them), alternately, each into a new run directory;
the token shards are cached once before timing. The runner's overhead = sweep time / train time - 1
(study creation, MLflow parent run, claiming, tracking, report). Goal: under 5% for one-minute trials.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    cfg = yaml.safe_load((ROOT / "experiments/cpu/looped-mesh.yaml").read_text())
    cfg["model"]["preset"] = "cpu-tiny"
    cfg["data"].update(seq_len=128, batch_size=16)
    cfg["train"].update(
        max_steps=args.steps, val_every=args.steps // 2, checkpoint_every=args.steps // 3, progress=False
    )
    cfg_file = tmp / "trial.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    sweep = {"name": "bench-overhead", "base": str(cfg_file), "axes": {"train.seed": [0]}}
    sweep_file = tmp / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(sweep))
    py = [sys.executable, "-m", "recursive_lightning"]
    timed(
        py + ["train", "--config", str(cfg_file), "--run-dir", str(tmp / "warm"), "--max-steps", "2"]
    )  # shards
    t_train, t_sweep = [], []
    for i in range(args.reps):
        t_train.append(timed(py + ["train", "--config", str(cfg_file), "--run-dir", str(tmp / f"train{i}")]))
        t_sweep.append(timed(py + ["sweep", str(sweep_file), "--run-dir", str(tmp / f"sweep{i}")]))
    a, b = statistics.median(t_train), statistics.median(t_sweep)
    print(f"{args.steps} steps of cpu-tiny 2+4R2+2 mesh, {args.reps} alternating reps (median wall seconds)")
    print(f"train  {a:7.1f} s   {t_train}")
    print(f"sweep  {b:7.1f} s   {t_sweep}")
    print(f"runner overhead per trial: {100 * (b / a - 1):+.1f}%")


if __name__ == "__main__":
    main()
