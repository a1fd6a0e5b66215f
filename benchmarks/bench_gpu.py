"""GPU benchmarks: SpiralFormer-B against LoopedFormer, MeSH against base, eager against torch.compile.

    python benchmarks/bench_gpu.py                                   # pythia-160m and -410m, 1024 and 4096
    python benchmarks/bench_gpu.py --presets pythia-1b --seq-lens 4096 --modes eager,layers,model

For each preset and sequence length, forward+backward (``model.loss`` + ``backward``, bf16 autocast, weights
in float32 as in bf16-mixed training) of the Table 1 pair LoopedFormer ``P+Nx{1,1}+P`` / SpiralFormer-B
``P+Nx{1/8,1/4,1/2,1}+P`` (MeSH topology), and of the looped model with the ``base`` topology (MeSH's
overhead), in each ``--modes``: ``eager``, ``layers`` (train.compile: layers, per-layer torch.compile) and
``model`` (train.compile: model, the whole forward compiled). Timed with CUDA events; the models take turns, ``--reps`` rounds after ``--warmup``; medians.
Each time ratio is printed next to the FLOP ratio of ``accounting.describe`` (SpiralFormer Table 1's
convention: attention counted at full L x L) and the causal one (attention halved, what causal kernels
compute). Achieved TFLOP/s counts 3x the forward FLOPs (causal attention) per forward+backward, and is
compared with a bf16 8192^3 matrix product measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from recursive_lightning.model.accounting import describe  # noqa: E402
from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.model.model import RecursiveLM  # noqa: E402
from recursive_lightning.training.parallel import compile_model  # noqa: E402

LAYOUTS = {  # SpiralFormer Table 1: (LoopedFormer, SpiralFormer-B) at each size
    "pythia-160m": ("2+4x{1,1}+2", "2+4x{1/8,1/4,1/2,1}+2"),
    "pythia-410m": ("4+8x{1,1}+4", "4+8x{1/8,1/4,1/2,1}+4"),
    "pythia-1b": ("3+5x{1,1}+3", "3+5x{1/8,1/4,1/2,1}+3"),
    "pythia-1.4b": ("4+8x{1,1}+4", "4+8x{1/8,1/4,1/2,1}+4"),
}


def matmul_peak(n: int = 8192, reps: int = 20) -> float:
    """bf16 TFLOP/s of an n^3 product on random data (the ceiling achieved rates are compared with)."""
    a, b = (
        torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
        torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
    )
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def flops(p: str, layout: str, topology: str, seq: int, batch: int) -> tuple[int, int]:
    """Forward FLOPs (attention at full L x L, Table 1) and with attention halved (causal kernels)."""
    d = describe(preset(p, layout=layout, topology=topology, max_seq_len=seq), seq_len=seq, batch_size=batch)
    return d["flops_forward"], d["flops_forward"] - d["flops_attention"] // 2


def build(p: str, layout: str, topology: str, seq: int, mode: str) -> RecursiveLM:
    """``mode``: eager, or a train.compile scope (layers / model)."""
    torch.manual_seed(0)
    model = RecursiveLM(preset(p, layout=layout, topology=topology, max_seq_len=seq)).cuda().train()
    if mode != "eager":
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


def step_fn(model: RecursiveLM, batch: int, seq: int):
    g = torch.Generator(device="cuda").manual_seed(1)
    idx = torch.randint(0, model.cfg.vocab_size, (batch, seq), device="cuda", generator=g)
    tgt = torch.randint(0, model.cfg.vocab_size, (batch, seq), device="cuda", generator=g)

    def run() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(idx, tgt)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return run


def interleaved(fns: dict[str, object], reps: int, warmup: int) -> dict[str, list[float]]:
    """ms per call of each fn, the fns taking turns (order reversed on odd rounds)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(reps):
        for k in names if r % 2 == 0 else names[::-1]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[k]()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end))
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="pythia-160m,pythia-410m")
    p.add_argument("--seq-lens", default="1024,4096")
    p.add_argument(
        "--tokens", type=int, default=16384, help="tokens per forward+backward (batch = tokens / L)"
    )
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--modes",
        default="eager",
        help="comma list of eager, layers, model (train.compile scopes)",
    )
    p.add_argument("--variants", default="looped mesh,spiral-B mesh,looped base")
    p.add_argument(
        "--busy", action="store_true", help="also profile each model: share of time the GPU is busy"
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA GPU")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = matmul_peak()
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 8192^3 matmul {peak:.0f} TFLOP/s"
    )
    rows = []
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
                fns = {
                    v: step_fn(build(name, layout, topo, seq, tag), batch, seq)
                    for v, (layout, topo) in variants.items()
                }
                times = interleaved(fns, args.reps, args.warmup + (3 if tag != "eager" else 0))
                med = {k: statistics.median(t) for k, t in times.items()}
                busy = {v: gpu_busy(fns[v]) if args.busy else float("nan") for v in variants}
                for v in variants:
                    tflops = 3 * fl[v][1] / (med[v] / 1e3) / 1e12
                    rows.append(
                        (
                            name,
                            seq,
                            batch,
                            tag,
                            v,
                            med[v],
                            batch * seq / med[v] * 1e3,
                            tflops,
                            100 * tflops / peak,
                            100 * busy[v],
                        )
                    )
                ratio = med["spiral-B mesh"] / med["looped mesh"]
                paired = statistics.median(
                    a / b for a, b in zip(times["spiral-B mesh"], times["looped mesh"])
                )
                f_tab = fl["spiral-B mesh"][0] / fl["looped mesh"][0]
                f_causal = fl["spiral-B mesh"][1] / fl["looped mesh"][1]
                mesh = med["looped mesh"] / med.get("looped base", float("nan"))
                print(
                    f"{name} L={seq} x{batch} {tag}: spiral/looped time {ratio:.3f} (paired {paired:.3f}) vs FLOPs "
                    f"{f_tab:.4f} (Table 1 convention) / {f_causal:.4f} (causal); mesh/base time {mesh:.3f} vs FLOPs "
                    f"{fl['looped mesh'][0] / fl.get('looped base', (float('nan'),))[0]:.4f}",
                    flush=True,
                )
                del fns
                torch.cuda.empty_cache()
    print(
        "\n| preset | L | batch | mode | model | ms fwd+bwd | tokens/s | TFLOP/s | % of matmul peak | GPU busy % |"
    )
    print("| --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.1f} | {r[6]:,.0f} | {r[7]:.0f} | {r[8]:.0f} | {r[9]:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
