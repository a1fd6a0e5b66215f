"""Load Hugging Face GPT-NeoX (Pythia) and LLaMA weights into a vanilla ``RecursiveLM``.

    cfg   = config_from_gpt_neox(hf_model.config)      # vanilla layout, scale_embeddings=False
    model = RecursiveLM(cfg)
    load_gpt_neox_state_dict(model, hf_model.state_dict())

and likewise ``config_from_llama`` / ``load_llama_state_dict`` for ``LlamaForCausalLM`` (the
Transformer++ baseline); with network access, ``from_pretrained_gpt_neox("EleutherAI/pythia-160m")``
or ``from_pretrained_llama(name_or_path)`` (both also take a local directory).

GPT-NeoX key mapping (HF -> ours):

    gpt_neox.embed_in                         -> embed
    gpt_neox.layers.i.input_layernorm         -> prelude.layers.i.norm1
    gpt_neox.layers.i.post_attention_layernorm-> prelude.layers.i.norm2
    gpt_neox.layers.i.attention.query_key_value -> prelude.layers.i.attn.qkv  (rows permuted, below)
    gpt_neox.layers.i.attention.dense         -> prelude.layers.i.attn.proj
    gpt_neox.layers.i.mlp.dense_h_to_4h       -> prelude.layers.i.mlp.up
    gpt_neox.layers.i.mlp.dense_4h_to_h       -> prelude.layers.i.mlp.down
    gpt_neox.final_layer_norm                 -> norm
    embed_out (hub checkpoints) / lm_head (transformers >= 5 in memory) -> head

HF's fused ``query_key_value`` output rows are grouped per head, ``(heads, 3, head_dim)``
(``modeling_gpt_neox.py``: ``qkv.view(b, l, heads, 3 * head_dim)`` then ``chunk(3, dim=-1)``);
ours are ``[q of all heads | k | v]`` = ``(3, heads, head_dim)``, so the rows are permuted.

LLaMA key mapping (HF -> ours); several HF matrices fill row blocks of one of ours:

    model.embed_tokens                        -> embed
    model.layers.i.input_layernorm            -> prelude.layers.i.norm1
    model.layers.i.post_attention_layernorm   -> prelude.layers.i.norm2
    model.layers.i.self_attn.{q,k,v}_proj     -> prelude.layers.i.attn.qkv  rows [q | k | v]
    model.layers.i.self_attn.o_proj           -> prelude.layers.i.attn.proj
    model.layers.i.mlp.{gate,up}_proj         -> prelude.layers.i.mlp.up    rows [gate | up]
    model.layers.i.mlp.down_proj              -> prelude.layers.i.mlp.down
    model.norm                                -> norm
    lm_head                                   -> head  (absent or equal to embed_tokens when tied)

Our k/v rows hold ``n_kv_heads`` heads and query head i reads kv head ``i // (n_heads / n_kv_heads)``
(SDPA's ``enable_gqa``), which is HF's ``repeat_kv``. The rotary embedding is the same in both:
inverse frequencies ``base ** (-arange(0, head_dim, 2) / head_dim)``, angles ``cat(freqs, freqs)``
and rotate-half; HF Llama's default rope rotates every head dim, so ``rotary_pct`` is 1. Scaled
ropes (``rope_scaling`` / a ``rope_parameters`` type other than default) and biases are refused.

Loading is strict: every key of the checkpoint must be consumed (apart from the non-parameter
attention-mask buffers old GPT-NeoX checkpoints carry; a stored ``rotary_emb.inv_freq`` is checked
against the model's rotary settings), every parameter of the model must be filled, and every shape
must match. Any mismatch raises one ``ConfigError`` naming the key, before the model is touched.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from recursive_lightning.errors import ConfigError
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.recursive.model import RecursiveLM


@dataclass(frozen=True)
class _Family:
    """What differs between the checkpoint families: names for messages and the key patterns."""

    name: str  # in messages: "GPT-NeoX", "LLaMA"
    model_type: str
    config_class: str
    model_class: str
    config_fn: str
    loader: str
    layer: re.Pattern  # group 1: the layer index
    inv_freq: re.Pattern  # stored rotary frequencies (checked, not loaded)
    ignored: re.Pattern | None  # non-parameter buffers HF itself ignores on load
    head_keys: tuple[str, ...]
    head_name: str  # the head key(s) as named when missing
    base_field: str  # the rotary base in configs older than transformers 5's rope_parameters


_GPT_NEOX = _Family(
    name="GPT-NeoX",
    model_type="gpt_neox",
    config_class="GPTNeoXConfig",
    model_class="GPTNeoXForCausalLM",
    config_fn="config_from_gpt_neox",
    loader="load_gpt_neox_state_dict",
    layer=re.compile(r"^gpt_neox\.layers\.(\d+)\."),
    inv_freq=re.compile(r"^gpt_neox\.(layers\.\d+\.attention\.)?rotary_emb\.inv_freq$"),
    ignored=re.compile(r"^gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias)$"),
    head_keys=("embed_out.weight", "lm_head.weight"),
    head_name="embed_out.weight (or lm_head.weight)",
    base_field="rotary_emb_base",
)
_LLAMA = _Family(
    name="LLaMA",
    model_type="llama",
    config_class="LlamaConfig",
    model_class="LlamaForCausalLM",
    config_fn="config_from_llama",
    loader="load_llama_state_dict",
    layer=re.compile(r"^model\.layers\.(\d+)\."),
    inv_freq=re.compile(r"^model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$"),
    ignored=None,
    head_keys=("lm_head.weight",),
    head_name="lm_head.weight",
    base_field="rope_theta",
)

# HF GPT-NeoX layer sub-module -> our Block sub-module
_LAYER_MAP = {
    "input_layernorm": "norm1",
    "post_attention_layernorm": "norm2",
    "attention.query_key_value": "attn.qkv",
    "attention.dense": "attn.proj",
    "mlp.dense_h_to_4h": "mlp.up",
    "mlp.dense_4h_to_h": "mlp.down",
}
# HF LLaMA layer sub-module -> (our Block sub-module, which row block of it: index into its parts)
_LLAMA_LAYER_MAP = {
    "input_layernorm": ("norm1", None),
    "post_attention_layernorm": ("norm2", None),
    "self_attn.q_proj": ("attn.qkv", 0),
    "self_attn.k_proj": ("attn.qkv", 1),
    "self_attn.v_proj": ("attn.qkv", 2),
    "self_attn.o_proj": ("attn.proj", None),
    "mlp.gate_proj": ("mlp.up", 0),
    "mlp.up_proj": ("mlp.up", 1),
    "mlp.down_proj": ("mlp.down", None),
}


# ---------------------------------------------------------------------------------- configs


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _rope(hf_config: Any, fam: _Family) -> tuple[Mapping, float]:
    """(rope parameters, rotary base) from either the transformers >= 5 ``rope_parameters`` dict or
    the older ``rotary_emb_base`` (GPT-NeoX) / ``rope_theta`` (LLaMA) / ``rope_scaling`` fields
    (config.json on the hub); refuses every rope type but the plain (default) one."""
    params = _get(hf_config, "rope_parameters") or {}
    scaling = _get(hf_config, "rope_scaling") or {}
    if not isinstance(params, Mapping) or not isinstance(scaling, Mapping):
        raise ConfigError(f"{fam.name} config: rope_parameters / rope_scaling must be a dict or empty.")
    for field, source in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = source.get("rope_type", source.get("type", "default"))
        if kind not in (None, "default"):
            raise ConfigError(
                f"{fam.name} config: {field} rope type '{kind}' is not supported; only plain (default) "
                "rotary embeddings convert to recursive_lightning."
            )
    base = params.get("rope_theta", _get(hf_config, fam.base_field, 10000.0))
    return params, float(base)


def _check_hf_config(hf_config: Any, fam: _Family, act: str, required: tuple[str, ...]) -> tuple[int, int]:
    """Model type, required fields, activation and head_dim shared by both families: (d_model, heads)."""
    model_type = _get(hf_config, "model_type")
    if model_type not in (None, fam.model_type):
        raise ConfigError(f"{fam.config_fn} needs a {fam.name} config, not model_type '{model_type}'.")
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", *required)
    missing = [k for k in required if _get(hf_config, k) is None]
    if missing:
        raise ConfigError(
            f"{fam.name} config lacks {', '.join(missing)}; pass a transformers {fam.config_class}."
        )
    have = _get(hf_config, "hidden_act", act)
    if have != act:
        note = "the exact (erf) GELU, which is HF's 'gelu'" if act == "gelu" else "SiLU (SwiGLU), HF's 'silu'"
        raise ConfigError(
            f"{fam.name} config: hidden_act '{have}' is not supported; recursive_lightning's {fam.name} MLP "
            f"uses {note}."
        )
    head_dim = _get(hf_config, "head_dim")
    d, heads = int(_get(hf_config, "hidden_size")), int(_get(hf_config, "num_attention_heads"))
    if head_dim is not None and heads * int(head_dim) != d:
        raise ConfigError(
            f"{fam.name} config: head_dim {head_dim} x {heads} heads != hidden_size {d}; "
            "recursive_lightning needs head_dim = hidden_size / heads."
        )
    return d, heads


def _vanilla_config(hf_config: Any, fields: dict[str, Any], overrides: Mapping[str, Any]) -> ModelConfig:
    """The fields both families share (vanilla layout of num_hidden_layers, base topology, unscaled
    embeddings), then ``fields``, then ``overrides`` (validated as any model config)."""
    n_layers = int(_get(hf_config, "num_hidden_layers"))
    common = {
        "preset": None,
        "layout": str(n_layers),
        "vocab_size": int(_get(hf_config, "vocab_size")),
        "d_model": int(_get(hf_config, "hidden_size")),
        "n_heads": int(_get(hf_config, "num_attention_heads")),
        "max_seq_len": int(_get(hf_config, "max_position_embeddings", 2048)),
        "tie_embeddings": bool(_get(hf_config, "tie_word_embeddings", False)),
        "scale_embeddings": False,
        "init_std": float(_get(hf_config, "initializer_range", 0.02)),
        "topology": "base",
        "n_layers_hint": n_layers,
    }
    return ModelConfig.from_dict({**common, **fields, **overrides})


def config_from_gpt_neox(hf_config: Any) -> ModelConfig:
    """The vanilla ``ModelConfig`` of a ``transformers.GPTNeoXConfig`` (or its config.json dict).

    Layout = ``num_hidden_layers`` distinct layers, topology base, ``scale_embeddings=False``
    (Pythia does not scale its embeddings), GELU MLP of ``intermediate_size``, LayerNorm with biases.
    """
    d, _ = _check_hf_config(hf_config, _GPT_NEOX, "gelu", ())
    if _get(hf_config, "attention_bias", True) is False:
        raise ConfigError(
            "GPT-NeoX config: attention_bias=False is not supported; recursive_lightning keeps biases on every "
            "linear layer (model.bias), as stock Pythia does."
        )
    params, base = _rope(hf_config, _GPT_NEOX)
    intermediate = _get(hf_config, "intermediate_size")
    fields = {
        "n_kv_heads": None,
        "mlp": "gelu",
        "mlp_hidden": None if intermediate in (None, 4 * d) else int(intermediate),
        "norm": "layernorm",
        "norm_eps": float(_get(hf_config, "layer_norm_eps", 1e-5)),
        "bias": True,
        "parallel_residual": bool(_get(hf_config, "use_parallel_residual", True)),
        "rotary_pct": float(params.get("partial_rotary_factor", _get(hf_config, "rotary_pct", 0.25))),
        "rotary_base": base,
    }
    return _vanilla_config(hf_config, fields, {})


def config_from_llama(hf_config: Any, **overrides: Any) -> ModelConfig:
    """The vanilla ``ModelConfig`` of a ``transformers.LlamaConfig`` (or its config.json dict): the
    Transformer++ recipe, i.e. RMSNorm, SwiGLU MLP of ``intermediate_size``, sequential residual, full
    rotary, grouped-query attention of ``num_key_value_heads``, no biases, unscaled embeddings.

    ``overrides`` replace any of the resulting ``ModelConfig`` fields (e.g. ``max_seq_len``); the
    loader still refuses a model whose weights would not mean what they mean in HF.
    """
    _check_hf_config(hf_config, _LLAMA, "silu", ("intermediate_size",))
    for field in ("attention_bias", "mlp_bias"):
        if _get(hf_config, field, False):
            raise ConfigError(
                f"LLaMA config: {field}=True is not supported; recursive_lightning's LLaMA layers have no "
                "biases (model.bias False)."
            )
    _, base = _rope(hf_config, _LLAMA)  # HF Llama's default rope ignores partial_rotary_factor
    heads = int(_get(hf_config, "num_attention_heads"))
    kv = int(_get(hf_config, "num_key_value_heads") or heads)
    fields = {
        "n_kv_heads": None if kv == heads else kv,
        "mlp": "swiglu",
        "mlp_hidden": int(_get(hf_config, "intermediate_size")),
        "norm": "rmsnorm",
        "norm_eps": float(_get(hf_config, "rms_norm_eps", 1e-6)),
        "bias": False,
        "parallel_residual": False,
        "rotary_pct": 1.0,
        "rotary_base": base,
    }
    return _vanilla_config(hf_config, fields, overrides)


# ---------------------------------------------------------------------------------- state dicts


@dataclass(frozen=True)
class _Slot:
    """Where one checkpoint tensor goes: ``param`` or its row block ``rows``, after ``fix``."""

    param: torch.nn.Parameter
    rows: tuple[int, int] | None = None
    fix: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def key(self) -> tuple[int, tuple[int, int] | None]:
        return id(self.param), self.rows

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.param.shape)
        return shape if self.rows is None else (self.rows[1] - self.rows[0], *shape[1:])

    def target(self) -> torch.Tensor:
        return self.param if self.rows is None else self.param[self.rows[0] : self.rows[1]]


def _check_model(model: RecursiveLM, fam: _Family, wanted: Mapping[str, Any], extra: list[str]) -> None:
    """Refuse a model whose settings differ from what the family's weights mean, all problems in one."""
    if not isinstance(model, RecursiveLM):
        raise ConfigError(f"{fam.loader} needs a RecursiveLM, not {type(model).__name__}.")
    cfg = model.cfg
    problems = []
    if model.layout.kind != "vanilla":
        problems.append(
            f"model.layout '{cfg.layout}' is {model.layout.kind}; {fam.name} weights need a vanilla layout"
        )
    for field, want in wanted.items():
        if getattr(cfg, field) != want:
            problems.append(f"model.{field} is {getattr(cfg, field)!r}, {fam.name} needs {want!r}")
    problems += extra
    if problems:
        raise ConfigError(
            f"{fam.loader}: " + "; ".join(problems) + f"; build the model with {fam.config_fn}(hf_config)."
        )


def _qkv_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rows (heads, 3, head_dim) -> ours (3, heads, head_dim); works for weight and bias."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def _gpt_neox_targets(model: RecursiveLM) -> dict[str, _Slot]:
    heads = model.cfg.n_heads
    out = {"gpt_neox.embed_in.weight": _Slot(model.embed.weight)}
    for i, block in enumerate(model.prelude.layers):
        for hf_name, ours in _LAYER_MAP.items():
            fix = (lambda t: _qkv_rows(t, heads)) if ours == "attn.qkv" else None
            for pname, param in block.get_submodule(ours).named_parameters(recurse=False):
                out[f"gpt_neox.layers.{i}.{hf_name}.{pname}"] = _Slot(param, fix=fix)
    for pname, param in model.norm.named_parameters(recurse=False):
        out[f"gpt_neox.final_layer_norm.{pname}"] = _Slot(param)
    return out


def _llama_targets(model: RecursiveLM) -> dict[str, _Slot]:
    cfg = model.cfg
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    parts = {"attn.qkv": (q, kv, kv), "mlp.up": (cfg.hidden, cfg.hidden)}  # row blocks of the fused layers
    out = {"model.embed_tokens.weight": _Slot(model.embed.weight)}
    for i, block in enumerate(model.prelude.layers):
        for hf_name, (ours, part) in _LLAMA_LAYER_MAP.items():
            rows = None
            if part is not None:
                start = sum(parts[ours][:part])
                rows = (start, start + parts[ours][part])
            for pname, param in block.get_submodule(ours).named_parameters(recurse=False):
                out[f"model.layers.{i}.{hf_name}.{pname}"] = _Slot(param, rows)
    for pname, param in model.norm.named_parameters(recurse=False):
        out[f"model.norm.{pname}"] = _Slot(param)
    return out


def _check_inv_freq(model: RecursiveLM, fam: _Family, key: str, value: torch.Tensor) -> None:
    rot = model.prelude.rotary
    expected = 1.0 / (rot.base ** (torch.arange(0, rot.dim, 2, dtype=torch.float32) / max(rot.dim, 1)))
    value = value.detach().float().cpu()
    if value.shape != expected.shape or not torch.allclose(value, expected, rtol=1e-4, atol=0.0):
        raise ConfigError(
            f"checkpoint key '{key}' holds rotary frequencies of {value.numel() * 2} dims that do not match "
            f"model.rotary_pct {model.cfg.rotary_pct} / rotary_base {model.cfg.rotary_base} "
            f"({expected.numel() * 2} dims); build the model with {fam.config_fn}(hf_config)."
        )


def _load(
    model: RecursiveLM, hf_state_dict: Mapping[str, torch.Tensor], fam: _Family, targets: dict[str, _Slot]
) -> None:
    """Check every key, shape and tied pair of ``hf_state_dict`` against ``targets`` (HF key -> slot),
    then copy; ``ConfigError`` naming the first offending key leaves the model unchanged."""
    hf_layers = {int(m.group(1)) for k in hf_state_dict if (m := fam.layer.match(k))}
    n_model = len(model.prelude.layers)
    if hf_layers and max(hf_layers) + 1 != n_model:
        raise ConfigError(
            f"the checkpoint has {max(hf_layers) + 1} {fam.name} layers but the model has {n_model} "
            f"(model.layout '{model.cfg.layout}'); build the model with {fam.config_fn}(hf_config)."
        )

    head = _Slot(model.head.weight)
    plan: dict[tuple, tuple[str, _Slot, torch.Tensor]] = {}  # slot key -> (HF key, slot, value)
    head_key = None
    for key, value in hf_state_dict.items():
        if fam.ignored is not None and fam.ignored.match(key):
            continue
        if fam.inv_freq.match(key):
            _check_inv_freq(model, fam, key, value)
            continue
        if key in fam.head_keys:
            if head_key is not None:
                if not torch.equal(hf_state_dict[head_key], value):
                    raise ConfigError(
                        f"the checkpoint holds both '{head_key}' and '{key}' with different values."
                    )
                continue
            head_key, slot = key, head
        elif key in targets:
            slot = targets[key]
        else:
            raise ConfigError(
                f"checkpoint key '{key}' has no counterpart in a {fam.name} RecursiveLM; "
                f"{fam.loader} takes the state dict of transformers' {fam.model_class}."
            )
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"checkpoint key '{key}' is a {type(value).__name__}, not a tensor.")
        if tuple(value.shape) != slot.shape:
            raise ConfigError(
                f"checkpoint key '{key}' has shape {tuple(value.shape)} but the model expects "
                f"{slot.shape}; build the model with {fam.config_fn}(hf_config)."
            )
        if slot.fix is not None:
            value = slot.fix(value)
        if slot.key in plan:  # tied: the embedding and the head are one tensor; both copies must agree
            other_key, _, other = plan[slot.key]
            if not torch.equal(other, value.to(device=other.device, dtype=other.dtype)):
                raise ConfigError(
                    f"model.tie_embeddings is True but checkpoint keys '{other_key}' and '{key}' differ; "
                    f"set tie_embeddings False ({fam.config_fn} reads tie_word_embeddings)."
                )
            continue
        plan[slot.key] = (key, slot, value)

    missing = [k for k, slot in targets.items() if slot.key not in plan]
    if head.key not in plan:
        missing.append(fam.head_name)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(
            f"the checkpoint lacks '{missing[0]}'{more}; pass the full state dict of {fam.model_class} "
            "(its LM head included)."
        )
    filled = {id(slot.param) for _, slot, _ in plan.values()}
    unfilled = [n for n, p in model.named_parameters() if id(p) not in filled]
    if unfilled:  # pragma: no cover - guarded by _check_model; kept so a new parameter can't slip through
        raise ConfigError(f"{fam.loader} would leave model parameter '{unfilled[0]}' unfilled.")
    # everything checked: only now touch the model, so a failed load leaves it unchanged
    for _, slot, value in plan.values():
        slot.target().copy_(value)


@torch.no_grad()
def load_gpt_neox_state_dict(model: RecursiveLM, hf_state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy a ``GPTNeoXForCausalLM`` state dict into a vanilla ``model`` in place (strict).

    Raises ``ConfigError`` naming the first offending key when the checkpoint has a key without a
    counterpart, lacks a key the model needs, or holds a tensor of the wrong shape; the model is
    left unchanged then (everything is checked before the first copy).
    """
    wanted = {"scale_embeddings": False, "mlp": "gelu", "norm": "layernorm", "bias": True}
    extra = []
    if isinstance(model, RecursiveLM) and model.cfg.kv_heads != model.cfg.n_heads:
        extra.append(
            f"model.n_kv_heads {model.cfg.kv_heads} != n_heads {model.cfg.n_heads}; "
            "GPT-NeoX has no grouped-query attention"
        )
    _check_model(model, _GPT_NEOX, wanted, extra)
    _load(model, hf_state_dict, _GPT_NEOX, _gpt_neox_targets(model))


@torch.no_grad()
def load_llama_state_dict(model: RecursiveLM, hf_state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy a ``LlamaForCausalLM`` state dict into a vanilla ``model`` in place (strict).

    ``q_proj``/``k_proj``/``v_proj`` fill the row blocks of our fused ``attn.qkv``, ``gate_proj``/
    ``up_proj`` those of ``mlp.up``. With tied embeddings ``lm_head.weight`` may be absent (as
    ``save_pretrained`` writes it) or must equal ``model.embed_tokens.weight``. Raises ``ConfigError``
    naming the first offending key, leaving the model unchanged, as ``load_gpt_neox_state_dict``.
    """
    wanted = {
        "scale_embeddings": False,
        "mlp": "swiglu",
        "norm": "rmsnorm",
        "bias": False,
        "parallel_residual": False,
        "rotary_pct": 1.0,
    }
    _check_model(model, _LLAMA, wanted, [])
    _load(model, hf_state_dict, _LLAMA, _llama_targets(model))


def _from_pretrained(
    fam: _Family,
    config_fn: Callable[[Any], ModelConfig],
    loader: Callable[[RecursiveLM, Mapping[str, torch.Tensor]], None],
    name_or_path: str,
    kwargs: dict[str, Any],
) -> RecursiveLM:
    import transformers  # heavy

    if "dtype" not in kwargs and "torch_dtype" not in kwargs:
        # transformers >= 5 loads the checkpoint's dtype by default (float16 for Pythia); keep float32
        key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        kwargs[key] = torch.float32
    hf = getattr(transformers, fam.model_class).from_pretrained(name_or_path, **kwargs)
    cfg = config_fn(hf.config)
    dtype = next(hf.parameters()).dtype
    model = RecursiveLM(cfg)
    loader(model, hf.state_dict())
    del hf
    return model.to(dtype).eval()


def from_pretrained_gpt_neox(name_or_path: str, **kwargs: Any) -> RecursiveLM:
    """A ``RecursiveLM`` holding a GPT-NeoX checkpoint (e.g. ``EleutherAI/pythia-160m`` or a local
    directory), loaded with ``transformers.GPTNeoXForCausalLM.from_pretrained(name_or_path, **kwargs)``.

    Needs network access for hub names (or a populated HF cache). Returns the model in eval mode
    with float32 weights unless ``dtype``/``torch_dtype`` is passed.
    """
    return _from_pretrained(_GPT_NEOX, config_from_gpt_neox, load_gpt_neox_state_dict, name_or_path, kwargs)


def from_pretrained_llama(name_or_path: str, **kwargs: Any) -> RecursiveLM:
    """A ``RecursiveLM`` holding a LLaMA checkpoint (a hub name or a local directory, e.g. one written
    by ``LlamaForCausalLM.save_pretrained``), loaded with
    ``transformers.LlamaForCausalLM.from_pretrained(name_or_path, **kwargs)``.

    Needs network access for hub names (or a populated HF cache). Returns the model in eval mode
    with float32 weights unless ``dtype``/``torch_dtype`` is passed.
    """
    return _from_pretrained(_LLAMA, config_from_llama, load_llama_state_dict, name_or_path, kwargs)


__all__ = [
    "config_from_gpt_neox",
    "config_from_llama",
    "from_pretrained_gpt_neox",
    "from_pretrained_llama",
    "load_gpt_neox_state_dict",
    "load_llama_state_dict",
]
