"""The glue around the layers on its own, each choice side by side in one process.

    python benchmarks/bench_glue.py                       # cpu-tiny (16 x 128), cpu-base and pythia-160m (2 x 1024)
    python benchmarks/bench_glue.py --presets cpu-tiny --reps 40
    python benchmarks/bench_glue.py --presets --threads 2  # Mela's rows alone, at this machine's default threads

Choices the code makes, each timed both ways, interleaved (ABAB / BABA), one thread (``--threads``), host memory
kept as ``train`` keeps it, CPU-time clock:

- S_down + S_up of SpiralFormer-B's three coarse steps (g = 8, 4, 2; learned scorer and allocator), forward and
  backward: chunks of up to ``resolution._LOOP_MAX_K`` positions summed by multiply-adds (the default) against
  one GEMM per chunk (``_LOOP_MAX_K = 0``).
- A Linear used 4 times by 2048 tokens, forward and backward: the weight-gradient buffer of
  ``model/shared_grad.py`` against autograd's own sum, for the shapes of each preset's core.
- Mela's HMM attention sub-layer and its memories' q/k normalisation at cpu-mela's shape (8 x 256 tokens),
  forward and backward: q and k rotated by ``block.qkv_rotary`` and normalised by ``l2_normalize``, each with a
  written-out backward (the default), against the composed forms ``torch.compile`` is given (the same functions
  with ``torch.compiler.is_compiling`` true).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_mesh_overhead import interleaved, set_threads  # noqa: E402

from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.model.mela.hierarchical_memory import GatedAttention  # noqa: E402
from recursive_lightning.model.mela.neural_memory import l2_normalize  # noqa: E402
from recursive_lightning.model.recursive import resolution  # noqa: E402
from recursive_lightning.model.recursive.model import RecursiveLM  # noqa: E402
from recursive_lightning.model.shared_grad import Linear, accumulate_weight_grads  # noqa: E402

SHAPES = {"cpu-tiny": (16, 128), "cpu-base": (2, 1024), "pythia-160m": (2, 1024)}


def glue(name: str) -> dict:
    batch, length = SHAPES.get(name, (2, 1024))
    cfg = preset(name, layout="2+4x{1/8,1/4,1/2,1}+2", topology="mesh", max_seq_len=max(length, 128))
    model = RecursiveLM(cfg)
    h = torch.randn(batch, length, cfg.d_model, requires_grad=True)
    coarse = [s for s in model.steps if not s.full_resolution]

    def run(max_k: int):
        def f() -> None:
            resolution._LOOP_MAX_K = max_k
            for step in coarse:
                step.up(step.down(h), length).sum().backward()
            h.grad = None

        return f

    default = resolution._LOOP_MAX_K
    try:
        return {"multiply-adds": run(default), "GEMM per chunk": run(0)}
    finally:
        resolution._LOOP_MAX_K = default


def linear(d_in: int, d_out: int, tokens: int = 2048, uses: int = 4) -> dict:
    lin = Linear(d_in, d_out)
    xs = [torch.randn(tokens, d_in, requires_grad=True) for _ in range(uses)]

    def run(in_place: bool):
        def f() -> None:
            with accumulate_weight_grads([lin], in_place, min_numel=0):
                sum(lin(x).sum() for x in xs).backward()
            lin.weight.grad = lin.bias.grad = None

        return f

    return {"buffer": run(True), "autograd": run(False)}


def mela(name: str = "cpu-mela", batch: int = 8, tokens: int = 256) -> dict[str, dict]:
    """{sub-layer: {"written-out": fn, "composed": fn}} of Mela's HMM attention and q/k normalisation."""
    cfg = preset(name)
    attn = GatedAttention(cfg)
    x = torch.randn(batch, tokens // cfg.patch_size, cfg.hmm_width, requires_grad=True)
    heads = cfg.memory_heads
    qk = torch.randn(2, batch, heads, x.shape[1], cfg.hmm_width // heads, requires_grad=True)

    def both(fn) -> dict:
        def written_out() -> None:
            fn().sum().backward()

        def composed() -> None:
            compiling = torch.compiler.is_compiling
            torch.compiler.is_compiling = lambda: True  # the forms the compiler is handed
            try:
                fn().sum().backward()
            finally:
                torch.compiler.is_compiling = compiling

        return {"written-out": written_out, "composed": composed}

    return {"HMM attention": both(lambda: attn(x)), "q/k normalisation": both(lambda: l2_normalize(qk))}


def report(title: str, fns: dict, reps: int) -> None:
    times = interleaved(fns, reps, warmup=2, clock="cpu")
    (a, ta), (b, tb) = times.items()
    ma, mb = 1e3 * statistics.median(ta), 1e3 * statistics.median(tb)
    print(f"| {title} | {a} {ma:.2f} ms | {b} {mb:.2f} ms | {ma / mb:.3f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="*", default=list(SHAPES))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    set_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), CPU time, medians of {args.reps} interleaved rounds\n"
    )
    print("| what | default | other | default / other |")
    print("| --- | ---: | ---: | ---: |")
    for part, fns in mela().items():
        report(f"cpu-mela: {part}, fwd+bwd", fns, args.reps)
    for name in args.presets:
        report(f"{name}: S_down + S_up x 3, fwd+bwd", glue(name), args.reps)
    for name in args.presets:
        d = preset(name).d_model
        for d_in, d_out in ((d, 3 * d), (d, 4 * d)):
            report(f"{name}: Linear {d_in} -> {d_out} x 4 uses", linear(d_in, d_out), args.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
