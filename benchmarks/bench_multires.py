"""Wall-clock of SpiralFormer-B against LoopedFormer with the same layer allocation (SpiralFormer Table 1).

    python benchmarks/bench_multires.py --reps 16 --min-util 0.95   # pythia-160m, 2+4x{1/8,1/4,1/2,1}+2 vs 2+4x{1,1}+2, 2 x 1024
    python benchmarks/bench_multires.py --breakdown --one-process   # + where the time goes, component by component
    python benchmarks/bench_multires.py --preset cpu-base --reps 20 # the same allocation at d=256
    python benchmarks/bench_multires.py --preset cpu-tiny --seq-len 128 --batch 16 --threads 1 --clock cpu \
        --reps 32 --free-glue --attention  # the default sweep's size: the bound with no S_down/S_up work

Table 1 compares, at every Pythia size, LoopedFormer ``P+Nx{1,1}+P`` with SpiralFormer-B
``P+Nx{1/8,1/4,1/2,1}+P`` (same prelude/core/coda, same parameters; e.g. 160M: 2+4x{1,1}+2 at 1.65e12
vs 2+4x{1/8,1/4,1/2,1}+2 at 1.48e12 FLOPs). The 12-layer ``cpu-base`` preset mirrors the 160M
allocation. Both use the MeSH topology by default (Table 1's unstarred rows). The default is the paper's
smallest size, Pythia-160M, at 2 x 1024 tokens.

Each model trains in a process of its own, as a training run would (``--one-process``: both in this
one, sharing its heap; see ``bench_mesh_overhead.InProcess`` for why that biases the comparison); one
forward+backward (``model.loss`` + ``backward``) per model per repetition, the processes taking turns
(ABAB, BABA on odd repetitions) after a warm-up, fresh processes every ``--respawn`` rounds; medians are
compared. The measured
time ratio is reported next to two forward FLOP ratios of ``model.describe.describe``: with attention halved
(causal; the goal: time ratio <= that + 0.03) and at full L x L (Table 1's convention, stricter).

``--breakdown`` times each component alone (forward+backward on random inputs of the right shape,
interleaved the same way): prelude+coda, the shared core at each resolution, S_down / S_up of each
step (``ResolutionStep.down/up``), the MeSH topology, embeddings+head+loss - and prints each
component's share of the measured time next to its share of the FLOPs.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_mesh_overhead import (  # noqa: E402
    ROUNDS,
    InProcess,
    add_common_args,
    fwd_bwd,
    interleaved,
    parse_sets,
    quartiles,
    set_threads,
)

from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.model.describe import describe  # noqa: E402
from recursive_lightning.model.recursive.model import RecursiveLM  # noqa: E402
from recursive_lightning.training.parallel import compile_model  # noqa: E402


def build(args: argparse.Namespace, kind: str) -> RecursiveLM:
    """``looped`` or ``spiral``: same seed, so the same prelude, core and coda weights."""
    torch.manual_seed(0)
    layout = args.looped if kind == "looped" else args.spiral
    model = RecursiveLM(preset(args.preset, layout=layout, topology=args.topology, **parse_sets(args.set)))
    if args.compile:
        compile_model(model, args.compile)  # train.compile: both models compiled the same way
    if args.free_glue:
        for step in model.steps:
            if not step.full_resolution:
                step.down, step.up = _free_down(step), _free_up(step)
    return model.train()


def _free_down(step):
    """A stand-in for S_down that does no work: the last position of each chunk, a strided view (the shape
    and the core's input length of the real one; ``--free-glue``)."""

    def down(h: torch.Tensor, offset: int | None = None) -> torch.Tensor:
        n = (h.shape[1] + step.offset) // step.g
        return h[:, step.g - 1 - step.offset :: step.g][:, :n]

    return down


def _free_up(step):
    """A stand-in for S_up that does no work beyond a broadcast: each chunk's row repeated g times, cropped or
    zero-padded to the sequence (``--free-glue``)."""

    def up(z: torch.Tensor, length: int) -> torch.Tensor:
        b, n, d = z.shape
        u = z.unsqueeze(2).expand(b, n, step.g, d).reshape(b, n * step.g, d)
        return u[:, :length] if n * step.g >= length else F.pad(u, (0, 0, 0, length - n * step.g))

    return up


def inputs(args: argparse.Namespace, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab, (args.batch, args.seq_len), generator=g)
    return idx, torch.randint(0, vocab, (args.batch, args.seq_len), generator=g)


def workload(args: argparse.Namespace, kind: str):
    """What an :class:`InProcess` worker times: one forward+backward of ``kind`` on the fixed batch."""
    model = build(args, kind)
    idx, tgt = inputs(args, model.cfg.vocab_size)
    return lambda: fwd_bwd(model, idx, tgt)


def _grad_leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_()


def _fwd_flops(fn) -> int:
    """Forward FLOPs as ``model.describe.describe`` counts them: the CPU flash-attention kernel has no
    FLOP formula, so attention is run through the math backend (its two matmuls are counted)."""
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        fn()
    return counter.get_total_flops()


def components(model: RecursiveLM, batch: int, seq: int) -> dict[str, tuple]:
    """name -> (fwd+bwd closure, forward FLOPs) for each part of the model."""
    d, vocab = model.cfg.d_model, model.cfg.vocab_size
    lay = model.layout
    out: dict[str, tuple] = {}
    x = _grad_leaf(batch, seq, d)
    idx = torch.randint(0, vocab, (batch, seq))

    def module_fn(fn, *inputs):
        def run():
            leaves = [t.detach().requires_grad_() for t in inputs]
            fn(*leaves).float().sum().backward()
            model.zero_grad(set_to_none=True)

        return run, _fwd_flops(lambda: fn(*inputs))

    out["prelude + coda"] = module_fn(lambda h: model.coda(model.prelude(h)), x)

    def embed_head(h):
        logits = model.head(model.norm(h + model.embed(idx)))
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.flatten())

    out["embed + norm + head + loss"] = module_fn(embed_head, x)
    for t, (step, core_id) in enumerate(zip(model.steps, lay.core_index)):
        core = model.cores[core_id]
        g = step.g
        if g == 1 and step.shift == 0 and step.gain == 1:
            out[f"step {t} (g=1): core at L={seq}"] = module_fn(core, x)
            continue
        n = seq // g
        z = _grad_leaf(batch, n, d)
        out[f"step {t} (g={g}): core at L={n}"] = module_fn(core, z)
        out[f"step {t} (g={g}): down"] = module_fn(step.down, x)
        out[f"step {t} (g={g}): up"] = module_fn(lambda z_, step=step: step.up(z_, seq), z)
    topo = model.topology
    srcs = [_grad_leaf(batch, seq, d) for _ in range(lay.n_loop + 2)]

    def topology(*leaves):
        h, carry = topo.start(leaves[0], leaves[1])
        for t in range(lay.n_loop):
            h, carry = topo.step(t, h, leaves[2 + t], carry)
        return topo.finish(h, carry)

    out[f"topology ({model.cfg.topology})"] = module_fn(topology, *srcs)
    return out


def breakdown(
    models: dict[str, RecursiveLM],
    measured: dict[str, float],
    batch: int,
    seq: int,
    reps: int,
    clock: str = "wall",
) -> None:
    """Each component alone; min over reps (one-sided noise on a shared machine), median alongside."""
    for name, model in models.items():
        comps = components(model, batch, seq)
        times = interleaved({k: v[0] for k, v in comps.items()}, reps, warmup=1, clock=clock)
        total_ms = sum(1e3 * min(ts) for ts in times.values())
        total_fl = sum(v[1] for v in comps.values())
        print(
            f"\n### {name}: components alone (fwd+bwd), sum of mins {total_ms:.0f} ms, whole model {measured[name]:.0f} ms\n"
        )
        print("| component | min ms | median ms | share of time | share of FLOPs | ms per GFLOP |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for k, ts in times.items():
            ms, fl = 1e3 * min(ts), comps[k][1]
            per = f"{ms / (fl / 1e9):.1f}" if fl else "-"
            print(
                f"| {k} | {ms:.1f} | {1e3 * statistics.median(ts):.1f} | {100 * ms / total_ms:.1f} % | "
                f"{100 * fl / total_fl:.1f} % | {per} |"
            )


def attention(args: argparse.Namespace, reps: int) -> None:
    """SDPA forward+backward, causal against full, at each length the SpiralFormer-B layout's core runs (the
    preset's heads and head size, this run's batch): what the attention kernel computes at each resolution."""
    cfg = preset(args.preset, layout=args.spiral, **parse_sets(args.set))
    lengths = sorted({(args.seq_len + w) // g for g, w in zip(cfg.parsed_layout.chunk, cfg.offsets())})
    fns = {}
    for n in lengths:
        q, k, v = (torch.randn(args.batch, n, cfg.n_heads, cfg.head_dim).transpose(1, 2) for _ in range(3))
        for causal in (True, False):

            def run(q=q, k=k, v=v, causal=causal):
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal).sum().backward()

            fns[(n, causal)] = run
    times = interleaved(fns, reps, warmup=1, clock=args.clock)
    print(
        f"\n### attention alone (SDPA fwd+bwd, batch {args.batch}, {cfg.n_heads} heads of {cfg.head_dim})\n"
    )
    print("| L | causal ms | full ms | causal / full | causal FLOPs / full |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in lengths:
        c, f = (1e3 * statistics.median(times[(n, x)]) for x in (True, False))
        print(f"| {n} | {c:.3f} | {f:.3f} | {c / f:.2f} | 0.50 |")


def profile(model: RecursiveLM, idx: torch.Tensor, tgt: torch.Tensor, rows: int = 25) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    fwd_bwd(model, idx, tgt)
    with tprofile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            fwd_bwd(model, idx, tgt)
    print(f"\n## torch.profiler, 2 fwd+bwd of {model.cfg.layout} (self CPU time, top {rows})\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="pythia-160m")
    p.add_argument("--spiral", default="2+4x{1/8,1/4,1/2,1}+2", help="SpiralFormer-B layout")
    p.add_argument("--looped", default="2+4x{1,1}+2", help="LoopedFormer layout with the same allocation")
    p.add_argument("--topology", default="mesh", help="topology of both models (Table 1: mesh)")
    add_common_args(p, seq_len=1024, batch=2)
    p.add_argument(
        "--one-process", action="store_true", help="both models in this process (default: a process each)"
    )
    p.add_argument(
        "--respawn",
        type=int,
        default=4,
        help="start fresh worker processes every this many rounds: a process keeps its own speed (where its "
        "memory landed) for its lifetime, so one pair of processes would compare two draws of that",
    )
    p.add_argument(
        "--compile",
        choices=("layers", "glue", "model"),
        help="compile both models as train.compile does (each worker compiles once: use a large --respawn)",
    )
    p.add_argument("--breakdown", action="store_true", help="time every component alone")
    p.add_argument(
        "--attention",
        action="store_true",
        help="time SDPA alone, causal against full, at each length the SpiralFormer-B core runs",
    )
    p.add_argument(
        "--free-glue",
        action="store_true",
        help="replace SpiralFormer-B's S_down / S_up by stand-ins that do no work (a strided view, a "
        "broadcast): a lower bound on the time ratio any S_down / S_up could reach (not the model)",
    )
    p.add_argument("--profile", action="store_true", help="torch.profiler table of the SpiralFormer model")
    args = p.parse_args(argv)

    set_threads(args.threads, not args.system_malloc)
    layouts = {"looped": args.looped, "spiral": args.spiral}
    models = (
        {v: build(args, v) for v in layouts} if args.one_process or args.breakdown or args.profile else {}
    )

    print("# SpiralFormer-B vs LoopedFormer wall-clock (forward + backward)\n")
    print(
        f"machine  {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, clock {args.clock}, malloc {'system' if args.system_malloc else 'kept'}, "
        f"load average {os.getloadavg()[0]:.2f} at start"
    )
    print(
        f"model    preset {args.preset}, topology {args.topology}, batch {args.batch} x seq "
        f"{args.seq_len}, reps {args.reps} (+{args.warmup} warm-up), interleaved, "
        + (
            "both in one process"
            if args.one_process
            else f"a process per model, fresh every {args.respawn} rounds"
        )
        + (f", overrides {' '.join(args.set)}" if args.set else "")
    )

    if args.one_process:
        idx, tgt = inputs(args, models["looped"].cfg.vocab_size)
        fns = {k: (lambda m=m: fwd_bwd(m, idx, tgt)) for k, m in models.items()}
        times = interleaved(fns, args.reps, args.warmup, min_util=args.min_util or None, clock=args.clock)
    else:
        times, kept, run, per_pair = {k: [] for k in layouts}, 0, 0, []
        for start in range(0, args.reps, args.respawn):
            fns = {
                k: InProcess(functools.partial(workload, args, k), args.threads, not args.system_malloc)
                for k in layouts
            }
            part = interleaved(
                fns,
                min(args.respawn, args.reps - start),
                args.warmup,
                min_util=args.min_util or None,
                clock=args.clock,
            )
            for k, fn in fns.items():
                fn.close()
                times[k] += part[k]
            kept, run = kept + ROUNDS["kept"], run + ROUNDS["run"]
            per_pair.append(statistics.median(a / b for a, b in zip(part["spiral"], part["looped"])))
        ROUNDS.update(kept=kept, run=run)
        print("process pairs: median spiral/looped ratio of each  " + "  ".join(f"{r:.3f}" for r in per_pair))
    print(
        f"rounds   {ROUNDS['kept']} kept of {ROUNDS['run']} run"
        + (f" (--min-util {args.min_util})" if args.clock == "wall" else "")
    )
    desc = {
        lay: describe(
            preset(args.preset, layout=lay, topology=args.topology, **parse_sets(args.set)),
            args.seq_len,
            args.batch,
        )
        for lay in set(layouts.values())
    }
    flops = {lay: d["flops_forward"] for lay, d in desc.items()}
    # causal kernels skip the masked half of QK^T and AV where their blocks allow (flash-attn on a GPU); on
    # the CPU at these lengths SDPA's causal kernel costs what the full one does (``--attention``)
    causal = {lay: d["flops_forward"] - d["flops_attention"] // 2 for lay, d in desc.items()}
    med = {k: 1e3 * statistics.median(ts) for k, ts in times.items()}

    print("\n| model | layout | fwd FLOPs (1e9) | median ms | IQR ms | min ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for k, ts in times.items():
        lo, hi = quartiles(ts)
        print(
            f"| {k} | `{layouts[k]}` | {flops[layouts[k]] / 1e9:.1f} | {med[k]:.1f} | {1e3 * lo:.1f}-{1e3 * hi:.1f} | "
            f"{1e3 * min(ts):.1f} |"
        )
    flop_ratio = flops[args.spiral] / flops[args.looped]
    causal_ratio = causal[args.spiral] / causal[args.looped]
    goal, strict = causal_ratio + 0.03, flop_ratio + 0.03
    print(f"\nFLOP ratio with causal attention (half of L x L): {causal_ratio:.4f}; goal: <= {goal:.4f}")
    print(
        f"FLOP ratio with attention at full L x L (describe, Table 1's convention): {flop_ratio:.4f}; "
        f"stricter: <= {strict:.4f}\n"
    )
    print("| ratio | medians | paired: median of per-rep ratios (IQR) | mins | goal | stricter |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for v, ref in [("spiral", "looped")]:
        r = med[v] / med[ref]
        ratios = [a / b for a, b in zip(times[v], times[ref])]
        paired, (plo, phi) = statistics.median(ratios), quartiles(ratios)
        mins = min(times[v]) / min(times[ref])
        print(
            f"| {v} / {ref} | {r:.4f} | {paired:.4f} ({plo:.3f}-{phi:.3f}) | {mins:.4f} | "
            f"{'MET' if r <= goal else 'MISSED'} | {'MET' if r <= strict else 'MISSED'} |"
        )
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")

    if args.breakdown:
        breakdown(models, med, args.batch, args.seq_len, max(5, args.reps), args.clock)
    if args.profile:
        profile(models["spiral"], *inputs(args, models["spiral"].cfg.vocab_size))
    if args.attention:
        attention(args, max(5, args.reps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
