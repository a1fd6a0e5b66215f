"""Cached decoding (model/decoding.py, SpiralFormer Alg. 2): prefill + token-by-token states equal the full
forward at every position, for every family, schedule, offset, shift, scaling variant and topology."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.decoding import DecodeCache
from recursive_lightning.model.recursive.model import RecursiveLM

TOPOLOGIES = ["base", "anchor", "residual+anchor", "mesh", "dynamic"]


def _model(**kw) -> RecursiveLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=53, d_model=32, n_heads=4, max_seq_len=64, **kw)
    return RecursiveLM(cfg).double().eval()


@st.composite
def models(draw):
    kind = draw(st.sampled_from(["vanilla", "looped", "unshared", "multires"]))
    topology = draw(st.sampled_from(TOPOLOGIES))
    if kind == "vanilla":
        return _model(layout="2")
    if kind == "looped":
        return _model(layout=f"1+1R{draw(st.integers(1, 3))}+1", topology=topology)
    if kind == "unshared":
        return _model(layout="1+1+1+1", topology=topology)
    gs = draw(st.lists(st.sampled_from([1, 2, 3, 4, 8]), min_size=1, max_size=3))
    offsets = [draw(st.integers(0, g - 1)) for g in gs]
    shifts = [g - 1 + draw(st.integers(0, 2)) if g > 1 else 0 for g in gs]
    return _model(
        layout="1+1x{" + ",".join(f"1/{g}" for g in gs) + "}+1",
        topology=topology,
        offset=offsets,
        shift=shifts,
        downscale=draw(st.sampled_from(["self_aggregation", "mean"])),
        upscale=draw(st.sampled_from(["allocation", "broadcast"])),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=models(), length=st.integers(1, 40), data=st.data())
def test_cached_states_equal_the_full_forward(model, length, data):
    idx = torch.randint(0, 53, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        full = model.hidden(idx)
        cache = DecodeCache.empty(model)
        parts, at = [], 0
        while at < length:  # a prefill of any length, then pieces of 1-3 tokens
            n = data.draw(st.integers(1, length - at)) if at == 0 else data.draw(st.integers(1, 3))
            parts.append(model.hidden(idx[:, at : at + n], cache=cache))
            at += n
    assert cache.length == length
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "arch",
    [
        {"layout": "1+2R2+1", "topology": "mesh"},
        {"layout": "1+1x{1/8,1/4,1/2,1}+1", "topology": "mesh"},
        {"layout": "1+1x{1/4,1/2}+1", "topology": "anchor", "shift": "parallel", "offset": "zero"},
    ],
)
def test_generate_with_cache_equals_recomputation_past_the_window(arch):
    model = _model(**arch)
    idx = torch.randint(0, 53, (1, 50), generator=torch.Generator().manual_seed(1))
    cached = model.generate(idx, 30)  # runs past max_seq_len = 64: the window slides
    recomputed = model.generate(idx, 30, use_cache=False)
    assert cached.shape == (1, 80)
    assert torch.equal(cached, recomputed)


def test_sampling_with_cache_equals_recomputation_and_top1_is_greedy():
    model = _model(layout="1+1x{1/4,1/2,1}+1", topology="mesh")
    idx = torch.randint(0, 53, (3, 20), generator=torch.Generator().manual_seed(2))
    runs = [
        model.generate(
            idx, 25, use_cache=c, temperature=1.5, top_k=20, generator=torch.Generator().manual_seed(7)
        )
        for c in (True, False)
    ]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], model.generate(idx, 25))  # sampling does differ from greedy here
    top1 = model.generate(idx, 25, temperature=2.0, top_k=1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(top1, model.generate(idx, 25))


def test_noncausal_shift_is_not_cached():
    model = _model(layout="1+1x{1/4}+1", shift=[1], allow_noncausal=True)
    assert not model.cacheable
    with pytest.raises(ValueError, match="Prop. 1"):
        model.hidden(torch.zeros(1, 4, dtype=torch.long), cache=DecodeCache.empty(model))


@pytest.mark.parametrize("family", ["multires", "mela"])
def test_generate_command_prints_the_greedy_continuation(family, tmp_path, capsys):
    from pydoc_data.topics import topics

    from recursive_lightning.cli import main
    from recursive_lightning.config import RunConfig
    from recursive_lightning.data.tokenizer import train_bpe
    from recursive_lightning.model.build import build_model
    from recursive_lightning.training.checkpoint import save_model_checkpoint
    from tests.evaluation.test_evaluation import FAMILIES

    tok = train_bpe([topics[k] for k in sorted(topics)[:5]], 300)
    arch = {"layout": "1+1x{1/4,1}+1"} if family == "multires" else FAMILIES["mela"]
    run = RunConfig.from_dict(
        {"name": "gen", "model": {"vocab_size": 300, "d_model": 32, "n_heads": 4, **arch}}
    )
    torch.manual_seed(0)
    model = build_model(run.model).eval()
    ckpt = save_model_checkpoint(tmp_path / "m.ckpt", model, run, tok)
    prompt = "The with statement"
    assert main(["generate", str(ckpt), "--prompt", prompt, "--max-new-tokens", "20"]) == 0
    out = capsys.readouterr()
    ids = tok.encode(prompt).ids
    # Mela: against its own cached decoding (equal to the full forward in float64, test_mela.py; float32 drifts)
    ref = model.generate(
        torch.tensor([ids]), 20, stop=[tok.token_to_id("<|endoftext|>")], use_cache=family == "mela"
    )
    new = [t for t in ref[0, len(ids) :].tolist() if t != tok.token_to_id("<|endoftext|>")]
    assert out.out.rstrip("\n") == prompt + tok.decode(new)
    assert "tokens/s" in out.err
    assert main(["generate", str(ckpt), "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err
    assert main(["generate", str(ckpt), "--temperature", "-1"]) == 2
    assert "--temperature" in capsys.readouterr().err
    sampled = [main(["generate", str(ckpt), "--temperature", "1", "--seed", "5"]) for _ in range(2)]
    first, second, _ = capsys.readouterr().out.split("\n")
    assert sampled == [0, 0] and first == second  # a seed gives the same sample
