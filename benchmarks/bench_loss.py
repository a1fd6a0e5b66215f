"""The blockwise cross-entropy (``model/loss.py``) against ``F.cross_entropy``, forward + backward.

    .venv/bin/python benchmarks/bench_loss.py                       # 1024 tokens x 50304 (Pythia vocabulary)
    .venv/bin/python benchmarks/bench_loss.py --tokens 4096 --reps 20

Both take the same float32 logits (N, V) and return the mean loss; one call = loss + backward to the logits.
Calls alternate (ABAB, BABA) in one process; medians are compared. Also reported: minor page faults per
call (each fresh 4 KiB page the kernel has to zero) - ``F.cross_entropy`` allocates three (N, V) tensors per
call (log-softmax, the NLL gradient, the softmax gradient), the blockwise loss one (the gradient).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_mesh_overhead import interleaved, quartiles, set_threads  # noqa: E402

from recursive_lightning.model.loss import cross_entropy  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"))
    args = p.parse_args(argv)
    set_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.tokens, args.vocab, generator=g).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    faults = {"F.cross_entropy": [], "blockwise": []}

    def timed(name, fn):
        def run():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            fn(logits, targets).backward()
            logits.grad = None
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)

        return run

    fns = {
        "F.cross_entropy": timed("F.cross_entropy", lambda x, t: F.cross_entropy(x, t)),
        "blockwise": timed("blockwise", cross_entropy),
    }
    times = interleaved(fns, args.reps, warmup=2, clock=args.clock)
    print(
        f"# cross-entropy forward+backward, {args.tokens} x {args.vocab} float32 logits, threads "
        f"{torch.get_num_threads()}, clock {args.clock}, {args.reps} reps interleaved\n"
    )
    print("| loss | median ms | IQR ms | min ms | page faults per call (median) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, ts in times.items():
        lo, hi = quartiles(ts)
        print(
            f"| {name} | {1e3 * statistics.median(ts):.1f} | {1e3 * lo:.1f}-{1e3 * hi:.1f} | "
            f"{1e3 * min(ts):.1f} | {statistics.median(faults[name][2:]):.0f} |"
        )
    ratio = statistics.median(times["blockwise"]) / statistics.median(times["F.cross_entropy"])
    print(f"\nblockwise / F.cross_entropy (medians): {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
