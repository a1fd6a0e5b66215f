"""Host-side cost of one training step: operator calls and time where the arithmetic is negligible.

    python benchmarks/bench_host_overhead.py                 # cpu-tiny, 1 x 64 tokens, 1 thread, CPU time
    python benchmarks/bench_host_overhead.py --optimizer     # the step with a fused AdamW step
    python benchmarks/bench_host_overhead.py --by-op         # where the calls go, per ATen operator
    python benchmarks/bench_host_overhead.py --mela          # mela-400m vs transformerpp-400m at 4K, by part
    python benchmarks/bench_host_overhead.py --mela --compile glue   # the same compiled: kernels per step
    python benchmarks/bench_host_overhead.py --mela --memory-kernel triton   # memory updates fused, and backward

On a GPU a small model's step (and SpiralFormer's coarse passes at any size) is bound by the host launching
kernels, not by the kernels (docs/benchmarks.md, "GPU speed": the GPU idles a quarter of SpiralFormer-B's step at 160M).
What the host does per step can be measured on the CPU with a model so small that the arithmetic is
negligible: the number of ATen operator calls that do work (views and allocations left out; composite
operators such as ``linear`` -> ``addmm`` count at each level, as each is a dispatch), the number of those
calls that reach no further operator ("leaf" calls: about one kernel launch each on a GPU; some are CPU-only
details, such as the bias copy inside the CPU ``addmm``), and the step's CPU time. Reported for LoopedFormer
and SpiralFormer-B with MeSH and with the base topology (SpiralFormer Table 1's pair), and vanilla.

``--mela``: one fwd+bwd (batch 1, 4,096 tokens) of mela-400m's structure against transformerpp-400m's, every
width set to 64 (one head; the calls depend on the layers, cycles, chunks and memory heads, not on the widths),
and where Mela's calls go: the decoder (Mela with the HMM bypassed), the HMM's attention, fusions and norms
(Mela without its neural memory, less the decoder), the neural memory, and the memory of the H-1 cycles
without gradients (Mela at H = 1 less the full model). The goal: Mela's leaf calls at most 2x Transformer++'s.
``--compile SCOPE``: both models under that ``train.compile`` scope, counting what a compiled step launches: the
kernels inductor generated, the library GEMMs its graphs call, and the ATen calls left outside its graphs. The
kernels are the CPU backend's, which also fuses loop nests a GPU runs as separate Triton kernels: on a GPU the
count is about this or higher. ``--memory-kernel triton``: Mela's memory updates as the two fused Triton
kernels of ``train.memory_kernel: triton`` and, for the updates with gradients, their backward as two more
(Triton's interpreter where there is no GPU), each launch one call.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_mesh_overhead import interleaved, set_threads  # noqa: E402

from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.model.recursive.model import RecursiveLM  # noqa: E402
from recursive_lightning.training.parallel import compile_model  # noqa: E402

NO_KERNEL = {  # operators that only make views, allocate or dispatch to another operator
    "aten::view", "aten::as_strided", "aten::transpose", "aten::slice", "aten::t", "aten::unsqueeze",
    "aten::squeeze", "aten::permute", "aten::expand", "aten::select", "aten::narrow", "aten::reshape",
    "aten::split", "aten::chunk", "aten::detach", "aten::_unsafe_view", "aten::unbind", "aten::alias",
    "aten::resolve_conj", "aten::resolve_neg", "aten::empty", "aten::empty_like", "aten::split_with_sizes",
    "aten::empty_strided", "aten::contiguous", "aten::_reshape_alias", "aten::view_as", "aten::lift_fresh",
    "aten::result_type", "aten::unflatten", "aten::flatten", "aten::to", "aten::_to_copy",
    "aten::new_empty", "aten::new_empty_strided",
}  # fmt: skip

LOOPED, SPIRAL = "2+4x{1,1}+2", "2+4x{1/8,1/4,1/2,1}+2"
MODELS = {  # name: (layout, topology)
    "vanilla": ("8", "base"),
    "LoopedFormer 2+4x{1,1}+2 mesh": (LOOPED, "mesh"),
    "SpiralFormer-B 2+4x{1/8,1/4,1/2,1}+2 mesh": (SPIRAL, "mesh"),
    "LoopedFormer base": (LOOPED, "base"),
    "SpiralFormer-B base": (SPIRAL, "base"),
}


def step_fn(layout: str, topology: str, p: str, batch: int, seq: int, optimizer: bool = False):
    torch.manual_seed(0)
    model = RecursiveLM(preset(p, layout=layout, topology=topology))
    idx = torch.randint(0, model.cfg.vocab_size, (batch, seq))
    # fused: the step as one operator call, as a GPU's multi-tensor kernels are launched once per step (the
    # CPU's foreach path dispatches per tensor, which a GPU does not)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True) if optimizer else None

    def run() -> None:
        model.loss(idx, idx).backward()
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)

    return run


TRITON_LAUNCH = "triton_kernel::"  # the profiler event of a counted Triton launch (count_triton_launches)


def _counted(name: str) -> bool:
    """An ATen call that does work, a kernel inductor generated (``--compile``: named ``graph_N_cpp_fused_*``
    in the profile once :func:`profile_generated_kernels` is on) or a Triton launch (:func:`count_triton_launches`)."""
    return (
        (name.startswith("aten::") and name not in NO_KERNEL)
        or "cpp_fused" in name
        or name.startswith(TRITON_LAUNCH)
    )


class _ProfiledLaunch:
    """``kernel[grid](...)`` of a Triton kernel inside a profiler event named ``name``."""

    def __init__(self, kernel, name: str) -> None:
        self.kernel, self.name = kernel, name

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            with torch.profiler.record_function(TRITON_LAUNCH + self.name):
                return launch(*args, **kwargs)

        return run


MEMORY_KERNELS = ("store_surprise", "orthogonal_step", "orthogonal_step_backward", "store_surprise_backward")


def count_triton_launches(*modules) -> None:
    """Each launch of the Triton kernels of ``modules`` (``model/mela/memory_kernel.py`` and
    ``memory_kernel_backward.py``) from now on records a profiler event, which :func:`op_calls` counts as one
    call; what runs inside (the ATen copies of Triton's interpreter, on the CPU) is not counted."""
    for module in modules:
        for name in MEMORY_KERNELS:
            if hasattr(module, name):
                setattr(module, name, _ProfiledLaunch(getattr(module, name), name))


def profile_generated_kernels() -> None:
    """Each kernel inductor's CPU backend generates from now on records a profiler event (``graph_N_cpp_fused_*``)
    when called, so that :func:`op_calls` counts it."""
    import torch._inductor.config  # heavy

    torch._inductor.config.cpp.enable_kernel_profile = True


def _leaf(event) -> bool:
    """A counted call none of whose callees (at any depth) is counted: about one kernel launch."""
    if event.name.startswith(TRITON_LAUNCH):
        return True
    stack = list(event.cpu_children)
    while stack:
        child = stack.pop()
        if _counted(child.name):
            return False
        stack.extend(child.cpu_children)
    return True


def _below(event, matches) -> bool:
    """Whether an event that ``event`` ran inside (at any depth) has a name ``matches`` accepts."""
    parent = event.cpu_parent
    while parent is not None:
        if matches(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def _inside_triton_launch(event) -> bool:
    return _below(event, lambda name: name.startswith(TRITON_LAUNCH))


def _outside_compiled(event) -> bool:
    """Whether ``event`` ran in eager mode: under no compiled region's forward or backward ("Torch-Compiled
    Region", "CompiledFunction[Backward]", its graphs)."""
    return not _below(event, lambda name: "Compiled" in name)


def op_calls(
    fn, by_op: bool = False, eager_only: bool = False
) -> tuple[int, int] | tuple[int, int, dict[str, int]]:
    """(ATen calls that do work, leaf calls among them) of one call of ``fn`` after a warm-up call; with
    ``by_op``, also the calls per operator; with ``eager_only``, only the calls outside compiled regions."""
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [
        e
        for e in prof.events()
        if _counted(e.name) and not _inside_triton_launch(e) and (not eager_only or _outside_compiled(e))
    ]
    calls, leaves = len(events), sum(_leaf(e) for e in events)
    if not by_op:
        return calls, leaves
    per_op: dict[str, int] = {}
    for e in events:
        per_op[e.name] = per_op.get(e.name, 0) + 1
    return calls, leaves, per_op


MELA_AT_64 = {
    "d_model": 64,
    "hmm_d_model": 64,
    "n_heads": 1,
    "n_kv_heads": 1,
    "hmm_heads": 1,
    "vocab_size": 512,
}
MELA_PARTS = {  # name: (preset overrides, HMM bypassed)
    "Mela": ({}, False),
    "Mela, HMM bypassed (decoder)": ({}, True),
    "Mela without neural memory": ({"neural_memory": False}, False),
    "Mela at H = 1 (no cycles without gradients)": ({"h_cycles": 1}, False),
    "Mela at H = 1 without neural memory": ({"h_cycles": 1, "neural_memory": False}, False),
    "Mela, memory update without Newton-Schulz": ({"memory_update": "forgetting"}, False),
}


def mela_calls(
    mela: str,
    transformerpp: str,
    seq: int,
    by_op: bool = False,
    parts: bool = True,
    compile_scope: str | None = None,
    memory_kernel: bool = False,
) -> dict[str, tuple]:
    """``op_calls`` of one fwd+bwd of each model of :data:`MELA_PARTS` (``parts``; else Mela alone) and of
    Transformer++, at width 64; with ``compile_scope`` (a ``train.compile`` value) every model compiled so,
    each compiled graph's kernels counted as inductor generated them (one call each) beside the ATen calls
    left outside the graphs and the library GEMMs the graphs call; with ``memory_kernel`` Mela's memory updates
    and their backward as the fused Triton kernels (:func:`interpreted_memory_kernel`)."""
    from bench_mela import decoder_alone  # optional

    from recursive_lightning.model.build import build_model  # heavy

    if compile_scope:
        profile_generated_kernels()

    def step(name: str, overrides: dict, bypass: bool):
        torch.manual_seed(0)
        model = build_model(preset(name, **MELA_AT_64, **overrides))
        model = decoder_alone(model) if bypass else model
        if compile_scope:
            compile_model(model, compile_scope)
        if memory_kernel and not bypass:
            model.use_memory_kernel()
        idx = torch.randint(0, 512, (1, seq + 1))

        def run() -> None:
            model.loss(idx[:, :-1], idx[:, 1:]).backward()
            model.zero_grad(set_to_none=True)

        return run

    overrides = {k: v for k, v in MELA_AT_64.items() if k not in ("hmm_d_model", "hmm_heads")}
    tpp = _transformerpp(transformerpp, overrides, seq, compile_scope)
    out = {"Transformer++": op_calls(tpp, by_op=by_op)}
    fns = {
        part: step(mela, extra, bypass)
        for part, (extra, bypass) in list(MELA_PARTS.items())[: None if parts else 1]
    }
    for part, fn in fns.items():
        out[part] = op_calls(fn, by_op=by_op)
    if compile_scope:  # where Mela's calls still run eagerly, around its compiled regions
        out["Mela, the calls outside compiled regions"] = op_calls(fns["Mela"], eager_only=True)
    return out


def _transformerpp(name: str, overrides: dict, seq: int, compile_scope: str | None = None):
    torch.manual_seed(0)
    model = RecursiveLM(preset(name, **overrides))
    if compile_scope:
        compile_model(model, compile_scope)
    idx = torch.randint(0, 512, (1, seq + 1))

    def run() -> None:
        model.loss(idx[:, :-1], idx[:, 1:]).backward()
        model.zero_grad(set_to_none=True)

    return run


def interpret_triton_on_the_cpu() -> None:
    """Triton kernels imported from now on run by Triton's interpreter, on CPU tensors (``TRITON_INTERPRET=1``,
    read when ``triton.jit`` decorates a kernel); Triton from ``setup.sh``'s ``.venv/triton-interpreter`` where
    torch did not bring it."""
    os.environ["TRITON_INTERPRET"] = "1"
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", ".venv", "triton-interpreter"))


def interpreted_memory_kernel() -> None:
    """``model/mela/memory_kernel.py`` and its backward under Triton's interpreter (the tensors here are the
    CPU's), each launch counted (:func:`count_triton_launches`)."""
    interpret_triton_on_the_cpu()
    from triton.runtime import interpreter  # optional

    from recursive_lightning.model.mela import memory_kernel, memory_kernel_backward  # optional

    # the interpreter's int32 overflow check of every index operation: half its time, and counts do not need it
    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    count_triton_launches(memory_kernel, memory_kernel_backward)


def report_mela(args) -> bool:
    """Prints the counts, Mela's parts and the PASS/MISS line of the 2x goal; True when it holds."""
    fused = args.memory_kernel == "triton"
    if fused:
        interpreted_memory_kernel()
    c = mela_calls(
        args.mela, args.transformerpp, args.seq_len, args.by_op, not args.totals, args.compile, fused
    )
    leaves = {k: v[1] for k, v in c.items()}
    print(
        f"{args.mela} vs {args.transformerpp} at width 64, 1 x {args.seq_len} tokens, fwd+bwd, "
        f"train.compile: {args.compile or 'false'}, train.memory_kernel: {args.memory_kernel}, "
        f"torch {torch.__version__}\n"
    )
    kind = "ATen and generated kernels" if args.compile else "ATen calls (no views)"
    print(f"| model | {kind} | leaf calls (~kernels) |\n| --- | ---: | ---: |")
    for k, v in c.items():
        print(f"| {k} | {v[0]:,} | {v[1]:,} |")
    if not args.totals:
        _print_parts(args, c, leaves)
    ratio = leaves["Mela"] / leaves["Transformer++"]
    ok = ratio <= 2.0
    what = (
        f"kernels per fwd+bwd, train.compile: {args.compile}"
        if args.compile
        else "leaf ATen calls per fwd+bwd"
    ) + (", the memory updates fused (2 launches each, 2 more in the backward)" if fused else "")
    print(
        f"\n{'PASS' if ok else 'MISS'} host calls Mela / Transformer++ {ratio:.2f} <= 2.0 "
        f"({leaves['Mela']:,} vs {leaves['Transformer++']:,} {what})"
    )
    if args.by_op:
        ops = sorted(c["Mela"][2], key=lambda op: -c["Mela"][2][op])
        print("\n| operator | Mela | Transformer++ |\n| --- | ---: | ---: |")
        for op in ops:
            print(f"| {op} | {c['Mela'][2][op]} | {c['Transformer++'][2].get(op, 0)} |")
    return ok


def _print_parts(args, c: dict[str, tuple], leaves: dict[str, int]) -> None:
    full, dec = leaves["Mela"], leaves["Mela, HMM bypassed (decoder)"]
    no_mem, h1 = leaves["Mela without neural memory"], leaves["Mela at H = 1 (no cycles without gradients)"]
    h1_no_mem, no_ns = (
        leaves["Mela at H = 1 without neural memory"],
        leaves["Mela, memory update without Newton-Schulz"],
    )
    cfg = preset(args.mela)
    # the H-1 cycles without gradients run H-1 times the forward of the last cycle's applications
    grad_cycle, no_grad = h1 - h1_no_mem, (full - no_mem) - (h1 - h1_no_mem)
    fwd = no_grad / (cfg.h_cycles - 1)
    print("\n| Mela's leaf calls by part | calls | share |\n| --- | ---: | ---: |")
    parts = {
        "decoder": dec,
        "HMM attention, fusions, norms": no_mem - dec,
        "neural memory": full - no_mem,
        "  its H-1 cycles without gradients (forward)": no_grad,
        "  its last cycle's forward": round(fwd),
        "  its last cycle's backward": round(grad_cycle - fwd),
        "  Newton-Schulz-5 and its step floor (fwd+bwd, all cycles)": full - no_ns,
    }
    for k, v in parts.items():
        print(f"| {k} | {v:,} | {v / full:.3f} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="cpu-tiny")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--optimizer", action="store_true", help="include a fused AdamW step")
    p.add_argument("--by-op", action="store_true", help="also list the calls per ATen operator")
    p.add_argument(
        "--mela", nargs="?", const="mela-400m", default=None, help="Mela against Transformer++, by part"
    )
    p.add_argument("--transformerpp", default="transformerpp-400m")
    p.add_argument("--totals", action="store_true", help="--mela: Mela and Transformer++ only, no parts")
    p.add_argument(
        "--compile",
        choices=["layers", "glue"],
        help="--mela: both models compiled with this train.compile scope (Mela and Transformer++ only); "
        "inductor's generated kernels counted with the calls left outside its graphs",
    )
    p.add_argument(
        "--memory-kernel",
        choices=["torch", "triton"],
        default="torch",
        help="--mela: Mela's memory updates and their backward as fused Triton kernels (interpreted on the "
        "CPU), each launch one call (Mela and Transformer++ only)",
    )
    args = p.parse_args(argv)
    if (args.compile or args.memory_kernel != "torch") and not args.mela:
        p.error("--compile and --memory-kernel count Mela's paths; add --mela")
    args.totals = args.totals or bool(args.compile) or args.memory_kernel != "torch"
    set_threads(1)
    if args.mela:
        args.seq_len = 4096 if args.seq_len == 64 else args.seq_len
        report_mela(args)
        return 0
    fns = {
        k: step_fn(layout, topo, args.preset, args.batch, args.seq_len, args.optimizer)
        for k, (layout, topo) in MODELS.items()
    }
    counts = {k: op_calls(fn, by_op=args.by_op) for k, fn in fns.items()}
    times = interleaved(fns, args.reps, warmup=3, clock="cpu") if args.reps else {}  # the models take turns
    step = "fwd+bwd+AdamW" if args.optimizer else "fwd+bwd"
    print(f"{args.preset}, {args.batch} x {args.seq_len} tokens, 1 thread, torch {torch.__version__}\n")
    print(f"| model | ATen calls per {step} (no views) | leaf calls (~kernels) | CPU ms per step (median) |")
    print("| --- | ---: | ---: | ---: |")
    for k in fns:
        ms = f"{1e3 * statistics.median(times[k]):.2f}" if times else "-"
        print(f"| {k} | {counts[k][0]} | {counts[k][1]} | {ms} |")
    for topo in ("mesh", "base"):
        looped = [v for k, v in counts.items() if k.startswith("LoopedFormer") and k.endswith(topo)][0]
        spiral = [v for k, v in counts.items() if k.startswith("SpiralFormer") and k.endswith(topo)][0]
        print(
            f"SpiralFormer-B / LoopedFormer ({topo}): calls {spiral[0] / looped[0]:.3f}, "
            f"leaf calls {spiral[1] / looped[1]:.3f}"
        )
    if args.by_op:
        ops = sorted(
            {op for c in counts.values() for op in c[2]}, key=lambda op: -counts[list(fns)[2]][2].get(op, 0)
        )
        print("\n| operator | " + " | ".join(fns) + " |")
        print("| --- |" + " ---: |" * len(fns))
        for op in ops:
            print(f"| {op} | " + " | ".join(str(counts[k][2].get(op, 0)) for k in fns) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
