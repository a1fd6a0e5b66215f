"""Time to the first compiled training step, with inductor's cache empty and then holding the first run's graphs.

    python benchmarks/bench_compile_cache.py                                   # cpu-tiny 1+1R2+1, compile: layers
    python benchmarks/bench_compile_cache.py --compile model --layout 1+2R2+1 --topology mesh
    python benchmarks/bench_compile_cache.py --preset pythia-410m --layout 4+8R2+4 --seq-len 4096 --batch 4 \\
        --compile model --accelerator gpu --precision bf16-mixed                 # on a GPU

Two ``train`` commands of one config, each a fresh process as a user starts them, one optimizer step each, with
``TORCHINDUCTOR_CACHE_DIR`` a new empty folder: the first builds every graph (cold), the second finds them in the
cache (warm). For each: the first step's seconds and graphs the run prints (``[train] first step ready in ...``,
``training/parallel.py: first_step_line``) and the process's wall-clock. Default threads unless
``OMP_NUM_THREADS`` is set.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(
    r"first step ready in ([\d.]+) s; train\.compile \w+: (\d+) graph\(s\) compiled, (\d+) of them"
)


def one_run(args, tmp: Path, name: str, env: dict) -> tuple[float, int, int, float]:
    """(first step seconds, graphs compiled, graphs from the cache, process wall seconds) of one ``train``."""
    overrides = {
        "model.preset": args.preset,
        "model.layout": args.layout,
        "model.topology": args.topology,
        "model.max_seq_len": args.seq_len,
        "data.seq_len": args.seq_len,
        "data.batch_size": args.batch,
        "data.val_batches": 1,
        "train.max_steps": 1,
        "train.val_every": 1,
        "train.checkpoint_every": 1,
        "train.progress": "false",
        "train.compile": args.compile,
        "train.accelerator": args.accelerator,
        "train.precision": args.precision,
    }
    cmd = [
        sys.executable,
        "-m",
        "recursive_lightning",
        "train",
        "--config",
        args.config,
        "--run-dir",
        tmp / name,
    ]
    for key, value in overrides.items():
        cmd += [f"--{key}", str(value)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    found = LINE.search(p.stdout + p.stderr)
    if p.returncode or not found:
        raise SystemExit(f"train failed (exit {p.returncode}):\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return float(found[1]), int(found[2]), int(found[3]), wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "experiments/cpu/looped-base.yaml"))
    p.add_argument("--preset", default="cpu-tiny")
    p.add_argument("--layout", default="1+1R2+1")
    p.add_argument("--topology", default="base")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--compile", default="layers", choices=["layers", "glue", "model"])
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--precision", default="auto")
    args = p.parse_args()
    import torch  # heavy

    threads = os.environ.get("OMP_NUM_THREADS", f"default ({torch.get_num_threads()})")
    print(f"torch {torch.__version__}; {args.preset} {args.layout} {args.topology}, {args.batch} x {args.seq_len}, "
          f"train.compile {args.compile}, {args.accelerator}, threads {threads}")  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
        for name in ("cold", "warm"):
            rows.append((name, *one_run(args, Path(tmp), name, env)))
    print("\n| inductor cache | first step s | graphs compiled | from the cache | process wall s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, first, made, loaded, wall in rows:
        print(f"| {name} | {first:.1f} | {made} | {loaded} | {wall:.1f} |")
    print(f"\nwarm / cold first step: {rows[1][1] / rows[0][1]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
