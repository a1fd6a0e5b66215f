"""The model's own kernels against liger-kernel's fused Triton ones, forward + backward, at a 400M model's sizes.

    python benchmarks/bench_gpu_kernels.py                       # transformerpp-400m's sizes, 4 x 4096 tokens
    python benchmarks/bench_gpu_kernels.py --preset pythia-410m  # GPT-NeoX: LayerNorm, GELU MLP, 25 % rotary
    python benchmarks/bench_gpu_kernels.py --smoke               # no GPU needed: the model's paths on the CPU

For each operation where liger-kernel has a fused kernel, the path the model runs today and Liger's, on the same
bf16 inputs (autocast's dtype on a GPU), taking turns after a warm-up; CUDA-event medians of forward + backward,
peak memory above the inputs, and Liger's largest difference from ours in the output and the input gradient
(relative to the largest value):

- **loss**: the LM head and the loss (``model/loss.py``: the logits kept, one pass over them each way) against
  Liger's fused linear cross-entropy, which never stores the (N, V) logits;
- **norm**: ``nn.RMSNorm`` (torch's fused kernel) against Liger's RMSNorm, or LayerNorm against Liger's;
- **mlp activation**: ``silu(gate) * up`` of a SwiGLU MLP against Liger's SiLU-mul (a GELU MLP: ours only);
- **rotary**: ``model/block.py: qkv_rotary`` (queries and keys rotated, the head split) against Liger's RoPE
  (liger-kernel 0.8.5's ``rotary_dim`` covers GPT-NeoX's partial rotary).

One line per operation says whether Liger is faster (``LIGER FASTER x0.83``) or not, and whether it agrees with
ours to bf16's rounding; ``train`` uses what wins only once measured here (docs/benchmarks.md: GPU speed).
liger-kernel is not a dependency of the package: the lent machine gets its wheel from ``.whl`` (gpu_wheels.sh).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from recursive_lightning.model.block import Rotary, qkv_rotary  # noqa: E402
from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.model.loss import cross_entropy  # noqa: E402


def timed(fn: Callable[[], tuple], device: str, reps: int) -> tuple[float, float]:
    """(median ms of ``fn``, its peak memory in MiB above what was allocated before) after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else float("nan")
    return statistics.median(times), peak


def fwd_bwd(op: Callable, inputs: list[torch.Tensor]) -> Callable[[], tuple]:
    """A call of ``op`` on fresh leaves of ``inputs`` and a backward of its sum (or of the loss): (output, grads)."""

    def run() -> tuple:
        leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        out = op(*leaves)
        (out if out.dim() == 0 else out.float().sum()).backward()
        return out.detach(), [x.grad for x in leaves if x.grad is not None]

    return run


def rel_diff(a: tuple, b: tuple) -> float:
    """The largest |a - b| over the output and the gradients, relative to the largest |a|."""
    pairs = [(a[0], b[0]), *zip(a[1], b[1])]
    return max(
        float((x.float() - y.float()).abs().max() / x.float().abs().max().clamp_min(1e-30)) for x, y in pairs
    )


def operations(cfg, tokens: int, device: str, dtype: torch.dtype) -> dict[str, tuple]:
    """name: (inputs, ours, Liger's or None where it does not apply)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    d, v, seq = cfg.d_model, cfg.vocab_size, 4096 if device == "cuda" else 64
    targets = torch.randint(0, v, (tokens,), generator=g).to(device)
    ops: dict[str, tuple] = {}
    ours_loss = lambda h, w, t: cross_entropy(h @ w.t(), t, overwrite_logits=True)  # noqa: E731
    ops["loss"] = (
        [rand(tokens, d), rand(v, d, scale=d**-0.5), targets],
        ours_loss,
        "liger_fused_linear_cross_entropy",
    )
    weight, bias = rand(d, scale=0.1) + 1, rand(d, scale=0.1)
    if cfg.norm == "rmsnorm":
        ours_norm = lambda x, w: F.rms_norm(x, (d,), w, cfg.norm_eps)  # noqa: E731
        ops["norm"] = ([rand(tokens, d), weight], ours_norm, "liger_rms_norm")
    else:
        ours_norm = lambda x, w, b: F.layer_norm(x, (d,), w, b, cfg.norm_eps)  # noqa: E731
        ops["norm"] = ([rand(tokens, d), weight, bias], ours_norm, "liger_layer_norm")
    gated = cfg.mlp == "swiglu"
    ours_mlp = (lambda a, b: F.silu(a) * b) if gated else (lambda a: F.gelu(a))
    mlp_inputs = [rand(tokens, cfg.hidden)] * (2 if gated else 1)
    ops["mlp activation"] = (mlp_inputs, ours_mlp, "liger_swiglu" if gated else None)
    h, kvh, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    rot = Rotary(cfg)
    cos, sin = rot.cos_sin(torch.arange(seq), torch.float32)
    cos, sin = cos.to(device, dtype), sin.to(device, dtype)
    qkv = rand(tokens // seq, seq, h + 2 * kvh, hd)

    def ours_rotary(x):
        q, k, _ = qkv_rotary(x, cos, sin, (h, kvh), rot.dim)
        return torch.cat([q.flatten(), k.flatten()])

    ops["rotary"] = ([qkv], ours_rotary, "liger_rope")  # partial rotary (GPT-NeoX): Liger's rotary_dim
    return ops


def liger_op(name: str, cfg, seq: int, dtype: torch.dtype, device: str) -> Callable | None:
    """Liger's counterpart of an operation, with our operation's signature; None without liger-kernel."""
    try:
        from liger_kernel.transformers import functional as lf  # optional
    except ImportError:
        return None
    h, kvh = cfg.n_heads, cfg.n_kv_heads
    if name == "liger_fused_linear_cross_entropy":
        return lambda x, w, t: lf.liger_fused_linear_cross_entropy(x, w, t)
    if name == "liger_rms_norm":  # casting "llama": float32 inside, as torch's kernel; not in place
        return lambda x, w: lf.liger_rms_norm(x, w, cfg.norm_eps, in_place=False)
    if name == "liger_layer_norm":
        return lambda x, w, b: lf.liger_layer_norm(x, w, b, cfg.norm_eps)
    if name == "liger_swiglu":
        return lf.liger_swiglu
    if name == "liger_rope":
        cos, sin = Rotary(cfg).cos_sin(torch.arange(seq), torch.float32)
        cos, sin = cos.to(device, dtype)[None], sin.to(device, dtype)[None]

        def rope(x):
            q, k = x[:, :, :h].transpose(1, 2), x[:, :, h : h + kvh].transpose(1, 2)
            q, k = lf.liger_rope(q.contiguous(), k.contiguous(), cos, sin)  # rotary_dim: cos's width
            return torch.cat([q.flatten(), k.flatten()])

        return rope
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="transformerpp-400m")
    p.add_argument("--tokens", type=int, default=4 * 4096, help="tokens per step (batch x sequence)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="the model's paths on the CPU at a tiny size")
    args = p.parse_args(argv)
    if args.smoke:
        device, dtype, args.tokens, args.reps = "cpu", torch.float32, 128, 1
        cfg = preset(args.preset, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=512)
    elif not torch.cuda.is_available():
        print("bench_gpu_kernels.py needs a CUDA GPU (--smoke runs the model's paths on the CPU)")
        return 1
    else:
        device, dtype, cfg = "cuda", torch.bfloat16, preset(args.preset)
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    seq = 4096 if device == "cuda" else 64
    print(
        f"{args.preset}: d {cfg.d_model}, vocab {cfg.vocab_size}, {args.tokens} tokens, {dtype}, {args.reps} reps"
    )
    print(
        "\n| operation | ours ms | ours MiB | Liger ms | Liger MiB | Liger / ours | Liger's largest difference |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    verdicts = []
    for name, (inputs, ours, liger_name) in operations(cfg, args.tokens, device, dtype).items():
        ms, mib = timed(fwd_bwd(ours, inputs), device, args.reps)
        liger = liger_op(liger_name, cfg, seq, dtype, device) if liger_name else None
        if liger is None:
            why = "no liger-kernel" if liger_name else "does not apply"
            print(f"| {name} | {ms:.3f} | {mib:.0f} | - | - | - | {why} |")
            continue
        lms, lmib = timed(fwd_bwd(liger, inputs), device, args.reps)
        diff = rel_diff(fwd_bwd(ours, inputs)(), fwd_bwd(liger, inputs)())
        print(f"| {name} | {ms:.3f} | {mib:.0f} | {lms:.3f} | {lmib:.0f} | {lms / ms:.2f} | {diff:.1e} |")
        agrees = "agrees" if diff < 2e-2 else "DIFFERS"
        verdicts.append(
            f"{'LIGER FASTER' if lms < ms else 'OURS FASTER'} {name} x{lms / ms:.2f} ({agrees}, {diff:.1e})"
        )
    print()
    for line in verdicts:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
