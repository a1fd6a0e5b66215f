"""Test-time depth in the ``eval`` and ``generate`` commands (evaluation/depth.py): the trained count
reproduces the ordinary evaluation bit for bit, other counts are the model under ``at_depth``; MLflow gets
``eval/loops_<k>/...`` and the PNG; a dial the model lacks is one sentence, exit 2, nothing on disk."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import assert_eval_refused

from recursive_lightning.cli import main
from recursive_lightning.evaluation.run import flat_metrics
from recursive_lightning.model.depth import at_depth
from recursive_lightning.training.checkpoint import load_checkpoint
from tests.evaluation.test_evaluation import _texts, ckpts, local_tasks, tokenizer  # noqa: F401 (fixtures)


@pytest.fixture
def doc(tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text(_texts()[2][:1000])
    return text


def test_eval_loops_trained_count_is_the_ordinary_evaluation(ckpts, local_tasks, doc, tmp_path, capsys):  # noqa: F811
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["eval", str(ckpts["looped-mesh"]), "--ppl", f"doc={doc}", "--tasks", "tiny_mc", "--shots", "0"]
    args += [
        "--limit",
        "4",
        "--include-path",
        str(local_tasks),
        "--out",
        str(tmp_path / "o"),
        "--tracking-uri",
        uri,
    ]
    assert main([*args, "--loops", "4,1,2"]) == 0  # trained: K = 2 (1+2R2+1)
    printed = capsys.readouterr().out
    assert (
        "test-time depth" in printed
        and "2 (trained)" in printed
        and "by-depth.png" in printed.replace("\n", "")
    )
    out = json.loads(next((tmp_path / "o").glob("eval-*.json")).read_text())
    depth = out["depth"]
    assert (depth["dial"], depth["trained"], list(depth["counts"])) == ("loops", 2, ["1", "2", "4"])
    flops = [depth["counts"][k]["flops_forward_per_token"] for k in ("1", "2", "4")]
    assert flops[0] < flops[1] < flops[2] and flops[1] == depth["trained_flops_forward_per_token"]
    m = MlflowClient(uri).get_run(out["mlflow"]["run_id"]).data.metrics
    for key in ("ppl/doc", "bpb/doc", "tiny_mc/0shot/acc", "avg/0shot"):
        assert m[f"eval/loops_2/{key}"] == m[f"eval/{key}"], key  # bit for bit
    assert m["eval/loops_1/ppl/doc"] != m["eval/ppl/doc"] != m["eval/loops_4/ppl/doc"]
    assert m == pytest.approx(flat_metrics(out)) and "eval/loops_4/tiny_mc/0shot/acc_norm" in m
    arts = [a.path for a in MlflowClient(uri).list_artifacts(out["mlflow"]["run_id"], "eval")]
    png = tmp_path / "o" / f"{depth['plot'].rsplit('/', 1)[-1]}"
    assert f"eval/{png.name}" in arts and png.name.endswith("-by-depth.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # another depth is the model evaluated under at_depth (the perplexity the package computes)
    from recursive_lightning.evaluation.perplexity import perplexity

    loaded = load_checkpoint(ckpts["looped-mesh"])
    with at_depth(loaded.model, 4):
        want = perplexity(loaded.model, loaded.tokenizer, [doc.read_text()], out["window"], None, 16)
    assert depth["counts"]["4"]["ppl"]["doc"]["ppl"] == want["ppl"]


def test_eval_h_cycles_of_mela(ckpts, doc, tmp_path, capsys):  # noqa: F811
    args = ["eval", str(ckpts["mela"]), "--ppl", f"doc={doc}", "--tasks", "none", "--no-mlflow"]
    assert main([*args, "--out", str(tmp_path), "--h-cycles", "1,2,3"]) == 0
    out = json.loads(next(tmp_path.glob("eval-*.json")).read_text())
    m = flat_metrics(out)
    assert out["depth"]["dial"] == "h_cycles" and out["depth"]["trained"] == 2
    assert m["eval/h_cycles_2/ppl/doc"] == m["eval/ppl/doc"] != m["eval/h_cycles_1/ppl/doc"]
    assert "eval/h_cycles_3/bpb/doc" in m and "h-cycles" in capsys.readouterr().out


@pytest.mark.parametrize(
    "family,flags,message",
    [
        ("mela", ["--loops", "2"], "--loops does not apply to this mela model"),
        (
            "looped-mesh",
            ["--h-cycles", "2"],
            "--h-cycles does not apply to this recursive model: a looped model's depth dial is the loop count of "
            "its shared core; use --loops.",
        ),
        ("vanilla", ["--loops", "2"], "no shared core to loop"),
        ("unshared", ["--loops", "1,2"], "no shared core to loop"),
        ("looped-base", ["--loops", "0,2"], "--loops must be whole counts >= 1, not 0"),
        ("looped-base", ["--loops", "1,x"], "--loops must be a comma-separated list of integers"),
        ("looped-base", ["--loops", ","], "--loops must be a non-empty list"),
        ("looped-base", ["--loops", "2", "--h-cycles", "2"], "not both"),
    ],
)
def test_bad_depth_is_one_sentence_and_nothing_on_disk(family, flags, message, ckpts, doc, tmp_path, capsys):  # noqa: F811
    assert_eval_refused(ckpts[family], doc, flags, message, tmp_path, capsys)


def test_generate_at_depth(ckpts, capsys):  # noqa: F811
    ckpt = str(ckpts["looped-mesh"])
    prompt = ["--prompt", "The with statement", "--max-new-tokens", "12"]
    assert main(["generate", ckpt, *prompt]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", ckpt, *prompt, "--loops", "2"]) == 0  # the trained K
    assert capsys.readouterr().out == plain
    assert main(["generate", ckpt, *prompt, "--loops", "5"]) == 0
    deeper = capsys.readouterr().out
    loaded = load_checkpoint(ckpt)
    model, tok = loaded.model.eval(), loaded.tokenizer
    ids = tok.encode("The with statement").ids
    eos = tok.token_to_id("<|endoftext|>")
    with at_depth(model, 5):
        ref = model.generate(torch.tensor([ids]), 12, stop=[eos])
    new = [t for t in ref[0, len(ids) :].tolist() if t != eos]
    assert deeper.rstrip("\n") == "The with statement" + tok.decode(new) and deeper != plain
    assert main(["generate", str(ckpts["mela"]), "--loops", "2"]) == 2
    assert "--loops does not apply" in capsys.readouterr().err
    assert main(["generate", str(ckpts["mela"]), *prompt, "--h-cycles", "3"]) == 0


def test_generate_with_adaptive_exit(ckpts, capsys):  # noqa: F811
    """--exit-kl 0 is ordinary decoding at that depth and uses every loop step; a large threshold exits at the
    first check (two steps); the mean is printed; a bad request is one sentence."""
    ckpt = str(ckpts["looped-mesh"])
    prompt = ["--prompt", "The with statement", "--max-new-tokens", "12", "--loops", "4"]
    assert main(["generate", ckpt, *prompt]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", ckpt, *prompt, "--exit-kl", "0"]) == 0
    out = capsys.readouterr()
    assert out.out == plain and "4.00 of 4 loop steps per token" in out.err
    assert main(["generate", ckpt, *prompt, "--exit-kl", "1e9"]) == 0
    assert "2.00 of 4 loop steps per token" in capsys.readouterr().err
    for flags, words in (
        (["--exit-kl", "-1"], ">= 0"),
        (["--exit-kl", "1e-3", "--no-cache"], "drop --no-cache"),
    ):
        assert main(["generate", ckpt, *prompt, *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1
    assert main(["generate", str(ckpts["mela"]), "--exit-kl", "1e-3"]) == 2
    assert "H cycles" in capsys.readouterr().err


@pytest.mark.parametrize(
    "family,flags,message",
    [
        (
            "mela",
            ["--h-cycles", "0"],
            "--h-cycles must be one whole cycle count from 1 to 256, not 0; e.g. --h-cycles 4.",
        ),
        (
            "mela",
            ["--h-cycles", "-1"],
            "--h-cycles must be one whole cycle count from 1 to 256, not -1; e.g. --h-cycles 4.",
        ),
        (
            "mela",
            ["--h-cycles", "300"],
            "--h-cycles must be one whole cycle count from 1 to 256, not 300; e.g. --h-cycles 4.",
        ),
        (
            "looped-mesh",
            ["--loops", "0"],
            "--loops must be one whole loop count from 1 to 256, not 0; e.g. --loops 4.",
        ),
        ("mela", ["--loops", "0"], "--loops does not apply to this mela model"),
        ("vanilla", ["--loops", "0"], "no shared core to loop"),
        (
            "mela",
            ["--exit-kl", "1e-3"],
            "--exit-kl: adaptive exit stops a looped model's loop steps, and Mela's depth is its H cycles; drop "
            "--exit-kl, or set Mela's depth with --h-cycles N (e.g. --h-cycles 4).",
        ),
    ],
)
def test_generate_depth_refusal_names_a_value_generate_takes(family, flags, message, ckpts, capsys):  # noqa: F811
    """generate decodes at one depth: its refusal is one sentence, exit 2, whose example generate accepts
    (the shared check's comma lists are eval's form, which generate's one-integer option refuses)."""
    ckpt = str(ckpts[family])
    assert main(["generate", ckpt, "--max-new-tokens", "2", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    if example := re.search(r"e\.g\. (--[a-z-]+) (\S+?)\.?\)?\.$", err):
        assert main(["generate", ckpt, "--max-new-tokens", "2", *example.groups()]) == 0
