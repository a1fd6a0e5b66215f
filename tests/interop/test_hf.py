"""GPT-NeoX (Pythia) and LLaMA -> RecursiveLM conversion: parameter counts and logits match
transformers, mismatches are ConfigErrors.

Everything is built offline from small random configs; nothing is downloaded.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from recursive_lightning.errors import ConfigError  # noqa: E402
from recursive_lightning.interop.hf import (  # noqa: E402
    config_from_gpt_neox,
    config_from_llama,
    from_pretrained_gpt_neox,
    from_pretrained_llama,
    load_gpt_neox_state_dict,
    load_llama_state_dict,
)
from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.model.recursive.model import RecursiveLM  # noqa: E402

VOCAB = 97
_DTYPE_KW = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"


def _hf_config(**overrides) -> GPTNeoXConfig:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=256,
        rotary_pct=0.25,
        max_position_embeddings=128,
        use_parallel_residual=True,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return GPTNeoXConfig(**kw)


def _hf_model(hf_config: GPTNeoXConfig, seed: int = 0) -> GPTNeoXForCausalLM:
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(hf_config).float().eval()
    with torch.no_grad():  # larger than the 0.02 init so that every weight visibly matters
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _convert(hf: GPTNeoXForCausalLM) -> RecursiveLM:
    model = RecursiveLM(config_from_gpt_neox(hf.config)).eval()
    load_gpt_neox_state_dict(model, hf.state_dict())
    return model


def _assert_same_logits(hf: GPTNeoXForCausalLM, model: RecursiveLM, length: int = 48) -> None:
    idx = torch.randint(0, hf.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(idx).logits
        got = model(idx)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


CASES = {
    "parallel": {},
    "sequential": {"use_parallel_residual": False},
    "two-heads-odd-mlp-full-rotary": {
        "hidden_size": 48,
        "num_attention_heads": 2,
        "intermediate_size": 100,
        "rotary_pct": 1.0,
        "rotary_emb_base": 500,
        "layer_norm_eps": 1e-6,
    },
    "half-rotary-8-heads": {"num_attention_heads": 8, "rotary_pct": 0.5, "num_hidden_layers": 2},
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case: str) -> None:
    hf = _hf_model(_hf_config(**CASES[case]))
    model = _convert(hf)
    _assert_same_logits(hf, model)


def test_config_fields() -> None:
    hc = _hf_config(
        use_parallel_residual=False, intermediate_size=100, rotary_emb_base=500, layer_norm_eps=1e-6
    )
    cfg = config_from_gpt_neox(hc)
    assert cfg.layout == "3" and cfg.parsed_layout.kind == "vanilla" and cfg.topology == "base"
    assert (cfg.d_model, cfg.n_heads, cfg.vocab_size, cfg.max_seq_len) == (64, 4, VOCAB, 128)
    assert cfg.rotary_pct == 0.25 and cfg.rotary_base == 500 and cfg.norm_eps == 1e-6
    assert cfg.parallel_residual is False and cfg.mlp_hidden == 100 and cfg.hidden == 100
    assert cfg.scale_embeddings is False and cfg.tie_embeddings is False and cfg.mlp == "gelu"
    assert config_from_gpt_neox(_hf_config()).mlp_hidden is None  # 4 d stays the default


def test_config_from_hub_style_dict() -> None:
    """config.json of a hub checkpoint (pre-transformers-5 field names)."""
    data = {
        "model_type": "gpt_neox",
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
        "vocab_size": 50304,
        "max_position_embeddings": 2048,
        "rotary_pct": 0.25,
        "rotary_emb_base": 10000,
        "rope_scaling": None,
        "layer_norm_eps": 1e-5,
        "use_parallel_residual": True,
        "tie_word_embeddings": False,
        "hidden_act": "gelu",
    }
    cfg = config_from_gpt_neox(data)
    ref = preset("pythia-160m", scale_embeddings=False)
    for name in (
        "layout",
        "d_model",
        "n_heads",
        "vocab_size",
        "max_seq_len",
        "rotary_pct",
        "rotary_base",
        "hidden",
    ):
        assert getattr(cfg, name) == getattr(ref, name), name


def test_tied_embeddings() -> None:
    hf = _hf_model(_hf_config(tie_word_embeddings=True))
    assert hf.lm_head.weight is hf.gpt_neox.embed_in.weight
    model = _convert(hf)
    assert model.cfg.tie_embeddings and model.head.weight is model.embed.weight
    _assert_same_logits(hf, model)


def test_hub_key_names_and_legacy_buffers() -> None:
    """Hub checkpoints name the head ``embed_out`` and may carry mask buffers and inv_freq."""
    hf = _hf_model(_hf_config())
    sd = dict(hf.state_dict())
    sd["embed_out.weight"] = sd.pop("lm_head.weight")
    head_dim, rot = 16, 4
    for i in range(3):
        sd[f"gpt_neox.layers.{i}.attention.bias"] = torch.ones(1, 1, 128, 128, dtype=torch.bool).tril()
        sd[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
        sd[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = 1.0 / (
            10000 ** (torch.arange(0, rot, 2).float() / rot)
        )
    assert head_dim * 0.25 == rot
    model = RecursiveLM(config_from_gpt_neox(hf.config)).eval()
    load_gpt_neox_state_dict(model, sd)
    _assert_same_logits(hf, model)


def test_qkv_permutation_matters() -> None:
    """Guard against an identity mapping passing by accident: copying qkv rows unpermuted differs."""
    hf = _hf_model(_hf_config())
    model = _convert(hf)
    with torch.no_grad():
        for i, block in enumerate(model.prelude.layers):
            block.attn.qkv.weight.copy_(hf.gpt_neox.layers[i].attention.query_key_value.weight)
            block.attn.qkv.bias.copy_(hf.gpt_neox.layers[i].attention.query_key_value.bias)
    idx = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        assert (model(idx) - hf(idx).logits).abs().max() > 1e-2


def test_from_pretrained_local_directory(tmp_path) -> None:
    hf = _hf_model(_hf_config())
    hf.save_pretrained(tmp_path)
    model = from_pretrained_gpt_neox(str(tmp_path))
    assert not model.training
    _assert_same_logits(hf, model)


def test_from_pretrained_half_checkpoint_loads_float32(tmp_path) -> None:
    """Pythia's hub weights are float16; transformers >= 5 would keep that dtype unless told."""
    _hf_model(_hf_config()).half().save_pretrained(tmp_path)
    model = from_pretrained_gpt_neox(str(tmp_path))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    ref = GPTNeoXForCausalLM.from_pretrained(str(tmp_path), **{_DTYPE_KW: torch.float32}).eval()
    _assert_same_logits(ref, model)


# ---------------------------------------------------------------------------------- mismatches


@pytest.fixture(scope="module")
def hf_small() -> GPTNeoXForCausalLM:
    return _hf_model(_hf_config())


def _fresh(hf: GPTNeoXForCausalLM) -> RecursiveLM:
    return RecursiveLM(config_from_gpt_neox(hf.config))


def test_missing_key(hf_small) -> None:
    sd = dict(hf_small.state_dict())
    del sd["gpt_neox.layers.1.mlp.dense_4h_to_h.bias"]
    with pytest.raises(ConfigError, match=r"lacks 'gpt_neox\.layers\.1\.mlp\.dense_4h_to_h\.bias'"):
        load_gpt_neox_state_dict(_fresh(hf_small), sd)


def test_missing_head(hf_small) -> None:
    sd = dict(hf_small.state_dict())
    del sd["lm_head.weight"]
    with pytest.raises(ConfigError, match="embed_out"):
        load_gpt_neox_state_dict(_fresh(hf_small), sd)


def test_unexpected_key(hf_small) -> None:
    sd = dict(hf_small.state_dict())
    sd["gpt_neox.layers.0.attention.extra.weight"] = torch.zeros(3)
    with pytest.raises(
        ConfigError, match=r"'gpt_neox\.layers\.0\.attention\.extra\.weight' has no counterpart"
    ):
        load_gpt_neox_state_dict(_fresh(hf_small), sd)


def test_wrong_shape(hf_small) -> None:
    sd = dict(hf_small.state_dict())
    sd["gpt_neox.embed_in.weight"] = torch.zeros(VOCAB + 1, 64)
    with pytest.raises(ConfigError, match=r"embed_in\.weight' has shape \(98, 64\).*\(97, 64\)"):
        load_gpt_neox_state_dict(_fresh(hf_small), sd)


def test_layer_count_mismatch(hf_small) -> None:
    model = RecursiveLM(
        preset("cpu-tiny", layout="2", d_model=64, n_heads=4, vocab_size=VOCAB, scale_embeddings=False)
    )
    with pytest.raises(ConfigError, match="3 GPT-NeoX layers but the model has 2"):
        load_gpt_neox_state_dict(model, hf_small.state_dict())


def test_wrong_model_settings(hf_small) -> None:
    base = config_from_gpt_neox(hf_small.config).to_dict()
    for change, pattern in [
        ({"scale_embeddings": True}, "scale_embeddings"),
        ({"layout": "1+1R2+1"}, "vanilla layout"),
        ({"norm": "rmsnorm"}, "layernorm"),
        ({"n_kv_heads": 2}, "n_kv_heads"),
    ]:
        model = RecursiveLM(type(config_from_gpt_neox(hf_small.config)).from_dict({**base, **change}))
        with pytest.raises(ConfigError, match=pattern):
            load_gpt_neox_state_dict(model, hf_small.state_dict())


def test_rotary_mismatch_detected_from_inv_freq(hf_small) -> None:
    sd = dict(hf_small.state_dict())
    sd["gpt_neox.rotary_emb.inv_freq"] = 1.0 / (
        10000 ** (torch.arange(0, 8, 2).float() / 8)
    )  # rotary_pct 0.5
    with pytest.raises(ConfigError, match="rotary"):
        load_gpt_neox_state_dict(_fresh(hf_small), sd)


def test_unsupported_configs() -> None:
    with pytest.raises(ConfigError, match="hidden_act"):
        config_from_gpt_neox(_hf_config(hidden_act="gelu_new"))
    with pytest.raises(ConfigError, match="rope type"):
        config_from_gpt_neox(_hf_config(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(ConfigError, match="model_type"):
        config_from_gpt_neox({"model_type": "llama", "hidden_size": 64})
    with pytest.raises(ConfigError, match="attention_bias"):
        config_from_gpt_neox(_hf_config(attention_bias=False))


def test_failed_load_leaves_model_unchanged(hf_small) -> None:
    model = _fresh(hf_small)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = dict(hf_small.state_dict())
    del sd["gpt_neox.final_layer_norm.bias"]  # found missing only after every other key was read
    with pytest.raises(ConfigError, match="final_layer_norm"):
        load_gpt_neox_state_dict(model, sd)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_tied_model_rejects_different_head() -> None:
    hf = _hf_model(_hf_config(tie_word_embeddings=True))
    sd = dict(hf.state_dict())
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0
    with pytest.raises(ConfigError, match="tie_embeddings"):
        load_gpt_neox_state_dict(_fresh(hf), sd)


# ---------------------------------------------------------------------------------- LLaMA (Transformer++)


def _llama_config(**overrides) -> LlamaConfig:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=100,
        max_position_embeddings=128,
        attn_implementation="sdpa",  # "eager" takes its softmax in float32 even for float64 inputs
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def _llama_model(hf_config: LlamaConfig, seed: int = 0) -> LlamaForCausalLM:
    """float64, random weights larger than the init (norm gains around 1) so that every weight matters."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    return model


def _llama_convert(hf: LlamaForCausalLM) -> RecursiveLM:
    model = RecursiveLM(config_from_llama(hf.config)).double().eval()
    load_llama_state_dict(model, hf.state_dict())
    return model


def _assert_same_llama_logits(
    hf: LlamaForCausalLM, model: RecursiveLM, length: int = 48, atol: float = 1e-5
) -> None:
    idx = torch.randint(0, hf.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(idx).logits
        got = model(idx)
    assert got.shape == want.shape and want.std() > 0.5  # logits large enough for 1e-5 to mean something
    # HF's RMSNorm computes in float32 even for float64 weights, hence 1e-5 and not float64 precision
    torch.testing.assert_close(got.to(want.dtype), want, atol=atol, rtol=0)


def _n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied tensors count once in both


def _one_sentence(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert msg.endswith(".") and ". " not in msg and "\n" not in msg, msg
    return msg


LLAMA_CASES = {
    "mha": {},
    "gqa-2-of-4": {"num_key_value_heads": 2},
    "mqa-tied": {"num_key_value_heads": 1, "tie_word_embeddings": True},
    "odd-mlp-theta-500-eps": {
        "hidden_size": 48,
        "num_attention_heads": 3,
        "intermediate_size": 77,
        "rope_theta": 500.0,
        "rms_norm_eps": 1e-5,
    },
    "8-heads-gqa-tied-theta-1e6": {
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 130,
        "rope_theta": 1e6,
        "tie_word_embeddings": True,
    },
}


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_params_and_logits_match_transformers(case: str) -> None:
    hf = _llama_model(_llama_config(**LLAMA_CASES[case]))
    model = _llama_convert(hf)
    assert _n_params(model) == _n_params(hf)
    assert model.cfg.tie_embeddings == hf.config.tie_word_embeddings
    _assert_same_llama_logits(hf, model)


def test_llama_logits_match_to_float64_precision(monkeypatch) -> None:
    """With HF's RMSNorm kept in float64 (it casts to float32 internally), the only float32 step
    left in either model is the rotary table (the same in both), so the logits agree to ~1e-14."""
    from transformers.models.llama import modeling_llama

    def rmsnorm64(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rmsnorm64)
    for case in ("gqa-2-of-4", "odd-mlp-theta-500-eps", "8-heads-gqa-tied-theta-1e6"):
        hf = _llama_model(_llama_config(**LLAMA_CASES[case]))
        _assert_same_llama_logits(hf, _llama_convert(hf), atol=1e-12)


def test_llama_config_fields() -> None:
    hc = _llama_config(num_key_value_heads=2, rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    cfg = config_from_llama(hc)
    assert cfg.layout == "3" and cfg.parsed_layout.kind == "vanilla" and cfg.topology == "base"
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, cfg.max_seq_len) == (
        64,
        4,
        2,
        VOCAB,
        128,
    )
    assert (cfg.mlp, cfg.mlp_hidden, cfg.hidden, cfg.norm, cfg.norm_eps) == (
        "swiglu",
        100,
        100,
        "rmsnorm",
        1e-5,
    )
    assert cfg.rotary_pct == 1.0 and cfg.rotary_base == 500.0
    assert cfg.bias is False and cfg.parallel_residual is False and cfg.scale_embeddings is False
    assert cfg.tie_embeddings is True
    assert config_from_llama(_llama_config()).n_kv_heads is None  # num_key_value_heads = heads: plain MHA
    assert config_from_llama(_llama_config(), max_seq_len=64).max_seq_len == 64  # overrides
    with pytest.raises(ConfigError, match="not a model field"):
        config_from_llama(_llama_config(), max_seq=64)


def test_llama_config_from_hub_style_dict() -> None:
    """config.json of a hub checkpoint (pre-transformers-5 field names; TinyLlama-1.1B's numbers)."""
    data = {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    cfg = config_from_llama(data)
    assert (cfg.layout, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.hidden) == ("22", 2048, 32, 4, 5632)
    assert (cfg.vocab_size, cfg.max_seq_len, cfg.norm_eps, cfg.rotary_base) == (32000, 2048, 1e-5, 10000.0)
    llama3 = {**data, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(ConfigError, match="rope_scaling rope type 'llama3'") as err:
        config_from_llama(llama3)
    _one_sentence(err)


def test_llama_rotary_is_hf_default_rope() -> None:
    """Our rotary (rotate-half, cat(freqs, freqs)) holds HF Llama's default inverse frequencies."""
    hf = _llama_model(_llama_config(rope_theta=500.0))
    model = _llama_convert(hf)
    rot = model.prelude.rotary
    ours = 1.0 / (rot.base ** (torch.arange(0, rot.dim, 2, dtype=torch.float32) / rot.dim))
    torch.testing.assert_close(ours, hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)
    # old checkpoints store inv_freq: a matching one is accepted, a different one refused
    sd = dict(hf.state_dict())
    sd["model.rotary_emb.inv_freq"] = hf.model.rotary_emb.inv_freq.clone()
    load_llama_state_dict(RecursiveLM(config_from_llama(hf.config)), sd)
    sd["model.rotary_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    with pytest.raises(ConfigError, match=r"'model\.rotary_emb\.inv_freq' holds rotary frequencies") as err:
        load_llama_state_dict(RecursiveLM(config_from_llama(hf.config)), sd)
    _one_sentence(err)


def test_llama_fused_rows_matter() -> None:
    """Guard against a symmetric mistake passing: swapping the gate and up blocks, or q and k, differs."""
    hf = _llama_model(_llama_config(num_key_value_heads=4))
    model = _llama_convert(hf)
    idx = torch.randint(0, VOCAB, (1, 16))
    for name, half in (("mlp.up", 100), ("attn.qkv", 64)):
        broken = _llama_convert(hf)
        with torch.no_grad():
            for block in broken.prelude.layers:
                w = block.get_submodule(name).weight
                w[: 2 * half].copy_(torch.cat([w[half : 2 * half], w[:half]]))
            assert (broken(idx) - model(idx)).abs().max() > 1e-2, name


@pytest.mark.parametrize("tied", [False, True])
def test_llama_from_pretrained_local_directory(tmp_path, tied: bool) -> None:
    """save_pretrained then from_pretrained_llama; a tied checkpoint is written without lm_head."""
    hf = _llama_model(_llama_config(num_key_value_heads=2, tie_word_embeddings=tied))
    hf.save_pretrained(tmp_path)
    model = from_pretrained_llama(str(tmp_path))
    assert not model.training and {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.cfg.tie_embeddings is tied and _n_params(model) == _n_params(hf)
    ref = LlamaForCausalLM.from_pretrained(str(tmp_path), **{_DTYPE_KW: torch.float32}).eval()
    _assert_same_llama_logits(ref, model)
    exact = from_pretrained_llama(str(tmp_path), **{_DTYPE_KW: torch.float64})
    assert {p.dtype for p in exact.parameters()} == {torch.float64}
    _assert_same_llama_logits(hf, exact)


def test_llama_tied_head_absent_equal_or_refused() -> None:
    hf = _llama_model(_llama_config(tie_word_embeddings=True))
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    sd = dict(hf.state_dict())
    assert "lm_head.weight" in sd  # equal to embed_tokens
    _assert_same_llama_logits(hf, _llama_convert(hf))
    model = RecursiveLM(config_from_llama(hf.config)).double().eval()
    load_llama_state_dict(model, {k: v for k, v in sd.items() if k != "lm_head.weight"})
    assert model.head.weight is model.embed.weight
    _assert_same_llama_logits(hf, model)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0
    with pytest.raises(ConfigError, match="tie_embeddings") as err:
        load_llama_state_dict(RecursiveLM(config_from_llama(hf.config)), sd)
    _one_sentence(err)


# LLaMA mismatches


@pytest.fixture(scope="module")
def llama_small() -> LlamaForCausalLM:
    return _llama_model(_llama_config(num_key_value_heads=2))


def _llama_fresh(hf: LlamaForCausalLM) -> RecursiveLM:
    return RecursiveLM(config_from_llama(hf.config))


@pytest.mark.parametrize(
    "key",
    ["model.layers.1.self_attn.k_proj.weight", "model.layers.2.mlp.gate_proj.weight", "model.norm.weight"],
)
def test_llama_missing_key(llama_small, key: str) -> None:
    sd = {k: v for k, v in llama_small.state_dict().items() if k != key}
    with pytest.raises(ConfigError, match=f"lacks '{re.escape(key)}'") as err:
        load_llama_state_dict(_llama_fresh(llama_small), sd)
    _one_sentence(err)


def test_llama_missing_head(llama_small) -> None:
    sd = {k: v for k, v in llama_small.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ConfigError, match=r"lacks 'lm_head\.weight'") as err:
        load_llama_state_dict(_llama_fresh(llama_small), sd)
    _one_sentence(err)


def test_llama_unexpected_key(llama_small) -> None:
    sd = dict(llama_small.state_dict())
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    with pytest.raises(
        ConfigError, match=r"'model\.layers\.0\.self_attn\.q_norm\.weight' has no counterpart"
    ) as err:
        load_llama_state_dict(_llama_fresh(llama_small), sd)
    _one_sentence(err)


@pytest.mark.parametrize(
    "key, shape",
    [
        ("model.layers.0.self_attn.k_proj.weight", (64, 64)),  # 4 kv heads where the model has 2
        ("model.layers.1.mlp.up_proj.weight", (128, 64)),
        ("model.embed_tokens.weight", (VOCAB + 1, 64)),
    ],
)
def test_llama_wrong_shape(llama_small, key: str, shape: tuple[int, int]) -> None:
    sd = dict(llama_small.state_dict())
    sd[key] = torch.zeros(shape, dtype=torch.float64)
    with pytest.raises(ConfigError, match=rf"'{re.escape(key)}' has shape {re.escape(str(shape))}") as err:
        load_llama_state_dict(_llama_fresh(llama_small), sd)
    _one_sentence(err)


def test_llama_layer_count_mismatch(llama_small) -> None:
    model = RecursiveLM(config_from_llama(llama_small.config, layout="2"))
    with pytest.raises(ConfigError, match="3 LLaMA layers but the model has 2") as err:
        load_llama_state_dict(model, llama_small.state_dict())
    _one_sentence(err)


def test_llama_wrong_model_settings(llama_small) -> None:
    for change, pattern in [
        ({"scale_embeddings": True}, "scale_embeddings"),
        ({"layout": "1+1R2+1"}, "vanilla layout"),
        ({"norm": "layernorm"}, "rmsnorm"),
        ({"mlp": "gelu"}, "swiglu"),
        ({"bias": True}, "model.bias"),
        ({"parallel_residual": True}, "parallel_residual"),
        ({"rotary_pct": 0.5}, "rotary_pct"),
    ]:
        model = RecursiveLM(config_from_llama(llama_small.config, **change))
        with pytest.raises(ConfigError, match=pattern) as err:
            load_llama_state_dict(model, llama_small.state_dict())
        _one_sentence(err)


def test_llama_unsupported_configs() -> None:
    for kwargs, pattern in [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters rope type 'linear'"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "rope type 'dynamic'",
        ),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 32}, "head_dim"),
    ]:
        with pytest.raises(ConfigError, match=pattern) as err:
            config_from_llama(_llama_config(**kwargs))
        _one_sentence(err)
    with pytest.raises(ConfigError, match="rope_scaling rope type 'linear'"):  # config.json spelling
        config_from_llama(
            {**_llama_config().to_dict(), "rope_parameters": None, "rope_scaling": {"type": "linear"}}
        )
    with pytest.raises(ConfigError, match="model_type"):
        config_from_llama(_hf_config())
    with pytest.raises(ConfigError, match="intermediate_size"):
        config_from_llama(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "vocab_size": 10,
            }
        )


def test_llama_failed_load_leaves_model_unchanged(llama_small) -> None:
    model = _llama_fresh(llama_small)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = {k: v for k, v in llama_small.state_dict().items() if k != "model.norm.weight"}
    with pytest.raises(ConfigError, match=r"model\.norm\.weight"):
        load_llama_state_dict(model, sd)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_llama_loader_refuses_gpt_neox_checkpoint(llama_small, hf_small) -> None:
    with pytest.raises(ConfigError, match="no counterpart in a LLaMA RecursiveLM"):
        load_llama_state_dict(_llama_fresh(llama_small), hf_small.state_dict())
