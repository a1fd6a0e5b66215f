"""Downstream accuracy without the network: the embedded tasks (built from the embedded corpus's
held-out documents) are deterministic and disjoint from the training split, run through real lm-eval and land
in the checkpoint's MLflow run; ``eval --ppl`` offline skips the default tasks it cannot have in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recursive_lightning.config import DataConfig, RunConfig
from recursive_lightning.data import embedded_tasks as et
from recursive_lightning.evaluation import downstream as ev
from recursive_lightning.evaluation.options import EvalOptions
from recursive_lightning.evaluation.run import evaluate_checkpoint
from recursive_lightning.model.build import build_model
from recursive_lightning.training.checkpoint import save_model_checkpoint

MAX_LEN = 64


@pytest.fixture(scope="module")
def split():
    from recursive_lightning.data.corpus import embedded_corpus_documents
    from recursive_lightning.data.shards import split_documents

    return split_documents(embedded_corpus_documents(), et.HELDOUT_FRACTION)


@pytest.fixture(scope="module")
def items(data_cache):
    return et.embedded_task_items(data_cache)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_cache) -> Path:
    """A run directory with a tiny (untrained) checkpoint, its MLflow run in SQLite, and a perplexity set."""
    from pydoc_data.topics import topics

    from recursive_lightning.data.tokenizer import train_bpe
    from recursive_lightning.tracking.runs import create_run, default_tracking_uri, ensure_experiment

    root = tmp_path_factory.mktemp("embedded-eval")
    run_dir = root / "run"
    run_dir.mkdir()
    uri = default_tracking_uri(run_dir)
    run_id = create_run(uri, ensure_experiment(uri, "t-embedded", run_dir / "mlartifacts"), "train")
    texts = [topics[k] for k in sorted(topics)[:10]]
    torch.manual_seed(0)
    run = RunConfig.from_dict(
        {
            "name": "t-embedded",
            "model": {
                "vocab_size": 512,
                "d_model": 32,
                "n_heads": 4,
                "max_seq_len": MAX_LEN,
                "layout": "1+2R2+1",
                "topology": "mesh",
            },
            "data": {"seq_len": MAX_LEN, "cache_dir": data_cache},
        }
    )
    save_model_checkpoint(
        run_dir / "checkpoints" / "last.ckpt",
        build_model(run.model),
        run,
        train_bpe(texts, 512),
        global_step=5,
        mlflow_run_id=run_id,
    )
    (root / "doc.txt").write_text(texts[3][:1500])
    return run_dir


def _metrics(run_dir: Path) -> dict[str, float]:
    """The metrics of the MLflow run the last ``eval`` of ``run_dir`` logged to."""
    from mlflow.tracking import MlflowClient

    target = json.loads((run_dir / "eval" / "eval-last.json").read_text())["mlflow"]
    return MlflowClient(tracking_uri=target["tracking_uri"]).get_run(target["run_id"]).data.metrics


# ---------------------------------------------------------------------------------------------- items
def test_items_are_deterministic(items, tmp_path):
    """Built again from the corpus, in another process with another string-hash seed, into a fresh cache: the
    same items; the cached file is what is read back."""
    code = "import sys; from recursive_lightning.data.embedded_tasks import embedded_task_items as f; f(sys.argv[1])"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env, timeout=300)
    assert et.embedded_task_items(tmp_path) == items
    (cached,) = (tmp_path / "tasks").glob("embedded-*.json")
    assert json.loads(cached.read_text()) == items
    assert not [p for p in (tmp_path / "tasks").iterdir() if p != cached]  # no temporary left behind
    for task in et.EMBEDDED_TASKS:
        assert len(items[task]["test"]) >= 200 and len(items[task]["train"]) == et.FEWSHOT_ITEMS
    assert items["meta"]["heldout_fraction"] == et.HELDOUT_FRACTION == DataConfig().val_fraction
    assert ev.EMBEDDED_TASKS == et.EMBEDDED_TASKS
    for x in items[et.NEXTSENT]["test"]:
        assert len(x["choices"]) == et.CHOICES and len(set(x["choices"])) == et.CHOICES
    labels = [x["label"] for x in items[et.NEXTSENT]["test"]]
    assert len(set(labels)) == et.CHOICES  # the answer's position varies


def test_items_are_disjoint_from_the_training_split(items, split):
    """Every item comes from a held-out document of a default run (data.val_fraction 0.05, and so of any larger
    fraction) and no item text appears in a training document."""
    training, heldout = split
    train_text = "\f".join(et.normalise(d) for d in training)
    heldout_text = [et.normalise(d) for d in heldout]
    texts = []
    for split_name in ("test", "train"):
        for x in items[et.LASTWORD][split_name]:
            texts.append((x["doc"], f"{x['context']} {x['target']}"))
        for x in items[et.NEXTSENT][split_name]:
            texts.append((x["doc"], f"{x['context']} {x['choices'][x['label']]}"))
    assert len(texts) > 400
    for doc, text in texts:
        assert text in heldout_text[doc], text
        assert text not in train_text, text
    # the answer sentences themselves are never training text either
    for x in items[et.NEXTSENT]["test"]:
        assert x["choices"][x["label"]] not in train_text


# ---------------------------------------------------------------------------------------------- eval
def test_eval_ppl_offline_skips_default_tasks(run_dir, capsys, monkeypatch):
    """``eval CHECKPOINT --ppl NAME=PATH`` on a machine without the network: perplexity and the embedded tasks,
    one line naming the skipped default tasks, exit 0; the skipped tasks are tagged on the MLflow run."""
    from recursive_lightning.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    doc = run_dir.parent / "doc.txt"
    rc = main(["eval", str(run_dir), "--ppl", f"doc={doc}", "--shots", "0", "--limit", "6"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    notes = [line for line in out.err.splitlines() if "skipped default tasks" in line]
    assert len(notes) == 1, out.err[-2000:]
    for t in ev.PAPER_TASKS:
        assert t in notes[0]
    assert "offline" in notes[0] and "embedded_lastword" not in notes[0].split("(")[0]
    assert "doc" in out.out and "embedded_nextsent" in out.out
    result = json.loads((run_dir / "eval" / "eval-last.json").read_text())
    assert result["ppl"]["doc"]["ppl"] > 1
    assert set(result["skipped_tasks"]) == set(ev.PAPER_TASKS)
    assert set(result["tasks"]["0"]) == set(et.EMBEDDED_TASKS)
    metrics = _metrics(run_dir)
    assert "eval/ppl/doc" in metrics and "eval/embedded_lastword/0shot/acc" in metrics

    # the same through the Python API with the task list a sweep's `evaluate: {tasks: default}` passes
    res = evaluate_checkpoint(
        run_dir,
        EvalOptions(tasks="default", shots=[0], limit=2, mlflow=False, out_dir=run_dir.parent / "api"),
    )
    assert set(res["skipped_tasks"]) == set(ev.PAPER_TASKS) and set(res["tasks"]["0"]) == set(
        et.EMBEDDED_TASKS
    )


def test_named_unavailable_task_is_an_error(run_dir, capsys, monkeypatch):
    from recursive_lightning.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    doc = run_dir.parent / "doc.txt"
    rc = main(
        ["eval", str(run_dir), "--ppl", f"doc={doc}", "--tasks", "default,lambada_openai", "--no-mlflow"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("error: task 'lambada_openai' needs the Hugging Face dataset")
    assert "--include-path" in err[-1] and "Traceback" not in "\n".join(err)


def test_embedded_tasks_through_lm_eval_to_mlflow(run_dir, data_cache, capsys):
    """The embedded tasks run as ordinary lm-eval tasks (TaskManager over their YAML folder) and their
    accuracies reach the checkpoint's MLflow run under eval/<task>/<k>shot/<metric>."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from recursive_lightning.cli import main

    tm = TaskManager(
        include_path=str(ev.EMBEDDED_DIR), include_defaults=False, metadata={"cache_dir": data_cache}
    )
    assert set(et.EMBEDDED_TASKS) <= set(tm.all_tasks)
    res = lm_eval.simple_evaluate(
        model="recursive_lightning",
        model_args=f"checkpoint={run_dir},batch_size=8",
        tasks=list(et.EMBEDDED_TASKS),
        num_fewshot=1,
        limit=4,
        task_manager=tm,
        bootstrap_iters=0,
        log_samples=False,
    )
    assert res["n-samples"]["embedded_nextsent"]["effective"] == 4
    for key in ("acc,none", "acc_norm,none"):
        assert 0.0 <= res["results"]["embedded_nextsent"][key] <= 1.0
    assert 0.0 <= res["results"]["embedded_lastword"]["acc,none"] <= 1.0

    rc = main(
        ["eval", str(run_dir), "--tasks", "embedded", "--shots", "0", "--limit", "8", "--batch-size", "8"]
    )
    assert rc == 0
    metrics = _metrics(run_dir)
    keys = [
        "eval/embedded_lastword/0shot/acc",
        "eval/embedded_lastword/0shot/perplexity",
        "eval/embedded_nextsent/0shot/acc",
        "eval/embedded_nextsent/0shot/acc_norm",
        "eval/avg/0shot",
    ]
    for key in keys:
        assert key in metrics, key
        if "perplexity" not in key:
            assert 0.0 <= metrics[key] <= 1.0
    assert metrics["eval/avg/0shot"] == pytest.approx(
        (metrics["eval/embedded_lastword/0shot/acc"] + metrics["eval/embedded_nextsent/0shot/acc_norm"]) / 2
    )
    assert "embedded_nextsent" in capsys.readouterr().out


def test_sweep_files_evaluate_the_embedded_tasks(tmp_path):
    from recursive_lightning.errors import ConfigError, UserError
    from recursive_lightning.sweep.spec import load_sweep

    root = Path(__file__).resolve().parents[2]
    spec = load_sweep(root / "ablations" / "default.yaml")
    assert ev.expand_tasks(spec.evaluate["tasks"]) == (list(et.EMBEDDED_TASKS), set())
    base = root / "experiments" / "cpu" / "looped-mesh.yaml"
    for tasks, ok in (("default", True), (["embedded", "piqa"], True), (3, False), (["piqa", None], False)):
        f = tmp_path / "s.yaml"
        f.write_text(json.dumps({"name": "s", "base": str(base), "evaluate": {"tasks": tasks}}))
        if ok:
            assert load_sweep(f).evaluate["tasks"] == tasks
        else:
            with pytest.raises(ConfigError, match="evaluate.tasks must be a list of lm-eval task names"):
                load_sweep(f)
    with pytest.raises(UserError, match="tasks must be a list"):
        ev.expand_tasks(3)  # type: ignore[arg-type]
