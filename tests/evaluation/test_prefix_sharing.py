"""Prefix sharing: continuations of one context packed in one row score exactly as when run alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recursive_lightning.evaluation.perplexity import score_sequences
from recursive_lightning.evaluation.prefix_sharing import pack, plan_trees, score_trees
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.recursive.model import RecursiveLM

VOCAB = 61
ARCHS = {
    "vanilla-sequential-rmsnorm": {"layout": "2", "parallel_residual": False, "norm": "rmsnorm"},
    "looped-mesh": {"layout": "1+2R2+1", "topology": "mesh"},
    "looped-static-gqa": {"layout": "1+1R3+1", "topology": "static", "n_kv_heads": 2},
    "unshared-anchor-partial-rotary": {"layout": "1+1+1+1", "topology": "anchor", "rotary_pct": 0.5},
}


def _model(arch: dict) -> RecursiveLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, d_model=32, n_heads=4, max_seq_len=64, **arch)
    return RecursiveLM(cfg).eval()


MODELS = {name: _model(arch) for name, arch in ARCHS.items()}
tokens = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
items = st.lists(  # (context, [continuations]) items, like multiple-choice questions
    st.tuples(tokens, st.lists(tokens, min_size=1, max_size=5)), min_size=1, max_size=6
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(items=items, arch=st.sampled_from(sorted(ARCHS)), max_branches=st.integers(2, 7))
def test_packed_branches_score_like_separate_sequences(items, arch, max_branches):
    model = MODELS[arch]
    requests = [(ctx, cont) for ctx, conts in items for cont in conts]
    trees, alone = plan_trees(requests, max_branches, max_tokens=64)
    packed = score_trees(model, trees, max_requests=max_branches)
    assert sorted([*packed, *alone]) == list(range(len(requests)))  # every request scored exactly once
    assert all(2 <= len(t.branches) <= max_branches and len(t) <= 64 for t in trees)
    ref = score_sequences(model, [(ctx + cont, len(cont)) for ctx, cont in requests], batch_size=1)
    for i, s in packed.items():
        assert s.tokens == len(requests[i][1])
        assert s.logprob == pytest.approx(ref[i].logprob, abs=2e-4, rel=1e-5)
        assert s.greedy == ref[i].greedy


def test_branches_see_the_trunk_and_their_own_prefix_only():
    (tree,), _ = plan_trees([([5, 6, 7], [1, 2, 3]), ([5, 6, 7], [4, 8])], 4, 64)
    p = pack([tree])
    # row: 5 6 7 | 1 2 | 4  (a continuation's last token is only a target)
    assert p["x"][0].tolist() == [5, 6, 7, 1, 2, 4]
    assert p["pos"][0].tolist() == [0, 1, 2, 3, 4, 3]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 0],
            [1, 1, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(p["mask"][0], expected)
    rows_b, rows_p, targets = p["rows"]
    assert list(zip(rows_p, targets)) == [(2, 1), (3, 2), (4, 3), (2, 4), (5, 8)]


def test_multiresolution_models_refuse_packed_inputs():
    model = _model({"layout": "1+2x{1/2,1}+1", "topology": "mesh"})
    assert not model.packable and MODELS["looped-mesh"].packable
    x = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="full-resolution"):
        model.hidden(x, positions=torch.arange(4)[None], mask=torch.ones(1, 4, 4, dtype=torch.bool))
