"""torchao's float8 training against bf16 autocast: a 400M model's training step, as torchtitan converts it.

    python benchmarks/bench_float8.py                       # transformerpp-400m and 410M LoopedFormer, 4 x 4096
    python benchmarks/bench_float8.py --recipe rowwise      # per-row scales (torchao's rowwise recipe)
    python benchmarks/bench_float8.py --compile false       # eager: the scaling casts unfused
    python benchmarks/bench_float8.py --smoke               # no GPU needed: the conversion and step on the CPU

Every ``Linear`` inside the transformer layers whose input and output widths are multiples of 16 (the float8
GEMM's alignment) becomes torchao's ``Float8Linear`` (``convert_to_float8_training``, dynamic scaling: e4m3
inputs and weights, e5m2 output gradients); the embeddings, the LM head with its loss and the norms stay in
bf16, as torchtitan's default filter leaves the output layer. Both models run under bf16 autocast with
``train.compile: layers`` (the float8 casts and amax reductions fuse into the compiled layers; eager, each is a
kernel of its own), from the same weights, taking turns after a warm-up; wall-clock medians of forward +
backward, peak memory, and the float8 model's loss on the first batch against the bf16 model's.

One line per model says which is faster (``FLOAT8 FASTER x0.84``: float8's time over bf16's) and whether the
losses agree to 1 %. ``train`` offers float8 only once a GPU measures a gain at this package's sizes: at d = 768-1024
a GEMM is short enough that the casts can cost what the faster GEMM saves. torchao is not a dependency of the
package: the lent machine gets its wheel from ``.whl`` (``gpu_wheels.sh``).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_mesh_overhead import interleaved  # noqa: E402

from recursive_lightning.model.build import build_model  # noqa: E402
from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.training.parallel import compile_model  # noqa: E402

MODELS = {  # name: preset fields
    "transformerpp-400m": {"name": "transformerpp-400m"},
    "looped-410m": {"name": "pythia-410m", "layout": "4+8x{1,1}+4", "topology": "mesh"},  # LoopedFormer, MeSH
}
SMOKE = {"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512}


def layer_linears(model: torch.nn.Module):
    """``module_filter_fn`` for ``convert_to_float8_training``: the Linears of the transformer layers whose
    widths are multiples of 16 (the embeddings and the LM head are not Linears of a layer)."""
    inside = {id(m) for layers in model.layer_lists() for layer in layers for m in layer.modules()}

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        return (
            id(module) in inside
            and isinstance(module, torch.nn.Linear)
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    return keep


def float8_copy(model: torch.nn.Module, recipe: str) -> tuple[torch.nn.Module, int]:
    """A float8 copy of ``model`` (same weights) and the number of Linears converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # optional
    from torchao.float8.float8_linear import Float8Linear  # optional

    out = copy.deepcopy(model)
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(out, config=config, module_filter_fn=layer_linears(out))
    return out, sum(isinstance(m, Float8Linear) for m in out.modules())


def step(model: torch.nn.Module, idx: torch.Tensor, device: str):
    """One forward + backward under bf16 autocast (waits for the GPU: the caller times the wall-clock)."""

    def run() -> float:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model.loss(idx[:, :-1], idx[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        return loss.item()

    return run


def compare(name: str, fields: dict, args, device: str) -> str:
    """Prints the model's row pair; returns its verdict line."""
    torch.manual_seed(0)
    cfg = preset(**fields, max_seq_len=args.seq_len, **(SMOKE if args.smoke else {}))
    bf16 = build_model(cfg).to(device).train()
    f8, converted = float8_copy(bf16, args.recipe)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), device=device)
    if args.compile != "false":
        for m in (bf16, f8):
            compile_model(m, args.compile)
    fns = {"bf16": step(bf16, idx, device), "float8": step(f8, idx, device)}
    first = {k: fn() for k, fn in fns.items()}  # compiles; the losses of the same weights on the same batch
    peak = {}
    for k, fn in fns.items():
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        fn()
        peak[k] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    med = {k: 1e3 * statistics.median(v) for k, v in interleaved(fns, args.reps, warmup=1).items()}
    tokens = args.batch * args.seq_len
    for k in fns:
        print(
            f"| {name} | {k} | {med[k]:.1f} | {tokens / med[k] * 1e3:,.0f} | {peak[k]:.1f} | {first[k]:.4f} |"
        )
    ratio, diff = med["float8"] / med["bf16"], abs(first["float8"] - first["bf16"]) / abs(first["bf16"])
    agrees = "losses agree" if diff < 0.01 else "LOSSES DIFFER"
    winner = "FLOAT8 FASTER" if ratio < 1 else "BF16 FASTER"
    return (
        f"{winner} {name} x{ratio:.2f} ({converted} Linears in float8, {args.recipe}; {agrees}, {diff:.1e})"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"a comma list of {', '.join(MODELS)}")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    p.add_argument("--compile", default="layers", choices=["false", "layers", "glue", "model"])
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, eager, two reps")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.models.split(",")]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"--models: {', '.join(unknown)} unknown; choose from {', '.join(MODELS)}")
    if args.smoke:
        device, args.batch, args.seq_len, args.reps, args.compile = "cpu", 2, 64, 2, "false"
    elif not torch.cuda.is_available():
        print("bench_float8.py needs a CUDA GPU with float8 (sm_89 or newer; --smoke runs on the CPU)")
        return 1
    else:
        device = "cuda"
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    try:
        import torchao  # optional
    except ImportError:
        print("bench_float8.py needs torchao (pip install torchao, or .whl from benchmarks/gpu_wheels.sh)")
        return 1
    print(
        f"torchao {torchao.__version__}, {args.batch} x {args.seq_len}, bf16 autocast, train.compile: "
        f"{args.compile}, {args.reps} reps, wall-clock medians\n"
    )
    print(
        "| model | GEMMs | ms fwd+bwd | tokens/s | peak GiB | first loss |\n| --- | --- | ---: | ---: | ---: | ---: |"
    )
    verdicts = [compare(n, MODELS[n], args, device) for n in names]
    print()
    for line in verdicts:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
