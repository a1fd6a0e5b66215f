"""Per-token adaptive exit at decode (model/recursive/adaptive_exit.py): threshold 0 is ordinary cached decoding
at that depth, token for token; an infinite threshold exits every generated token after one loop step and then
equals a reference that recomputes the whole sequence with each position's keys and values taken at its exit
step; the skipped steps' caches stay aligned; a bad request gets one sentence."""

from __future__ import annotations

import pytest
import torch

from recursive_lightning.errors import UserError
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.decoding import decode
from recursive_lightning.model.depth import at_depth
from recursive_lightning.model.recursive.adaptive_exit import ExitStats, decode_adaptive, hidden_adaptive
from recursive_lightning.model.recursive.model import RecursiveLM

TINY = dict(vocab_size=61, d_model=32, n_heads=4, max_seq_len=64)


def _model(topology: str = "anchor", layout: str = "1+2R3+1") -> RecursiveLM:
    torch.manual_seed(0)
    model = (
        RecursiveLM(ModelConfig.from_dict({**TINY, "layout": layout, "topology": topology})).double().eval()
    )
    with torch.no_grad():
        for p in model.topology.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


PROMPT = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("topology", ["base", "anchor", "mesh", "dynamic"])
@pytest.mark.parametrize("loops", [None, 5])
def test_threshold_zero_is_ordinary_decoding(topology, loops):
    model = _model(topology)
    with at_depth(model, loops):
        stats = ExitStats()
        adaptive = torch.stack(list(decode_adaptive(model, PROMPT, 12, 0.0, stats)), 1)
        ordinary = torch.stack(list(decode(model, PROMPT, 12)), 1)
    assert torch.equal(adaptive, ordinary)
    assert stats.mean_loops == (loops or 3) and len(stats.loops) == 2 * 11


@pytest.mark.parametrize("topology", ["anchor", "mesh"])
def test_exit_after_one_step_equals_the_reference_with_shared_keys_and_values(topology):
    """threshold inf: every generated position exits at the first check, after two loop steps (the criterion
    compares two successive steps; the prompt runs at full depth). Reference: per loop step t, the keys/values of
    a position come from step min(t, exit step); computed by hand from the caches of an ordinary prefill, then
    one position at a time at depth 2 into the step-0 and step-1 caches, the latter copied to step 2."""
    model = _model(topology)
    cache = model.new_cache()
    model.hidden(PROMPT, cache=cache)
    tokens = torch.randint(0, 61, (2, 4), generator=torch.Generator().manual_seed(3))
    got = [hidden_adaptive(model, tokens[:, i : i + 1], cache, float("inf")) for i in range(4)]
    assert all(bool((used == 2).all()) for _, used in got)
    lengths = {name: [layer.length for layer in site] for name, site in cache.kv.items()}
    assert all(n == PROMPT.shape[1] + 4 for site in lengths.values() for n in site)

    ref = model.new_cache()
    model.hidden(PROMPT, cache=ref)
    for i in range(4):
        with at_depth(model, 2):  # two loop steps at the step-0 and step-1 caches, the coda after them
            shallow = model.new_cache()
            shallow.kv = {k: ref.kv[k] for k in ("prelude", "step0", "step1", "coda")}
            shallow.length = ref.length
            logits = model.head(model.hidden(tokens[:, i : i + 1], cache=shallow)[:, -1])
        for layer, exit_step in zip(ref.kv["step2"], ref.kv["step1"]):
            layer.extend(exit_step.k[:, :, -1:], exit_step.v[:, :, -1:])
        ref.length += 1
        torch.testing.assert_close(got[i][0], logits, atol=1e-12, rtol=0)
    for name in cache.kv:
        for a, b in zip(cache.kv[name], ref.kv[name]):
            torch.testing.assert_close(a.k, b.k, atol=1e-12, rtol=0)


def test_an_intermediate_threshold_saves_loops_and_reports_them():
    model = _model("anchor")
    with at_depth(model, 8):
        full, some = ExitStats(), ExitStats()
        list(decode_adaptive(model, PROMPT, 16, 0.0, full))
        list(decode_adaptive(model, PROMPT, 16, 1e-7, some))  # an untrained model: near-uniform, tiny KLs
    assert full.mean_loops == 8 and 2 < some.mean_loops < 8 and some.max_loops == 8


@pytest.mark.parametrize(
    "layout, threshold, words",
    [
        ("1+2x{1/2,1}+1", 1e-3, "full-resolution"),
        ("1+1+1+1", 1e-3, "full-resolution"),
        ("1+2R3+1", -1.0, ">= 0"),
        ("1+2R3+1", "x", ">= 0"),
    ],
)
def test_a_bad_request_gets_one_sentence(layout, threshold, words):
    model = _model("base", layout)
    with pytest.raises(UserError, match=words) as err:
        next(decode_adaptive(model, PROMPT, 2, threshold, ExitStats()))
    assert "--exit-kl" in str(err.value)


@pytest.mark.parametrize("topology, threshold", [("anchor", 1e-7), ("mesh", 1e-6)])  # near-uniform: tiny KLs
def test_a_batch_decodes_as_its_rows_alone(topology, threshold):
    """Rows of a batch exit at their own steps: each row's logits, loop counts and caches are those it gets
    alone (teacher-forced tokens, so that every row sees the same positions)."""
    model = _model(topology)
    tokens = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(4))
    with at_depth(model, 8):
        caches = [model.new_cache() for _ in range(3)]
        model.hidden(PROMPT, cache=caches[0])
        for r in range(2):
            model.hidden(PROMPT[r : r + 1], cache=caches[r + 1])
        differ = False
        for i in range(10):
            logits, used = hidden_adaptive(model, tokens[:, i : i + 1], caches[0], threshold)
            differ |= bool(used[0] != used[1])
            for r in range(2):
                row_logits, row_used = hidden_adaptive(
                    model, tokens[r : r + 1, i : i + 1], caches[r + 1], threshold
                )
                torch.testing.assert_close(logits[r : r + 1], row_logits, atol=1e-12, rtol=0)
                assert used[r] == row_used[0]
    for name, site in caches[0].kv.items():
        for r in range(2):
            for a, b in zip(site, caches[r + 1].kv[name]):
                torch.testing.assert_close(a.k[r : r + 1], b.k, atol=1e-12, rtol=0)
                torch.testing.assert_close(a.v[r : r + 1], b.v, atol=1e-12, rtol=0)
    assert differ  # the rows did exit at different steps
