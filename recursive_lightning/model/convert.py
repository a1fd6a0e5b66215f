"""Load Hugging Face GPT-NeoX (Pythia) weights into a vanilla ``RecursiveLM``.

    cfg   = config_from_gpt_neox(hf_model.config)      # vanilla layout, scale_embeddings=False
    model = RecursiveLM(cfg)
    load_gpt_neox_state_dict(model, hf_model.state_dict())

or, with network access, ``from_pretrained_gpt_neox("EleutherAI/pythia-160m")``.

Key mapping (HF -> ours):

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

Loading is strict: every key of the checkpoint must be consumed (apart from the non-parameter
attention-mask buffers old checkpoints carry; a stored ``rotary_emb.inv_freq`` is checked against
the model's rotary settings), every parameter of the model must be filled, and every shape must
match. Any mismatch raises one ``ConfigError`` naming the key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from recursive_lightning.errors import ConfigError
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.model import RecursiveLM

# buffers (not parameters) some GPT-NeoX checkpoints carry; HF itself ignores them on load
_IGNORED = re.compile(r"^gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias)$")
_INV_FREQ = re.compile(r"^gpt_neox\.(layers\.\d+\.attention\.)?rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^gpt_neox\.layers\.(\d+)\.")
_HEAD_KEYS = ("embed_out.weight", "lm_head.weight")

# HF GPT-NeoX layer sub-module -> our Block sub-module
_LAYER_MAP = {
    "input_layernorm": "norm1",
    "post_attention_layernorm": "norm2",
    "attention.query_key_value": "attn.qkv",
    "attention.dense": "attn.proj",
    "mlp.dense_h_to_4h": "mlp.up",
    "mlp.dense_4h_to_h": "mlp.down",
}


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _rope(hf_config: Any) -> tuple[float, float]:
    """(rotary_pct, rotary base) from either the transformers >= 5 ``rope_parameters`` dict or the
    older ``rotary_pct`` / ``rotary_emb_base`` / ``rope_scaling`` fields (config.json on the hub)."""
    params = _get(hf_config, "rope_parameters") or {}
    scaling = _get(hf_config, "rope_scaling") or {}
    if not isinstance(params, Mapping) or not isinstance(scaling, Mapping):
        raise ConfigError("GPT-NeoX config: rope_parameters / rope_scaling must be a dict or empty.")
    for source in (params, scaling):
        kind = source.get("rope_type", source.get("type", "default"))
        if kind not in (None, "default"):
            raise ConfigError(
                f"GPT-NeoX config: rope type '{kind}' is not supported; only plain (default) rotary "
                "embeddings convert to recursive_lightning."
            )
    pct = params.get("partial_rotary_factor", _get(hf_config, "rotary_pct", 0.25))
    base = params.get("rope_theta", _get(hf_config, "rotary_emb_base", 10000.0))
    return float(pct), float(base)


def config_from_gpt_neox(hf_config: Any) -> ModelConfig:
    """The vanilla ``ModelConfig`` of a ``transformers.GPTNeoXConfig`` (or its config.json dict).

    Layout = ``num_hidden_layers`` distinct layers, topology base, ``scale_embeddings=False``
    (Pythia does not scale its embeddings), GELU MLP of ``intermediate_size``, LayerNorm with biases.
    """
    model_type = _get(hf_config, "model_type")
    if model_type not in (None, "gpt_neox"):
        raise ConfigError(f"config_from_gpt_neox needs a GPT-NeoX config, not model_type '{model_type}'.")
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
    missing = [k for k in required if _get(hf_config, k) is None]
    if missing:
        raise ConfigError(f"GPT-NeoX config lacks {', '.join(missing)}; pass a transformers GPTNeoXConfig.")
    act = _get(hf_config, "hidden_act", "gelu")
    if act != "gelu":
        raise ConfigError(
            f"GPT-NeoX config: hidden_act '{act}' is not supported; recursive_lightning's MLP uses the exact "
            "(erf) GELU, which is HF's 'gelu'."
        )
    if _get(hf_config, "attention_bias", True) is False:
        raise ConfigError(
            "GPT-NeoX config: attention_bias=False is not supported; recursive_lightning keeps biases on every "
            "linear layer (model.bias), as stock Pythia does."
        )
    head_dim = _get(hf_config, "head_dim")
    d, heads = int(_get(hf_config, "hidden_size")), int(_get(hf_config, "num_attention_heads"))
    if head_dim is not None and heads * int(head_dim) != d:
        raise ConfigError(
            f"GPT-NeoX config: head_dim {head_dim} x {heads} heads != hidden_size {d}; "
            "recursive_lightning needs head_dim = hidden_size / heads."
        )
    pct, base = _rope(hf_config)
    intermediate = _get(hf_config, "intermediate_size")
    n_layers = int(_get(hf_config, "num_hidden_layers"))
    cfg = ModelConfig(
        preset=None,
        layout=str(n_layers),
        vocab_size=int(_get(hf_config, "vocab_size")),
        d_model=d,
        n_heads=heads,
        n_kv_heads=None,
        mlp="gelu",
        mlp_hidden=None if intermediate in (None, 4 * d) else int(intermediate),
        norm="layernorm",
        norm_eps=float(_get(hf_config, "layer_norm_eps", 1e-5)),
        bias=True,
        parallel_residual=bool(_get(hf_config, "use_parallel_residual", True)),
        rotary_pct=pct,
        rotary_base=base,
        max_seq_len=int(_get(hf_config, "max_position_embeddings", 2048)),
        tie_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
        scale_embeddings=False,
        init_std=float(_get(hf_config, "initializer_range", 0.02)),
        topology="base",
        n_layers_hint=n_layers,
    )
    return cfg.validate()


def _check_model(model: RecursiveLM) -> None:
    cfg = model.cfg
    problems = []
    if model.layout.kind != "vanilla":
        problems.append(
            f"model.layout '{cfg.layout}' is {model.layout.kind}; GPT-NeoX weights need a vanilla layout"
        )
    if cfg.scale_embeddings:
        problems.append("model.scale_embeddings is True; Pythia embeddings are unscaled (set it to False)")
    if cfg.mlp != "gelu":
        problems.append(f"model.mlp is '{cfg.mlp}', GPT-NeoX uses gelu")
    if cfg.norm != "layernorm":
        problems.append(f"model.norm is '{cfg.norm}', GPT-NeoX uses layernorm")
    if not cfg.bias:
        problems.append("model.bias is False, GPT-NeoX linear layers and LayerNorms have biases")
    if cfg.kv_heads != cfg.n_heads:
        problems.append(
            f"model.n_kv_heads {cfg.kv_heads} != n_heads {cfg.n_heads}; GPT-NeoX has no grouped-query attention"
        )
    if problems:
        raise ConfigError(
            "load_gpt_neox_state_dict: "
            + "; ".join(problems)
            + ". Build the model with config_from_gpt_neox(hf_config)."
        )


def _qkv_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rows (heads, 3, head_dim) -> ours (3, heads, head_dim); works for weight and bias."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def _targets(model: RecursiveLM) -> dict[str, tuple[torch.nn.Parameter, bool]]:
    """HF key -> (our parameter, is_qkv)."""
    out: dict[str, tuple[torch.nn.Parameter, bool]] = {
        "gpt_neox.embed_in.weight": (model.embed.weight, False)
    }
    for i, block in enumerate(model.prelude.layers):
        for hf_name, ours in _LAYER_MAP.items():
            module = block.get_submodule(ours)
            for pname, param in module.named_parameters(recurse=False):
                out[f"gpt_neox.layers.{i}.{hf_name}.{pname}"] = (param, ours == "attn.qkv")
    for pname, param in model.norm.named_parameters(recurse=False):
        out[f"gpt_neox.final_layer_norm.{pname}"] = (param, False)
    return out


def _check_inv_freq(model: RecursiveLM, key: str, value: torch.Tensor) -> None:
    rot = model.prelude.rotary
    expected = 1.0 / (rot.base ** (torch.arange(0, rot.dim, 2, dtype=torch.float32) / max(rot.dim, 1)))
    value = value.detach().float().cpu()
    if value.shape != expected.shape or not torch.allclose(value, expected, rtol=1e-4, atol=0.0):
        raise ConfigError(
            f"checkpoint key '{key}' holds rotary frequencies of {value.numel() * 2} dims that do not match "
            f"model.rotary_pct {model.cfg.rotary_pct} / rotary_base {model.cfg.rotary_base} "
            f"({expected.numel() * 2} dims); build the model with config_from_gpt_neox(hf_config)."
        )


@torch.no_grad()
def load_gpt_neox_state_dict(model: RecursiveLM, hf_state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy a ``GPTNeoXForCausalLM`` state dict into a vanilla ``model`` in place (strict).

    Raises ``ConfigError`` naming the first offending key when the checkpoint has a key without a
    counterpart, lacks a key the model needs, or holds a tensor of the wrong shape; the model is
    left unchanged then (everything is checked before the first copy).
    """
    if not isinstance(model, RecursiveLM):
        raise ConfigError(f"load_gpt_neox_state_dict needs a RecursiveLM, not {type(model).__name__}.")
    _check_model(model)
    targets = _targets(model)
    hf_layers = {int(m.group(1)) for k in hf_state_dict if (m := _LAYER.match(k))}
    n_model = len(model.prelude.layers)
    if hf_layers and max(hf_layers) + 1 != n_model:
        raise ConfigError(
            f"the checkpoint has {max(hf_layers) + 1} GPT-NeoX layers but the model has {n_model} "
            f"(model.layout '{model.cfg.layout}'); build the model with config_from_gpt_neox(hf_config)."
        )

    heads = model.cfg.n_heads
    plan: dict[int, tuple[str, torch.nn.Parameter, torch.Tensor]] = {}  # id(param) -> (key, param, value)
    head_key = None
    for key, value in hf_state_dict.items():
        if _IGNORED.match(key):
            continue
        if _INV_FREQ.match(key):
            _check_inv_freq(model, key, value)
            continue
        if key in _HEAD_KEYS:
            if head_key is not None:
                if not torch.equal(hf_state_dict[head_key], value):
                    raise ConfigError(
                        f"the checkpoint holds both '{head_key}' and '{key}' with different values."
                    )
                continue
            head_key = key
            param, is_qkv = model.head.weight, False
        elif key in targets:
            param, is_qkv = targets[key]
        else:
            raise ConfigError(
                f"checkpoint key '{key}' has no counterpart in a GPT-NeoX RecursiveLM; "
                "load_gpt_neox_state_dict takes the state dict of transformers' GPTNeoXForCausalLM."
            )
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"checkpoint key '{key}' is a {type(value).__name__}, not a tensor.")
        if tuple(value.shape) != tuple(param.shape):
            raise ConfigError(
                f"checkpoint key '{key}' has shape {tuple(value.shape)} but the model expects "
                f"{tuple(param.shape)}; build the model with config_from_gpt_neox(hf_config)."
            )
        if is_qkv:
            value = _qkv_rows(value, heads)
        if id(param) in plan:  # tied: embed_in and the head are one tensor; both copies must agree
            other_key, _, other = plan[id(param)]
            if not torch.equal(other, value.to(device=other.device, dtype=other.dtype)):
                raise ConfigError(
                    f"model.tie_embeddings is True but checkpoint keys '{other_key}' and '{key}' differ; "
                    "set tie_embeddings False (config_from_gpt_neox reads tie_word_embeddings)."
                )
            continue
        plan[id(param)] = (key, param, value)

    missing = [k for k, (p, _) in targets.items() if id(p) not in plan]
    if id(model.head.weight) not in plan:
        missing.append("embed_out.weight (or lm_head.weight)")
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(
            f"the checkpoint lacks '{missing[0]}'{more}; pass the full state dict of GPTNeoXForCausalLM "
            "(its LM head included)."
        )
    unfilled = [n for n, p in model.named_parameters() if id(p) not in plan]
    if unfilled:  # pragma: no cover - guarded by _check_model; kept so a new parameter can't slip through
        raise ConfigError(f"load_gpt_neox_state_dict would leave model parameter '{unfilled[0]}' unfilled.")
    # everything checked: only now touch the model, so a failed load leaves it unchanged
    for _, param, value in plan.values():
        param.copy_(value)


def from_pretrained_gpt_neox(name_or_path: str, **kwargs: Any) -> RecursiveLM:
    """A ``RecursiveLM`` holding a GPT-NeoX checkpoint (e.g. ``EleutherAI/pythia-160m`` or a local
    directory), loaded with ``transformers.GPTNeoXForCausalLM.from_pretrained(name_or_path, **kwargs)``.

    Needs network access for hub names (or a populated HF cache). Returns the model in eval mode
    with float32 weights unless ``dtype``/``torch_dtype`` is passed.
    """
    import transformers
    from transformers import GPTNeoXForCausalLM

    if "dtype" not in kwargs and "torch_dtype" not in kwargs:
        # transformers >= 5 loads the checkpoint's dtype by default (float16 for Pythia); keep float32
        key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        kwargs[key] = torch.float32
    hf = GPTNeoXForCausalLM.from_pretrained(name_or_path, **kwargs)
    cfg = config_from_gpt_neox(hf.config)
    dtype = next(hf.parameters()).dtype
    model = RecursiveLM(cfg)
    load_gpt_neox_state_dict(model, hf.state_dict())
    del hf
    return model.to(dtype).eval()


__all__ = ["config_from_gpt_neox", "from_pretrained_gpt_neox", "load_gpt_neox_state_dict"]
