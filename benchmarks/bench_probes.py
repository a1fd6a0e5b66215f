"""Wall-clock of the `probe` command's work on CPU, and batched RBF-CKA against a naive double loop.

    python benchmarks/bench_probes.py                              # cpu-small 2+4R2+2 mesh, 500 x 256 tokens
    python benchmarks/bench_probes.py --layout "2+4x{1/4,1/2,1}+2"  # a multi-resolution model
    python benchmarks/bench_probes.py --samples 100 --threads 1

Part 1 probes ``--samples`` sequences of ``--seq-len`` random token ids through a randomly initialised
``cpu-small`` model (random weights are fine: the cost does not depend on the values) exactly as
``python -m recursive_lightning probe`` does - ``capture`` (``model.traced`` per batch with attention
maps + every per-sample statistic), ``summarize`` and all figures - and prints the time of each stage
next to a plain ``model(x)`` pass over the same batches. Goal: everything < 2 minutes on 2 CPU cores.
Loading a checkpoint, tokenising text and MLflow logging are not included (seconds, independent of
``--samples``).

Part 2 times the per-sample RBF-CKA matrix between the ``K + 3`` states of ``--cka-samples``
sequences: ``probes.cka.cka_matrix`` as the probe uses it (all samples and state pairs in one batched
computation) against a Python double loop over state pairs calling it for one pair of one sample at a
time, and checks that they agree.

Both wall and process CPU seconds are printed: on a machine shared with other jobs, multi-threaded
wall times inflate badly; ``--threads 1`` CPU seconds are what one idle core would take.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.model.recursive.model import RecursiveLM  # noqa: E402
from recursive_lightning.probes.capture import ProbeSettings, capture  # noqa: E402
from recursive_lightning.probes.cka import cka_matrix  # noqa: E402
from recursive_lightning.probes.figures import Sheet  # noqa: E402
from recursive_lightning.probes.registry import draw, summarize  # noqa: E402


def naive_cka_matrix(states: torch.Tensor, kernel: str = "rbf") -> torch.Tensor:
    """``[N, S, L, d]`` -> ``[N, S, S]`` with Python loops over samples and state pairs (one pair per call)."""
    N, S = states.shape[:2]
    out = torch.empty(N, S, S, dtype=torch.float64)
    for n in range(N):
        for i in range(S):
            for j in range(S):
                out[n, i, j] = cka_matrix(states[n, [i, j]], kernel=kernel)[0, 1]
    return out


class Timer:
    """Wall-clock and process CPU seconds (CPU time is robust to other processes on a busy machine;
    with ``--threads 1`` it is the wall time an idle core would take)."""

    def __enter__(self) -> Timer:
        self.w, self.c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.w, time.process_time() - self.c

    def __str__(self) -> str:
        return f"{self.wall:8.2f} s wall {self.cpu:8.2f} s CPU"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--layout", default="2+4R2+2")
    p.add_argument("--topology", default="mesh")
    p.add_argument("--samples", type=int, default=500)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cka-samples", type=int, default=8)
    p.add_argument("--no-attention", action="store_true")
    p.add_argument("--progress", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = RecursiveLM(preset(args.preset, layout=args.layout, topology=args.topology)).eval()
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (args.samples, args.seq_len), generator=g)
    print(
        f"{args.preset} layout {args.layout} topology {args.topology} (d={cfg.d_model}, heads={cfg.n_heads}, "
        f"{sum(q.numel() for q in model.parameters()) / 1e6:.2f}M params); {args.samples} samples x {args.seq_len} "
        f"tokens, batch {args.batch_size}; torch {torch.__version__}, {args.threads} threads, "
        f"{platform.processor() or platform.machine()}"
    )

    # ---- part 1: the probe pipeline
    with Timer() as t_fwd, torch.no_grad():
        for i in range(0, args.samples, args.batch_size):
            model(x[i : i + args.batch_size])
    settings = ProbeSettings(batch_size=args.batch_size, attention=not args.no_attention)
    with Timer() as t_cap:
        cap = capture(model, x, settings, progress=args.progress)
    meta = {
        "model": {
            "kind": model.layout.kind,
            "layout": args.layout,
            "topology": cfg.topology,
            "chunk": list(model.layout.chunk),
        }
    }
    with Timer() as t_sum:
        summary = summarize(cap, meta)
    with tempfile.TemporaryDirectory() as tmp, Timer() as t_plot:
        title = f"bench ({args.layout}, {cfg.topology})"
        files = draw({"bench": (cap, summary)}, Sheet(Path(tmp), title))
    wall = t_cap.wall + t_sum.wall + t_plot.wall
    cpu = t_cap.cpu + t_sum.cpu + t_plot.cpu
    print(f"plain forward (no probes)      {t_fwd}")
    print(f"capture (traced + statistics)  {t_cap}  ({args.samples / t_cap.wall:.1f} samples/s)")
    print(f"summarize                      {t_sum}")
    print(f"figures ({len(files):2d} PNGs)              {t_plot}")
    ok = "OK" if wall < 120 else "MISSED"
    print(f"probe total                    {wall:8.2f} s wall {cpu:8.2f} s CPU  (goal < 120 s wall: {ok})")

    # ---- part 2: batched vs naive RBF-CKA
    n = min(args.cka_samples, args.samples)
    _, trace = model.traced(x[:n])
    states = torch.stack([h for _, h in trace.states], dim=1).to(torch.float64)  # [n, S, L, d]
    with Timer() as t_fast:
        fast = cka_matrix(states)
    with Timer() as t_slow:
        slow = naive_cka_matrix(states)
    err = float((fast - slow).abs().max())
    S = states.shape[1]
    print(f"RBF-CKA of {n} samples x {S} states ({S * S} pairs each, L={args.seq_len}, d={cfg.d_model}):")
    print(f"  batched cka_matrix           {t_fast}")
    print(
        f"  naive double loop (cka)      {t_slow}  -> {t_slow.wall / t_fast.wall:.1f}x slower than batched; "
        f"max |diff| {err:.1e}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
