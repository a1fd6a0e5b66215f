"""Greedy decoding tokens/s: the decoding cache (model/decoding.py, SpiralFormer Alg. 2) vs recomputing the
window at every token, side by side in one process.

    .venv/bin/python benchmarks/bench_decode.py [--preset cpu-small] [--prompt 256] [--new 128] [--batch 1]

For each model (LoopedFormer with MeSH, SpiralFormer-B with MeSH, a vanilla stack of the same depth) both
modes decode the same prompt alternately (cached, recomputed, cached, ...) after a warm-up; the best round of
each is reported, and the generated tokens must be identical.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.model.recursive.model import RecursiveLM  # noqa: E402

MODELS = {
    "vanilla": {"layout": "8", "topology": "base"},
    "looped (mesh)": {"layout": "2+4x{1,1}+2", "topology": "mesh"},
    "SpiralFormer-B (mesh)": {"layout": "2+4x{1/8,1/4,1/2,1}+2", "topology": "mesh"},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"{args.preset}, batch {args.batch}, prompt {args.prompt} + {args.new} new tokens, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}\n"
    )
    print("| model | cached tok/s | recomputed tok/s | speed-up | same tokens |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name, arch in MODELS.items():
        torch.manual_seed(0)
        model = RecursiveLM(preset(args.preset, **arch)).eval()
        idx = torch.randint(0, model.cfg.vocab_size, (args.batch, args.prompt))
        model.generate(idx[:, :32], 4)
        model.generate(idx[:, :32], 4, use_cache=False)
        best, out = {}, {}
        for _ in range(args.rounds):
            for mode, use_cache in (("cached", True), ("recomputed", False)):
                t = time.perf_counter()
                out[mode] = model.generate(idx, args.new, use_cache=use_cache)
                best[mode] = min(best.get(mode, float("inf")), time.perf_counter() - t)
        rate = {k: args.batch * args.new / v for k, v in best.items()}
        print(
            f"| {name} `{arch['layout']}` | {rate['cached']:.0f} | {rate['recomputed']:.0f} | "
            f"{rate['cached'] / rate['recomputed']:.1f}x | {torch.equal(out['cached'], out['recomputed'])} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
