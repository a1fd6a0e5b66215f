"""Parameters and FLOPs before training, counted on the meta device (no weights allocated).

FLOP convention (SpiralFormer Table 1): 2 FLOPs per multiply-accumulate of every matrix product,
attention scores (QK^T) and values (AV) included at full L x L (no causal halving), LM head
included, element-wise work ignored. MeSH Table 7 uses fvcore instead (1 per MAC, no attention):
``flops_forward_fvcore`` approximates that convention as (matrix-product MACs) - (attention MACs).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils.flop_counter import FlopCounterMode

from recursive_lightning import formatting
from recursive_lightning.errors import UserError
from recursive_lightning.model.build import build_on_meta
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.depth import at_depth
from recursive_lightning.model.mela.hierarchical_memory import GatedAttention
from recursive_lightning.model.mela.model import MelaLM
from recursive_lightning.model.mela.neural_memory import NeuralMemory
from recursive_lightning.model.recursive.depth import loop_plan
from recursive_lightning.model.recursive.mesh import MeSH
from recursive_lightning.model.recursive.model import RecursiveLM
from recursive_lightning.model.recursive.topology import Combination

CONVENTION = (
    "2 FLOPs per multiply-accumulate, attention QK^T and AV at full LxL included (SpiralFormer Table 1)"
)


def _numel(module: torch.nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def count_parameters(model: RecursiveLM) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())  # shared/tied tensors counted once
    embedding = model.embed.weight.numel() + (0 if model.cfg.tie_embeddings else model.head.weight.numel())
    router = _numel(model.topology) if isinstance(model.topology, MeSH) else 0
    combination = _numel(model.topology) if isinstance(model.topology, Combination) else 0
    resolution = sum(_numel(s.scorer) + _numel(s.allocator) for s in model.steps)
    return {
        "params_total": total,
        "params_non_embedding": total - embedding,
        "params_embedding": embedding,
        "params_router": router,
        "params_combination": combination,
        "params_resolution": resolution,
    }


_T = TypeVar("_T")


def without_loading_the_compiler(count: Callable[[], _T]) -> _T:
    """``count()`` on the meta device without importing torch's compiler (1-2 s of a 3 s ``describe``).

    torch's Python meta kernels (``torch._refs``: ``cat``, ``where``, ``pow``, ...) and
    ``FlopCounterMode.__torch_dispatch__`` are wrapped in ``torch._disable_dynamo``, whose first call imports
    ``torch._dynamo`` only to mark the function as one the compiler must not trace (torch/_compile.py). A
    count compiles nothing: while it runs, and only if ``torch._dynamo`` is not loaded yet, a stand-in
    answers ``disable(fn)`` with ``fn``. On return the stand-in leaves, with the marks it made, so a later
    ``torch.compile`` loads the compiler and marks these functions itself. Should a torch version ask the
    stand-in for more than ``disable``, the count runs again with the compiler. For a process that only
    counts (the ``describe`` command): another thread would see the stand-in meanwhile."""
    if "torch._dynamo" in sys.modules:
        return count()
    marked: list[Any] = []

    def disable(fn: Any, *args: Any, **kwargs: Any) -> Any:
        marked.append(fn)
        return fn

    stand_in = types.ModuleType("torch._dynamo", "a stand-in while describe counts (model/describe.py)")
    stand_in.disable = disable  # type: ignore[attr-defined]
    sys.modules["torch._dynamo"], torch._dynamo = stand_in, stand_in
    try:
        return count()
    except (ImportError, AttributeError) as e:
        if "_dynamo" not in str(e):
            raise
    finally:
        if sys.modules.get("torch._dynamo") is stand_in:
            del sys.modules["torch._dynamo"]
        if vars(torch).get("_dynamo") is stand_in:
            del torch._dynamo
        for fn in marked:
            getattr(fn, "__dict__", {}).pop("__dynamo_disable", None)
    return count()


def _attention_macs(cfg: ModelConfig, seq_len: int, plan: list[int]) -> int:
    lay = cfg.parsed_layout
    macs = (lay.prelude + lay.coda) * 2 * seq_len * seq_len * cfg.d_model
    for s in plan:  # the trained step each loop step runs as (model/recursive/depth.py)
        n = seq_len // lay.chunk[s]
        macs += lay.cores[lay.core_index[s]] * 2 * n * n * cfg.d_model
    return macs


def _meta_forward(
    cls: type[torch.nn.Module], cfg: ModelConfig, seq_len: int, batch_size: int, loops: int | None = None
) -> tuple[torch.nn.Module, FlopCounterMode]:
    """The model built on the meta device (no weights allocated) and the FLOPs of one forward pass at depth
    ``loops`` (None: as built)."""
    model = build_on_meta(cls, cfg)
    layers = [layer for stack in model.layer_lists() for layer in stack]  # prelude, cores, coda
    with at_depth(model, loops):
        return model, _count_forward(model, seq_len, batch_size, layers)


def _signature(x: Any) -> Any:
    """What a module's FLOPs and output shapes depend on, on the meta device: shapes, dtypes, structure."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_signature(v) for v in x))
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):  # Mela's MemoryState: its tensors' shapes
        return (type(x).__name__, tuple(_signature(getattr(x, f.name)) for f in dataclasses.fields(x)))
    return ("object", id(x))  # anything else: never equal to another call's


def _structure(module: torch.nn.Module) -> Any:
    """What a module's FLOPs depend on besides its inputs: the class, parameter and buffer shapes and plain
    attributes of it and of every submodule (equal for two layers of one stack, which hold other weights)."""
    return tuple(
        (
            name,
            type(m),
            tuple(
                (k, _signature(v))
                for k, v in sorted(vars(m).items())
                if not k.startswith("_") and k != "forward"
            ),
            tuple((k, _signature(t)) for k, t in (*m._parameters.items(), *m._buffers.items())),
        )
        for name, m in module.named_modules()
    )


class _Replay:
    """Calls that repeat one already counted during a meta-device count: the first call runs, later ones add
    its FLOPs (per module path, moved to their own path) and return its outputs. A call repeats another when
    both modules have one structure (``_structure``) and their inputs one signature: the same module called
    again, or another layer of the same stack. Meta tensors hold no values, so a replayed output is exactly
    what a rerun would give. Mela's HLR calls its L-module l_cycles * h_cycles times and its H-module h_cycles
    times per forward (Sec. 3.2), all with one input shape; its decoder is a stack of identical layers."""

    def __init__(
        self, counter: FlopCounterMode, root: torch.nn.Module, modules: list[torch.nn.Module]
    ) -> None:
        self.counter, self.modules = counter, modules
        # the names FlopCounterMode's module tracker gives (torch/utils/module_tracker.py)
        self.paths = {id(m): f"{type(root).__name__}.{n}" for n, m in root.named_modules() if n}
        self.seen: dict[Any, tuple[Any, str, dict[str, dict[Any, int]]]] = {}

    def _wrap(self, module: torch.nn.Module) -> Any:
        forward, path = module.forward, self.paths[id(module)]

        def replayed(*args: Any, **kwargs: Any) -> Any:
            key = (_structure(module), _signature(args), _signature(sorted(kwargs.items())))
            if key not in self.seen:
                before = self.counter.get_flop_counts()
                out = forward(*args, **kwargs)
                delta = {  # the module's own count and its submodules'
                    k: {op: n - before.get(k, {}).get(op, 0) for op, n in ops.items()}
                    for k, ops in self.counter.get_flop_counts().items()
                    if k == path or k.startswith(path + ".")
                }
                self.seen[key] = (out, path, delta)
                return out
            out, source, delta = self.seen[key]
            counts = self.counter.flop_counts
            for k, ops in delta.items():
                for op, n in ops.items():
                    counts[path + k[len(source) :]][op] += n
            for parent in self.counter.mod_tracker.parents - {path}:  # the enclosing modules and "Global"
                for op, n in delta[source].items():
                    counts[parent][op] += n
            return out

        return replayed

    def __enter__(self) -> _Replay:
        for m in self.modules:
            m.forward = self._wrap(m)  # an instance attribute: nn.Module.__call__ runs it, hooks included
        return self

    def __exit__(self, *exc: Any) -> None:
        for m in self.modules:
            del m.forward


def _count_forward(
    model: torch.nn.Module, seq_len: int, batch_size: int, replay: list[torch.nn.Module] = ()
) -> FlopCounterMode:
    idx = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad(), _Replay(counter, model, list(replay)):
        model(idx)
    return counter


def describe(
    cfg: ModelConfig, seq_len: int = 4096, batch_size: int = 1, loops: int | None = None
) -> dict[str, Any]:
    """Parameter counts and forward FLOPs of one ``batch_size x seq_len`` sequence, in seconds at any size;
    ``loops``: at that test-time depth (K' loop steps, Mela's H' cycles; model/depth.py), None: as built."""
    for name, v in (("seq_len", seq_len), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"describe needs a positive --{name.replace('_', '-')}, not {v!r}.")
    if cfg.arch == "mela":
        return describe_mela(cfg, seq_len, batch_size, loops)
    model, counter = _meta_forward(RecursiveLM, cfg, seq_len, batch_size, loops)
    params = count_parameters(model)
    flops = counter.get_total_flops()
    lay = cfg.parsed_layout
    plan = loop_plan(lay, loops)
    attention = 2 * batch_size * _attention_macs(cfg, seq_len, plan)
    out: dict[str, Any] = {
        "layout": cfg.layout,
        "kind": lay.kind,
        "topology": cfg.topology,
        "d_model": cfg.d_model,
        "n_loop": len(plan),
        "n_loop_trained": lay.n_loop,
        "n_compute_layers": lay.prelude + sum(lay.cores[lay.core_index[s]] for s in plan) + lay.coda,
        "buffer": cfg.buffer_slots if cfg.topology == "mesh" else None,
        **params,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "flops_forward": flops,
        "flops_attention": attention,
        "flops_forward_fvcore": (flops - attention) // 2,
        "flops_convention": CONVENTION,
    }
    if cfg.topology == "mesh":
        # MeSH Eq. 8, fvcore units: (N_loop + 1) * 6 * bs * S * d * B
        out["flops_mesh_eq8"] = (len(plan) + 1) * 6 * batch_size * seq_len * cfg.d_model * cfg.buffer_slots
    return out


MELA_CONVENTION = (
    "2 FLOPs per multiply-accumulate, attention QK^T and AV over each chunk at full size (C + P*C decoder "
    "positions, C patches in the HMM; chunks never attend to each other)"
)

# Mela Table 1: (memory %, language %) of each size; the rest is embedding + output
MELA_TABLE1_SHARES = {"mela-400m": (27.45, 65.75), "mela-800m": (28.78, 66.35), "mela-1.2b": (18.19, 76.97)}


def _mela_parameters(model: torch.nn.Module) -> dict[str, int]:
    hmm = model.hmm
    attention = sum(_numel(m) for m in hmm.modules() if isinstance(m, GatedAttention))
    gates = sum(_numel(m.gate) for m in hmm.modules() if isinstance(m, GatedAttention))
    memories = [m for m in hmm.modules() if isinstance(m, NeuralMemory)]
    initial = sum(_numel(m.init_weights) for m in memories)
    fusions = _numel(hmm.fusions) + _numel(hmm.l_module.fuse) + _numel(hmm.h_module.fuse)
    norms = sum(_numel(m) for m in hmm.modules() if isinstance(m, torch.nn.RMSNorm))
    total = sum(p.numel() for p in model.parameters())
    embedding = model.embed.weight.numel() + (0 if model.cfg.tie_embeddings else model.head.weight.numel())
    memory = _numel(hmm) + model.memory_init.numel()
    return {
        "params_total": total,
        "params_non_embedding": total - embedding,
        "params_embedding": embedding,
        "params_router": 0,
        "params_combination": 0,
        "params_resolution": 0,
        "params_memory": memory,
        "params_language": total - embedding - memory,
        "params_patchify": _numel(hmm.patchify),
        "params_hmm_attention": attention - gates,
        "params_hmm_gates": gates,
        "params_hmm_norms": norms,
        "params_memory_projections": sum(_numel(m) for m in memories) - initial,
        "params_initial_memories": initial,
        "params_fusions": fusions,
        "params_memory_tokens": model.memory_init.numel(),
    }


def _ns_flops(cfg: ModelConfig) -> int:
    """FLOPs of one Newton-Schulz-k over one memory state (every tensor, every head): per step on an m x n
    matrix (m <= n) A = XX^T (m^2 n MACs), A @ A (m^3), (bA + cA^2) @ X (m^2 n)."""
    hd = cfg.hmm_width // cfg.memory_heads
    dims = [hd] + [cfg.memory_expansion * hd] * (cfg.memory_depth - 1) + [hd]
    macs = 0
    for a, b in zip(dims[:-1], dims[1:]):
        m, n = min(a, b), max(a, b)
        macs += 2 * m * m * n + m**3
    return 2 * cfg.ns_steps * macs * cfg.memory_heads


def _mela_flop_counts(
    model: torch.nn.Module, cfg: ModelConfig, seq_len: int, batch_size: int
) -> dict[str, dict[Any, int]]:
    """FLOPs by module path and op of one meta forward. Every part grows by the same amount per chunk of
    P*C tokens (decoder rows, HMM chunks, patchify, head positions), so beyond 3 chunks the forward is
    counted at 2 and 3 chunks (same partial last chunk) and extended linearly: exact, and seconds at any
    length (the HMM's meta forward runs Python shape functions op by op)."""
    PC = cfg.tokens_per_chunk
    n = -(-seq_len // PC)
    replay = [model.hmm.l_module, model.hmm.h_module, *(m for stack in model.layer_lists() for m in stack)]
    if n <= 3:
        return _count_forward(model, seq_len, batch_size, replay).get_flop_counts()
    two = seq_len - (n - 2) * PC
    c2 = _count_forward(model, two, batch_size, replay).get_flop_counts()
    c3 = _count_forward(model, two + PC, batch_size, replay).get_flop_counts()
    return {
        k: {op: c2.get(k, {}).get(op, 0) + (n - 2) * (c3[k][op] - c2.get(k, {}).get(op, 0)) for op in c3[k]}
        for k in c3
    }


def describe_mela(
    cfg: ModelConfig, seq_len: int = 4096, batch_size: int = 1, h_cycles: int | None = None
) -> dict[str, Any]:
    """``describe`` for ``arch: mela``: parameters by part with Table 1's shares, the sequence geometry
    (N_p, N_c, decoder length), HLR's block applications and the forward FLOPs by part; ``h_cycles``: at that
    test-time depth H' (None: as built)."""
    model = build_on_meta(MelaLM, cfg)
    with at_depth(model, h_cycles):
        counts = _mela_flop_counts(model, cfg, seq_len, batch_size)
        return _describe_mela(model, cfg, counts, seq_len, batch_size)


def _describe_mela(
    model: MelaLM, cfg: ModelConfig, counts: dict[str, dict[Any, int]], seq_len: int, batch_size: int
) -> dict[str, Any]:
    PC, C, P = cfg.tokens_per_chunk, cfg.chunk_size, cfg.patch_size
    n_chunks = -(-seq_len // PC)
    hmm_chunks = n_chunks - 1  # the last chunk's memory is read by no text position
    apps = len(model.hmm.applications)
    kv = len(model.layers) * 2 * (C + PC) * cfg.kv_heads * cfg.head_dim
    out: dict[str, Any] = {
        "arch": "mela",
        "layout": cfg.layout,
        "kind": "mela",
        "topology": cfg.topology,
        "d_model": cfg.d_model,
        "hmm_d_model": cfg.hmm_width,
        "n_loop": 0,
        "n_loop_trained": 0,
        "h_cycles": model.hmm.cycles,
        "h_cycles_trained": cfg.h_cycles,
        "n_compute_layers": len(model.layers),
        "buffer": None,
        **_mela_parameters(model),
        "seq_len": seq_len,
        "batch_size": batch_size,
        "patch_size": P,
        "chunk_size": C,
        "n_patches": seq_len // P,  # N_p = floor(N / P)
        "n_chunks": n_chunks,  # N_c = N_p / C = decoder chunks of P*C tokens
        "decoder_length": seq_len + n_chunks * C,  # N (P+1) / P when P*C divides N
        "hmm_chunks_computed": hmm_chunks,
        # readings (docs/models.md, Mela): C counts patches (Sec. 3.1 N_c = N_p / C, Sec. 4.1 chunks of
        # P*C tokens, Fig. 3b P=4, C=1); each block's memory carried through the cycles or not
        "chunk_unit": "patches",
        "memory_carry": cfg.memory_carry,
        "memory_read": cfg.memory_read,
        "fusion": cfg.fusion,
        "block_applications": apps,
        "block_applications_with_grad": apps // model.hmm.cycles,
        **_mela_flops(model, cfg, counts, n_chunks, hmm_chunks, batch_size),
        "flops_convention": MELA_CONVENTION,
        "decode_state_elements": batch_size
        # at most: a full chunk's keys/values and text, the memory rows (one set per H cycle with MemStack)
        * (
            _memory_state(model, cfg)
            + kv
            + C * cfg.d_model * (cfg.h_cycles if cfg.memstack else 1)
            + PC * cfg.d_model
        ),
    }
    if cfg.preset in MELA_TABLE1_SHARES:
        out["table1_memory_pct"], out["table1_language_pct"] = MELA_TABLE1_SHARES[cfg.preset]
    return out


def _mela_flops(
    model: MelaLM,
    cfg: ModelConfig,
    counts: dict[str, dict[Any, int]],
    n_chunks: int,
    hmm_chunks: int,
    batch_size: int,
) -> dict[str, int]:
    """Mela's forward FLOPs, whole and by part (decoder, decoder attention, HMM attention, memory projections,
    Newton-Schulz, the memory's inner loop, the rest of the HMM), from the counter's per-module ``counts``."""
    by_module = {k: sum(v.values()) for k, v in counts.items()}
    flops = by_module.get("Global", 0)
    hmm = by_module.get("MelaLM.hmm", 0)
    hmm_names = [n for n, _ in model.hmm.named_modules() if n]
    attention = sum(by_module.get(f"MelaLM.hmm.{n}", 0) for n in hmm_names if n.endswith(".attn"))
    memory_all = sum(by_module.get(f"MelaLM.hmm.{n}", 0) for n in hmm_names if n.endswith(".memory"))
    projections = sum(
        by_module.get(f"MelaLM.hmm.{n}", 0)
        for n in hmm_names
        if n.rsplit(".", 1)[-1] in ("qkv", "out", "theta", "eta", "alpha") and ".memory." in n
    )
    apps = len(model.hmm.applications)
    ns = (
        _ns_flops(cfg) * apps * hmm_chunks * batch_size
        if cfg.neural_memory and cfg.memory_update == "newton_schulz"
        else 0
    )
    C, PC = cfg.chunk_size, cfg.tokens_per_chunk
    attn_macs = len(model.layers) * n_chunks * 2 * (C + PC) ** 2 * cfg.d_model * batch_size
    return {
        "flops_forward": flops,
        "flops_attention": 2 * attn_macs,
        "flops_forward_fvcore": (flops - 2 * attn_macs) // 2,
        "flops_decoder": flops - hmm,  # decoder layers, final norm, head
        "flops_hmm_attention": attention,
        "flops_memory_projections": projections,
        "flops_newton_schulz": ns,
        "flops_memory_inner_loop": memory_all - projections - ns,
        "flops_hmm_other": hmm - attention - memory_all,
    }


def _memory_state(model: MelaLM, cfg: ModelConfig) -> int:
    """Elements of the neural memories' state a decode carries: each memory slot's weights, twice with
    momentum (one per block with ``memory_carry`` cycles, else one per application)."""
    if not cfg.neural_memory:
        return 0
    state = [m.init_weights for m in model.hmm.modules() if hasattr(m, "init_weights")]
    per_app = {id(m): sum(p.numel() for p in m) for m in state}
    momentum = 2 if cfg.memory_update != "plain" else 1
    blocks = {"l": model.hmm.l_module.blocks, "h": model.hmm.h_module.blocks}
    return momentum * sum(
        per_app[id(blocks["l" if k == "l" else "h"][j].memory.init_weights)]
        for k, j in model.hmm.memory_slots
    )


def format_description(d: dict[str, Any]) -> str:
    if d.get("arch") == "mela":
        return format_mela(d)

    lines = [
        f"layout            {d['layout']} ({d['kind']}, {d['n_loop']} loop steps, {d['n_compute_layers']} unrolled layers)",
        f"topology          {d['topology']}" + (f" (buffer B={d['buffer']})" if d["buffer"] else ""),
        f"params total      {formatting.params(d['params_total'])}",
        f"params non-emb    {formatting.params(d['params_non_embedding'])}",
        f"params router     {d['params_router']:,}",
    ]
    if d["params_resolution"]:
        lines.append(
            f"params scaling    {d['params_resolution']:,} (self-aggregation scorers + allocation routers)"
        )
    if d["params_combination"]:
        lines.append(f"params combin.    {d['params_combination']:,}")
    lines += [
        f"forward FLOPs     {formatting.flops(d['flops_forward'])} for {d['batch_size']}x{d['seq_len']} tokens",
        f"                  convention: {d['flops_convention']}",
        f"                  fvcore-style (1/MAC, no attention): {formatting.flops(d['flops_forward_fvcore'])}",
    ]
    if "flops_mesh_eq8" in d:
        lines.append(f"MeSH Eq. 8 extra  {formatting.flops(d['flops_mesh_eq8'])} (fvcore units)")
    return "\n".join(lines)


def format_mela(d: dict[str, Any]) -> str:
    total = d["params_total"]

    def m(x: int) -> str:
        return f"{x:>15,} ({x / 1e6:8.2f}M, {100 * x / total:5.2f}%)"

    def f(x: int) -> str:
        return f"{formatting.flops(x):>13} ({100 * x / d['flops_forward']:5.1f}%)"

    table = ""
    if "table1_memory_pct" in d:
        table = f"   Table 1: memory {d['table1_memory_pct']}%, language {d['table1_language_pct']}%"
    notes = []
    if d["seq_len"] % (d["patch_size"] * d["chunk_size"]):
        notes.append(
            f"note: {d['seq_len']} tokens is not a multiple of P*C = {d['patch_size'] * d['chunk_size']}: the last "
            "chunk is partial here (train refuses such a data.seq_len)"
        )
    if d["hmm_chunks_computed"] == 0:
        notes.append("note: one chunk only: no token reads the memory at this length")
    lines = [
        f"Mela              decoder of {d['n_compute_layers']} layers (d={d['d_model']}), HMM d={d['hmm_d_model']}",
        f"params total      {m(total)}",
        f"  memory          {m(d['params_memory'])}{table}",
        f"  language        {m(d['params_language'])}",
        f"  embedding       {m(d['params_embedding'])}",
        "  memory by part:",
        f"    patchify              {m(d['params_patchify'])}",
        f"    HMM attention         {m(d['params_hmm_attention'])}",
        f"    HMM gates             {m(d['params_hmm_gates'])}",
        f"    HMM norms             {m(d['params_hmm_norms'])}",
        f"    memory projections    {m(d['params_memory_projections'])}",
        f"    initial memories M_0  {m(d['params_initial_memories'])}",
        f"    fusions               {m(d['params_fusions'])}",
        f"    chunk-0 memory tokens {m(d['params_memory_tokens'])}",
        f"sequence          {d['seq_len']} tokens -> N_p={d['n_patches']} patches (P={d['patch_size']}), "
        f"N_c={d['n_chunks']} chunks (C={d['chunk_size']}), decoder length {d['decoder_length']}",
        f"HLR               {d['block_applications']} memory-block applications per forward, "
        f"{d['block_applications_with_grad']} with gradients; HMM over {d['hmm_chunks_computed']} chunk(s) "
        "(the last chunk's memory is read by no token)",
        f"readings          chunk_size C counts patches (P*C = {d['patch_size'] * d['chunk_size']} tokens a chunk); "
        f"memory_carry {d['memory_carry']} ("
        + (
            "each block's memory continues through the H x L cycles and on to the next chunk"
            if d["memory_carry"] == "cycles"
            else "every block application scans from its block's M_0"
        )
        + f"); memory_read {d['memory_read']}; fusion {d['fusion']}"
        + (" (h only, parameter-free)" if d["fusion"] == "none" else ""),
        f"forward FLOPs     {formatting.flops(d['flops_forward'])} for {d['batch_size']}x{d['seq_len']} tokens, by part:",
        f"  decoder         {f(d['flops_decoder'])}",
        f"  HMM attention   {f(d['flops_hmm_attention'])}",
        f"  memory proj.    {f(d['flops_memory_projections'])}",
        f"  inner loop      {f(d['flops_memory_inner_loop'])}",
        f"  Newton-Schulz   {f(d['flops_newton_schulz'])}",
        f"  HMM other       {f(d['flops_hmm_other'])}",
        f"                  convention: {d['flops_convention']}",
        f"decoding state    at most {d['decode_state_elements']:,} elements, constant in the sequence length",
        *notes,
    ]
    return "\n".join(lines)
