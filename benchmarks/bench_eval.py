"""Log-likelihood requests per second of the lm-eval adapter: batched (batch 16) vs one request at a time.

Three modes: ``single`` (batch 1), ``padded`` (batch 16, every request its own row) and ``batched`` (batch 16
with prefix sharing: the continuations of one context in one packed row, ``evaluation/prefix_sharing.py``;
multi-resolution layouts are not packable and score like ``padded``).

    python benchmarks/bench_eval.py                                  # cpu-small, layout 2+2R2+2 mesh, CPU
    python benchmarks/bench_eval.py --layout 8 --topology base --requests 512 --device cuda

Random weights (throughput does not depend on them) and a byte-level BPE trained on the Python docs that
ship with CPython. The requests look like the papers' tasks: a context of ``--ctx-min``..``--ctx-max``
tokens (LAMBADA passages, PIQA/ARC/SciQ questions, HellaSwag stems) and a 1..12-token continuation, four
continuations per context like a 4-way multiple-choice item. Both modes score the same requests in one
process, alternately (batched, single, batched, single, ...) after a warm-up; the best round of each is
reported, and the two modes' log-likelihoods are compared (they must agree to float precision).
Goal: batched >= 4x the requests/second of one-at-a-time on CPU. On a shared machine use
``--threads 1 --clock cpu`` (process CPU time; other processes' load then does not skew the ratio).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def build(args):
    from pydoc_data.topics import topics

    from recursive_lightning.config import RunConfig
    from recursive_lightning.data.tokenizer import train_bpe
    from recursive_lightning.evaluation.lm_eval_adapter import RecursiveLightningLM
    from recursive_lightning.model.recursive.model import RecursiveLM
    from recursive_lightning.training.checkpoint import Loaded

    texts = [topics[k] for k in sorted(topics)]
    tok = train_bpe(texts[:40], args.vocab)
    torch.manual_seed(0)
    run = RunConfig.from_dict(
        {
            "name": "bench-eval",
            "model": {"preset": args.preset, "layout": args.layout, "topology": args.topology},
        }
    )
    model = RecursiveLM(run.model)
    loaded = Loaded(model, run, tok, None, "random-weights", 0)
    words = " ".join(texts).split()
    rng = random.Random(0)
    requests = []
    while len(requests) < args.requests:
        n_ctx = rng.randint(args.ctx_min, args.ctx_max)
        start = rng.randrange(0, len(words) - 2 * n_ctx)
        ctx = " ".join(words[start : start + n_ctx])
        for _ in range(4):
            s = rng.randrange(0, len(words) - 12)
            requests.append((ctx, " " + " ".join(words[s : s + rng.randint(1, 8)])))
    requests = requests[: args.requests]

    def make(bs: int, sharing: bool = True) -> RecursiveLightningLM:
        return RecursiveLightningLM.from_loaded(
            loaded, batch_size=bs, device=args.device, prefix_sharing=sharing
        )

    return make, requests, tok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--layout", default="2+2R2+2")
    p.add_argument("--topology", default="mesh")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--ctx-min", type=int, default=16, help="context words, min (about 1.3 tokens each)")
    p.add_argument("--ctx-max", type=int, default=96, help="context words, max")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu = process CPU time (robust on a shared machine; use with --threads 1)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from lm_eval.api.instance import Instance

    make, requests, tok = build(args)
    inst = [Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)]
    batched, padded, single = make(args.batch_size), make(args.batch_size, False), make(1)
    n_tok = sum(len(tok.encode(c + x).ids) for c, x in requests)
    print(
        f"{args.preset} {args.layout} {args.topology} on {args.device} ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, {args.clock} clock); {len(requests)} requests, "
        f"{n_tok / len(requests):.0f} tokens each on average"
    )
    batched.loglikelihood(inst[:32], disable_tqdm=True)  # warm-up
    padded.loglikelihood(inst[:32], disable_tqdm=True)
    single.loglikelihood(inst[:8], disable_tqdm=True)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    times = {"batched": [], "padded": [], "single": []}
    results = {}
    for _ in range(args.rounds):
        for name, lm in (("batched", batched), ("padded", padded), ("single", single)):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t = clock()
            results[name] = lm.loglikelihood(inst, disable_tqdm=True)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(clock() - t)
    diff = max(
        abs(a - b)
        for other in ("batched", "padded")
        for (a, _), (b, _) in zip(results[other], results["single"])
    )
    rate = {k: len(requests) / min(v) for k, v in times.items()}
    for k in ("single", "padded", "batched"):
        bs = 1 if k == "single" else args.batch_size
        print(
            f"  {k:8s} (batch {bs:2d}): {rate[k]:8.1f} requests/s   rounds: "
            + ", ".join(f"{t:.2f}s" for t in times[k])
        )
    speedup = rate["batched"] / rate["single"]
    print(
        f"  speed-up {speedup:.2f}x (goal >= 4x): {'ok' if speedup >= 4 else 'below goal'}; without prefix "
        f"sharing {rate['padded'] / rate['single']:.2f}x; max |loglik batched - single| = {diff:.2e}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
