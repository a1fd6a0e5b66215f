"""GPU benchmarks: SpiralFormer-B against LoopedFormer, MeSH against base, eager against torch.compile.

    python benchmarks/bench_gpu.py                                   # pythia-160m and -410m, 1024 and 4096
    python benchmarks/bench_gpu.py --goals                           # the GPU goals, one command (below)
    python benchmarks/bench_gpu.py --presets pythia-1b --seq-lens 4096 --modes eager,layers,glue,model
    python benchmarks/bench_gpu.py --smoke                           # no GPU needed: the pipeline on the CPU

For each preset and sequence length, forward+backward (``model.loss`` + ``backward``, bf16 autocast, weights
in float32 as in bf16-mixed training) of the Table 1 pair LoopedFormer ``P+Nx{1,1}+P`` / SpiralFormer-B
``P+Nx{1/8,1/4,1/2,1}+P`` (MeSH topology), and of the looped model with the ``base`` topology (MeSH's
overhead), in each ``--modes``: ``eager``, ``layers`` (train.compile: layers, per-layer torch.compile),
``glue`` (train.compile: glue: the layers and, as regions of their own, S_down / S_up and MeSH's routers +
read), ``model`` (train.compile: model, the whole forward compiled), ``graphs`` (the eager forward + backward
captured as one CUDA graph and replayed: ``cuda_graph_step.py``) and ``cudagraphs`` (the whole forward with
``mode="reduce-overhead"``; it crashed in the compiled backward on torch 2.11, so it runs only when named).
``first s`` is the time from building a model to the end of its first step (compilation, capture). Timed with CUDA events; the models take turns, ``--reps`` rounds after
``--warmup``; medians. Each time ratio is printed next to the FLOP ratio of ``model.describe.describe``
(SpiralFormer Table 1's convention: attention counted at full L x L) and the causal one (attention halved,
what causal kernels compute). Achieved TFLOP/s counts 3x the forward FLOPs (causal attention) per
forward+backward, and is compared with a bf16 8192^3 matrix product measured in the same run. ``--calls``
adds the ATen calls per step (the host's share: ``bench_host_overhead.py``).

``--goals`` runs pythia-160m and -410m at 1024 x 16 and 4096 x 4 (default modes eager, graphs) with
``--busy`` and ``--calls``, and ends with a PASS / MISS line per GPU goal, each at the best mode measured:
time ratio <= causal FLOP ratio + 0.03, SpiralFormer-B's GPU busy share >= 95 %, LoopedFormer MeSH at 410M
>= 50 % of the matmul peak, +mesh vs base <= 2 %, and a compiled ``model`` step ready in <= 90 s where that
mode ran. ``--smoke`` runs the same code on the CPU (cpu-tiny, float32, 1 rep) to check the script, not to time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cuda_graph_step import graphed_step  # noqa: E402

from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.model.describe import describe  # noqa: E402
from recursive_lightning.model.recursive.model import RecursiveLM  # noqa: E402
from recursive_lightning.training.parallel import compile_model  # noqa: E402

DEVICE = "cuda"  # "cpu" with --smoke

LAYOUTS = {  # SpiralFormer Table 1: (LoopedFormer, SpiralFormer-B) at each size
    "cpu-tiny": ("2+4x{1,1}+2", "2+4x{1/8,1/4,1/2,1}+2"),  # --smoke
    "pythia-160m": ("2+4x{1,1}+2", "2+4x{1/8,1/4,1/2,1}+2"),
    "pythia-410m": ("4+8x{1,1}+4", "4+8x{1/8,1/4,1/2,1}+4"),
    "pythia-1b": ("3+5x{1,1}+3", "3+5x{1/8,1/4,1/2,1}+3"),
    "pythia-1.4b": ("4+8x{1,1}+4", "4+8x{1/8,1/4,1/2,1}+4"),
}


class _Clock:
    """CUDA events on the GPU, perf_counter on the CPU (--smoke): ``elapsed_time`` in ms after ``stop``."""

    def __init__(self) -> None:
        cuda = DEVICE == "cuda"
        self.events = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        )
        self.t0 = self.t1 = 0.0

    def start(self) -> None:
        self.events[0].record() if self.events else None
        self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.events:
            self.events[1].record()
            self.events[1].synchronize()
        self.t1 = time.perf_counter()

    def elapsed_time(self) -> float:
        return self.events[0].elapsed_time(self.events[1]) if self.events else 1e3 * (self.t1 - self.t0)


def matmul_peak(n: int = 8192, reps: int = 20) -> float:
    """bf16 TFLOP/s of an n^3 product on random data (the ceiling achieved rates are compared with; float32
    and n = 512 with --smoke)."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    n = n if DEVICE == "cuda" else 512
    a, b = torch.randn(n, n, device=DEVICE, dtype=dtype), torch.randn(n, n, device=DEVICE, dtype=dtype)
    for _ in range(3):
        a @ b
    clock = _Clock()
    clock.start()
    for _ in range(reps):
        a @ b
    clock.stop()
    return 2 * n**3 * reps / (clock.elapsed_time() / 1e3) / 1e12


def flops(p: str, layout: str, topology: str, seq: int, batch: int) -> tuple[int, int]:
    """Forward FLOPs (attention at full L x L, Table 1) and with attention halved (causal kernels)."""
    d = describe(preset(p, layout=layout, topology=topology, max_seq_len=seq), seq_len=seq, batch_size=batch)
    return d["flops_forward"], d["flops_forward"] - d["flops_attention"] // 2


def build(p: str, layout: str, topology: str, seq: int, mode: str) -> RecursiveLM:
    """``mode``: eager or graphs (an eager model), or a train.compile scope (layers / glue / model)."""
    torch.manual_seed(0)
    model = RecursiveLM(preset(p, layout=layout, topology=topology, max_seq_len=seq)).to(DEVICE).train()
    if mode == "cudagraphs":
        model.shared_grads_in_place = False  # as compile_model does
        model.compile(mode="reduce-overhead")
    elif mode not in ("eager", "graphs"):
        compile_model(model, mode)
    return model


def gpu_busy(fn, steps: int = 3) -> float:
    """Share of the wall-clock during which the GPU runs a kernel (1.0: GPU-bound; low: the host's
    kernel launches are the bottleneck)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize()
    kernel_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return kernel_us / 1e3 / start.elapsed_time(end)


def gpu_kernels(fn) -> int:
    """The device activities (kernels, copies, fills) of one call of ``fn`` on the GPU, counted by the
    profiler: in eager mode the launches the host makes, the measure ``bench_host_overhead.py`` approximates
    on the CPU with leaf ATen calls; a replayed graph holds as many, launched by one call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")


def step_fn(model: RecursiveLM, batch: int, seq: int, mode: str = "eager"):
    g = torch.Generator(device=DEVICE).manual_seed(1)
    idx = torch.randint(0, model.cfg.vocab_size, (batch, seq), device=DEVICE, generator=g)
    tgt = torch.randint(0, model.cfg.vocab_size, (batch, seq), device=DEVICE, generator=g)
    if mode == "graphs":
        return graphed_step(model, idx, tgt)

    def run() -> None:
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
            loss = model.loss(idx, tgt)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return run


def interleaved(fns: dict[str, object], reps: int, warmup: int) -> dict[str, list[float]]:
    """ms per call of each fn, the fns taking turns (order reversed on odd rounds)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(reps):
        for k in names if r % 2 == 0 else names[::-1]:
            clock = _Clock()
            clock.start()
            fns[k]()
            clock.stop()
            times[k].append(clock.elapsed_time())
    return times


DEFAULTS = dict(presets="pythia-160m,pythia-410m", seq_lens="1024,4096", modes="eager")
GOALS = {**DEFAULTS, "modes": "eager,graphs", "busy": True}


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default=None, help="comma list (default: pythia-160m,pythia-410m)")
    p.add_argument("--seq-lens", default=None, help="comma list (default: 1024,4096)")
    p.add_argument(
        "--tokens", type=int, default=16384, help="tokens per forward+backward (batch = tokens / L)"
    )
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--modes",
        default=None,
        help="comma list of eager (the default), layers, glue, model (train.compile scopes), graphs and cudagraphs",
    )
    p.add_argument("--variants", default="looped mesh,spiral-B mesh,looped base")
    p.add_argument(
        "--busy", action="store_true", help="also profile each model: share of time the GPU is busy"
    )
    p.add_argument("--calls", action="store_true", help="also count the ATen calls of one step per model")
    p.add_argument("--goals", action="store_true", help="the GPU goals in one run (see the docstring)")
    p.add_argument("--issue18", dest="goals", action="store_true", help=argparse.SUPPRESS)  # alias of --goals
    p.add_argument("--smoke", action="store_true", help="run on the CPU (cpu-tiny, 1 rep): checks the script")
    args = p.parse_args(argv)
    # --goals' settings, or the plain defaults, where the command line names none
    for k, v in (GOALS if args.goals else DEFAULTS).items():
        if getattr(args, k) in (None, False):
            setattr(args, k, v)
    args.calls = args.calls or args.goals
    if args.smoke:
        DEVICE = "cpu"
        args.presets, args.seq_lens, args.tokens, args.reps, args.warmup, args.busy = (
            "cpu-tiny",
            "64",
            128,
            1,
            1,
            False,
        )
    elif not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA GPU (--smoke runs it on the CPU to check the script)")
        return 1
    if DEVICE == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    peak = matmul_peak()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (--smoke: not a measurement)"
    print(f"device: {name}, torch {torch.__version__}; 8192^3 bf16 matmul {peak:.1f} TFLOP/s")
    rows, goals = [], []
    modes = args.modes.split(",")
    for name in args.presets.split(","):
        looped, spiral = LAYOUTS[name]
        for seq in (int(s) for s in args.seq_lens.split(",")):
            batch = max(1, args.tokens // seq)
            variants = {
                "looped mesh": (looped, "mesh"),
                "spiral-B mesh": (spiral, "mesh"),
                "looped base": (looped, "base"),
            }
            variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
            fl = {v: flops(name, layout, topo, seq, batch) for v, (layout, topo) in variants.items()}
            for tag in modes:
                fns, first = {}, {}
                for v, (layout, topo) in variants.items():
                    t0 = time.perf_counter()
                    try:
                        fns[v] = step_fn(build(name, layout, topo, seq, tag), batch, seq, tag)
                        fns[v]()
                    except Exception as e:  # a mode that fails (capture, compile) leaves the others' figures
                        print(
                            f"{name} L={seq} {tag} {v}: failed: {type(e).__name__}: {str(e)[:300]}",
                            flush=True,
                        )
                        break
                    if DEVICE == "cuda":
                        torch.cuda.synchronize()
                    first[v] = time.perf_counter() - t0
                if len(fns) < len(variants) or len(first) < len(variants):
                    fns = {}
                    if DEVICE == "cuda":
                        torch.cuda.empty_cache()
                    continue
                times = interleaved(fns, args.reps, args.warmup + (3 if tag != "eager" else 0))
                med = {k: statistics.median(t) for k, t in times.items()}
                busy = {v: gpu_busy(fns[v]) if args.busy else float("nan") for v in variants}
                calls = {v: _calls(fns[v]) if args.calls else -1 for v in variants}
                for v in variants:
                    tflops = 3 * fl[v][1] / (med[v] / 1e3) / 1e12
                    rows.append(
                        (name, seq, batch, tag, v, med[v], batch * seq / med[v] * 1e3, tflops,
                         100 * tflops / peak, 100 * busy[v], calls[v], first[v])
                    )  # fmt: skip
                if "spiral-B mesh" not in med or "looped mesh" not in med:
                    continue
                ratio = med["spiral-B mesh"] / med["looped mesh"]
                paired = statistics.median(
                    a / b for a, b in zip(times["spiral-B mesh"], times["looped mesh"])
                )
                f_tab = fl["spiral-B mesh"][0] / fl["looped mesh"][0]
                f_causal = fl["spiral-B mesh"][1] / fl["looped mesh"][1]
                mesh = med["looped mesh"] / med.get("looped base", float("nan"))
                goals.append(
                    (
                        name,
                        seq,
                        batch,
                        tag,
                        ratio,
                        f_causal,
                        mesh,
                        100 * 3 * fl["looped mesh"][1] / (med["looped mesh"] / 1e3) / 1e12 / peak,
                        100 * busy["spiral-B mesh"],
                        max(first.values()),
                    )
                )
                print(
                    f"{name} L={seq} x{batch} {tag}: spiral/looped time {ratio:.3f} (paired {paired:.3f}) vs FLOPs "
                    f"{f_tab:.4f} (Table 1 convention) / {f_causal:.4f} (causal); mesh/base time {mesh:.3f} vs FLOPs "
                    f"{fl['looped mesh'][0] / fl.get('looped base', (float('nan'),))[0]:.4f}",
                    flush=True,
                )
                del fns
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
    print(
        "\n| preset | L | batch | mode | model | ms fwd+bwd | tokens/s | TFLOP/s | % of matmul peak | GPU busy % "
        "| ATen calls | first s |"
    )
    print("| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.1f} | {r[6]:,.0f} | {r[7]:.0f} | {r[8]:.0f} "
            f"| {r[9]:.0f} | {r[10] if r[10] >= 0 else '-'} | {r[11]:.1f} |"
        )
    if args.goals or args.smoke:
        _goals(goals)
    return 0


def _calls(fn) -> int:
    from bench_host_overhead import op_calls

    return op_calls(fn)[0]


def _goals(goals: list[tuple]) -> None:
    """The GPU goals, each at the best mode measured for its preset and length."""
    print("\nthe GPU goals (best mode per preset and length):")
    keys = sorted({(g[0], g[1], g[2]) for g in goals})
    for name, seq, batch in keys:
        mine = [g for g in goals if g[:3] == (name, seq, batch)]
        best = min(mine, key=lambda g: g[4] - g[5])
        ok = best[4] <= best[5] + 0.03
        print(
            f"  {'PASS' if ok else 'MISS'} {name} {seq} x {batch}: spiral/looped time {best[4]:.3f} <= causal "
            f"FLOP ratio {best[5]:.4f} + 0.03 ({best[3]})"
        )
        busy = max(mine, key=lambda g: g[8] if g[8] == g[8] else -1)
        if busy[8] == busy[8]:  # measured (--busy)
            print(
                f"  {'PASS' if busy[8] >= 95 else 'MISS'} {name} {seq} x {batch}: SpiralFormer-B GPU busy "
                f"{busy[8]:.0f} % >= 95 % ({busy[3]})"
            )
        mesh = min(mine, key=lambda g: g[6])
        print(
            f"  {'PASS' if mesh[6] <= 1.02 else 'MISS'} {name} {seq} x {batch}: +mesh {100 * (mesh[6] - 1):+.1f} % <= 2 % ({mesh[3]})"
        )
        if "410m" in name:
            mfu = max(mine, key=lambda g: g[7])
            print(
                f"  {'PASS' if mfu[7] >= 50 else 'MISS'} {name} {seq} x {batch}: LoopedFormer MeSH {mfu[7]:.0f} % of the matmul peak >= 50 % ({mfu[3]})"
            )
        for g in mine:
            if g[3] == "model":
                print(
                    f"  {'PASS' if g[9] <= 90 else 'MISS'} {name} {seq} x {batch}: compile: model, first step ready "
                    f"in {g[9]:.0f} s <= 90 s"
                )


if __name__ == "__main__":
    raise SystemExit(main())
