"""Mela on a GPU: training speed against Transformer++ at 4K, and eval memory from 4K to 32K.

    python benchmarks/bench_gpu_mela.py                        # mela-400m / transformerpp-400m, bf16 autocast
    python benchmarks/bench_gpu_mela.py --part eval --lengths 4096,8192,16384,32768
    python benchmarks/bench_gpu_mela.py --part train --compile glue   # layers and memory updates compiled
    python benchmarks/bench_gpu_mela.py --part train --graphs         # each step replayed as one CUDA graph
    python benchmarks/bench_gpu_mela.py --part train --matmul-precision highest   # the memory's GEMMs in FP32
    python benchmarks/bench_gpu_mela.py --part train --memory-kernel   # also Mela with fused memory updates
    python benchmarks/bench_gpu_mela.py --smoke                # no GPU needed: the pipeline on the CPU

``train``: forward+backward (``model.loss`` + ``backward``, bf16 autocast, float32 weights as in bf16-mixed
training) of Mela, of the same Mela with the HMM bypassed (``bench_mela.decoder_alone``: the decoder alone)
and of the Transformer++ of its size, ``--batch`` x ``--seq-len``, taking turns after a warm-up; CUDA-event
medians, and each model's device activities in one profiled step (kernels, copies and fills: in eager mode
one host launch each; the goal, at most 2x Transformer++'s, is the host-work goal ``bench_host_overhead.py``
approximates on the CPU). ``--graphs``: each model's forward + backward captured as one CUDA graph and replayed
(``cuda_graph_step.py``; a model whose capture fails runs eagerly, and says so). The goals: the memory's
wall-clock share 1 - t(decoder alone) / t(Mela) at most 2x its share of ``describe``'s forward FLOPs; Mela's
time over Transformer++'s at most 1.0, then at most their FLOP ratio + 0.10. ``--matmul-precision``: torch's
float32 matmul precision, which sets how Mela's memory loop (float32 outside autocast) multiplies: ``high``
(default) on TF32 tensor cores, as ``train`` runs it under bf16-mixed; ``highest`` in full FP32, as ``eval`` runs
it and as a user who chose ``highest`` trains. The two runs side by side give TF32's speed-up of Mela's step.
``--memory-kernel``: a fourth model taking turns with the three, Mela with ``train.memory_kernel: triton`` (its
memory updates as two fused Triton kernels a chunk and their backward as two more, ``model/mela/memory_kernel.py``
and ``memory_kernel_backward.py``), with its own
goal lines and its loss beside the PyTorch path's; ``eval`` then streams with the fused updates.

``eval``: the hidden states ``eval`` scores (``evaluation.perplexity.hidden_states``: a chunk-local model
streams a long input through its decoding cache one training-length piece at a time), batch 1, inference mode,
bf16 autocast, at each of ``--lengths``: peak CUDA memory above the weights, and that peak less the
(1, L, d) hidden states it returns (which grow with L by construction). Flat: the last within 10 % of the first.
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

from bench_gpu import gpu_kernels  # noqa: E402
from bench_host_overhead import interpret_triton_on_the_cpu  # noqa: E402
from bench_mela import decoder_alone  # noqa: E402
from cuda_graph_step import graphed_step  # noqa: E402

from recursive_lightning.evaluation.perplexity import hidden_states, stream_piece  # noqa: E402
from recursive_lightning.model.build import build_model  # noqa: E402
from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.model.describe import describe  # noqa: E402
from recursive_lightning.training.parallel import compile_model  # noqa: E402

DEVICE = "cuda"  # "cpu" with --smoke
FUSED = "Mela, fused memory updates"  # --memory-kernel


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(fn) -> float:
    """ms of one call (CUDA events on the GPU)."""
    if DEVICE == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


def part_train(args) -> dict[str, bool]:
    torch.manual_seed(0)
    models = {
        "Mela": build_model(preset(args.mela, max_seq_len=args.seq_len)),
        "Mela decoder alone": decoder_alone(build_model(preset(args.mela, max_seq_len=args.seq_len))),
        "Transformer++": build_model(preset(args.transformerpp, max_seq_len=args.seq_len)),
    }
    if args.memory_kernel:
        models[FUSED] = build_model(preset(args.mela, max_seq_len=args.seq_len))
        models[FUSED].load_state_dict(models["Mela"].state_dict())
        models[FUSED].use_memory_kernel()
    vocab = models["Mela"].cfg.vocab_size
    idx = torch.randint(0, vocab, (args.batch, args.seq_len + 1), device=DEVICE)

    def step(model: torch.nn.Module, name: str):
        if args.graphs:
            try:
                return graphed_step(model, idx[:, :-1], idx[:, 1:])
            except Exception as e:  # the figures of the eager step instead, said so
                print(
                    f"{name}: CUDA graph capture failed, eager: {type(e).__name__}: {str(e)[:300]}",
                    flush=True,
                )
                model.zero_grad(set_to_none=True)

        def run() -> None:
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
                loss = model.loss(idx[:, :-1], idx[:, 1:])
            loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    for m in models.values():
        m.to(DEVICE).train()
        if args.compile:  # a train.compile scope: glue compiles the layers and each memory's regions
            compile_model(m, args.compile)
    if args.memory_kernel:
        try:
            _agreement(models["Mela"], models[FUSED], idx)
        except Exception as e:  # the fused kernels: the other models' figures still come
            print(f"{FUSED}: failed, left out: {type(e).__name__}: {str(e)[:400]}", flush=True)
            del models[FUSED]
    fns = {k: step(m, k) for k, m in models.items()}
    peak_gib, first_s = {}, {}
    for k, fn in list(fns.items()):
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            for i in range(args.warmup):
                fn()
                if i == 0:  # the first step: compilation, with train.compile or the fused kernels
                    _sync()
                    first_s[k] = time.perf_counter() - t0
        except Exception as e:  # the fused kernels: the other models' figures still come
            if k != FUSED:
                raise
            print(f"{k}: failed, left out: {type(e).__name__}: {str(e)[:400]}", flush=True)
            del fns[k], models[k]
            continue
        _sync()
        peak_gib[k] = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else float("nan")
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(args.reps):
        for k in list(fns) if r % 2 == 0 else list(fns)[::-1]:
            times[k].append(_timed(fns[k]))
    med = {k: statistics.median(v) for k, v in times.items()}
    kernels = {k: gpu_kernels(fn) if DEVICE == "cuda" else -1 for k, fn in fns.items()}
    dm = describe(preset(args.mela, max_seq_len=args.seq_len), seq_len=args.seq_len, batch_size=args.batch)
    dt = describe(
        preset(args.transformerpp, max_seq_len=args.seq_len), seq_len=args.seq_len, batch_size=args.batch
    )
    flop_share = 1 - dm["flops_decoder"] / dm["flops_forward"]
    flop_ratio = dm["flops_forward"] / dt["flops_forward"]
    tokens = args.batch * args.seq_len
    print(
        f"\n## train: fwd+bwd, bf16 autocast, {args.batch} x {args.seq_len}, {args.reps} reps, medians, "
        f"train.compile: {args.compile or 'false'}{', CUDA graphs' if args.graphs else ''}, float32 matmul "
        f"precision {torch.get_float32_matmul_precision()}\n"
    )
    print(
        "| model | params | ms fwd+bwd | tokens/s | peak memory (GiB) | first step (s) | GPU kernels / step |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k, m in models.items():
        n = sum(p.numel() for p in m.parameters())
        print(
            f"| {k} | {n / 1e6:.1f}M | {med[k]:.1f} | {tokens / med[k] * 1e3:,.0f} | {peak_gib[k]:.1f} | "
            f"{first_s.get(k, float('nan')):.1f} | {f'{kernels[k]:,}' if kernels[k] >= 0 else 'n/a'} |"
        )
    goals: dict[str, bool] = {}
    for mela in [k for k in ("Mela", FUSED) if k in med]:
        goals |= _goal_lines(mela, med, flop_share, flop_ratio, tokens)
        if DEVICE == "cuda" and not args.graphs:  # eager: a launch by the host per kernel
            goals |= _kernel_goal(mela, kernels)
    return goals


def _kernel_goal(mela: str, kernels: dict[str, int]) -> dict[str, bool]:
    """The host-work goal on the GPU: the kernels one eager step of ``mela`` launches, at most 2x
    Transformer++'s."""
    ratio = kernels[mela] / kernels["Transformer++"]
    tag = "" if mela == "Mela" else f" ({mela})"
    ok = ratio <= 2.0
    print(
        f"{'PASS' if ok else 'MISS'} GPU kernels per eager step{tag} / Transformer++'s {ratio:.2f} <= 2.0 "
        f"({kernels[mela]:,} vs {kernels['Transformer++']:,})",
        flush=True,
    )
    return {f"GPU kernels per step{tag}": ok}


def _goal_lines(mela: str, med: dict[str, float], flop_share: float, flop_ratio: float, tokens: int) -> dict:
    """The goals of one Mela variant (``mela``, a key of ``med``), printed PASS/MISS."""
    wall_share = 1 - med["Mela decoder alone"] / med[mela]
    time_ratio = med[mela] / med["Transformer++"]
    tag = "" if mela == "Mela" else f" ({mela})"
    goals = {
        f"memory wall share{tag}": wall_share <= 2 * flop_share,
        f"Mela / Transformer++ time{tag}": time_ratio <= 1.0,
        f"Mela / Transformer++ time, FLOPs{tag}": time_ratio <= flop_ratio + 0.10,
    }
    mark = ["PASS" if v else "MISS" for v in goals.values()]
    print(
        f"\n{mark[0]} memory's wall-clock share{tag} {wall_share:.3f} <= 2 x its forward-FLOP share "
        f"{flop_share:.3f}\n"
        f"{mark[1]} Mela / Transformer++ time{tag} {time_ratio:.3f} <= 1.0 (tokens/s "
        f"{tokens / med[mela] * 1e3:,.0f} vs {tokens / med['Transformer++'] * 1e3:,.0f})\n"
        f"{mark[2]} Mela / Transformer++ time{tag} {time_ratio:.3f} <= FLOP ratio {flop_ratio:.3f} + 0.10",
        flush=True,
    )
    return goals


def _agreement(plain: torch.nn.Module, fused: torch.nn.Module, idx: torch.Tensor) -> None:
    """The loss of Mela with and without the fused memory updates on one batch, and their difference."""
    with torch.no_grad(), torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
        a, b = (m.loss(idx[:, :-1], idx[:, 1:]).item() for m in (plain, fused))
    print(f"loss, PyTorch memory updates {a:.6f}, fused {b:.6f}, |difference| {abs(a - b):.2e}", flush=True)


@torch.inference_mode()
def part_eval(args) -> dict[str, bool]:
    torch.manual_seed(0)
    model = build_model(preset(args.mela, max_seq_len=args.seq_len)).to(DEVICE).eval()
    if args.memory_kernel:
        model.use_memory_kernel()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"\n## eval hidden states, {args.mela}, batch 1, bf16 autocast, pieces of {stream_piece(model.cfg):,} "
        f"tokens, memory updates {'fused' if args.memory_kernel else 'PyTorch'}\n"
    )
    print("| L | ms | tokens/s | peak above weights (MiB) | less the returned states (MiB) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    rows = []
    piece = stream_piece(model.cfg)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):  # warm both paths up
        for n in (piece, 2 * piece):  # one forward; a stream through the decoding cache
            hidden_states(model, torch.zeros(1, n, dtype=torch.long, device=DEVICE))
    for L in (int(s) for s in args.lengths.split(",")):
        x = torch.randint(0, model.cfg.vocab_size, (1, L), device=DEVICE)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        got = []
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
            ms = _timed(lambda x=x, got=got: got.append(hidden_states(model, x)))
        h = got.pop()
        peak = (torch.cuda.max_memory_allocated() - weights) / 2**20 if DEVICE == "cuda" else float("nan")
        out = h.numel() * h.element_size() / 2**20
        rows.append((L, peak, peak - out))
        print(f"| {L:,} | {ms:.0f} | {L / ms * 1e3:,.0f} | {peak:,.0f} | {peak - out:,.0f} |", flush=True)
        del h, x
    flat = rows[-1][2] <= 1.10 * rows[0][2] if DEVICE == "cuda" else False
    print(
        f"\n{'PASS' if flat else 'MISS'} eval memory flat: {rows[-1][0]:,} tokens {rows[-1][2]:,.0f} MiB <= 1.10 x "
        f"{rows[0][0]:,} tokens {rows[0][2]:,.0f} MiB (less the returned states)"
    )
    return {"eval memory flat": flat}


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "train", "eval"), default="all")
    p.add_argument("--mela", default="mela-400m")
    p.add_argument("--transformerpp", default="transformerpp-400m")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lengths", default="4096,8192,16384,32768")
    p.add_argument(
        "--compile",
        default=None,
        choices=("layers", "glue", "model"),
        help="train: a train.compile scope for all three models (glue: Mela's memory updates too)",
    )
    p.add_argument(
        "--graphs", action="store_true", help="train: each step captured as one CUDA graph and replayed"
    )
    p.add_argument(
        "--matmul-precision",
        choices=("high", "highest"),
        default="high",
        help="float32 GEMMs (Mela's memory loop) on TF32 (high, as train under bf16-mixed) or in FP32",
    )
    p.add_argument(
        "--memory-kernel",
        action="store_true",
        help="train: also Mela with fused memory updates (train.memory_kernel: triton); eval: with them",
    )
    p.add_argument(
        "--smoke", action="store_true", help="run on the CPU (cpu sizes, 1 rep): checks the script"
    )
    args = p.parse_args(argv)
    if args.smoke:
        DEVICE = "cpu"
        if args.memory_kernel:  # Triton's interpreter runs the kernels on the CPU
            interpret_triton_on_the_cpu()
        args.mela, args.transformerpp, args.seq_len, args.batch = "cpu-mela", "cpu-transformerpp", 512, 1
        args.reps, args.warmup, args.lengths = 1, 1, "512,1024"
    elif not torch.cuda.is_available():
        print("bench_gpu_mela.py needs a CUDA GPU (--smoke runs it on the CPU to check the script)")
        return 1
    else:
        torch.set_float32_matmul_precision(args.matmul_precision)
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    goals = {}
    if args.part in ("all", "train"):
        goals |= part_train(args)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    if args.part in ("all", "eval"):
        goals |= part_eval(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
