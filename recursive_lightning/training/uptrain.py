"""Uptraining: a recursive model initialised from a pretrained vanilla model (``train --init-from``).

The cheaper route to a recursive model than pretraining it: take a trained vanilla transformer, copy its
weights into the recursive layout and train briefly (Relaxed Recursive Transformers, Bae et al. 2024: their
initialisations of the looped block; McLeish et al. 2025, retrofitting recurrence with prelude / core / coda
taken from the original layers).

    source    a checkpoint or run directory of this package (vanilla layout), a local Hugging Face GPT-NeoX
              (Pythia) or LLaMA directory (read by ``interop/hf.py``), or a Hub name when online
    copied    embeddings, LM head and final norm as they are; prelude = the source's first layers, coda =
              its last layers; every distinct core layer from the middle layers by the strategy
    strategy  stepwise | average | lower (Bae et al. 2024) | select:LAYERS (an explicit map)

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

A run records the source, its weights' fingerprint, the tokenizer's, the strategy, the layer map and the
start in its checkpoints (``checkpoint["uptrain"]``) and its MLflow run (params ``init.*``, tag
``init.layer_map``, artifact ``init_from.json``). The initialisation runs only when a run starts at step 0;
``--resume`` from a checkpoint never loads the source again.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback

from recursive_lightning.errors import ConfigError

if TYPE_CHECKING:
    from recursive_lightning.config import RunConfig
    from recursive_lightning.model.layout import Layout
    from recursive_lightning.model.recursive.model import RecursiveLM

STRATEGIES = ("stepwise", "average", "lower")
MESH_ROUTER_MARGIN = 6.0  # [reading] logit gap of the near-identity MeSH routers (see the module docstring)
INIT_TOKENIZER = "init"  # data.tokenizer value: the tokenizer of train.init_from
TOKENIZER_FILE = "init_tokenizer.json"  # the source's tokenizer, kept in the run directory for --resume
CHECKPOINT_KEY = "uptrain"
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


@torch.no_grad()
def start_as_layers(model: RecursiveLM, margin: float = MESH_ROUTER_MARGIN) -> str:
    """Set topology and resolution parameters so the model computes prelude, the core at each full-resolution
    step, coda (module docstring); returns what the start is, for the record."""
    from recursive_lightning.model.recursive.topology import Additive, Combination, MeSH

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
        return f"near: MeSH routers one-hot-like, logit margin {margin:g} (chosen slot weight {weight:.4f})"
    if isinstance(topo, Additive):
        return f"not an identity: topology {model.cfg.topology} adds fixed supplements (no coefficient)"
    if coarse:
        return "not an identity: base topology with coarse steps (the state becomes the up-scaled update)"
    return "exact: base topology"


# ---------------------------------------------------------------------------------- sources


@dataclass
class Source:
    """A loaded vanilla model to initialise from."""

    name: str  # as given (an absolute path for local sources)
    kind: str  # checkpoint | gpt_neox | llama
    model: RecursiveLM
    tokenizer: Any  # tokenizers.Tokenizer, or None when the source has none

    @property
    def n_layers(self) -> int:
        return len(self.model.prelude.layers)

    def fingerprint(self) -> str:
        return weights_fingerprint(self.model)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 (16 hex digits) over every tensor's name, shape and float32 values."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _hf_source(name: str, model_type: str | None, local: bool) -> Source:
    from recursive_lightning.interop import hf as convert

    loaders = {"gpt_neox": convert.from_pretrained_gpt_neox, "llama": convert.from_pretrained_llama}
    if model_type not in loaders:
        raise ConfigError(
            f"train.init_from '{name}' is a Hugging Face model of type '{model_type}'; uptraining reads "
            "GPT-NeoX (Pythia) and LLaMA models."
        )
    kwargs = {"local_files_only": True} if local else {}
    model = loaders[model_type](name, **kwargs)
    tokenizer = None
    from tokenizers import Tokenizer

    if local:
        if (Path(name) / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_file(str(Path(name) / "tokenizer.json"))
    else:
        try:
            tokenizer = Tokenizer.from_pretrained(name)
        except Exception:  # noqa: BLE001 - a model repository without tokenizer.json
            tokenizer = None
    return Source(name, model_type, model.float(), tokenizer)


def load_source(spec: str) -> Source:
    """Load ``train.init_from``: a package checkpoint / run directory, a local HF directory, or a Hub name."""
    path = Path(spec).expanduser()
    if path.exists():
        path = path.resolve()
        if path.is_dir() and (path / "config.json").is_file():
            try:
                model_type = json.loads((path / "config.json").read_text()).get("model_type")
            except (OSError, ValueError) as e:
                raise ConfigError(
                    f"train.init_from '{path}': config.json is not readable JSON ({e})."
                ) from None
            return _hf_source(str(path), model_type, local=True)
        from recursive_lightning.model.recursive.model import RecursiveLM
        from recursive_lightning.training.checkpoint import load_checkpoint

        if path.is_file() and not zipfile.is_zipfile(path):  # torch.save writes a zip archive
            raise ConfigError(
                f"train.init_from '{path}' is neither a checkpoint nor a model directory; pass a .ckpt file "
                "or run directory of this package, or a Hugging Face model directory (with config.json)."
            )
        loaded = load_checkpoint(path)
        model = loaded.model
        if not isinstance(model, RecursiveLM) or model.layout.kind != "vanilla":
            what = model.cfg.layout if isinstance(model, RecursiveLM) else type(model).__name__
            raise ConfigError(
                f"train.init_from '{path}' holds a {what} model; uptraining starts from a vanilla checkpoint "
                "(a layout like 12)."
            )
        return Source(str(path), "checkpoint", model.float(), loaded.tokenizer)
    if spec.startswith(("/", ".", "~")) or spec.endswith((".ckpt", ".json")):
        raise ConfigError(
            f"train.init_from '{spec}' does not exist; pass a checkpoint or run directory of this package, a "
            "local Hugging Face model directory, or a Hub name."
        )
    try:  # a Hub name: the config says which family, then interop/hf.py reads the weights
        from transformers import AutoConfig

        model_type = AutoConfig.from_pretrained(spec).model_type
    except Exception as e:  # noqa: BLE001 - offline, unknown repository, gated model: all one sentence
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"train.init_from '{spec}' is not a local path and could not be read from the Hugging Face Hub "
            f"({reason}); check the name and the network (HF_HUB_OFFLINE), or pass a local directory."
        ) from None
    return _hf_source(spec, model_type, local=False)


# ---------------------------------------------------------------------------------- copying


def _check_fields(model: RecursiveLM, source: Source, fields: tuple[str, ...]) -> None:
    for field in fields:
        want, have = getattr(source.model.cfg, field), getattr(model.cfg, field)
        if want != have:
            key = "n_kv_heads" if field == "kv_heads" else field
            raise ConfigError(
                f"model.{key} is {have!r} but the source '{source.name}' has {want!r}; set model.{key} {want} "
                "so the copied layers compute what they computed there."
            )


def _shape_error(
    source: Source, name: str, value: torch.Tensor, where: str, target: torch.Tensor
) -> ConfigError:
    cfg = source.model.cfg
    return ConfigError(
        f"source '{source.name}' tensor '{name}' has shape {tuple(value.shape)} but the target's '{where}' has "
        f"{tuple(target.shape)}; the target needs the source's sizes (model.d_model {cfg.d_model}, "
        f"model.vocab_size {cfg.vocab_size}, model.n_heads {cfg.n_heads}, model.mlp_hidden {cfg.hidden})."
    )


@torch.no_grad()
def initialise(model: RecursiveLM, source: Source, strategy: str, margin: float = MESH_ROUTER_MARGIN) -> dict:
    """Copy ``source`` into ``model`` by ``strategy`` and start its topology as the selected layers; returns
    the record (source, fingerprints, strategy, layer map, start). Everything is checked before any copy."""
    from recursive_lightning.model.recursive.model import RecursiveLM

    if not isinstance(model, RecursiveLM):
        raise ConfigError(
            f"train.init_from needs a recursive model (model.arch recursive), not {type(model).__name__}."
        )
    _check_fields(model, source, _CATEGORICAL)
    lmap = layer_map(source.n_layers, model.layout, strategy)
    src = source.model
    # (target parameter, source tensors to average, target name, source names)
    plan: list[tuple[torch.Tensor, list[torch.Tensor], str, list[str]]] = []
    shared = [("embed", model.embed, src.embed), ("norm", model.norm, src.norm)]
    if not model.cfg.tie_embeddings:  # tied: the head is the embedding (and the source's too, checked above)
        shared.append(("head", model.head, src.head))
    for prefix, ours, theirs in shared:
        for pname, param in ours.named_parameters():
            key = f"{prefix}.{pname}"
            plan.append((param, [theirs.get_parameter(pname)], key, [key]))
    for name, sources in lmap.items():
        stack = model.get_submodule(name)
        for j, idx in enumerate(sources):
            for pname, param in stack.layers[j].named_parameters():
                values = [src.prelude.layers[i].get_parameter(pname) for i in idx]
                plan.append(
                    (param, values, f"{name}.layers.{j}.{pname}", [f"layers.{i}.{pname}" for i in idx])
                )
    for target, values, where, names in plan:  # every shape before the first copy: a failure changes nothing
        for value, name in zip(values, names):
            if value.shape != target.shape:
                raise _shape_error(source, name, value, where, target)
    _check_fields(model, source, _NUMERIC)
    for target, values, _, _ in plan:
        # one source: an exact copy; several (average): their mean (Bae et al. 2024), summed in float64
        target.copy_(values[0] if len(values) == 1 else torch.stack([v.double() for v in values]).mean(0))
    start = start_as_layers(model, margin)
    return {
        "source": source.name,
        "kind": source.kind,
        "fingerprint": source.fingerprint(),
        "tokenizer_fingerprint": _tokenizer_fingerprint(source.tokenizer),
        "strategy": strategy,
        "layer_map": {k: [list(v) for v in vs] for k, vs in lmap.items()},
        "source_layers": source.n_layers,
        "start": start,
    }


def _tokenizer_fingerprint(tok: Any) -> str | None:
    if tok is None:
        return None
    from tokenizers import Tokenizer

    from recursive_lightning.data.tokenizer import _ensure_eos, tokenizer_fingerprint

    return tokenizer_fingerprint(_ensure_eos(Tokenizer.from_str(tok.to_str())))


# ---------------------------------------------------------------------------------- train integration


def tokenizer_spec(cfg: RunConfig, run_dir: Path) -> str:
    """``data.tokenizer`` as the data module reads it: ``init`` is the source's copy in the run directory."""
    if cfg.data.tokenizer.strip() != INIT_TOKENIZER:
        return cfg.data.tokenizer
    path = Path(run_dir) / TOKENIZER_FILE
    if not cfg.train.init_from:
        raise ConfigError(
            "data.tokenizer 'init' means the tokenizer of train.init_from, which is not set; pass --init-from "
            "SOURCE or another data.tokenizer."
        )
    if not path.is_file():
        raise ConfigError(
            f"data.tokenizer 'init': '{path}' is missing (it is written when the run starts from its source); "
            "start the run again in a new --run-dir."
        )
    return str(path)


def keep_tokenizer(cfg: RunConfig, source: Source, run_dir: Path) -> None:
    """With ``data.tokenizer: init``, write the source's tokenizer into the run directory (atomically)."""
    if cfg.data.tokenizer.strip() != INIT_TOKENIZER:
        return
    if source.tokenizer is None:
        raise ConfigError(
            f"data.tokenizer is 'init' but the source '{source.name}' carries no tokenizer (no tokenizer.json); "
            "save the tokenizer beside the model or set data.tokenizer to its tokenizer.json."
        )
    from recursive_lightning.files import atomic_write_text

    atomic_write_text(Path(run_dir) / TOKENIZER_FILE, source.tokenizer.to_str())


def check_tokenizer(cfg: RunConfig, source: Source, tokenizer: Any) -> None:
    """The data's tokenizer must be the source's: one sentence naming both otherwise."""
    from recursive_lightning.data.tokenizer import tokenizer_fingerprint

    theirs = _tokenizer_fingerprint(source.tokenizer)
    ours = tokenizer_fingerprint(tokenizer)
    if theirs is None:
        print(
            f"train: the source '{source.name}' carries no tokenizer; trusting data.tokenizer "
            f"'{cfg.data.tokenizer}' to be the one it was trained with.",
            file=sys.stderr,
            flush=True,
        )
    elif theirs != ours:
        raise ConfigError(
            f"data.tokenizer '{cfg.data.tokenizer}' (fingerprint {ours}) is not the tokenizer of train.init_from "
            f"'{source.name}' (fingerprint {theirs}); set data.tokenizer init to train with the source's."
        )


# the architecture fields the copied weights fix; a local Hugging Face source gives them unless named
ARCH_FIELDS = (
    "vocab_size",
    "d_model",
    "n_heads",
    "n_kv_heads",
    "mlp",
    "mlp_hidden",
    "norm",
    "norm_eps",
    "bias",
    "parallel_residual",
    "rotary_pct",
    "rotary_base",
    "tie_embeddings",
    "scale_embeddings",
)


def hf_architecture(path: Path) -> dict[str, Any] | None:
    """The architecture fields (:data:`ARCH_FIELDS`) of a local Hugging Face GPT-NeoX / LLaMA directory, read
    from its config.json alone; None for anything else (loading it later says what is wrong)."""
    from recursive_lightning.interop import hf as convert

    try:
        raw = json.loads((path / "config.json").read_text())
        to_config = {"gpt_neox": convert.config_from_gpt_neox, "llama": convert.config_from_llama}.get(
            raw.get("model_type")
        )
        cfg = to_config(raw).to_dict() if to_config else None
    except (OSError, ValueError, AttributeError):  # ConfigError is a ValueError: load_source words it
        return None
    return None if cfg is None else {k: cfg.get(k) for k in ARCH_FIELDS}


def cli_overrides(init_from: str, config: str | None, overrides: list[str]) -> list[str]:
    """``train --init-from``: a local source as an absolute path (the run may resume from elsewhere);
    ``data.tokenizer init`` unless the command line names a tokenizer, or the config file names one beside its
    own ``train.init_from`` (a recipe's tokenizer for training from scratch is not the source's; a named one is
    checked against the source's); and, for a local Hugging Face directory, its architecture fields
    (:data:`ARCH_FIELDS`) where neither the command line nor the config's ``model:`` section names them, so
    ``--config <any recipe> --init-from DIR --model.layout ...`` works as printed (the preset's sizes give way)."""
    path = Path(init_from).expanduser()
    if path.exists():
        i = len(overrides) - 1 - overrides[::-1].index("--train.init_from")
        overrides = [*overrides[: i + 1], str(path.resolve()), *overrides[i + 2 :]]

    def on_command_line(key: str) -> bool:
        return any(o == f"--{key}" or o.startswith(f"--{key}=") for o in overrides)

    raw: dict[str, Any] = {}
    if config:
        from recursive_lightning.config import load_yaml

        raw = load_yaml(config)
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    train = raw.get("train") if isinstance(raw.get("train"), dict) else {}
    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    named = on_command_line("data.tokenizer") or (
        data.get("tokenizer") is not None and train.get("init_from") is not None
    )
    out = overrides if named else [*overrides, "--data.tokenizer", INIT_TOKENIZER]
    arch = hf_architecture(path.resolve()) if path.is_dir() and (path / "config.json").is_file() else None
    for key, value in (arch or {}).items():
        if key not in model and not on_command_line(f"model.{key}"):
            out += [
                f"--model.{key}",
                "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value),
            ]
    return out


def log_record(tracking_uri: str, run_id: str, record: dict) -> None:
    """MLflow: params init.source / kind / fingerprint / tokenizer_fingerprint / strategy / start, tag
    init.layer_map, artifact init_from.json."""
    from recursive_lightning.tracking.runs import log_artifact_text, log_params, set_tags

    keys = ("source", "kind", "fingerprint", "tokenizer_fingerprint", "strategy", "source_layers", "start")
    log_params(tracking_uri, run_id, {f"init.{k}": record[k] for k in keys})
    set_tags(tracking_uri, run_id, {"init.layer_map": json.dumps(record["layer_map"])})
    log_artifact_text(tracking_uri, run_id, "init_from.json", json.dumps(record, indent=2))


class Record(Callback):
    """Carries the record in every checkpoint (``checkpoint["uptrain"]``) and back on --resume."""

    def __init__(self, record: dict | None) -> None:
        self.record = record

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.record is not None:
            checkpoint[CHECKPOINT_KEY] = self.record

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self.record = checkpoint.get(CHECKPOINT_KEY, self.record)


__all__ = [
    "MESH_ROUTER_MARGIN",
    "STRATEGIES",
    "Record",
    "Source",
    "check_tokenizer",
    "cli_overrides",
    "initialise",
    "keep_tokenizer",
    "layer_map",
    "load_source",
    "log_record",
    "parse_strategy",
    "start_as_layers",
    "tokenizer_spec",
    "weights_fingerprint",
]
