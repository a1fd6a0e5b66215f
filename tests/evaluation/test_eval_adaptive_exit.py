"""Adaptive exit in the ``eval`` command (evaluation/adaptive_exit.py): threshold 0 is the ordinary
perplexity of the same tokens (to float rounding), the reference is the ordinary perplexity bit for bit, a huge
threshold exits every decoded token after two loop steps and equals a reference computed here with
``hidden_adaptive``; ``--exit-max-tokens`` cuts the windows; MLflow gets ``eval/exit_kl_<thr>/...``; a bad
request is one sentence, exit 2, nothing on disk."""

from __future__ import annotations

# ruff: noqa: F811  (the ckpts, doc and tokenizer fixtures are imported, then named as arguments)
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_eval_refused

from recursive_lightning.cli import main
from recursive_lightning.evaluation.adaptive_exit import threshold_key
from recursive_lightning.evaluation.run import flat_metrics
from recursive_lightning.model.depth import at_depth
from recursive_lightning.model.recursive.adaptive_exit import hidden_adaptive
from recursive_lightning.training.checkpoint import load_checkpoint
from tests.evaluation.test_eval_depth import doc  # noqa: F401 (fixture)
from tests.evaluation.test_evaluation import MAX_LEN, ckpts, tokenizer  # noqa: F401 (fixtures)


def _by_hand(ckpt, text: str, depth: int, threshold: float) -> tuple[float, list[int]]:
    """NLL of ``[EOS] + text`` in the windows of the ordinary perplexity (``plan_windows``), one row at a time:
    each window's context prefilled (one token, but for the last window's full context), its last state
    predicting the first scored token, every later one from ``hidden_adaptive`` fed the true previous token;
    and the loop steps of those."""
    from recursive_lightning.evaluation.perplexity import plan_windows

    loaded = load_checkpoint(ckpt)
    model, tok = loaded.model.eval(), loaded.tokenizer
    seq = [tok.token_to_id("<|endoftext|>"), *tok.encode(text, add_special_tokens=False).ids]
    nll, loops = 0.0, []

    def lp(logits, target):
        return float(F.log_softmax(logits.float(), -1)[0, target])

    with torch.no_grad(), at_depth(model, depth):
        for w in plan_windows(len(seq), 1, MAX_LEN):
            cache = model.new_cache()
            h = model.hidden(torch.tensor([seq[w.begin : w.target]]), cache=cache)
            nll -= lp(model.head(h[:, -1]), seq[w.target])
            for j in range(w.target + 1, w.end):
                logits, used = hidden_adaptive(model, torch.tensor([[seq[j - 1]]]), cache, threshold)
                nll -= lp(logits, seq[j])
                loops.append(int(used))
    return nll, loops


def test_eval_exit_kl(ckpts, doc, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = [
        "eval",
        str(ckpts["looped-mesh"]),
        "--ppl",
        f"doc={doc}",
        "--tasks",
        "none",
        "--out",
        str(tmp_path / "o"),
    ]
    assert main([*args, "--tracking-uri", uri, "--loops", "4", "--exit-kl", "1e9,0"]) == 0  # trained K = 2
    printed = capsys.readouterr().out
    assert "adaptive exit (at most 4 loop steps" in printed and "1e09" in printed
    out = json.loads(next((tmp_path / "o").glob("eval-*.json")).read_text())
    section = out["adaptive_exit"]
    assert (section["max_loops"], section["trained"], list(section["thresholds"])) == (4, 2, ["0", "1e09"])
    tokens = section["sets"]["doc"]["tokens"]
    assert tokens == out["ppl"]["doc"]["tokens"] and section["sets"]["doc"]["bytes"] == 1000  # the whole doc
    # the reference is the ordinary perplexity at the maximum depth, bit for bit
    assert section["reference"]["doc"]["ppl"] == out["depth"]["counts"]["4"]["ppl"]["doc"]["ppl"]
    assert (
        section["reference"]["doc"]["bits_per_byte"]
        == out["depth"]["counts"]["4"]["ppl"]["doc"]["bits_per_byte"]
    )
    zero, huge = section["thresholds"]["0"], section["thresholds"]["1e09"]
    # threshold 0: every loop step, the ordinary perplexity up to the rounding of cached decoding
    assert zero["mean_loops"] == 4 and zero["ppl"]["doc"]["ppl"] == pytest.approx(
        section["reference"]["doc"]["ppl"], rel=1e-6
    )
    # a huge threshold: every decoded token exits at the first check, after two loop steps
    nll, loops = _by_hand(ckpts["looped-mesh"], doc.read_text(), 4, 1e9)
    assert (
        huge["mean_loops"] == huge["ppl"]["doc"]["mean_loops"] == 2
        and set(loops) == {2}
        and huge["ppl"]["doc"]["loop_steps"] == sum(loops)
    )
    assert huge["ppl"]["doc"]["nll"] == pytest.approx(nll, rel=1e-6)
    assert section["sets"]["doc"]["tokens_at_full_depth"] == tokens - len(loops)
    assert abs(huge["ppl"]["doc"]["nll"] - zero["ppl"]["doc"]["nll"]) > 1e-3  # exiting changes the scores
    m = MlflowClient(uri).get_run(out["mlflow"]["run_id"]).data.metrics
    assert m["eval/exit_kl_0/mean_loops"] == 4 and m["eval/exit_kl_1e09/mean_loops"] == 2
    assert m["eval/exit_kl_1e09/ppl/doc"] == huge["ppl"]["doc"]["ppl"]
    assert (
        m["eval/exit_reference/ppl/doc"] == m["eval/loops_4/ppl/doc"] and m["eval/exit_reference/loops"] == 4
    )
    assert m == pytest.approx(flat_metrics(out)) and "eval/exit_kl_0/bpb/doc" in m


def test_exit_max_tokens_cuts_the_windows_in_order(ckpts, doc, tmp_path):
    """At most N tokens of a set, the first ones; with a stride every window's context is prefilled, and
    threshold 0 is still the ordinary score of those tokens."""
    from recursive_lightning.evaluation.perplexity import encode, eos_id_of, plan_windows, score_sequences

    args = ["eval", str(ckpts["looped-base"]), "--ppl", f"doc={doc}", "--tasks", "none", "--no-mlflow"]
    args += ["--out", str(tmp_path), "--stride", "12", "--exit-kl", "0", "--exit-max-tokens", "50"]
    assert main(args) == 0
    section = json.loads(next(tmp_path.glob("eval-*.json")).read_text())["adaptive_exit"]
    assert section["sets"]["doc"]["tokens"] == 50 and section["stride"] == 12 and section["max_loops"] == 2
    loaded = load_checkpoint(ckpts["looped-base"])
    model, tok = loaded.model.eval(), loaded.tokenizer
    (ids,) = encode(tok, [doc.read_text()])
    seq = [eos_id_of(tok), *ids]
    requests = [(seq[w.begin : w.end], w.end - w.target) for w in plan_windows(len(seq), 1, MAX_LEN, 12)]
    scored = score_sequences(model, requests, per_token=True)
    first = torch.cat([s.token_logprobs for s in scored])[:50]
    assert section["reference"]["doc"]["nll"] == pytest.approx(-float(first.sum()), rel=1e-12)
    assert section["thresholds"]["0"]["ppl"]["doc"]["nll"] == pytest.approx(-float(first.sum()), rel=1e-6)
    text = doc.read_text()
    enc = tok.encode(text, add_special_tokens=False)
    n_bytes = len(text[: enc.offsets[49][1]].encode())
    assert section["sets"]["doc"]["bytes"] == n_bytes < 1000
    assert section["reference"]["doc"]["bits_per_byte"] == pytest.approx(
        -float(first.sum()) / (math.log(2) * n_bytes)
    )


@pytest.mark.parametrize(
    "value,key", [(5e-4, "5e-04"), (1.5e-3, "1.5e-03"), (1e9, "1e09"), (0, "0"), (0.25, "2.5e-01")]
)
def test_threshold_key(value, key):
    assert threshold_key(value) == key and float(key) == value


@pytest.mark.parametrize(
    "family,flags,message",
    [
        ("looped-mesh", ["--exit-kl=-1e-3"], "--exit-kl must be finite KL thresholds >= 0"),
        ("looped-mesh", ["--exit-kl", "5e-4,x"], "--exit-kl must be a comma-separated list of KL thresholds"),
        ("looped-mesh", ["--exit-kl", "nan"], "--exit-kl must be finite KL thresholds >= 0"),
        ("looped-mesh", ["--exit-kl", ","], "--exit-kl must be a non-empty list"),
        ("looped-mesh", ["--exit-kl", "0", "--exit-max-tokens", "0"], "--exit-max-tokens must be >= 1"),
        ("looped-mesh", ["--exit-kl", "0", "--loops", "0,2"], "--loops must be whole counts >= 1"),
        ("multires", ["--exit-kl", "5e-4"], "--exit-kl needs a looped full-resolution layout"),
        ("unshared", ["--exit-kl", "5e-4"], "--exit-kl needs a looped full-resolution layout"),
        ("vanilla", ["--exit-kl", "5e-4"], "--exit-kl needs a looped full-resolution layout"),
        ("mela", ["--exit-kl", "5e-4"], "Mela's depth is its H cycles"),
    ],
)
def test_bad_exit_request_is_one_sentence_and_nothing_on_disk(
    family, flags, message, ckpts, doc, tmp_path, capsys
):
    assert_eval_refused(ckpts[family], doc, flags, message, tmp_path, capsys)


def test_exit_kl_needs_a_text_set(ckpts, tmp_path, capsys):
    args = ["eval", str(ckpts["looped-mesh"]), "--tasks", "none", "--no-mlflow", "--out", str(tmp_path / "o")]
    assert main([*args, "--exit-kl", "5e-4"]) == 2
    assert "--exit-kl scores text sets token by token: pass one with --ppl" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
