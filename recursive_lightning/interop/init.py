"""Uptraining's initialisation: which source layers fill each layer of the recursive layout (the strategies),
the copy of the weights into it, and the start of the topology as those layers (``train --init-from``; the
loading of the source and the record are ``training/uptrain.py``'s).

The strategies, for a source of N layers and a target P + core + C: the middle M = N - P - C layers are
replaced by the unrolled loop, U = sum of the core sizes over the loop steps (``4+4R2+4``: U = 8). Unrolled
position u stands for the middle layers overlapping [u M / U, (u + 1) M / U) — exactly layer u when M = U,
Bae et al.'s setting. A core layer j runs at one unrolled position per loop step (its *tied* positions).

    stepwise  core layer j = the (j M_c / m)-th layer of the core's middle range M_c (every k-th layer, k = M_c / m)
    average   core layer j = the mean of the layers its tied positions stand for (the layers it replaces)
    lower     core layer j = the j-th layer of the core's middle range (the first m layers)
    select:   '/'-separated groups of source layers: prelude / each distinct core / coda, e.g.
              select:0-3/4-7/8-11 for 4+4R2+4 from 12 layers (ranges a-b inclusive, commas between)

With M = K m (K loops of an m-layer core) these are Bae et al.'s: stepwise takes layers P, P+K, P+2K, ...,
average the mean of layers P+j, P+j+m, ..., lower P .. P+m-1. For M != K m the interval rule above is our
reading (Bae et al. describe N = K m, no prelude or coda); stepwise and lower need M_c >= m (else use average
or select).

Topology and resolution parameters then start so that, where the equations allow it, the recursive model at
step 0 computes what its selected layers compute: prelude, the core once per full-resolution loop step, coda,
i.e. h^(t+1) = u^(t) (MeSH Alg. 1 with h_sup = 0). Which topologies allow it ([reading] of ours):

    base                exact (it is h^(t+1) = u^(t)); a coarse SpiralFormer step replaces the state by its
                        up-scaled update (Eq. 4), no parameter can undo that: not an identity with coarse steps
    static, dynamic     exact, also with coarse steps: coefficients (a_core, a_res, a_anc, a_emb) = (1, 0, 0, 0)
                        at full-resolution steps and (0, 1, 0, 0) at coarse ones (a skip; MeSH App. E.3; the
                        dynamic Linear(d, 4) with zero weight and that bias). a_core still gets gradients
    mesh                near, not exact: softmax routers (Eq. 3) never reach one-hot. Slot 1 takes the prelude
                        output, slot t+2 the update of step t; the read routers pick the newest applied slot
                        (coarse steps are written, not read). Router weights 0, bias ``MESH_ROUTER_MARGIN`` on
                        the chosen slot: weight 1/(1 + (B-1) e^-margin), 0.990 at margin 6 with B = 5, which
                        keeps the routers trainable (a saturated softmax has no gradient). Needs B >= N_loop + 2
                        (the default N_loop + 3 has it); with fewer slots the routers keep their paper init
    residual, anchor,   not an identity: the supplements have no coefficient to switch off (MeSH Table 5)
    anchor_emb, sums
    SpiralFormer        scorers A^(t) and allocators B^(t) start at zero: mean pooling and uniform broadcast
                        (Eqs. 17, 21 with uniform softmax); the coarse steps themselves are never an identity
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from recursive_lightning.errors import ConfigError
from recursive_lightning.model.layout import Layout

if TYPE_CHECKING:
    import torch

    from recursive_lightning.model.recursive.model import RecursiveLM

STRATEGIES = ("stepwise", "average", "lower")
MESH_ROUTER_MARGIN = 6.0  # [reading] logit gap of the near-identity MeSH routers (see the module docstring)
# the fields that change what a copied layer computes without changing a tensor's shape
_CATEGORICAL = ("mlp", "norm", "bias", "parallel_residual", "scale_embeddings", "tie_embeddings")
_NUMERIC = ("n_heads", "kv_heads", "rotary_pct", "rotary_base", "norm_eps")
_EXAMPLE = "e.g. select:0-3/4-7/8-11 for 4+4R2+4 from 12 layers: prelude / each core / coda"

LayerMap = dict[str, list[tuple[int, ...]]]  # target stack ("prelude", "cores.0", ..., "coda") -> sources


# ---------------------------------------------------------------------------------- strategies


def parse_strategy(text: str) -> tuple[str, list[list[int]] | None]:
    """(strategy, explicit groups for ``select:``); one sentence naming ``train.init_strategy`` if bad."""
    text = str(text).strip()
    if text in STRATEGIES:
        return text, None
    if not text.startswith("select:"):
        raise ConfigError(
            f"train.init_strategy '{text}' is unknown; choose stepwise, average, lower or select:LAYERS "
            f"({_EXAMPLE})."
        )
    groups = []
    for part in text[len("select:") :].split("/"):
        layers: list[int] = []
        for item in filter(None, part.replace(" ", "").split(",")):
            m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
            if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
                raise ConfigError(
                    f"train.init_strategy '{text}': '{item}' is not a layer index or an increasing range a-b "
                    f"({_EXAMPLE})."
                )
            lo = int(m.group(1))
            layers += range(lo, int(m.group(2) or lo) + 1)
        groups.append(layers)
    if not any(groups):
        raise ConfigError(f"train.init_strategy '{text}' lists no source layers; name them ({_EXAMPLE}).")
    return "select", groups


def _stacks(layout: Layout) -> list[tuple[str, int]]:
    return [
        ("prelude", layout.prelude),
        *((f"cores.{i}", n) for i, n in enumerate(layout.cores)),
        ("coda", layout.coda),
    ]


def layer_map(n_source: int, layout: Layout, strategy: str) -> LayerMap:
    """Which source layers fill each target layer (several: their mean), by ``strategy`` (module docstring)."""
    kind, groups = parse_strategy(strategy)
    stacks = _stacks(layout)
    if groups is not None:
        if not layout.cores and len(groups) == 1:
            groups = [*groups, []]  # a vanilla target: one group for its layers
        if len(groups) != len(stacks):
            raise ConfigError(
                f"train.init_strategy '{strategy}' has {len(groups)} '/'-separated groups but model.layout "
                f"'{layout.text}' needs {len(stacks)} (prelude, {len(layout.cores)} core(s), coda; {_EXAMPLE})."
            )
        for (name, n), group in zip(stacks, groups):
            if len(group) != n:
                raise ConfigError(
                    f"train.init_strategy '{strategy}' gives {name} {len(group)} layers but model.layout "
                    f"'{layout.text}' has {n} there; list one source layer per target layer."
                )
            bad = [i for i in group if i >= n_source]
            if bad:
                raise ConfigError(
                    f"train.init_strategy '{strategy}' names layer {bad[0]} but the source has {n_source} layers "
                    f"(0-{n_source - 1})."
                )
        return {name: [(i,) for i in group] for (name, _), group in zip(stacks, groups)}

    pre, coda = layout.prelude, layout.coda
    middle = n_source - pre - coda
    if middle < (1 if layout.cores else 0):
        raise ConfigError(
            f"model.layout '{layout.text}' takes {pre} prelude and {coda} coda layers, leaving "
            f"{max(middle, 0)} of the source's {n_source} for the core; use a smaller prelude/coda or a deeper "
            "source."
        )
    out: LayerMap = {"prelude": [(i,) for i in range(pre)]}
    unrolled = sum(layout.cores[c] for c in layout.core_index)

    def stands_for(u: int) -> range:  # the middle layers overlapping [u M / U, (u + 1) M / U)
        lo = u * middle // unrolled
        return range(pre + lo, pre + max(lo + 1, -(-(u + 1) * middle // unrolled)))

    starts: dict[int, list[int]] = {c: [] for c in range(len(layout.cores))}
    offset = 0
    for c in layout.core_index:
        starts[c].append(offset)
        offset += layout.cores[c]
    for c, m in enumerate(layout.cores):
        tied = [sorted({i for s in starts[c] for i in stands_for(s + j)}) for j in range(m)]
        region = sorted({i for t in tied for i in t})
        if kind == "average":  # Bae et al.: the mean of the tied layers
            out[f"cores.{c}"] = [tuple(t) for t in tied]
            continue
        if len(region) < m:
            raise ConfigError(
                f"train.init_strategy {kind} needs at least {m} middle layers for core {c} of model.layout "
                f"'{layout.text}', but the source's {n_source} layers leave {len(region)}; use average or select."
            )
        if kind == "stepwise":  # every k-th layer, k = |region| / m
            out[f"cores.{c}"] = [(region[j * len(region) // m],) for j in range(m)]
        else:  # lower: the first m layers
            out[f"cores.{c}"] = [(region[j],) for j in range(m)]
    out["coda"] = [(n_source - coda + i,) for i in range(coda)]
    return out


# ---------------------------------------------------------------------------------- the start of the topology


def start_as_layers(model: RecursiveLM, margin: float = MESH_ROUTER_MARGIN) -> str:
    """Set topology and resolution parameters so the model computes prelude, the core at each full-resolution
    step, coda (module docstring); returns what the start is, for the record."""
    import torch  # heavy

    from recursive_lightning.model.recursive.mesh import MeSH  # heavy
    from recursive_lightning.model.recursive.topology import Additive, Combination  # heavy

    with torch.no_grad():
        topo = model.topology
        applied = [step.full_resolution for step in model.steps]  # coarse steps start as skips where possible
        for step in model.steps:  # mean pooling and uniform broadcast (Eqs. 17, 21 with uniform softmax)
            for lin in (step.scorer, step.allocator):
                if lin is not None:
                    lin.weight.zero_()
                    lin.bias.zero_()
        coarse = not all(applied)
        if not applied:
            return "exact: a vanilla target"
        if isinstance(topo, Combination):
            for t, on in enumerate(applied):
                coef = torch.tensor([1.0, 0.0, 0.0, 0.0] if on else [0.0, 1.0, 0.0, 0.0])
                if topo.dynamic:
                    topo.coef[t].weight.zero_()
                    topo.coef[t].bias.copy_(coef)
                else:
                    topo.alpha[t].copy_(coef)
            return "exact: (a_core, a_res, a_anc, a_emb) = (1,0,0,0) at full-resolution steps" + (
                ", (0,1,0,0) (skip) at coarse steps" if coarse else ""
            )
        if isinstance(topo, MeSH):
            slots = topo.slots
            if slots < len(applied) + 2:
                return (
                    f"paper init: MeSH with B={slots} slots < N_loop + 2 = {len(applied) + 2} cannot keep each "
                    "update in a slot of its own"
                )
            newest = 1  # the slot holding the current state: the prelude output first
            for idx in range(len(applied) + 1):  # router pair 0: transitional step; idx = t + 1: loop step t
                write = 1 if idx == 0 else idx + 1
                if idx > 0 and applied[idx - 1]:
                    newest = write
                for router, slot in ((topo.write[idx], write), (topo.read[idx], newest)):
                    router.weight.zero_()
                    router.bias.zero_()
                    router.bias[slot] = margin
            weight = 1 / (1 + (slots - 1) * math.exp(-margin))
            return (
                f"near: MeSH routers one-hot-like, logit margin {margin:g} (chosen slot weight {weight:.4f})"
            )
        if isinstance(topo, Additive):
            return f"not an identity: topology {model.cfg.topology} adds fixed supplements (no coefficient)"
        if coarse:
            return "not an identity: base topology with coarse steps (the state becomes the up-scaled update)"
        return "exact: base topology"


# ---------------------------------------------------------------------------------- copying


def _check_fields(model: RecursiveLM, source: RecursiveLM, source_name: str, fields: tuple[str, ...]) -> None:
    for field in fields:
        want, have = getattr(source.cfg, field), getattr(model.cfg, field)
        if want != have:
            key = "n_kv_heads" if field == "kv_heads" else field
            raise ConfigError(
                f"model.{key} is {have!r} but the source '{source_name}' has {want!r}; set model.{key} {want} "
                "so the copied layers compute what they computed there."
            )


def _shape_error(
    source: RecursiveLM, source_name: str, name: str, value: torch.Tensor, where: str, target: torch.Tensor
) -> ConfigError:
    cfg = source.cfg
    return ConfigError(
        f"source '{source_name}' tensor '{name}' has shape {tuple(value.shape)} but the target's '{where}' has "
        f"{tuple(target.shape)}; the target needs the source's sizes (model.d_model {cfg.d_model}, "
        f"model.vocab_size {cfg.vocab_size}, model.n_heads {cfg.n_heads}, model.mlp_hidden {cfg.hidden})."
    )


def initialise(
    model: RecursiveLM,
    source: RecursiveLM,
    source_name: str,
    strategy: str,
    margin: float = MESH_ROUTER_MARGIN,
) -> tuple[LayerMap, str]:
    """Copy the vanilla ``source`` (named ``source_name`` in errors) into ``model`` by ``strategy`` and start its
    topology as the selected layers; returns the layer map and what the start is. Everything is checked
    before any copy."""
    import torch  # heavy

    from recursive_lightning.model.recursive.model import RecursiveLM  # heavy

    if not isinstance(model, RecursiveLM):
        raise ConfigError(
            f"train.init_from needs a recursive model (model.arch recursive), not {type(model).__name__}."
        )
    _check_fields(model, source, source_name, _CATEGORICAL)
    lmap = layer_map(len(source.prelude.layers), model.layout, strategy)
    # (target parameter, source tensors to average, target name, source names)
    plan: list[tuple[torch.Tensor, list[torch.Tensor], str, list[str]]] = []
    shared = [("embed", model.embed, source.embed), ("norm", model.norm, source.norm)]
    if not model.cfg.tie_embeddings:  # tied: the head is the embedding (and the source's too, checked above)
        shared.append(("head", model.head, source.head))
    for prefix, ours, theirs in shared:
        for pname, param in ours.named_parameters():
            key = f"{prefix}.{pname}"
            plan.append((param, [theirs.get_parameter(pname)], key, [key]))
    for name, sources in lmap.items():
        stack = model.get_submodule(name)
        for j, idx in enumerate(sources):
            for pname, param in stack.layers[j].named_parameters():
                values = [source.prelude.layers[i].get_parameter(pname) for i in idx]
                plan.append(
                    (param, values, f"{name}.layers.{j}.{pname}", [f"layers.{i}.{pname}" for i in idx])
                )
    for target, values, where, names in plan:  # every shape before the first copy: a failure changes nothing
        for value, name in zip(values, names):
            if value.shape != target.shape:
                raise _shape_error(source, source_name, name, value, where, target)
    _check_fields(model, source, source_name, _NUMERIC)
    with torch.no_grad():
        for target, values, _, _ in plan:
            # one source: an exact copy; several (average): their mean (Bae et al. 2024), summed in float64
            target.copy_(values[0] if len(values) == 1 else torch.stack([v.double() for v in values]).mean(0))
    return lmap, start_as_layers(model, margin)
