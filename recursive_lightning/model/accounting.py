"""Parameters and FLOPs before training, counted on the meta device (no weights allocated).

FLOP convention (SpiralFormer Table 1): 2 FLOPs per multiply-accumulate of every matrix product,
attention scores (QK^T) and values (AV) included at full L x L (no causal halving), LM head
included, element-wise work ignored. MeSH Table 7 uses fvcore instead (1 per MAC, no attention):
``flops_forward_fvcore`` approximates that convention as (matrix-product MACs) - (attention MACs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.model import RecursiveLM
from recursive_lightning.model.topology import Combination, MeSH

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


def _attention_macs(cfg: ModelConfig, seq_len: int) -> int:
    lay = cfg.parsed_layout
    macs = (lay.prelude + lay.coda) * 2 * seq_len * seq_len * cfg.d_model
    for core_id, g in zip(lay.core_index, lay.chunk):
        n = seq_len // g
        macs += lay.cores[core_id] * 2 * n * n * cfg.d_model
    return macs


def describe(cfg: ModelConfig, seq_len: int = 4096, batch_size: int = 1) -> dict[str, Any]:
    """Parameter counts and forward FLOPs of one ``batch_size x seq_len`` sequence, in seconds at any size."""
    with torch.device("meta"):
        model = RecursiveLM(cfg)
    params = count_parameters(model)
    idx = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(idx)
    flops = counter.get_total_flops()
    attention = 2 * batch_size * _attention_macs(cfg, seq_len)
    lay = cfg.parsed_layout
    out: dict[str, Any] = {
        "layout": cfg.layout,
        "kind": lay.kind,
        "topology": cfg.topology,
        "d_model": cfg.d_model,
        "n_loop": lay.n_loop,
        "n_compute_layers": lay.n_compute,
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
        out["flops_mesh_eq8"] = (lay.n_loop + 1) * 6 * batch_size * seq_len * cfg.d_model * cfg.buffer_slots
    return out


def format_description(d: dict[str, Any]) -> str:
    def m(x: int) -> str:
        return f"{x:,} ({x / 1e6:.1f}M)"

    lines = [
        f"layout            {d['layout']} ({d['kind']}, {d['n_loop']} loop steps, {d['n_compute_layers']} unrolled layers)",
        f"topology          {d['topology']}" + (f" (buffer B={d['buffer']})" if d["buffer"] else ""),
        f"params total      {m(d['params_total'])}",
        f"params non-emb    {m(d['params_non_embedding'])}",
        f"params router     {d['params_router']:,}",
    ]
    if d["params_resolution"]:
        lines.append(
            f"params scaling    {d['params_resolution']:,} (self-aggregation scorers + allocation routers)"
        )
    if d["params_combination"]:
        lines.append(f"params combin.    {d['params_combination']:,}")
    lines += [
        f"forward FLOPs     {d['flops_forward'] / 1e12:.3f}e12 for {d['batch_size']}x{d['seq_len']} tokens",
        f"                  convention: {d['flops_convention']}",
        f"                  fvcore-style (1/MAC, no attention): {d['flops_forward_fvcore'] / 1e9:,.1f} GFLOPs",
    ]
    if "flops_mesh_eq8" in d:
        lines.append(f"MeSH Eq. 8 extra  {d['flops_mesh_eq8'] / 1e9:.3f} GFLOPs (fvcore units)")
    return "\n".join(lines)
