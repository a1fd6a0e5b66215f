"""Wall time of the commands that read a checkpoint, as a user runs them (a fresh process each: imports, the
checkpoint, the work), interleaved over ``--reps`` rounds; medians.

    OMP_NUM_THREADS=1 python benchmarks/bench_startup.py --reps 5 --against /tmp/old

The checkpoint is a 4-step cpu-tiny run (looped ``1+2R2+1``, MeSH) trained first. ``--against DIR``:
another checkout (``git archive <commit> | tar -x -C DIR``) timed the same way, interleaved with this one."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--against", help="another checkout's root, timed interleaved with this one")
    args = p.parse_args()
    roots = {"this": ROOT, **({"against": Path(args.against).resolve()} if args.against else {})}
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        config = Path(tmp) / "tiny.yaml"
        config.write_text(
            "name: startup\nmodel: {preset: cpu-tiny, layout: 1+2R2+1, topology: mesh}\n"
            "data: {tokenizer: 'bpe:4096', seq_len: 64, batch_size: 8, val_batches: 4}\n"
            "train: {max_steps: 4, val_every: 4, checkpoint_every: 4, progress: false}\n"
        )
        subprocess.run(
            [sys.executable, "-m", "recursive_lightning", "train", "--config", str(config), "--run-dir", str(run)],
            cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        ckpt = str(run / "checkpoints" / "last.ckpt")
        commands = {
            "generate 16 tokens": ["generate", ckpt, "--prompt", "The", "--max-new-tokens", "16"],
            "eval held-out perplexity": [
                "eval",
                ckpt,
                "--ppl",
                "heldout=embedded:heldout",
                "--tasks",
                "none",
                "--no-mlflow",
            ],
            "describe --preset cpu-tiny": ["describe", "--preset", "cpu-tiny"],
        }
        times: dict[str, list[float]] = {f"{c} ({r})": [] for c in commands for r in roots}
        for _ in range(args.reps):
            for name, argv in commands.items():
                for label, root in roots.items():
                    t0 = time.perf_counter()
                    subprocess.run(
                        [sys.executable, "-m", "recursive_lightning", *argv],
                        env={**os.environ, "PYTHONPATH": str(root)},
                        cwd=root,
                        check=True,
                        stdout=subprocess.DEVNULL,
                    )
                    times[f"{name} ({label})"].append(time.perf_counter() - t0)
    print(
        f"fresh-process wall seconds, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"{args.reps} interleaved reps, medians; load average {os.getloadavg()[0]:.1f}"
    )
    for name, ts in times.items():
        print(f"  {name:<45} {statistics.median(ts):6.2f} s")


if __name__ == "__main__":
    main()
