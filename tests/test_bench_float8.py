"""``benchmarks/bench_float8.py``: float8 goes to exactly the transformer layers' Linears whose widths a float8
GEMM takes (multiples of 16), never the embeddings or the LM head, as torchtitan's filter leaves the output
layer; the measurement itself needs torchao and a GPU (``gpu_session.sh float8``)."""

from __future__ import annotations

import sys

import torch
from conftest import ROOT

from recursive_lightning.model.build import build_model
from recursive_lightning.model.config import preset

sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_float8 as bench  # noqa: E402


def test_the_filter_takes_the_layers_linears_and_leaves_the_head_and_unaligned_widths():
    model = build_model(preset("cpu-tiny", layout="1+2R2+1", topology="mesh", tie_embeddings=False))
    model.layers_odd = torch.nn.Linear(24, 64)  # a Linear outside the layers: never converted
    inner = model.layer_lists()[0][0]
    inner.odd = torch.nn.Linear(64, 40)  # inside a layer, but 40 is no multiple of 16
    keep = bench.layer_linears(model)
    kept = {fqn for fqn, m in model.named_modules() if keep(m, fqn)}
    layer_linears = {
        fqn
        for fqn, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and any(m is x for ls in model.layer_lists() for layer in ls for x in layer.modules())
    }
    assert kept == layer_linears - {f for f in layer_linears if f.endswith(".odd")}
    assert kept and not any("head" in f or "embed" in f or f.endswith("layers_odd") for f in kept)
    # every attention and MLP projection of every layer list is taken (4 per layer: qkv, proj, up, down)
    assert len(kept) == 4 * sum(len(ls) for ls in model.layer_lists())
