"""What a researcher sees in MLflow: throughput over training time only, the resolved config logged once,
the corpus as a dataset input, system metrics, and the ``ui`` command on a moved or copied directory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest

from recursive_lightning.config import RunConfig
from recursive_lightning.tracking.runs import client
from recursive_lightning.training.run import train


class _Clock:
    """A deterministic clock: each phase of a step advances it by a fixed amount."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Phases(L.Callback):
    """Data loading 0.2 s, forward+backward 1.0 s per step; validation 10 s, a checkpoint write 5 s: only
    the step intervals are training time."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def setup(self, trainer, pl_module, stage) -> None:
        pl_module._clock = self.clock

    def on_train_batch_start(self, *args) -> None:
        self.clock.t += 0.2

    def on_before_optimizer_step(self, *args) -> None:
        self.clock.t += 1.0

    def on_validation_start(self, *args) -> None:
        self.clock.t += 10.0

    def on_save_checkpoint(self, *args) -> None:
        self.clock.t += 5.0


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_cache):
    from conftest import tiny_config

    raw = tiny_config(data_cache)
    # validations at 6 and 12, checkpoints at 5 and 10 (and after the first validation: best.ckpt); lr ~0 keeps
    # the second validation from improving, so no checkpoint write follows it
    raw["train"].update(max_steps=14, val_every=6, checkpoint_every=5, lr=1e-12)
    cfg = RunConfig.from_dict(raw)
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    clock = _Clock()
    # MLflow samples system metrics every 10 s by default; a quiet machine trains this run in less
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
    try:
        result = train(cfg, run_dir, callbacks=[_Phases(clock)])
    finally:
        mp.undo()
    return cfg, result


def test_tokens_per_sec_counts_training_time_only(finished):
    cfg, r = finished
    history = client(r.tracking_uri).get_metric_history(r.mlflow_run_id, "train/tokens_per_sec")
    by_step = {m.step: m.value for m in history}
    tokens = cfg.data.batch_size * cfg.data.seq_len
    assert 0 not in by_step  # the first step (warm-up) is not reported
    assert len(by_step) == cfg.train.max_steps - 1
    # steady steps: 1.2 s from the previous step's end; after a validation or a checkpoint: 1.0 s
    assert min(by_step.values()) == pytest.approx(tokens / 1.2)
    assert max(by_step.values()) == pytest.approx(tokens / 1.0)
    for after in (6, 12):  # the steps logged after the validations (logged at the step count before them)
        assert by_step[after] <= 1.3 * by_step[after - 1], (after, by_step)


def test_resolved_config_is_logged_once(finished):
    cfg, r = finished
    run = client(r.tracking_uri).get_run(r.mlflow_run_id)
    params = run.data.params
    assert not [k for k in params if k.startswith("run/")]  # not again as Lightning's hparams
    assert params["model.buffer"] == "5"  # MeSH's default B = N_loop + 3, resolved (1+2R2+1: N_loop 2)
    assert "describe.buffer" not in params and "describe.layout" not in params
    fields = {k.split(".", 1)[1] for k in params if k.split(".", 1)[0] in ("model", "data", "train")}
    assert not {k.removeprefix("describe.") for k in params if k.startswith("describe.")} & fields
    assert params["model.mlp_hidden"] == str(4 * cfg.model.d_model)  # resolved, not None
    assert not [k for k, v in params.items() if v == "None"]
    assert "model.patch_size" not in params  # Mela's fields do not act on a looped model
    assert params["describe.params_total"].isdigit()
    assert run.data.tags["run_dir"] == str(r.run_dir)


def test_the_corpus_is_a_dataset_input(finished):
    cfg, r = finished
    inputs = client(r.tracking_uri).get_run(r.mlflow_run_id).inputs.dataset_inputs
    by_context = {{t.key: t.value for t in i.tags}["mlflow.data.context"]: i.dataset for i in inputs}
    assert set(by_context) == {"training", "validation"}
    train = by_context["training"]
    # the session's data cache holds the shards of every test's tokenizer: the run's are the ones whose corpus and
    # tokenizer fingerprints make its digest
    metas = [json.loads(f.read_text()) for f in Path(cfg.data.cache_dir, "shards").glob("*/meta.json")]
    ours = [
        m for m in metas if train.digest == (m["corpus_fingerprint"] + m["tokenizer_fingerprint"][:8])[:36]
    ]
    assert len(ours) == 1, (train.digest, metas)
    meta = ours[0]
    assert train.name == "embedded-corpus/train" and train.source_type == "local"
    assert json.loads(train.profile)["tokens"] == meta["train_tokens"]
    assert json.loads(by_context["validation"].profile)["tokens"] == meta["val_tokens"]


def test_system_metrics_are_logged(finished):
    _, r = finished
    keys = client(r.tracking_uri).get_run(r.mlflow_run_id).data.metrics
    assert "system/cpu_utilization_percentage" in keys and "system/system_memory_usage_megabytes" in keys


def test_ui_points_a_copied_run_directory_at_its_own_artifacts(finished, tmp_path):
    import shutil

    from recursive_lightning.tracking.ui import servable, store_of

    _, r = finished
    copy = tmp_path / "copy"
    shutil.copytree(r.run_dir, copy)
    from mlflow.tracking import MlflowClient  # MLflow's own client: what `mlflow server` reads

    uri = servable(store_of(copy), tmp_path)
    raw = MlflowClient(uri)
    run = raw.get_run(r.mlflow_run_id)
    assert run.info.artifact_uri.startswith((copy / "mlartifacts").as_uri())
    names = {f.path for f in raw.list_artifacts(r.mlflow_run_id)}
    assert "config.yaml" in names


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["killed", "terminal-closed"])
def test_ui_leaves_no_server_behind(finished, sig):
    """The MLflow server runs in its own session (Ctrl-C reaches `ui`, which stops it): a `ui` killed outright
    or whose terminal closes takes the server and every process it started (uvicorn, job runners) with it."""
    import psutil

    _, r = finished
    ui = subprocess.Popen(
        [sys.executable, "-m", "recursive_lightning", "ui", str(r.run_dir), "--port", "5300"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server: list[psutil.Process] = []
    try:
        line = ui.stdout.readline()
        assert line.startswith("MLflow UI at http://127.0.0.1:"), line + ui.stdout.read()
        server = psutil.Process(ui.pid).children(recursive=True)
        assert any("uvicorn" in " ".join(p.cmdline()) for p in server)
        ui.send_signal(sig)
        ui.wait(timeout=300)  # bounds, not timings: stopping uvicorn on a loaded machine takes its time
        _, alive = psutil.wait_procs(server, timeout=300)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
    finally:
        ui.kill()
        for p in server:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def test_ui_names_a_directory_without_a_store(tmp_path):
    from recursive_lightning.cli import main

    assert main(["ui", str(tmp_path / "missing")]) == 2
    assert main(["ui", str(tmp_path)]) == 2


def test_report_on_an_unreachable_study_is_one_sentence(tmp_path, capsys):
    import socket

    from recursive_lightning.cli import main

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "sweep.json").write_text(
        json.dumps(
            {
                "name": "gone",
                "storage": f"postgresql+psycopg://nobody@127.0.0.1:{port}/optuna",
                "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            }
        )
    )
    assert main(["report", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot open the Optuna storage") and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "uri, says",
    [
        (
            "postgresql://user@127.0.0.1:1/db",
            "error: --tracking-uri 'postgresql://user@127.0.0.1:1/db' asks SQLAlchemy for the psycopg2 driver, "
            "which is not installed; write postgresql+psycopg://user@127.0.0.1:1/db",
        ),
        (
            "postgresql+psycopg://user@127.0.0.1:1/db",
            "error: cannot open the MLflow tracking store --tracking-uri 'postgresql+psycopg://user@127.0.0.1:1/db' "
            "(connection failed",
        ),
    ],
    ids=["default-driver", "nothing-listening"],
)
def test_ui_of_a_database_that_does_not_answer_is_one_sentence_at_once(uri, says, tmp_path):
    """`ui --tracking-uri postgresql://...` where nothing listens: one sentence before any server starts (the
    mlflow server waited on the database for minutes); the subprocess's limit only stops a hang."""
    from conftest import command_output

    code, out = command_output("ui", "--tracking-uri", uri, timeout=120)
    assert code == 2, out
    assert len(out.strip().splitlines()) == 1 and out.startswith(says), out


def test_ui_of_a_folder_store_is_the_servers_sentence_without_its_stack(tmp_path):
    """`ui --tracking-uri file:///...`: a folder that does not exist is refused as a missing SQLite file is; one
    that MLflow's server refuses gives its error's line only (no stack lines from its log)."""
    from conftest import ENV, command_output

    code, out = command_output("ui", "--tracking-uri", f"file://{tmp_path}/nothing")
    assert code == 2 and out.strip() == (
        f"error: ui: --tracking-uri 'file://{tmp_path}/nothing': '{tmp_path}/nothing' does not exist; pass the "
        "mlflow.db of a run or sweep directory, or the directory itself."
    ), out
    env = {
        k: v for k, v in ENV.items() if k != "MLFLOW_ALLOW_FILE_STORE"
    }  # this MLflow refuses folder stores
    code, out = command_output("ui", "--tracking-uri", f"file://{tmp_path}", env=env, timeout=300)
    assert code == 2, out
    assert len(out.strip().splitlines()) == 1 and "File " not in out, out
    assert out.startswith(
        f"error: ui: mlflow server could not serve the store file://{tmp_path} (exit code 1): "
    ), out
    assert "MlflowException: The filesystem tracking backend" in out, out
    assert list(tmp_path.iterdir()) == []
