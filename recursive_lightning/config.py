"""The run config: one YAML with ``name``, ``model``, ``data`` and ``train`` sections.

Every field can be overridden from the command line with a dotted key (``--model.topology mesh``,
``--train.lr 3e-4``). Unknown keys and values of the wrong type fail with one sentence naming the field.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from recursive_lightning.errors import ConfigError
from recursive_lightning.files import absent
from recursive_lightning.interop.init import parse_strategy
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.sampled_loops import check_train_loops
from recursive_lightning.strict_yaml import StrictYAMLError, parse_yaml, scalar_ambiguity, syntax_problem

# train.train_only part -> parameter-name prefixes of RecursiveLM (model/recursive/model.py; training/partial.py)
PARTS: dict[str, tuple[str, ...]] = {
    "embed": ("embed.",),
    "prelude": ("prelude.",),
    "core": ("cores.",),
    "coda": ("coda.",),
    "norm": ("norm.",),
    "head": ("head.",),
    "topology": ("topology.",),  # MeSH routers, static / dynamic combination coefficients
    "resolution": ("steps.",),  # SpiralFormer scorers A^(t) and allocators B^(t)
}


SEED_MAX = 2**32 - 1  # numpy's seeds, which Lightning's seed_everything hands the seed to


def check_seed(seed: int, where: str) -> None:
    """One sentence for a seed numpy cannot take (negative, or above 2**32 - 1)."""
    if not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"{where} must be a whole number from 0 to 2**32 - 1 = {SEED_MAX}, not {seed}.")


def check_train_only(parts: Any, steps: int, max_steps: int) -> None:
    """One sentence for a bad ``train.train_only`` / ``train.train_only_steps`` pair."""
    if steps < 0:
        raise ConfigError(f"train.train_only_steps must be >= 0, not {steps}.")
    if parts is None:
        if steps:
            raise ConfigError(
                f"train.train_only_steps is {steps} but train.train_only names no parts; list the parts to "
                f"train first, e.g. train.train_only: [topology, core] (parts: {', '.join(PARTS)})."
            )
        return
    if not isinstance(parts, list | tuple) or not parts or not all(isinstance(p, str) for p in parts):
        raise ConfigError(
            f"train.train_only must be a non-empty list of parts such as [topology, core], not {parts!r}."
        )
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ConfigError(f"train.train_only part '{unknown[0]}' is unknown; choose from {', '.join(PARTS)}.")
    if steps < 1:
        raise ConfigError(
            "train.train_only is set but train.train_only_steps is 0; give the number of steps to train "
            "only those parts (e.g. --train.train_only_steps 100)."
        )
    if steps > max_steps:
        raise ConfigError(
            f"train.train_only_steps {steps} exceeds train.max_steps {max_steps}; lower it or raise "
            "train.max_steps."
        )


@dataclass
class DataConfig:
    path: str | None = None  # text file, folder, glob or hf:<dataset>; None = the embedded corpus
    tokenizer: str = "bpe:4096"  # tokenizer.json path, a Hub name, or bpe:<vocab> trained and cached
    seq_len: int = 256
    batch_size: int = 16
    val_batches: int = 16
    val_fraction: float = 0.05  # share of documents held out for validation
    cache_dir: str | None = None  # token shards and tokenizers; default ~/.cache/recursive_lightning
    num_workers: int = 0


COMPILE_SCOPES = ("layers", "glue", "model")  # train.compile values besides false / true (= layers)
# train.accelerator values: Lightning's names for this machine's kind (auto), the CPU and a CUDA GPU
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")


@dataclass
class TrainConfig:
    max_steps: int = 300
    lr: float = 1e-3  # peak learning rate
    warmup_ratio: float = 0.01  # MeSH App. B: 1% warm-up
    warmup_steps: int | None = None  # a warm-up in steps instead (Mela Sec. 5.1: 500); overrides warmup_ratio
    min_lr_ratio: float = 0.1  # cosine decay to 10% of the peak
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    accumulate: int = 1
    # auto: bf16-mixed where the hardware has it, else 32-true; 64-true: float64 throughout (a numerics reference)
    precision: str = "auto"
    compile: bool | str = False  # false | true (= layers) | layers | glue | model (training/parallel.py)
    activation_checkpointing: bool = False
    # each step's forward + backward captured once as a CUDA graph and replayed (training/cuda_graphs.py):
    # one GPU, fixed depth, no gradient accumulation, eager layers
    cuda_graphs: bool = False
    # torch | triton: Mela's memory update as two fused Triton kernels a chunk instead of about 25, and its
    # backward as two instead of about 130 (model/mela/memory_kernel*.py); CUDA and the triton package
    memory_kernel: str = "torch"
    seed: int = 0
    val_every: int = 100  # steps between validations (and best-checkpoint selection)
    checkpoint_every: int = 100  # steps between `last` checkpoints
    log_every: int = 1
    accelerator: str = "auto"
    devices: Any = 1
    num_nodes: int = 1
    strategy: str = "auto"  # auto | ddp | fsdp (FSDP2 via ModelParallelStrategy)
    progress: bool = True
    # glibc: reuse freed memory instead of page-faulting it in again every step (training/host.py)
    keep_host_memory: bool = True
    # uptraining (training/uptrain.py): initialise from a pretrained vanilla model at step 0 (never on --resume)
    init_from: str | None = None  # a checkpoint or run dir of ours, a local HF GPT-NeoX / LLaMA dir, Hub name
    init_strategy: str = "stepwise"  # stepwise | average | lower | select:LAYERS (Bae et al. 2024)
    # train only these parts for the first train_only_steps steps, then everything (training/partial.py)
    train_only: list[str] | None = None  # of embed, prelude, core, coda, norm, head, topology, resolution
    train_only_steps: int = 0
    # a sampled loop count per step (Huginn; sampled_loops.py), None: the layout's K every step, e.g.
    # {distribution: poisson-lognormal, mean: 4, sigma: 0.5, backprop: 2} or {distribution: uniform, low: 2, high: 6}
    loops: dict[str, Any] | None = None


SECTIONS = ("name", "model", "data", "train")  # a run YAML's top level


def _devices_ok(devices: Any) -> bool:
    """Lightning's ``devices``: a count >= 1, ``auto``, -1, a list of ids, or a string of either ("2", "0,1")."""
    if isinstance(devices, bool):
        return False
    if isinstance(devices, int):
        return devices >= 1 or devices == -1
    if isinstance(devices, list):
        return bool(devices) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in devices
        )
    if isinstance(devices, str):
        text = devices.strip()
        return text == "auto" or (
            text not in ("", "0")
            and all(p.strip().lstrip("-").isdigit() for p in text.split(",") if p.strip())
        )
    return False


def device_count(devices: Any, every: int) -> int:
    """The processes ``train.devices`` starts on one node: a count, a list or comma string of device ids (its
    length), or ``auto`` / -1 (``every``: all of the node's devices)."""
    if isinstance(devices, bool):
        return 1
    if isinstance(devices, int):
        return every if devices == -1 else devices
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip()
    if text in ("auto", "-1"):
        return every
    if "," in text:
        return len([x for x in text.split(",") if x.strip()])
    return int(text) if text.isdigit() else 1


def check_train_choices(t: TrainConfig) -> None:
    """One sentence for a ``train`` field set to a value outside its choices: devices, accelerator, strategy,
    compile, precision (whether this machine can run the choice is ``training/parallel.check_supported``'s)."""
    if not _devices_ok(t.devices):
        raise ConfigError(
            f"train.devices must be a count >= 1, auto, -1 (every device) or a list of device ids, not "
            f"{t.devices!r}."
        )
    if t.accelerator not in ACCELERATORS:  # Lightning's others (tpu, mps) run no part of this package
        raise ConfigError(
            f"train.accelerator '{t.accelerator}' is not one this package trains on; choose "
            f"{', '.join(ACCELERATORS[:-1])} or {ACCELERATORS[-1]}."
        )
    if t.strategy not in ("auto", "ddp", "fsdp"):
        raise ConfigError(f"train.strategy '{t.strategy}' is unknown; choose auto, ddp or fsdp.")
    if t.compile not in (False, True, *COMPILE_SCOPES):
        raise ConfigError(
            f"train.compile '{t.compile}' is unknown; choose false, true (= layers), layers, glue or model."
        )
    if t.precision not in ("auto", "32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true"):
        raise ConfigError(
            f"train.precision '{t.precision}' is unknown; choose auto, 32-true, 64-true, bf16-mixed, 16-mixed "
            "or bf16-true."
        )


def check_cuda_graphs(t: TrainConfig) -> None:
    """One sentence for a setting ``train.cuda_graphs`` cannot replay: the graph holds one step's kernels, with
    its gradients set (not summed), on one GPU, at one depth."""
    clash = (
        ("train.loops", "a depth sampled per step, where a graph replays one", t.loops is not None),
        (
            "train.accumulate > 1",
            "gradients summed over micro-batches, where a graph sets them",
            t.accumulate != 1,
        ),
        ("train.strategy ddp or fsdp", "collectives inside the backward", t.strategy != "auto"),
        ("train.devices other than 1", "collectives inside the backward", t.devices not in (1, "1")),
        ("train.num_nodes > 1", "collectives inside the backward", t.num_nodes != 1),
        ("train.compile", "compiled regions, where the graph replays eager kernels", bool(t.compile)),
    )
    for setting, why, bad in clash:
        if bad:
            raise ConfigError(
                f"train.cuda_graphs cannot be combined with {setting} ({why}); set one of them off."
            )


def check_memory_kernel(t: TrainConfig, model: ModelConfig) -> None:
    """One sentence for a ``train.memory_kernel`` that is unknown or cannot compute this model's memory update
    (``model/mela/memory_kernel.py``: Mela's 2-layer memory with the Newton-Schulz update)."""
    if t.memory_kernel not in ("torch", "triton"):
        raise ConfigError(f"train.memory_kernel '{t.memory_kernel}' is unknown; choose torch or triton.")
    if t.memory_kernel == "torch":
        return
    if model.arch != "mela" or not model.neural_memory:
        raise ConfigError(
            "train.memory_kernel triton fuses Mela's neural memory update; set it torch for model.arch "
            f"{model.arch}" + ("" if model.arch != "mela" else " without model.neural_memory") + "."
        )
    if model.memory_depth != 2 or model.memory_update != "newton_schulz":
        raise ConfigError(
            "train.memory_kernel triton computes model.memory_update newton_schulz at model.memory_depth 2, not "
            f"{model.memory_update} at depth {model.memory_depth}; set train.memory_kernel torch."
        )
    if t.compile == "model":
        raise ConfigError(
            "train.memory_kernel triton cannot be combined with train.compile model (the compiled forward traces "
            "the PyTorch update); use train.compile glue or layers with it."
        )


def check_sections(data: dict[str, Any]) -> None:
    """One sentence for a top-level key of a run YAML that is none of :data:`SECTIONS` (a misspelt section)."""
    unknown = sorted(set(data) - set(SECTIONS), key=str)
    if unknown:
        hint = difflib.get_close_matches(str(unknown[0]), SECTIONS, n=1)
        extra = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(f"'{unknown[0]}' is not a config section{extra}; use name, model, data and train.")


@dataclass
class RunConfig:
    """One run: its ``name`` (the MLflow experiment and run name), ``model`` (:class:`ModelConfig`), ``data``
    and ``train`` sections, as a run YAML has them; :meth:`from_dict` / :func:`load_run_config` check every
    field, :meth:`to_dict` gives the YAML's mapping back."""

    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model.to_dict(),
            "data": dataclasses.asdict(self.data),
            "train": dataclasses.asdict(self.train),
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> values (MLflow params)."""
        out = {}
        for section, values in self.to_dict().items():
            if isinstance(values, dict):
                out.update({f"{section}.{k}": v for k, v in values.items()})
            else:
                out[section] = values
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        data = dict(data or {})
        check_sections(data)
        name = data.get("name", "run")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"name must be a non-empty string, not {name!r}.")
        check_name(name, "name")
        for section in ("model", "data", "train"):
            if section in data and data[section] is None:  # `model:` with nothing under it, or null
                raise ConfigError(
                    f"the '{section}' section is empty; indent its fields under '{section}:' (e.g. {section}: "
                    f"{{...}}) or remove the line for the defaults."
                )
            if data.get(section) is not None and not isinstance(data[section], dict):
                raise ConfigError(
                    f"the '{section}' section must be a mapping of fields (e.g. {section}: {{...}}), "
                    f"not {data[section]!r}."
                )
            check_misplaced(section, data.get(section) or {})
        return cls(
            name=name,
            model=ModelConfig.from_dict(data.get("model") or {}),
            data=_build(DataConfig, data.get("data") or {}, "data"),
            train=_build(TrainConfig, data.get("train") or {}, "train"),
        ).validate()

    def validate(self) -> RunConfig:
        d, t = self.data, self.train
        for section, obj, names in (
            ("data", d, ("seq_len", "batch_size", "val_batches")),
            ("train", t, ("max_steps", "accumulate", "val_every", "checkpoint_every", "log_every")),
        ):
            for n in names:
                if getattr(obj, n) < 1:
                    raise ConfigError(f"{section}.{n} must be >= 1, not {getattr(obj, n)}.")
        if not 0 < d.val_fraction < 1:
            raise ConfigError(
                f"data.val_fraction must lie strictly between 0 and 1 (the share of documents held out for "
                f"validation), not {d.val_fraction}; e.g. 0.05."
            )
        if d.path is not None and not str(d.path).strip():
            raise ConfigError(
                "data.path is empty; pass a text file, folder, glob or hf:<dataset>, or leave it out for the "
                "embedded corpus."
            )
        if d.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"data.seq_len {d.seq_len} exceeds model.max_seq_len {self.model.max_seq_len}; raise model.max_seq_len or lower data.seq_len."
            )
        m = self.model
        if m.arch == "mela" and d.seq_len % m.tokens_per_chunk:
            raise ConfigError(
                f"data.seq_len {d.seq_len} must be a multiple of P*C = {m.tokens_per_chunk} (model.patch_size "
                f"{m.patch_size} x model.chunk_size {m.chunk_size}) for a Mela model, so every chunk is complete."
            )
        if t.lr <= 0:
            raise ConfigError(f"train.lr must be positive, not {t.lr}.")
        check_seed(t.seed, "train.seed")
        if t.warmup_steps is not None and not 0 <= t.warmup_steps < t.max_steps:
            raise ConfigError(
                f"train.warmup_steps {t.warmup_steps} must lie in [0, train.max_steps) = [0, {t.max_steps}); "
                "lower it (--train.warmup_steps N) or raise train.max_steps."
            )
        for name in ("beta1", "beta2"):  # AdamW's moment decays
            if not 0 <= getattr(t, name) < 1:
                raise ConfigError(
                    f"train.{name} must lie in [0, 1), not {getattr(t, name)}; e.g. 0.9 or 0.95."
                )
        if t.weight_decay < 0 or t.grad_clip < 0:
            raise ConfigError(
                f"train.weight_decay and train.grad_clip must be >= 0 (0: off), not {t.weight_decay} and "
                f"{t.grad_clip}."
            )
        check_train_choices(t)
        if not 0 <= t.warmup_ratio < 1 or not 0 <= t.min_lr_ratio <= 1:
            raise ConfigError("train.warmup_ratio must lie in [0, 1) and train.min_lr_ratio in [0, 1].")
        if t.cuda_graphs:
            check_cuda_graphs(t)
        check_memory_kernel(t, self.model)
        if t.init_from is not None or t.init_strategy != "stepwise":  # uptraining
            parse_strategy(t.init_strategy)
        if t.train_only is not None or t.train_only_steps:
            check_train_only(t.train_only, t.train_only_steps, t.max_steps)
        t.loops = check_train_loops(t.loops, self.model)
        return self


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, not {value!r}.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where} must be an integer, not {value!r}.")
    if tp is float:
        number = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{where} must be a number, not {value!r}.")
        if not math.isfinite(number):
            raise ConfigError(f"{where} must be a finite number, not {value!r}.")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        if (
            isinstance(value, dict) and len(value) == 1
        ):  # YAML reads `select: 0-3` (or `select:`) as a mapping
            ((k, v),) = value.items()
            if isinstance(k, str) and (v is None or isinstance(v, str | int)):
                return f"{k}:{'' if v is None else v}"
        raise ConfigError(f"{where} must be a string, not {value!r}.")
    return value


def check_name(name: str, where: str) -> None:
    """A run's or a sweep's name becomes a folder under ``runs/``: one path component, so a name cannot place
    it elsewhere (``../x``, ``a/b``)."""
    if "/" in name or "\\" in name or name in (".", "..") or name != name.strip():
        parts = [p.strip() for p in name.replace("\\", "/").split("/") if p.strip(" .")]
        suggestion = parts[-1] if parts else "my-run"
        raise ConfigError(
            f"{where} {name!r} must be one folder name (no '/', backslash, '..' or surrounding spaces); "
            f"e.g. {suggestion!r}."
        )


def check_misplaced(section: str, fields: dict[str, Any]) -> None:
    """One sentence for a field written under the wrong section (``model.memory_kernel`` for
    ``train.memory_kernel``): the section that has it, where a close match in its own would mislead."""
    classes = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}
    own = {f.name for f in dataclasses.fields(classes[section])}
    for key in fields:
        if key in own:
            continue
        for other, cls in classes.items():
            if other != section and key in {f.name for f in dataclasses.fields(cls)}:
                raise ConfigError(
                    f"{section}.{key} is not a {section} field; it is {other}.{key}: move it there."
                )


def _build(cls: type, data: dict[str, Any], section: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"the '{section}' section must be a mapping of fields, not {data!r}.")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            extra = f" (did you mean '{section}.{hint[0]}'?)" if hint else ""
            raise ConfigError(f"{section}.{key} is not a {section} field{extra}.")
        kwargs[key] = _coerce(value, hints[key], f"{section}.{key}")
    return cls(**kwargs)


def check_model_types(data: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(ModelConfig)
    # layout: null means "the preset's own depth" (a vanilla row of a sweep)
    return {
        k: (_coerce(v, hints[k], f"model.{k}") if k in hints and not (k == "layout" and v is None) else v)
        for k, v in data.items()
    }


def load_yaml(
    path: str | Path,
    what: str = "config file",
    example: str = "experiments/cpu/looped-mesh.yaml",
    fields: str = "name/model/data/train sections",
) -> dict[str, Any]:
    """A YAML mapping from ``path``; every problem is one sentence naming the file (``what``: the kind of
    file, ``example`` and ``fields`` what the fix names)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} '{path}' is a directory; pass a YAML file such as {example}.")
    if not path.is_file():
        raise ConfigError(f"{what} '{path}' {absent(path)}; pass a YAML file such as {example}.")
    try:
        text = path.read_text(encoding="utf-8")
        data = parse_yaml(text, f"{what} '{path}'")
    except StrictYAMLError as e:  # a duplicate key or an ambiguous scalar: the message is the sentence
        raise ConfigError(str(e)) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} '{path}' {syntax_problem(e, text)}.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} '{path}' is not text (not UTF-8); pass a YAML file.") from None
    except OSError as e:
        raise ConfigError(f"{what} '{path}' cannot be read ({e.strerror}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} '{path}' must hold a mapping with {fields}, e.g. {example}.")
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        if node.get(p) is None:  # absent, or null in a resolved config (train.loops: null)
            node[p] = {}
        node = node[p]
        if not isinstance(node, dict):
            raise ConfigError(f"override '{key}': '{p}' is not a section.")
    node[parts[-1]] = value


def apply_overrides(
    data: dict[str, Any], argv: list[str], sections: tuple[str, ...] = ("model", "data", "train", "name")
) -> dict[str, Any]:
    """Apply ``--section.field value`` (or ``--section.field=value``) pairs; values parse as YAML scalars."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; overrides look like --model.topology mesh.")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"override --{key} needs a value.")
            if argv[i + 1].startswith("--"):  # the next option, not a value (a value may start with '-')
                raise ConfigError(
                    f"override --{key} needs a value before the next option {argv[i + 1]!r} "
                    f"(e.g. --{key} VALUE, or --{key}=VALUE)."
                )
            value = argv[i + 1]
            i += 1
        i += 1
        if key.split(".")[0] not in sections:
            raise ConfigError(
                f"unknown option --{key}; config overrides start with one of: {', '.join('--' + s + '.' for s in sections)}"
            )
        why = scalar_ambiguity(value) if key != "model.layout" else None
        if why:
            raise ConfigError(f"--{key} {value} {why}.")
        try:
            parsed = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            parsed = value
        if key == "model.layout":
            parsed = str(value)
        set_dotted(data, key, parsed)
    return data


def load_run_config(
    path: str | Path | None, overrides: list[str] | None = None, kept_by: str | Path | None = None
) -> RunConfig:
    """The run config in ``path`` (None: the defaults) with the command line's ``overrides``; ``kept_by``: the
    run directory whose own ``config.yaml`` ``path`` is (a resume), which a problem's sentence names too."""
    try:
        data = load_yaml(path) if path else {}
    except ConfigError as e:
        if kept_by is None:
            raise
        raise ConfigError(
            f"{str(e).rstrip('.')}; it is the config the run in '{kept_by}' was started with: repair it, or "
            "pass the config the run was started with as --config."
        ) from None
    data = apply_overrides(data, overrides or [])
    if "model" in data and isinstance(data["model"], dict):
        data["model"] = check_model_types(data["model"])
    return RunConfig.from_dict(data)
