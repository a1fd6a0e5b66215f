"""Wall-clock overhead of the MeSH topology (+mesh) over the plain looped model (base), same layout.

    python benchmarks/bench_mesh_overhead.py                      # cpu-base, 2+4R2+2, 4 x 512, 10 reps
    python benchmarks/bench_mesh_overhead.py --isolated --profile

One process, one forward+backward (``model.loss`` + ``backward``) per model per repetition; the
models are interleaved (ABAB, then BABA on odd repetitions so neither always runs first) after a
warm-up, and medians are compared. Every model holds the same transformer weights.

``--isolated`` also times the topology alone (routers and the factored buffer's reads and writes) on
random states; ``--profile`` prints a torch.profiler table of the MeSH model.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import yaml
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.model.describe import describe  # noqa: E402
from recursive_lightning.model.recursive.model import RecursiveLM  # noqa: E402
from recursive_lightning.training.host import keep_freed_memory  # noqa: E402


def parse_sets(items: list[str]) -> dict:
    """``--set d_model=512 --set n_heads=8`` -> model config overrides (values parsed as YAML)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set '{item}' must look like key=value, e.g. d_model=512")
        out[key.strip()] = yaml.safe_load(value)
    return out


def model_cfg(cfg_kwargs: dict, topology: str):
    """``cfg_kwargs`` = {"preset": ..., "layout": ..., **overrides}."""
    kw = dict(cfg_kwargs)
    return preset(kw.pop("preset"), **kw, topology=topology)


def make_model(cfg_kwargs: dict, variant: str, weights: dict | None) -> RecursiveLM:
    topology = "base" if variant == "base" else "mesh"
    torch.manual_seed(0)
    model = RecursiveLM(model_cfg(cfg_kwargs, topology))
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and all(k.startswith("topology.") for k in missing), (missing, unexpected)
    if variant not in ("base", "mesh"):
        raise SystemExit(f"unknown variant '{variant}'; use base or mesh")
    return model


# ----------------------------------------------------------------------------- timing


def fwd_bwd(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> None:
    model.loss(idx, tgt).backward()
    model.zero_grad(set_to_none=True)


ROUNDS = {"run": 0, "kept": 0}  # of the last interleaved() call, for the report


def _serve(build: Callable[[], Callable[[], None]], threads: int, keep_memory: bool, conn) -> None:
    """Worker loop of :class:`InProcess`: build the workload once, then time one call per request."""
    set_threads(threads, keep_memory)
    fn = build()
    conn.send("ready")
    while conn.recv() == "run":
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        conn.send((time.perf_counter() - w0, time.process_time() - c0))


class InProcess:
    """A workload in a process of its own, run on request: ``worker()`` -> (wall s, CPU s) of one call.

    A training run holds one model per process. Two models timed in one process share one heap, and
    which of them gets recycled pages and which gets fresh ones (a page fault per 4 KiB, e.g. for the
    200 MB logits of a 50k vocabulary) then depends on the other model's allocations, not on its own.
    ``build`` must be picklable (a module-level function, or a ``functools.partial`` of one); it returns the
    function to time. The parent only waits on a pipe while the worker runs."""

    def __init__(
        self, build: Callable[[], Callable[[], None]], threads: int, keep_memory: bool = True
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(build, threads, keep_memory, child), daemon=True)
        self.proc.start()
        if self.conn.recv() != "ready":
            raise RuntimeError("benchmark worker failed to start")

    def __call__(self) -> tuple[float, float]:
        self.conn.send("run")
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join()


def interleaved(
    fns: dict[str, Callable[[], None]],
    reps: int,
    warmup: int,
    min_util: float | None = None,
    max_rounds: int | None = None,
    clock: str = "wall",
) -> dict[str, list[float]]:
    """Seconds per call, the functions alternated ABAB / BABA round by round.

    A function that returns (wall, CPU) seconds (an :class:`InProcess` worker) is timed by what it returns.

    ``clock="wall"``: wall-clock (perf_counter). ``clock="cpu"``: this process's CPU time summed over
    its threads (process_time), which other processes on the machine barely disturb; with one torch
    thread it equals the wall-clock of an idle machine (no ``min_util`` filtering then).

    With ``min_util`` (a fraction of ``torch.get_num_threads()``), a round counts only if every call
    in it kept the process's CPU time / wall time >= min_util * threads, i.e. no other process took
    our cores (this machine is shared; a contended call runs 2-4x slower). Rounds are repeated
    until ``reps`` clean ones (at most ``max_rounds``, default 5 reps); with fewer than 3 clean
    rounds all rounds are returned and a warning is printed.
    """
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock '{clock}' must be wall or cpu")
    if clock == "cpu":
        min_util = None
    need = min_util * torch.get_num_threads() if min_util else 0.0
    max_rounds = max_rounds or (5 * reps if min_util else reps)
    kept: dict[str, list[float]] = {n: [] for n in names}
    every: dict[str, list[float]] = {n: [] for n in names}
    r = 0
    while r < max_rounds and len(kept[names[0]]) < reps:
        row, clean = {}, True
        for n in names if r % 2 == 0 else names[::-1]:
            w0, c0 = time.perf_counter(), time.process_time()
            timed = fns[n]()
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            if isinstance(timed, tuple):
                wall, cpu = timed
            clean &= cpu / wall >= need
            row[n] = cpu if clock == "cpu" else wall
        for n in names:
            every[n].append(row[n])
            if clean:
                kept[n].append(row[n])
        r += 1
    ROUNDS.update(run=r, kept=len(kept[names[0]]))
    if len(kept[names[0]]) < min(3, reps):
        print(f"warning: only {len(kept[names[0]])} of {r} rounds ran uncontended; reporting all rounds")
        return every
    return kept


def quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 4:
        return min(xs), max(xs)
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def isolated_topology(
    cfg_kwargs: dict, variants: list[str], batch: int, seq: int, reps: int, clock: str = "wall"
) -> dict[str, tuple[float, float]]:
    """Forward+backward of the topology alone (routers + buffer ops) on random states: (min, median) ms per call."""
    cfg = model_cfg(cfg_kwargs, "mesh")
    k, d = cfg.parsed_layout.n_loop, cfg.d_model
    g = torch.Generator().manual_seed(0)
    h_emb, h_pre = (torch.randn(batch, seq, d, generator=g) for _ in range(2))
    us = [torch.randn(batch, seq, d, generator=g) for _ in range(k)]
    fns = {}
    for v in variants:
        if v == "base":
            continue
        topo = make_model(cfg_kwargs, v, None).topology

        def run(topo=topo):
            leaves = [x.detach().requires_grad_() for x in (h_emb, h_pre, *us)]
            h, carry = topo.start(leaves[0], leaves[1])
            for t in range(k):
                h, carry = topo.step(t, h, leaves[2 + t], carry)
            topo.finish(h, carry).sum().backward()
            topo.zero_grad(set_to_none=True)

        fns[v] = run
    times = interleaved(fns, reps, warmup=2, clock=clock)
    return {v: (1e3 * min(ts), 1e3 * statistics.median(ts)) for v, ts in times.items()}


def profile(model: RecursiveLM, idx: torch.Tensor, tgt: torch.Tensor, reps: int = 3, rows: int = 25) -> None:
    """torch.profiler table of a fwd+bwd; MeSH start/step forward are wrapped in record_function."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as tprofile

    topo = model.topology
    orig_start, orig_step = topo.start, topo.step

    def start(*a):
        with record_function("mesh.start (routers + write/read)"):
            return orig_start(*a)

    def step(*a):
        with record_function("mesh.step (routers + write/read)"):
            return orig_step(*a)

    topo.start, topo.step = start, step
    try:
        fwd_bwd(model, idx, tgt)
        with tprofile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(reps):
                fwd_bwd(model, idx, tgt)
    finally:
        del topo.start, topo.step
    print(f"\n## torch.profiler, {reps} fwd+bwd of the mesh model (self CPU time, top {rows})\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    print("\n## grouped by input shape: buffer-sized ops (B, b, l, d) and router ops\n")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows))


# ----------------------------------------------------------------------------- main


def add_common_args(p: argparse.ArgumentParser, seq_len: int, batch: int) -> None:
    """Options shared with ``bench_multires.py``: model overrides, input shape, rounds, clock, threads."""
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model config override, e.g. d_model=512",
    )
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--min-util",
        type=float,
        default=0.9,
        help="keep a round only if CPU time / wall >= this x threads in every call (0: keep all)",
    )
    p.add_argument(
        "--clock",
        default="wall",
        choices=("wall", "cpu"),
        help="wall: wall-clock (default); cpu: process CPU time, robust on a busy shared machine (use --threads 1)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument(
        "--system-malloc",
        action="store_true",
        help="leave glibc's malloc as it is (default: keep freed memory, as `train` does; training/host.py)",
    )


def set_threads(threads: int, keep_memory: bool = True) -> None:
    """Threads, and host memory kept as `train` keeps it (``train.keep_host_memory``)."""
    if keep_memory:
        keep_freed_memory()
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="cpu-base")
    p.add_argument("--layout", default="2+4R2+2", help="a looped layout (MeSH needs loop steps)")
    add_common_args(p, seq_len=512, batch=4)
    p.add_argument("--isolated", action="store_true", help="also time the topology alone (fwd+bwd)")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of the mesh model")
    p.add_argument("--bf16", action="store_true", help="run under torch.autocast('cpu', bfloat16)")
    args = p.parse_args(argv)

    set_threads(args.threads, not args.system_malloc)
    variants = ["base", "mesh"]
    cfgk = {"preset": args.preset, "layout": args.layout, **parse_sets(args.set)}
    lay = model_cfg(cfgk, "base").parsed_layout
    if lay.n_loop == 0:
        raise SystemExit(f"layout '{args.layout}' has no loop steps; MeSH needs a looped layout like 2+4R2+2")

    base = make_model(cfgk, "base", None)
    weights = base.state_dict()
    models = {"base": base, **{v: make_model(cfgk, v, weights) for v in variants if v != "base"}}
    for m in models.values():
        m.train()
    g = torch.Generator().manual_seed(1)
    vocab = base.cfg.vocab_size
    idx = torch.randint(0, vocab, (args.batch, args.seq_len), generator=g)
    tgt = torch.randint(0, vocab, (args.batch, args.seq_len), generator=g)

    print("# MeSH wall-clock overhead (forward + backward)\n")
    print(
        f"machine  {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, clock {args.clock}{', bf16 autocast' if args.bf16 else ''}, "
        f"load average {os.getloadavg()[0]:.2f} at start"
    )
    print(
        f"model    preset {args.preset}, layout {args.layout}, batch {args.batch} x seq {args.seq_len}, "
        f"reps {args.reps} (+{args.warmup} warm-up), interleaved"
        + (f", overrides {' '.join(args.set)}" if args.set else "")
    )

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    with autocast:
        times = interleaved(
            {v: (lambda m=m: fwd_bwd(m, idx, tgt)) for v, m in models.items()},
            args.reps,
            args.warmup,
            min_util=args.min_util or None,
            clock=args.clock,
        )
    print(
        f"rounds   {ROUNDS['kept']} kept of {ROUNDS['run']} run"
        + (f" (--min-util {args.min_util})" if args.clock == "wall" else "")
    )

    fl = {t: describe(model_cfg(cfgk, t), args.seq_len, args.batch) for t in ("base", "mesh")}
    flop_ratio = fl["mesh"]["flops_forward"] / fl["base"]["flops_forward"]
    eq8 = fl["mesh"]["flops_mesh_eq8"]
    fvcore_ratio = (fl["base"]["flops_forward_fvcore"] + eq8) / fl["base"]["flops_forward_fvcore"]

    med_base = statistics.median(times["base"])
    print(
        "\n| variant | median ms | IQR ms | min ms | ratio to base (medians) | paired ratio, median (IQR) | ratio of mins |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for v, ts in times.items():
        lo, hi = quartiles(ts)
        ratios = [a / b for a, b in zip(ts, times["base"])]
        paired, (plo, phi) = statistics.median(ratios), quartiles(ratios)
        print(
            f"| {v} | {1e3 * statistics.median(ts):.1f} | {1e3 * lo:.1f}-{1e3 * hi:.1f} | {1e3 * min(ts):.1f} | "
            f"{statistics.median(ts) / med_base:.4f} | {paired:.4f} ({plo:.3f}-{phi:.3f}) | "
            f"{min(ts) / min(times['base']):.4f} |"
        )
    mesh_ratio = statistics.median(times["mesh"]) / med_base
    print(
        f"\nmesh / base {args.clock + ' time':<20}{mesh_ratio:.4f}  (overhead {100 * (mesh_ratio - 1):+.2f} %, goal < +3 %)"
    )
    print(
        f"mesh / base describe() FLOPs    {flop_ratio:.6f}  (overhead {100 * (flop_ratio - 1):+.4f} %, matmuls: routers)"
    )
    print(
        f"mesh / base fvcore + Eq. 8      {fvcore_ratio:.6f}  (overhead {100 * (fvcore_ratio - 1):+.4f} %, paper: +0.014 %)"
    )
    print(f"goal {'MET' if mesh_ratio < 1.03 else 'MISSED'}; load average {os.getloadavg()[0]:.2f} at end")

    if args.isolated:
        iso = isolated_topology(cfgk, variants, args.batch, args.seq_len, max(args.reps, 20), args.clock)
        base_min = 1e3 * min(times["base"])
        print(
            "\n| topology alone (fwd+bwd, routers included) | min ms | median ms | min as share of base min |"
        )
        print("| --- | ---: | ---: | ---: |")
        for v, (lo, mid) in iso.items():
            print(f"| {v} | {lo:.2f} | {mid:.2f} | {100 * lo / base_min:.2f} % |")
    if args.profile:
        profile(models["mesh"], idx, tgt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
