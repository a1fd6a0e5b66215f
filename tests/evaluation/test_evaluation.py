"""Evaluation: perplexity windows, the lm-eval adapter on every model family, local lm-eval tasks end to end,
the ``lm_eval`` command, the ``eval`` command's JSON and MLflow records, and the offline Hub-task sentence."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from recursive_lightning.config import RunConfig
from recursive_lightning.evaluation.lm_eval_adapter import RecursiveLightningLM
from recursive_lightning.evaluation.perplexity import (
    perplexity,
    perplexity_by_context_length,
    plan_windows,
)
from recursive_lightning.model.build import build_model
from recursive_lightning.model.config import LLAMA
from recursive_lightning.training.checkpoint import load_checkpoint, save_model_checkpoint

DATA = Path(__file__).resolve().parents[1] / "fixtures"
MAX_LEN = 32
FAMILIES = {
    "vanilla": {"layout": "4"},
    "looped-base": {"layout": "1+2R2+1", "topology": "base"},
    "looped-mesh": {"layout": "1+2R2+1", "topology": "mesh"},
    "looped-dynamic-gqa": {"layout": "1+2R2+1", "topology": "dynamic", "n_kv_heads": 2},
    "unshared": {"layout": "1+1+1+1", "topology": "anchor"},
    "multires": {"layout": "1+2x{1/4,1/2,1}+1", "topology": "mesh"},
    "transformerpp": {**LLAMA, "layout": "3", "n_kv_heads": 2},
    # Mela: 8-token chunks (P=2, C=4), so MAX_LEN holds 4 chunks and the long contexts many more
    "mela": {
        **LLAMA,
        "arch": "mela",
        "layout": "2",
        "n_kv_heads": 2,
        "patch_size": 2,
        "chunk_size": 4,
        "h_cycles": 2,
        "l_cycles": 2,
        "h_layers": 1,
        "l_layers": 1,
        "memory_heads": 2,
    },
}
UNPACKABLE = ("multires", "mela")  # pool neighbouring positions / chunk from the sequence start


def _texts() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)[:10]]


@pytest.fixture(scope="module")
def tokenizer():
    from recursive_lightning.data.tokenizer import train_bpe

    return train_bpe(_texts(), 512)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for i, (name, arch) in enumerate(FAMILIES.items()):
        torch.manual_seed(i)
        run = RunConfig.from_dict(
            {
                "name": f"t-{name}",
                "model": {"vocab_size": 512, "d_model": 32, "n_heads": 4, "max_seq_len": MAX_LEN, **arch},
                "data": {"seq_len": MAX_LEN},
            }
        )
        out[name] = save_model_checkpoint(root / f"{name}.ckpt", build_model(run.model), run, tokenizer)
    return out


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory) -> Path:
    """tests/fixtures task YAMLs with absolute data_files (datasets resolves relative ones from the cwd)."""
    out = tmp_path_factory.mktemp("tasks")
    cache = tmp_path_factory.mktemp("hf_datasets")
    for y in DATA.glob("*.yaml"):
        cfg = yaml.safe_load(y.read_text())
        kw = cfg["dataset_kwargs"]
        kw["data_files"] = {split: str(DATA / f) for split, f in kw["data_files"].items()}
        kw["cache_dir"] = str(cache)
        (out / y.name).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


def _direct_loglikelihood(model, tok, eot, context, continuation, max_len):
    """Sum of the model's own log-probs of the continuation, one unbatched forward of the left-truncated input."""
    if context:
        ctx = tok.encode(context).ids
        cont = tok.encode(context + continuation).ids[len(ctx) :]
    else:
        ctx, cont = [eot], tok.encode(continuation).ids
    full = ctx + cont
    inp = full[-(max_len + 1) : -1]
    # multi-resolution layouts are scored inside a longer sequence (see perplexity.py): pad after the input
    x = torch.tensor([inp])
    with torch.no_grad():
        logp = F.log_softmax(model(x)[0, : len(inp)].double(), -1)
    n = len(cont)
    tgt = torch.tensor(full[-n:])
    rows = logp[-n:]
    return rows.gather(-1, tgt[:, None]).sum().item(), bool((rows.argmax(-1) == tgt).all())


# ---------------------------------------------------------------------------------------------- windows
@pytest.mark.parametrize(
    "n,L,stride", [(1, 8, None), (8, 8, None), (9, 8, None), (50, 8, None), (50, 8, 3), (50, 8, 1), (7, 8, 8)]
)
def test_windows_score_every_token_once_like_lm_eval(n, L, stride):
    doc = list(range(100, 100 + n))
    seq = [0, *doc]
    wins = plan_windows(len(seq), 1, L, stride)
    scored = [j for w in wins for j in range(w.target, w.end)]
    assert scored == list(range(1, len(seq)))
    assert all(w.end - 1 - w.begin <= L and w.begin <= w.target - 1 for w in wins)
    # the same (input, prediction) pairs as lm-eval's rolling windows with context_len = L - stride + 1
    ref = [make_disjoint_window(p) for p in get_rolling_token_windows(doc, 0, L, L - (stride or L) + 1)]
    ref_full = [(a + b)[:-1] for a, b in ref]
    ours = [seq[w.begin : w.end - 1] for w in wins]
    assert [len(b) for _, b in ref] == [w.end - w.target for w in wins]
    assert ref_full == ours


# ---------------------------------------------------------------------------------------------- adapter
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loglikelihood_equals_model_logprobs(family, ckpts, tokenizer):
    loaded = load_checkpoint(ckpts[family])
    # float64: the bookkeeping (truncation, batching, packing) is under test, not float32 reassociation, which
    # Mela's test-time memory amplifies past 1e-3 between a batched and an unbatched forward (seen in a full run)
    loaded.model.double()
    lm = RecursiveLightningLM.from_loaded(loaded, batch_size=3)
    long_ctx = " ".join(_texts()[0].split()[:120])  # far more than MAX_LEN tokens: left-truncated
    reqs = [
        ("The quick brown fox", " jumps over the lazy dog"),
        (long_ctx, " and then the end of it"),
        ("", "Hello world, again"),
        ("A", " B"),
        ("Question: what is frozen water?\nAnswer:", " ice"),
        ("x = 1", "\ny = 2\nprint(x + y)"),
        # multiple-choice items: continuations of one context share a packed row (prefix_sharing.py)
        ("Question: what is frozen water?\nAnswer:", " fire"),
        ("Question: what is frozen water?\nAnswer:", " steam, or a cloud of it"),
        ("The quick brown fox", " sleeps"),
        (long_ctx, " too long to share"),
    ]
    packed_calls = []
    hidden = loaded.model.hidden
    loaded.model.hidden = lambda *a, **k: packed_calls.append(k.get("mask") is not None) or hidden(*a, **k)
    try:
        got = lm.loglikelihood(
            [Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)], disable_tqdm=True
        )
    finally:
        del loaded.model.hidden
    assert any(packed_calls) == (family not in UNPACKABLE)
    assert len(tokenizer.encode(long_ctx).ids) > 2 * MAX_LEN
    for (ctx, cont), (ll, greedy) in zip(reqs, got):
        ref, ref_greedy = _direct_loglikelihood(loaded.model, tokenizer, lm.eot_token_id, ctx, cont, MAX_LEN)
        assert ll == pytest.approx(ref, abs=1e-5, rel=0), (family, ctx[:20], cont)
        assert greedy == ref_greedy
    # batch composition does not matter (right padding)
    single = RecursiveLightningLM.from_loaded(loaded, batch_size=1)
    got1 = single.loglikelihood(
        [Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)], disable_tqdm=True
    )
    assert [a for a, _ in got1] == pytest.approx([a for a, _ in got], abs=1e-3)


def test_rolling_equals_package_perplexity(ckpts, tokenizer):
    loaded = load_checkpoint(ckpts["looped-mesh"])
    doc = _texts()[1][:450]
    toks = tokenizer.encode(doc).ids
    assert len(toks) > 3 * MAX_LEN
    for stride in (None, 16):
        lm = RecursiveLightningLM.from_loaded(loaded, batch_size=4, stride=stride)
        (rolling,) = lm.loglikelihood_rolling(
            [Instance("loglikelihood_rolling", {}, (doc,), 0)], disable_tqdm=True
        )
        ppl = perplexity(loaded.model, tokenizer, doc, stride=stride, batch_size=2)
        assert ppl["tokens"] == len(toks)
        assert -rolling == pytest.approx(ppl["nll"], rel=1e-6)
        assert ppl["ppl"] == pytest.approx(math.exp(ppl["nll"] / ppl["tokens"]))
        # and both equal lm-eval's own rolling windows scored by the bare model
        windows = [
            make_disjoint_window(w)
            for w in get_rolling_token_windows(
                toks, lm.eot_token_id, MAX_LEN, MAX_LEN - (stride or MAX_LEN) + 1
            )
        ]
        total = 0.0
        with torch.no_grad():
            for ctx, pred in windows:
                inp = (ctx + pred)[:-1]
                logp = F.log_softmax(loaded.model(torch.tensor([inp]))[0].double(), -1)
                total += logp[-len(pred) :].gather(-1, torch.tensor(pred)[:, None]).sum().item()
        assert rolling == pytest.approx(total, rel=1e-6)


@pytest.mark.parametrize("family", ["vanilla", "mela"])
def test_generate_until_greedy_with_stop(family, ckpts, tokenizer):
    loaded = load_checkpoint(ckpts[family])
    lm = RecursiveLightningLM.from_loaded(loaded, batch_size=2)
    prompt = "The cat sat on the"
    ids = tokenizer.encode(prompt).ids
    ref_ids = loaded.model.generate(torch.tensor([ids]), max_new_tokens=10)[0, len(ids) :].tolist()
    ref = tokenizer.decode(ref_ids)
    [free] = lm.generate_until(
        [Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 10}), 0)], disable_tqdm=True
    )
    assert free == ref
    stop = ref.strip()[2:4] or ref[-1]
    cut = ref[: ref.find(stop)]
    reqs = [
        (prompt, {"until": [stop], "max_gen_toks": 10}),
        ("Another prompt, longer than the first one", {"until": ["\n\n"], "max_gen_toks": 3}),
    ]
    out = lm.generate_until(
        [Instance("generate_until", {}, r, i) for i, r in enumerate(reqs)], disable_tqdm=True
    )
    assert out[0] == cut and stop not in out[0]
    assert isinstance(out[1], str)


# ---------------------------------------------------------------------------------------------- lm-eval
def test_local_tasks_through_simple_evaluate(ckpts, local_tasks):
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(local_tasks), include_defaults=False)
    res = lm_eval.simple_evaluate(
        model="recursive_lightning",  # found through lm-eval's registry
        model_args=f"checkpoint={ckpts['multires']},batch_size=8",
        tasks=["tiny_mc", "tiny_lambada"],
        num_fewshot=0,
        limit=6,
        task_manager=tm,
        bootstrap_iters=0,
        log_samples=False,
    )
    mc, lam = res["results"]["tiny_mc"], res["results"]["tiny_lambada"]
    for v in (mc["acc,none"], mc["acc_norm,none"], lam["acc,none"]):
        assert 0.0 <= v <= 1.0
    assert lam["perplexity,none"] > 1.0


@pytest.mark.slow
def test_lm_eval_command(ckpts, local_tasks, tmp_path):
    from recursive_lightning.evaluation import harness_hook

    if harness_hook.installed():  # the plain `lm_eval` command, through the .pth start-up hook
        cmd = [str(Path(sys.executable).parent / "lm_eval")]
    else:  # the hook is installed by setup.sh; without it, the wrapper does the same registration
        cmd = [sys.executable, "-m", "recursive_lightning.evaluation.lm_eval_cli"]
    cmd += [
        "--model",
        "recursive_lightning",
        "--model_args",
        f"checkpoint={ckpts['vanilla']}",
        "--tasks",
        "tiny_mc",
        "--include_path",
        str(local_tasks),
        "--limit",
        "4",
        "--device",
        "cpu",
        "--batch_size",
        "4",
        "--output_path",
        str(tmp_path / "out"),
    ]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "tiny_mc" in p.stdout and "acc_norm" in p.stdout
    results = list((tmp_path / "out").rglob("results_*.json"))
    assert results and 0 <= json.loads(results[0].read_text())["results"]["tiny_mc"]["acc,none"] <= 1


# ---------------------------------------------------------------------------------------------- eval command
def test_eval_command_json_and_mlflow(tmp_path, tokenizer, local_tasks, capsys):
    from mlflow.tracking import MlflowClient

    from recursive_lightning.cli import main
    from recursive_lightning.tracking.runs import create_run, default_tracking_uri, ensure_experiment

    run_dir = tmp_path / "run"
    uri = default_tracking_uri(run_dir)
    run_dir.mkdir()
    run_id = create_run(uri, ensure_experiment(uri, "t-eval", run_dir / "mlartifacts"), "train")
    torch.manual_seed(0)
    run = RunConfig.from_dict(
        {
            "name": "t-eval",
            "model": {
                "vocab_size": 512,
                "d_model": 32,
                "n_heads": 4,
                "max_seq_len": MAX_LEN,
                "layout": "1+2R2+1",
                "topology": "mesh",
            },
            "data": {"seq_len": MAX_LEN},
        }
    )
    save_model_checkpoint(
        run_dir / "checkpoints" / "last.ckpt",
        build_model(run.model),
        run,
        tokenizer,
        global_step=7,
        mlflow_run_id=run_id,
    )
    text = tmp_path / "doc.txt"
    text.write_text(_texts()[2][:1000])
    rc = main(
        [
            "eval",
            str(run_dir),
            "--ppl",
            f"doc={text}",
            "--tasks",
            "tiny_mc,tiny_lambada",
            "--shots",
            "0,5",
            "--limit",
            "3",
            "--context-lengths",
            "8,16,64,100000",
            "--ctx-max-tokens",
            "64",
            "--include-path",
            str(local_tasks),
            "--batch-size",
            "8",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tiny_mc" in printed and "average" in printed
    out = json.loads((run_dir / "eval" / "eval-last.json").read_text())
    assert out["global_step"] == 7 and out["mlflow"]["run_id"] == run_id
    assert out["ppl"]["doc"]["ppl"] > 1
    ctx = out["ppl_ctx"]["lengths"]
    assert ctx["64"]["extrapolated"] is True and ctx["16"]["extrapolated"] is False
    assert "skipped" in ctx["100000"]
    assert set(out["avg"]) == {"0", "5"} and 0 <= out["avg"]["0"] <= 1
    client = MlflowClient(tracking_uri=uri)
    metrics = client.get_run(run_id).data.metrics
    for key in (
        "eval/ppl/doc",
        "eval/ppl_ctx/8",
        "eval/tiny_mc/0shot/acc",
        "eval/tiny_mc/5shot/acc_norm",
        "eval/tiny_lambada/0shot/acc",
        "eval/avg/0shot",
        "eval/avg/5shot",
    ):
        assert key in metrics, key
    assert metrics["eval/ppl/doc"] == pytest.approx(out["ppl"]["doc"]["ppl"])
    assert client.get_metric_history(run_id, "eval/avg/0shot")[0].step == 7
    assert [a.path for a in client.list_artifacts(run_id, "eval")] == [
        "eval/eval-last-ppl-by-context.png",
        "eval/eval-last.json",
    ]
    png = run_dir / "eval" / "eval-last-ppl-by-context.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out["ppl_ctx"]["plot"] == str(png)
    assert out["ppl_ctx"]["train_seq_len"] == MAX_LEN and "plot: " in printed

    # a checkpoint whose run is not in the store: a new run, tagged with the checkpoint path
    other = save_model_checkpoint(
        tmp_path / "elsewhere" / "x.ckpt",
        build_model(run.model),
        run,
        tokenizer,
        mlflow_run_id="0123456789abcdef0123456789abcdef",
    )
    rc = main(
        [
            "eval",
            str(other),
            "--ppl",
            f"doc={text}",
            "--tasks",
            "none",
            "--tracking-uri",
            uri,
            "--out",
            str(tmp_path / "o2"),
        ]
    )
    assert rc == 0
    new = json.loads((tmp_path / "o2" / "eval-x.json").read_text())["mlflow"]
    assert new["created"] and new["run_id"] != run_id
    r = client.get_run(new["run_id"])
    assert r.data.tags["checkpoint"] == str(other.resolve()) and "eval/ppl/doc" in r.data.metrics


def test_hub_task_offline_is_one_sentence(ckpts, capsys):
    from recursive_lightning.cli import main

    rc = main(["eval", str(ckpts["vanilla"]), "--tasks", "piqa", "--shots", "0", "--no-mlflow"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("error: task 'piqa' needs the Hugging Face dataset 'baber/piqa'")
    assert "offline" in err and "dataset_path: json" in err and "--include-path" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_unknown_task_and_bad_inputs(ckpts, capsys):
    from recursive_lightning.cli import main

    assert main(["eval", str(ckpts["vanilla"]), "--tasks", "piqaa", "--no-mlflow"]) == 2
    assert "did you mean 'piqa'" in capsys.readouterr().err
    assert (
        main(["eval", str(ckpts["vanilla"]), "--ppl", "x=/nonexistent.txt", "--tasks", "none", "--no-mlflow"])
        == 2
    )
    assert "does not exist" in capsys.readouterr().err


def test_context_length_table(ckpts, tokenizer):
    model = load_checkpoint(ckpts["multires"]).model
    text = _texts()[3][:3000]
    n = len(tokenizer.encode(text).ids)
    res = perplexity_by_context_length(
        model, tokenizer, text, [8, 32, 64, n + 5], block=4, max_tokens=128, extrapolate=False
    )
    assert res[8]["segments"] == 16 and res[8]["tokens"] == 128 and res[8]["last_block"] == 4
    assert res[32]["ppl"] > 1 and res[32]["ppl_last"] > 1 and not res[32]["extrapolated"]
    assert "max_seq_len" in res[64]["skipped"]
    assert "skipped" in res[n + 5]
    # a segment of L tokens is exactly one forward pass: its NLL equals the document perplexity of it
    ids = tokenizer.encode(text).ids
    eos = tokenizer.token_to_id("<|endoftext|>")
    one = perplexity_by_context_length(model, tokenizer, text, [16], max_tokens=16)[16]
    seg = [eos, *ids[:16]]
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([seg[:-1]]))[0, :16].double(), -1)
    assert one["nll"] == pytest.approx(
        -logp.gather(-1, torch.tensor(seg[1:])[:, None]).sum().item(), rel=1e-6
    )
    docs = perplexity_by_context_length(model, tokenizer, [text, "short"], [16], mode="documents")[16]
    assert docs["segments"] == 1


@pytest.mark.parametrize("family", ["vanilla", "mela"])
def test_context_length_ppl_is_the_models_own_logprobs(family, ckpts, tokenizer):
    """Perplexity at a context length L = exp(mean NLL) of the model's own next-token log-probabilities over
    the same windows: the stream [eos, text...] cut into segments of L + 1 tokens overlapping by one, each one
    forward pass (Mela: a few chunks at a time through its cache; in float64, see test_mela.py's drift note)."""
    model = load_checkpoint(ckpts[family]).model.double()
    text = " ".join(_texts())
    ids = [tokenizer.token_to_id("<|endoftext|>"), *tokenizer.encode(text).ids]
    L, segments = MAX_LEN, 3
    got = perplexity_by_context_length(model, tokenizer, text, [L], max_tokens=segments * L)[L]
    assert got["segments"] == segments and got["tokens"] == segments * L
    nll = 0.0
    with torch.no_grad():
        for k in range(segments):
            seg = torch.tensor([ids[k * L : k * L + L + 1]])
            logp = F.log_softmax(model(seg[:, :-1])[0].double(), -1)
            nll -= logp.gather(-1, seg[0, 1:, None]).sum().item()
    assert got["nll"] == pytest.approx(nll, rel=1e-7)  # scored with a float32 log-softmax
    assert got["ppl"] == pytest.approx(math.exp(nll / (segments * L)), rel=1e-7)


def test_chunk_local_model_scores_long_inputs_chunk_by_chunk(ckpts, tokenizer, monkeypatch):
    """Mela's long contexts run through its decoding cache a few chunks at a time: the same log-probs as
    one forward pass, and no call sees more than one piece."""
    from recursive_lightning.evaluation import perplexity as ppl_mod

    model = load_checkpoint(ckpts["mela"]).model.double()  # float64: see the drift note in test_mela.py
    ids = tokenizer.encode(" ".join(_texts())).ids[: 12 * model.cfg.tokens_per_chunk + 5]
    monkeypatch.setattr(ppl_mod, "STREAM_CHUNKS", 2)
    widths = []
    hidden = model.hidden
    model.hidden = lambda x, **k: widths.append(x.shape[1]) or hidden(x, **k)
    try:
        streamed = ppl_mod.score_sequences(model, [(ids, len(ids) - 1)], per_token=True)[0]
    finally:
        del model.hidden
    assert max(widths) == 2 * model.cfg.tokens_per_chunk and len(widths) > 5
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), -1)
    want = logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    torch.testing.assert_close(streamed.token_logprobs, want, rtol=1e-6, atol=1e-6)  # float32 log-softmax


def test_eval_options_check_their_fields_and_read_a_sweep_block(tmp_path):
    """EvalOptions refuses a bad field in one sentence; a sweep's evaluate: block gives the same options with
    its paths relative to the sweep file (embedded:heldout as it is), no tasks and 0-shot by default."""
    from recursive_lightning.errors import UserError
    from recursive_lightning.evaluation.options import SWEEP_FIELDS, EvalOptions

    for bad, match in (
        ({"batch_size": 0}, "--batch-size must be >= 1"),
        ({"context_lengths": [256, 0]}, "--context-lengths must be positive"),
        ({"context_lengths": []}, "--context-lengths is empty"),
        ({"shots": [0, -1]}, "shots must be >= 0"),
        ({"ctx_mode": "windows"}, "--ctx-mode must be stream or documents"),
        ({"loops": [2, 0]}, "--loops must be whole counts >= 1, not 0"),
        ({"h_cycles": []}, "--h-cycles must be a non-empty list"),
        ({"loops": [1.5]}, "--loops must be whole counts"),
        ({"exit_kl": [1e-3, True]}, "--exit-kl must be finite KL thresholds >= 0 in nats, not True"),
        ({"exit_kl": [float("inf")]}, "--exit-kl must be finite"),
        ({"exit_kl": []}, "--exit-kl must be a non-empty list"),
        ({"exit_max_tokens": 0}, "--exit-max-tokens must be >= 1"),
    ):
        with pytest.raises(UserError, match=match):
            EvalOptions(**bad)
    assert EvalOptions(ppl_sets=["a=x.txt", "y.jsonl"]).ppl_paths() == {"a": "x.txt", "y": "y.jsonl"}
    with pytest.raises(UserError, match="NAME=PATH"):
        EvalOptions(ppl_sets=["=x.txt"]).ppl_paths()
    (tmp_path / "tasks").mkdir()
    o = EvalOptions.from_sweep(
        {"ppl": {"t": "t.txt", "h": "embedded:heldout"}, "include_path": "tasks", "ctx_block": 64},
        tmp_path,
        "sqlite:///x.db",
    )
    assert o.ppl_sets == {"t": str(tmp_path / "t.txt"), "h": "embedded:heldout"}
    assert o.include_path == str(tmp_path / "tasks") and o.tasks == [] and o.shots == [0]
    assert (o.ctx_block, o.ctx_mode, o.tracking_uri, o.mlflow) == (64, "stream", "sqlite:///x.db", True)
    assert EvalOptions(loops=[8, 1, 2, 2]).loops == [1, 2, 8] and o.loops is None
    o = EvalOptions.from_sweep({"loops": [4, 1], "h_cycles": [2]}, tmp_path, "sqlite:///x.db")
    assert (o.loops, o.h_cycles, o.depth_where_it_applies) == ([1, 4], [2], True)
    assert (o.exit_kl, o.exit_max_tokens) == (None, 4096) and EvalOptions(
        exit_kl=[1e-3, 0, 1e-3]
    ).exit_kl == [0, 1e-3]
    o = EvalOptions.from_sweep({"exit_kl": [5e-4], "exit_max_tokens": 64}, tmp_path, "sqlite:///x.db")
    assert (o.exit_kl, o.exit_max_tokens) == ([5e-4], 64)
    assert set(SWEEP_FIELDS.values()) <= set(EvalOptions.__dataclass_fields__)


def test_stream_piece_never_exceeds_the_training_length():
    """A chunk-local model streams a long input in pieces of at most STREAM_CHUNKS chunks and never more than
    its training length (so Mela-400M's eval memory at 32K is that of 4K), and at least one chunk."""
    from recursive_lightning.evaluation.perplexity import STREAM_CHUNKS, stream_piece
    from recursive_lightning.model.config import preset

    big = preset("mela-400m")
    assert big.tokens_per_chunk == 2048 and stream_piece(big) == 4096  # 2 chunks fit max_seq_len 4096
    small = preset("cpu-mela")
    assert stream_piece(small) == STREAM_CHUNKS * small.tokens_per_chunk == 512  # 8 of 16 that fit
    assert stream_piece(preset("cpu-mela", max_seq_len=32)) == small.tokens_per_chunk  # shorter than a chunk


def test_lm_evals_shot_override_note_is_silenced_and_its_other_warnings_are_not():
    """`eval --shots 0,5` overrides each task's default shot count by design: lm-eval's warning about it is
    dropped; any other lm-eval warning still reaches the user."""
    import logging

    from recursive_lightning.evaluation.downstream import _quiet_shot_override

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    log = logging.getLogger("lm_eval.evaluator")
    handler = Keep()
    log.addHandler(handler)
    try:
        _quiet_shot_override()
        _quiet_shot_override()  # once is enough however often eval runs
        log.warning("Overwriting default num_fewshot of %s from %s to %s", "hellaswag", None, 5)
        log.warning("something else")
    finally:
        log.removeHandler(handler)
    assert seen == ["something else"]
