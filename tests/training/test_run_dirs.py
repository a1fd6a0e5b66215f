"""Run directories and the commands around them: a finished run's result survives a resume, a
finished run can be extended, directories can be moved and copied, outputs are checked before any work,
SIGTERM exits non-zero, and bad input gets one sentence."""

import json
import os
import shutil
import signal
import sqlite3
from pathlib import Path

import pytest
import yaml
from conftest import read_only, run_of, tiny_config
from mlflow.tracking import MlflowClient

from recursive_lightning import cli
from recursive_lightning.config import RunConfig, load_run_config
from recursive_lightning.errors import ConfigError, Terminated, UserError
from recursive_lightning.tracking import runs
from recursive_lightning.tracking.runs import default_tracking_uri, portable_uri
from recursive_lightning.training.run import train


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_cache):
    """One finished 12-step run (validation at 6 and 12), copied by the tests that change it."""
    cfg = tiny_config(data_cache)
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(RunConfig.from_dict(cfg), run_dir)
    return run_dir, cfg


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "ppl.txt"
    p.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return p


# ------------------------------------------------------------------------------------ item 1 and 4
@pytest.mark.parametrize("result_lost", [False, True], ids=["result-kept", "killed-before-result"])
def test_resume_of_a_finished_run_keeps_its_result(finished, tmp_path, result_lost):
    """`--resume` of a finished run rewrites the same metrics; killed after its last checkpoint but before
    result.json, it validates that checkpoint again to the same metrics."""
    run_dir = _copy(finished[0], tmp_path / "run")
    before = json.loads((run_dir / "result.json").read_text())
    assert before["metrics"]["val/heldout/loss"] > 0
    if result_lost:
        (run_dir / "result.json").unlink()
    r = train(RunConfig.from_dict(finished[1]), run_dir, resume=True)
    after = json.loads((run_dir / "result.json").read_text())
    assert r.steps == after["steps"] == 12
    assert set(after["metrics"]) == set(before["metrics"])  # not {} (it was)
    for k, v in before["metrics"].items():
        assert after["metrics"][k] == pytest.approx(v, rel=1e-5), k
    assert run_of(run_dir).info.status == "FINISHED"


def test_resume_with_a_larger_max_steps_extends_a_finished_run(finished, tmp_path, capsys):
    from recursive_lightning.commands.train import main

    run_dir = _copy(finished[0], tmp_path / "run")
    assert main(["--run-dir", str(run_dir), "--resume", "--max-steps", "16"]) == 0
    out = capsys.readouterr().out  # what this command trained, then where the run stands
    assert "trained 4 steps" in out and "the run now at step 16" in out and "over 2 segments" in out
    run = run_of(run_dir)
    assert run.info.status == "FINISHED"  # not FAILED on "Changing param values is not allowed"
    assert run.data.params["train.max_steps"] == "12"  # MLflow params never change ...
    assert run.data.tags["resumed/train.max_steps"] == "16"  # ... the extension is recorded as a tag
    assert json.loads((run_dir / "result.json").read_text())["steps"] == 16
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["max_steps"] == 16  # resume uses it


# ------------------------------------------------------------------------------------ item 5
def test_a_moved_run_directory_resumes_and_evaluates_in_place(finished, tmp_path, text_file):
    from recursive_lightning.evaluation.options import EvalOptions
    from recursive_lightning.evaluation.run import evaluate_checkpoint

    old = _copy(finished[0], tmp_path / "a" / "run")
    assert (old / "mlflow_tracking_uri").read_text() == "sqlite:///mlflow.db"  # kept relative
    new = tmp_path / "b" / "run"
    new.parent.mkdir()
    old.rename(new)
    assert default_tracking_uri(new) == f"sqlite:///{new.resolve() / 'mlflow.db'}"
    cfg = RunConfig.from_dict(finished[1])
    cfg.train.max_steps = 13
    train(cfg, new, resume=True)  # was: "Run ... not found" (the old absolute store)
    res = evaluate_checkpoint(new, EvalOptions(ppl_sets={"t": str(text_file)}, tasks=[]))
    assert res["mlflow"]["tracking_uri"] == default_tracking_uri(new) and not res["mlflow"]["created"]
    assert not (tmp_path / "a" / "run").exists()  # no stray database at the old path
    run = run_of(new)
    assert "eval/ppl/t" in run.data.metrics
    assert run.info.artifact_uri.startswith((new / "mlartifacts").resolve().as_uri())


def test_a_copied_run_directory_logs_into_its_own_store(finished, tmp_path, text_file):
    from recursive_lightning.evaluation.options import EvalOptions
    from recursive_lightning.evaluation.run import evaluate_checkpoint

    original = _copy(finished[0], tmp_path / "original")
    copy = _copy(original, tmp_path / "copy")
    evaluate_checkpoint(copy, EvalOptions(ppl_sets={"t": str(text_file)}, tasks=[]))
    assert "eval/ppl/t" in run_of(copy).data.metrics
    assert "eval/ppl/t" not in run_of(original).data.metrics  # the original's store is left alone
    assert run_of(copy).info.artifact_uri.startswith((copy / "mlartifacts").resolve().as_uri())
    assert not list((original / "mlartifacts").rglob("eval-*.json"))


def test_tracking_uris_are_kept_relative_where_they_point_inside(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert portable_uri(f"sqlite:///{run / 'mlflow.db'}", run) == "sqlite:///mlflow.db"
    sweep = tmp_path / "sweep"
    (sweep / "trials" / "k").mkdir(parents=True)
    (sweep / "sweep.json").write_text("{}")
    trial = sweep / "trials" / "k"
    assert portable_uri(f"sqlite:///{sweep / 'mlflow.db'}", trial) == "sqlite:///../../mlflow.db"
    runs.record_tracking_uri(trial, f"sqlite:///{sweep / 'mlflow.db'}")
    moved = tmp_path / "elsewhere"
    sweep.rename(moved)
    assert default_tracking_uri(moved / "trials" / "k") == f"sqlite:///{moved.resolve() / 'mlflow.db'}"
    legacy = tmp_path / "legacy"  # a legacy directory: an absolute URI recorded, then moved: its own store
    legacy.mkdir()
    (legacy / "mlflow.db").write_text("")
    (legacy / "mlflow_tracking_uri").write_text(f"sqlite:///{tmp_path / 'gone' / 'mlflow.db'}")
    assert default_tracking_uri(legacy) == f"sqlite:///{legacy.resolve() / 'mlflow.db'}"
    shared = tmp_path / "shared" / "mlflow.db"  # a store outside the directory stays absolute
    assert portable_uri(f"sqlite:///{shared}", run) == f"sqlite:///{shared}"
    assert portable_uri("http://mlflow:5000", run) == "http://mlflow:5000"
    # a relative URI on the command line means the current directory, not the run directory
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        assert runs.absolute_uri("sqlite:///x.db") == f"sqlite:///{tmp_path / 'x.db'}"
    finally:
        os.chdir(cwd)


def test_artifact_roots_follow_a_moved_store(tmp_path):
    d = tmp_path / "a"
    uri = f"sqlite:///{d / 'mlflow.db'}"
    exp = runs.ensure_experiment(uri, "x", d / "mlartifacts")
    run_id = runs.create_run(uri, exp, "r")
    moved = tmp_path / "b"
    d.rename(moved)
    new_uri = f"sqlite:///{moved / 'mlflow.db'}"
    runs.log_artifact_text(new_uri, run_id, "note.txt", "hi")
    assert (moved / "mlartifacts").is_dir() and list((moved / "mlartifacts").rglob("note.txt"))
    assert not d.exists()
    with sqlite3.connect(moved / "mlflow.db") as con:
        (loc,) = con.execute("SELECT artifact_location FROM experiments WHERE name = 'x'").fetchone()
    assert loc == (moved / "mlartifacts").as_uri()


# ------------------------------------------------------------------------------------ item 6
def test_eval_checks_where_results_go_before_computing(finished, tmp_path, text_file, monkeypatch):
    from recursive_lightning.evaluation import perplexity as ppl_mod
    from recursive_lightning.evaluation.options import EvalOptions
    from recursive_lightning.evaluation.run import evaluate_checkpoint

    run_dir = _copy(finished[0], tmp_path / "run")
    read_only(monkeypatch, run_dir)
    calls = []
    real = ppl_mod.perplexity
    monkeypatch.setattr(ppl_mod, "perplexity", lambda *a, **k: calls.append(1) or real(*a, **k))
    with pytest.raises(UserError) as e:
        evaluate_checkpoint(run_dir, EvalOptions(ppl_sets={"t": str(text_file)}, tasks=[]))
    assert "read-only" in str(e.value) and "--out" in str(e.value) and not calls
    with pytest.raises(UserError, match="MLflow store"):  # the store is in the read-only directory too
        evaluate_checkpoint(
            run_dir, EvalOptions(ppl_sets={"t": str(text_file)}, tasks=[], out_dir=tmp_path / "out")
        )
    assert not calls
    res = evaluate_checkpoint(
        run_dir, EvalOptions(ppl_sets={"t": str(text_file)}, tasks=[], out_dir=tmp_path / "out", mlflow=False)
    )
    assert Path(res["json_path"]).parent == tmp_path / "out" and calls
    assert not (run_dir / "eval").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        evaluate_checkpoint(
            run_dir, EvalOptions(ppl_sets={"t": str(text_file)}, tasks=[], out_dir=tmp_path / "file")
        )


def test_probe_checks_where_results_go_before_probing(finished, tmp_path, monkeypatch):
    from recursive_lightning.commands import probe as probe_command
    from recursive_lightning.probes import run as probe_run

    run_dir = _copy(finished[0], tmp_path / "run")
    read_only(monkeypatch, run_dir)

    def no_capture(*a, **k):
        raise AssertionError("probed before checking the outputs")

    monkeypatch.setattr(probe_run, "capture", no_capture)
    with pytest.raises(UserError, match="read-only.*--out"):
        probe_command.main([str(run_dir), "--samples", "2", "--no-progress"])
    with pytest.raises(UserError, match="MLflow store"):
        probe_command.main([str(run_dir), "--samples", "2", "--no-progress", "--out", str(tmp_path / "o")])
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        probe_command.main([str(run_dir), "--no-mlflow", "--out", str(tmp_path / "file")])


# ------------------------------------------------------------------------------------ item 7
def test_sigterm_stops_train_with_143_and_the_run_resumes(tmp_path, tiny_run, monkeypatch, capsys):
    from recursive_lightning.training.module import RecursiveLMModule

    def sigterm_at_step_5(self, outputs, batch, batch_idx) -> None:
        if self.trainer.global_step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # Lightning's handler: stop at the step boundary

    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_run()))
    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(RecursiveLMModule, "on_train_batch_end", sigterm_at_step_5, raising=False)
        code = cli.main(["train", "--config", str(cfg_file), "--run-dir", str(run_dir)])
    assert code == Terminated.EXIT_CODE == 143
    assert "SIGTERM" in capsys.readouterr().err
    assert run_of(run_dir).info.status == "KILLED"
    assert not (run_dir / "result.json").exists()
    assert cli.main(["train", "--run-dir", str(run_dir), "--resume"]) == 0
    assert json.loads((run_dir / "result.json").read_text())["steps"] == 12
    assert run_of(run_dir).info.status == "FINISHED"


# ------------------------------------------------------------------------------------ item 9
def test_config_errors_are_one_sentence(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: 5\n")
    with pytest.raises(ConfigError, match="'model' section must be a mapping"):
        load_run_config(bad)
    for value in ("nan", ".nan", "inf", "-.inf"):
        with pytest.raises(ConfigError, match="train.lr must be a finite number"):
            load_run_config(None, ["--train.lr", value])
    with pytest.raises(ConfigError, match="finite"):
        load_run_config(None, ["--model.rotary_pct", "nan"])
    assert cli.main(["describe", "--config", str(bad)]) == 2
    assert "must be a mapping" in capsys.readouterr().err


def test_train_refuses_a_run_dir_it_cannot_use(tmp_path, tiny_run, monkeypatch):
    cfg = RunConfig.from_dict(tiny_run())
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        train(cfg, tmp_path / "file")
    read_only(monkeypatch, tmp_path / "ro")
    (tmp_path / "ro").mkdir()
    with pytest.raises(ConfigError, match="read-only"):
        train(cfg, tmp_path / "ro" / "run")


def test_ckpt_path_of_another_run_is_refused(finished, tmp_path, tiny_run):
    other = tiny_run()
    other["data"]["seq_len"] = 32
    with pytest.raises(ConfigError, match="data.seq_len"):
        train(
            RunConfig.from_dict(other),
            tmp_path / "run",
            ckpt_path=str(finished[0] / "checkpoints" / "last.ckpt"),
        )


def test_lm_eval_shows_our_errors_as_one_sentence(capsys):
    from recursive_lightning.evaluation import harness_hook

    seen = []
    harness_hook._excepthook(UserError, UserError("checkpoint 'x' does not exist."), None)
    assert capsys.readouterr().err == "error: checkpoint 'x' does not exist.\n"
    harness_hook._excepthook(KeyError, KeyError("k"), None, lambda *a: seen.append(a[0]))
    assert seen == [KeyError]  # anything else keeps its traceback


# ------------------------------------------------------------------------------------ item 10
def test_bare_command_says_it_runs_the_default_sweep(monkeypatch, capsys):
    import types

    ran = []
    stub = types.ModuleType("stub_sweep")
    stub.main = lambda argv: ran.append(argv) or 0
    monkeypatch.setitem(__import__("sys").modules, "stub_sweep", stub)
    monkeypatch.setitem(cli.COMMANDS, "sweep", "stub_sweep")
    assert cli.main([]) == 0 and ran == [[]]
    assert "running `sweep`" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "runs `sweep`" in capsys.readouterr().out


def test_resume_of_an_empty_directory_says_it_starts_from_scratch(tmp_path, tiny_run, capsys):
    cfg = tiny_run()
    cfg["train"].update(max_steps=2, val_every=2, checkpoint_every=2)
    (tmp_path / "run").mkdir()
    train(RunConfig.from_dict(cfg), tmp_path / "run", resume=True)
    assert "holds no checkpoint yet; training from step 0" in capsys.readouterr().err


def test_a_damaged_last_checkpoint_is_reported_when_an_older_one_is_used(finished, tmp_path, capsys):
    from recursive_lightning.training.checkpoint import load_checkpoint

    run_dir = _copy(finished[0], tmp_path / "run")
    last = run_dir / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    loaded = load_checkpoint(run_dir)
    assert loaded.path.name == "step=000012.ckpt"
    err = capsys.readouterr().err
    assert "last.ckpt' is damaged" in err and "step=000012.ckpt" in err


@pytest.mark.parametrize(
    "argv, text",
    [
        (["describe", "--help"], "tokens per sequence"),
        (["describe", "--help"], "sequences per forward pass"),
        (["train", "--help"], "extends it"),
        (["train", "--help"], "train.seed"),
        (["generate", "--help"], "tokens to generate"),
        (["generate", "--help"], "cuda:N (default cpu)"),
        (["eval", "--help"], "one token stream"),
        (["eval", "--help"], "sequences per forward pass (default 16)"),
    ],
)
def test_options_have_help(argv, text, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert text in " ".join(capsys.readouterr().out.split())


INTERRUPT_AT = """
import sys
import lightning as L
from recursive_lightning.cli import main

class CtrlC(L.Callback):  # the user presses Ctrl-C right after step 3: what Python's SIGINT handler raises
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 3:
            raise KeyboardInterrupt

import recursive_lightning.commands.train as run
fit = run.train
run.train = lambda *a, **k: fit(*a, **{**k, "callbacks": [CtrlC()]})
sys.exit(main(["train", "--config", sys.argv[1], "--run-dir", sys.argv[2]]))
"""


def test_ctrl_c_during_training_exits_130_and_marks_the_run_killed(tmp_path, tiny_run):
    """Lightning turns Ctrl-C inside fit into sys.exit(1); train reports it as the interrupt it was."""
    import subprocess
    import sys

    import yaml

    cfg = tiny_run()
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run(
        [sys.executable, "-c", INTERRUPT_AT, str(tmp_path / "c.yaml"), str(tmp_path / "run")],
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 130, p.stdout + p.stderr
    run_id = (tmp_path / "run" / "mlflow_run_id").read_text().strip()
    status = MlflowClient(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}").get_run(run_id).info.status
    assert status == "KILLED"


# ------------------------------------------ a command stopped at any instant: the run's status says what happened
def _stopped_at(point: str, tmp_path: Path, cfg_file: Path, run_dir: Path, *extra, signum=signal.SIGINT):
    """`train` run as a user types it, held at the named fault point (``pause``) until ``signum`` arrives:
    (exit status, output)."""
    import subprocess

    from test_run_dir_lock import QUIET, _train, wait_for

    mark = tmp_path / f"at-{point}"
    env = {
        **QUIET,
        "RECURSIVE_LIGHTNING_FAULT": f"{point}:1:pause",
        "RECURSIVE_LIGHTNING_FAULT_MARK": str(mark),
    }
    p = subprocess.Popen(
        _train("--config", cfg_file, "--run-dir", run_dir, *extra),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # as from a terminal: Python's Ctrl-C handler installed (a shell's background job ignores SIGINT)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_for(mark, p)
        p.send_signal(signum)
        out, _ = p.communicate(timeout=600)
    finally:
        p.kill()
    return p.returncode, out


@pytest.mark.parametrize("point", ["run_opened", "checkpoint_write_last"])
def test_ctrl_c_during_set_up_or_while_last_ckpt_is_written_ends_the_run_killed(point, tmp_path, tiny_run):
    """Ctrl-C after the MLflow run is RUNNING but before training starts, or while `last.ckpt` is being written
    (inside torch.save it would surface as the zip writer's error): exit 130, the run KILLED, no `*.tmp` left;
    a checkpoint being written is completed first and resumes. The set-up case prepares its data in the
    command (a cache of its own): litdata's handler, which would exit 0 on Ctrl-C, is not left behind."""
    cfg = tiny_run()
    if point == "run_opened":
        cfg["data"]["cache_dir"] = str(tmp_path / "cache")
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    code, out = _stopped_at(point, tmp_path, cfg_file, run_dir)
    assert code == 130, out
    assert "Traceback" not in out and "inline_container" not in out, out
    assert run_of(run_dir).info.status == "KILLED"
    assert not list(run_dir.rglob("*.tmp")) and not (run_dir / "result.json").exists()
    if point == "checkpoint_write_last":
        from recursive_lightning.training.checkpoint import read_checkpoint

        assert read_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 4


def test_a_full_disk_while_a_finished_run_is_extended_keeps_it_finished(finished, tmp_path):
    """The disk fills while `train --resume --max-steps 16` of a finished run writes `last.ckpt`: the command
    fails, the run stays FINISHED with its result.json as it was, and no `*.tmp` file is left."""
    import subprocess

    from test_run_dir_lock import QUIET, _train

    run_dir = _copy(finished[0], tmp_path / "run")
    result = (run_dir / "result.json").read_bytes()
    env = {**QUIET, "RECURSIVE_LIGHTNING_FAULT": "checkpoint_write_last:1:raise"}
    p = subprocess.run(
        _train("--run-dir", run_dir, "--resume", "--max-steps", 16), env=env, capture_output=True, text=True
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert (
        f"error: no space left on the device to write '{run_dir / 'checkpoints' / 'last.ckpt'}'" in p.stderr
    )
    assert run_of(run_dir).info.status == "FINISHED"
    assert (run_dir / "result.json").read_bytes() == result
    assert not list(run_dir.rglob("*.tmp"))


@pytest.mark.parametrize(
    "point, written",
    [("checkpoint_write_last", "checkpoints/last.ckpt"), ("write_result.json", "result.json")],
    ids=["checkpoint", "result"],
)
def test_a_full_disk_while_a_checkpoint_or_the_result_is_written_is_one_sentence(
    point, written, tmp_path, tiny_run
):
    """The disk fills (the fault point raises ENOSPC) while `train` writes its first `last.ckpt` or its
    `result.json`: one sentence naming the file and "no space left" (exit 2), no traceback, the MLflow run
    FAILED, no `*.tmp` file left and no result.json."""
    import subprocess

    from test_run_dir_lock import QUIET, _train

    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_run()))
    run_dir = tmp_path / "run"
    env = {**QUIET, "RECURSIVE_LIGHTNING_FAULT": f"{point}:1:raise"}
    p = subprocess.run(
        _train("--config", cfg_file, "--run-dir", run_dir),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: no space left on the device to write '{run_dir / written}'; free space on its file system (or "
        "choose another folder), then run the command again."
    ), p.stderr
    assert run_of(run_dir).info.status == "FAILED"
    assert not list(run_dir.rglob("*.tmp")) and not (run_dir / "result.json").exists()


def test_sigterm_the_instant_train_takes_a_new_run_dir_leaves_no_folder(tmp_path, tiny_run):
    """SIGTERM right after `train` took the writer lock of a new --run-dir, before anything was written: exit 143
    in one sentence, and the directory it created (holding only `.writer.lock`) is removed."""
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_run()))
    run_dir = tmp_path / "run"
    code, out = _stopped_at("run_dir_locked", tmp_path, cfg_file, run_dir, signum=signal.SIGTERM)
    assert code == 143 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1] == (
        "train: stopped by SIGTERM outside a training step; run the same command again (with --resume where the "
        "run directory holds its MLflow run)."
    ), out
    assert not run_dir.exists()


def test_ctrl_c_while_the_corpus_is_tokenised_exits_130_and_leaves_nothing_half_written(tmp_path, tiny_run):
    """Ctrl-C while a litdata worker tokenises the corpus (data preparation, before the MLflow run is opened):
    exit 130, not litdata's 0; no half-built shard folder or litdata scratch folder in the cache, and no run
    directory (nothing of value was written to it)."""
    from recursive_lightning.data.shards import is_complete

    cfg = tiny_run()
    cfg["data"]["cache_dir"] = str(tmp_path / "cache")  # a cache of its own: the corpus is tokenised here
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    code, out = _stopped_at("tokenising", tmp_path, cfg_file, run_dir)
    assert code == 130 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1] == "interrupted", out
    shards = tmp_path / "cache" / "shards"
    assert [d.name for d in shards.iterdir() if not is_complete(d)] == [], list(shards.rglob("*"))
    assert not list((tmp_path / "cache").rglob("*.tmp"))
    assert not run_dir.exists()


def test_sigterm_before_the_first_checkpoint_says_no_checkpoint_exists(tmp_path, tiny_run):
    """SIGTERM at step 1, before `train.checkpoint_every` wrote anything: the sentence does not promise a resume
    from a checkpoint that does not exist; it says a --resume starts from step 0."""
    cfg = tiny_run()
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    code, out = _stopped_at("training_step", tmp_path, cfg_file, run_dir, signum=signal.SIGTERM)
    assert code == 143, out
    assert not list((run_dir / "checkpoints").glob("*.ckpt")), out
    assert (
        out.strip()
        .splitlines()[-1]
        .endswith(
            "no checkpoint was written yet (train.checkpoint_every 4): a --resume starts from step 0: python -m "
            f"recursive_lightning train --resume --run-dir {run_dir}"
        )
    ), out
    assert "resumable from its last checkpoint" not in out, out


MELA = Path(__file__).resolve().parents[2] / "experiments" / "cpu" / "mela.yaml"
REFUSED = {  # flags: the end of the sentence; data.path and init_from are refused after the run dir is locked
    "--train.memory_kernel triton": "train.memory_kernel triton needs a CUDA GPU; set it torch on the CPU.",
    "--train.cuda_graphs true": "train.cuda_graphs needs a CUDA GPU; set it false on the CPU.",
    "--train.strategy fsdp --train.compile true": "train.compile with train.strategy fsdp fails on the CPU "
    "(torch.compile's C++ code generator rejects the FSDP2-wrapped layers); set train.compile false there, or "
    "train on GPUs.",
    "--model.d_model 100000000": "choose a smaller model (model.d_model, model.layout, model.preset) or a "
    "machine with more memory.",
    "--data.path /no/such/corpus.txt": "The data path /no/such/corpus.txt does not exist; pass an existing "
    "file, folder, glob or hf:<dataset>.",
    "--init-from /no/such/model": "train.init_from '/no/such/model' does not exist; pass a checkpoint or run "
    "directory of this package, a local Hugging Face model directory, or a Hub name.",
}


@pytest.mark.parametrize("flags", REFUSED, ids=lambda f: f.split()[0].split(".")[-1])
@pytest.mark.parametrize("run_dir_flag", [True, False], ids=["run-dir", "default-run-dir"])
def test_a_refused_train_leaves_nothing_on_disk(
    flags, run_dir_flag, tmp_path, data_cache, monkeypatch, capsys
):
    """A refusal after the config was read (this machine cannot run it, the data or the pretrained model is
    missing) exits 2 in one sentence and leaves no folder: not the --run-dir, not the parents it would have
    made, not runs/. A refusal that needs only the config comes before the run directory's lock makes any."""
    from recursive_lightning.training import run_lock

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton's interpreter would run triton on the CPU
    made = []
    make_dirs = run_lock._make_dirs
    monkeypatch.setattr(run_lock, "_make_dirs", lambda folder: made.append(folder) or make_dirs(folder))
    monkeypatch.chdir(tmp_path)  # the default run directory: runs/<name> here
    before = set(tmp_path.rglob("*"))
    argv = ["train", "--config", str(MELA), "--train.accelerator", "cpu", "--data.cache_dir", data_cache]
    argv += flags.split()
    if run_dir_flag:
        argv += ["--run-dir", str(tmp_path / "a" / "b" / "run")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: ") and err.strip().endswith(REFUSED[flags]), err
    assert len(err.strip().splitlines()) == 1, err
    assert set(tmp_path.rglob("*")) == before
    # a refusal that needs only the config comes before any folder; a later one removed what the lock made
    assert bool(made) is flags.startswith(("--data.path", "--init-from")), made
