"""GPT-NeoX (Pythia) -> RecursiveLM conversion: logits match transformers, mismatches are ConfigErrors.

Everything is built offline from small random configs; nothing is downloaded.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM  # noqa: E402

from recursive_lightning.errors import ConfigError  # noqa: E402
from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.model.convert import (  # noqa: E402
    config_from_gpt_neox,
    from_pretrained_gpt_neox,
    load_gpt_neox_state_dict,
)
from recursive_lightning.model.model import RecursiveLM  # noqa: E402

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
