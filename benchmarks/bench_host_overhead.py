"""Host-side cost of one training step: operator calls and time where the arithmetic is negligible.

    python benchmarks/bench_host_overhead.py               # cpu-tiny, 1 x 64 tokens, 1 thread, CPU time

On a GPU a small model's step (and SpiralFormer's coarse passes at any size) is bound by the host launching
kernels, not by the kernels (README, "GPU speed": the GPU idles a quarter of SpiralFormer-B's step at 160M).
What the host does per step can be measured on the CPU with a model so small that the arithmetic is
negligible: the number of ATen operator calls that do work (views and allocations left out; each is about
one kernel launch on a GPU) and the step's CPU time. Both are reported for LoopedFormer and SpiralFormer-B
(MeSH) and vanilla.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_mesh_overhead import interleaved, set_threads  # noqa: E402

from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.model.model import RecursiveLM  # noqa: E402

NO_KERNEL = {  # operators that only make views, allocate or dispatch to another operator
    "aten::view", "aten::as_strided", "aten::transpose", "aten::slice", "aten::t", "aten::unsqueeze",
    "aten::squeeze", "aten::permute", "aten::expand", "aten::select", "aten::narrow", "aten::reshape",
    "aten::split", "aten::chunk", "aten::detach", "aten::_unsafe_view", "aten::unbind", "aten::alias",
    "aten::resolve_conj", "aten::resolve_neg", "aten::empty", "aten::empty_like", "aten::split_with_sizes",
    "aten::empty_strided", "aten::contiguous", "aten::_reshape_alias", "aten::view_as", "aten::lift_fresh",
    "aten::result_type", "aten::unflatten", "aten::flatten", "aten::to", "aten::_to_copy",
}  # fmt: skip

MODELS = {
    "vanilla": "8",
    "LoopedFormer 2+4x{1,1}+2": "2+4x{1,1}+2",
    "SpiralFormer-B 2+4x{1/8,1/4,1/2,1}+2": "2+4x{1/8,1/4,1/2,1}+2",
}


def step_fn(layout: str, p: str, batch: int, seq: int):
    torch.manual_seed(0)
    model = RecursiveLM(preset(p, layout=layout, topology="mesh" if "x" in layout else "base"))
    idx = torch.randint(0, model.cfg.vocab_size, (batch, seq))

    def run() -> None:
        model.loss(idx, idx).backward()
        model.zero_grad(set_to_none=True)

    return run


def op_calls(fn) -> int:
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::") and e.key not in NO_KERNEL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="cpu-tiny")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--reps", type=int, default=40)
    args = p.parse_args(argv)
    set_threads(1)
    fns = {k: step_fn(v, args.preset, args.batch, args.seq_len) for k, v in MODELS.items()}
    calls = {k: op_calls(fn) for k, fn in fns.items()}
    times = interleaved(fns, args.reps, warmup=3, clock="cpu")  # the models take turns; CPU time
    print(f"{args.preset}, {args.batch} x {args.seq_len} tokens, 1 thread, torch {torch.__version__}\n")
    print("| model | ATen calls per fwd+bwd (no views) | CPU ms per step (median) |")
    print("| --- | ---: | ---: |")
    for k in fns:
        print(f"| {k} | {calls[k]} | {1e3 * statistics.median(times[k]):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
