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

The strategies (:func:`~recursive_lightning.interop.init.layer_map`) and the start of the topology
(:func:`~recursive_lightning.interop.init.start_as_layers`) are described in ``interop/init.py``; this module
is the I/O side: loading the source, the tokenizer checks, the record and its MLflow keys.

A run records the source, its weights' fingerprint, the tokenizer's, the strategy, the layer map and the
start in its checkpoints (``checkpoint["uptrain"]``) and its MLflow run (params ``init.*``, tag
``init.layer_map``, artifact ``init_from.json``). The initialisation runs only when a run starts at step 0;
``--resume`` from a checkpoint never loads the source again.
"""

from __future__ import annotations

import hashlib
import json
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from tokenizers import Tokenizer

from recursive_lightning.config import RunConfig, load_yaml
from recursive_lightning.data.tokenizer import INIT_TOKENIZER, ensure_eos, tokenizer_fingerprint
from recursive_lightning.errors import ConfigError
from recursive_lightning.files import atomic_write_text
from recursive_lightning.interop import hf
from recursive_lightning.interop.init import MESH_ROUTER_MARGIN, initialise
from recursive_lightning.model.recursive.model import RecursiveLM
from recursive_lightning.run_dir import RunDir
from recursive_lightning.tracking.runs import log_artifact_text, log_params, set_tags
from recursive_lightning.training.checkpoint import HF_WEIGHTS, load_checkpoint

TOKENIZER_FILE = RunDir.INIT_TOKENIZER  # the source's tokenizer, kept in the run directory for --resume
CHECKPOINT_KEY = "uptrain"


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
    loaders = {"gpt_neox": hf.from_pretrained_gpt_neox, "llama": hf.from_pretrained_llama}
    if model_type not in loaders:
        raise ConfigError(
            f"train.init_from '{name}' is a Hugging Face model of type '{model_type}'; uptraining reads "
            "GPT-NeoX (Pythia) and LLaMA models."
        )
    kwargs = {"local_files_only": True} if local else {}
    try:
        model = loaders[model_type](name, **kwargs)
    except Exception as e:  # noqa: BLE001 - weights missing, cut short (SafetensorError), of another shape
        if not local:
            raise
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"train.init_from '{name}': its weights cannot be read ({reason}); put its complete "
            "model.safetensors (or pytorch_model.bin) back in the folder."
        ) from None
    tokenizer = None
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
        if path.is_dir() and any((path / f).is_file() for f in HF_WEIGHTS):  # weights without config.json
            raise ConfigError(
                f"train.init_from '{path}' holds Hugging Face model weights but no config.json, which says what "
                "model they are; put the model's config.json back in the folder."
            )
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
        from transformers import AutoConfig  # heavy

        model_type = AutoConfig.from_pretrained(spec).model_type
    except Exception as e:  # noqa: BLE001 - offline, unknown repository, gated model: all one sentence
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"train.init_from '{spec}' is not a local path and could not be read from the Hugging Face Hub "
            f"({reason}); check the name and the network (HF_HUB_OFFLINE), or pass a local directory."
        ) from None
    return _hf_source(spec, model_type, local=False)


# ---------------------------------------------------------------------------------- copying


def initialise_from(
    model: RecursiveLM, source: Source, strategy: str, margin: float = MESH_ROUTER_MARGIN
) -> dict[str, Any]:
    """Copy ``source`` into ``model`` by ``strategy`` and start its topology as the selected layers
    (:func:`~recursive_lightning.interop.init.initialise`); returns the record (source, fingerprints, strategy,
    layer map, start)."""
    lmap, start = initialise(model, source.model, source.name, strategy, margin)
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
    return tokenizer_fingerprint(ensure_eos(Tokenizer.from_str(tok.to_str())))


# ---------------------------------------------------------------------------------- train integration


def tokenizer_spec(cfg: RunConfig, run_dir: Path) -> str:
    """``data.tokenizer`` as the data module reads it: ``init`` is the source's copy in the run directory."""
    if cfg.data.tokenizer.strip() != INIT_TOKENIZER:
        return cfg.data.tokenizer
    path = RunDir(run_dir).init_tokenizer
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
    atomic_write_text(RunDir(run_dir).init_tokenizer, source.tokenizer.to_str())


def check_tokenizer(cfg: RunConfig, source: Source, tokenizer: Any) -> None:
    """The data's tokenizer must be the source's: one sentence naming both otherwise."""
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
    try:
        raw = json.loads((path / "config.json").read_text())
        to_config = {"gpt_neox": hf.config_from_gpt_neox, "llama": hf.config_from_llama}.get(
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
    "Record",
    "Source",
    "check_tokenizer",
    "cli_overrides",
    "initialise_from",
    "keep_tokenizer",
    "load_source",
    "log_record",
    "tokenizer_spec",
    "weights_fingerprint",
]
