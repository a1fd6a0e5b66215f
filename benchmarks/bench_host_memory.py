"""CPU training steps with freed host memory kept (``train.keep_host_memory``) vs glibc's default.

    .venv/bin/python benchmarks/bench_host_memory.py                  # pythia-160m SpiralFormer-B, 1 x 1024
    .venv/bin/python benchmarks/bench_host_memory.py --preset cpu-base --steps 12

Each mode trains ``--steps`` AdamW steps in a fresh process (alternating system / keep / system / keep ...
for ``--pairs`` pairs) and reports per-step seconds, page faults per step and the peak RSS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

WORKER = """
import json, resource, sys, time, torch
sys.path.insert(0, {root!r})
if {keep}:
    from recursive_lightning.training.host import keep_freed_memory
    keep_freed_memory()
from recursive_lightning.model.config import preset
from recursive_lightning.model.recursive.model import RecursiveLM
torch.set_num_threads({threads}); torch.manual_seed(0)
model = RecursiveLM(preset({preset!r}, layout={layout!r}, topology="mesh")).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
idx = torch.randint(0, model.cfg.vocab_size, ({batch}, {seq} + 1))
steps, faults = [], []
for _ in range({steps}):
    t, f = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model.loss(idx[:, :-1], idx[:, 1:]).backward(); opt.step(); opt.zero_grad(set_to_none=True)
    steps.append(time.perf_counter() - t); faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
print(json.dumps({{"steps": steps, "faults": faults, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="pythia-160m")
    p.add_argument("--layout", default="2+4x{1/8,1/4,1/2,1}+2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--pairs", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    root = __file__.rsplit("/benchmarks/", 1)[0]
    results: dict[str, list[dict]] = {"system": [], "keep": []}
    for _ in range(args.pairs):
        for mode in results:
            code = WORKER.format(
                root=root, keep=mode == "keep", threads=args.threads, preset=args.preset,
                layout=args.layout, batch=args.batch, seq=args.seq_len, steps=args.steps,
            )  # fmt: skip
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"# {args.preset} `{args.layout}`, {args.batch} x {args.seq_len}, {args.steps} AdamW steps per process\n"
    )
    print("| malloc | steady step s (median of steps 3..) | page faults per steady step | peak RSS MB |")
    print("| --- | ---: | ---: | ---: |")
    for mode, runs in results.items():
        steady = [s for r in runs for s in r["steps"][2:]]
        faults = [f for r in runs for f in r["faults"][2:]]
        rss = max(r["rss_mb"] for r in runs)
        print(f"| {mode} | {statistics.median(steady):.2f} | {statistics.median(faults):.0f} | {rss:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
