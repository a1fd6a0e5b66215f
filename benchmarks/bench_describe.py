"""Wall time of ``python -m recursive_lightning describe --preset P`` for every preset, as a user runs it
(a fresh process: imports, meta-device build, FLOP count), interleaved over ``--reps`` rounds; medians.

    OMP_NUM_THREADS=1 python benchmarks/bench_describe.py --reps 3

    OMP_NUM_THREADS=1 python benchmarks/bench_describe.py --presets mela-400m cpu-mela --against /tmp/old

``--against DIR``: another checkout (e.g. ``git archive <commit> | tar -x -C DIR``) timed the same way,
interleaved with this one. Each round also times ``python -c "import torch, sympy"`` (the floor: torch's
meta kernels import sympy), so a loaded machine's figures can be read against it. Goal: under
3 s for every preset on a quiet machine."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from recursive_lightning.model.config import PRESETS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--presets", nargs="*", default=list(PRESETS))
    p.add_argument("--against", help="another checkout's root, timed interleaved with this one")
    args = p.parse_args()
    roots = {"this": ROOT, **({"against": Path(args.against).resolve()} if args.against else {})}
    times: dict[str, list[float]] = {
        f"{k} {r}" if args.against else k: [] for k in args.presets for r in roots
    }
    floor: list[float] = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, sympy"], check=True)
        floor.append(time.perf_counter() - t0)
        for name in args.presets:
            for label, root in roots.items():
                t0 = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-m", "recursive_lightning", "describe", "--preset", name],
                    env={**os.environ, "PYTHONPATH": str(root)},
                    check=True,
                    stdout=subprocess.DEVNULL,
                    cwd=root,
                )
                times[f"{name} {label}" if args.against else name].append(time.perf_counter() - t0)
    print(
        f"describe --preset P (seq_len 4096), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"{args.reps} interleaved reps, median wall seconds of a fresh process; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    for name, ts in times.items():
        print(f"  {name:<30} {statistics.median(ts):6.2f} s")
    print(f"  slowest                        {max(statistics.median(t) for t in times.values()):6.2f} s")
    print(f"  floor: import torch, sympy     {statistics.median(floor):6.2f} s")


if __name__ == "__main__":
    main()
