"""`train --resume` of a run directory that cannot continue its MLflow run as it stands: every checkpoint
deleted (training again from step 0 would log each step twice into the same run), every checkpoint damaged, its
config.yaml damaged. Each is one sentence naming the directory or file and the fix (exit 2), and neither the
directory nor the MLflow run changes (its status, its metric history)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from conftest import ENV, command_output, run_of

from recursive_lightning.config import load_run_config


def _state(run: Path) -> tuple[dict, str, int]:
    """Every file of ``run`` (content hash), its MLflow run's status and the number of points of its loss."""
    from mlflow.tracking import MlflowClient

    from recursive_lightning.tracking.runs import default_tracking_uri

    files = {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(run.rglob("*"))
    }
    r = run_of(run)
    points = len(MlflowClient(default_tracking_uri(run)).get_metric_history(r.info.run_id, "train/loss"))
    return files, r.info.status, points


def _refused(run: Path, *flags: str) -> str:
    before = _state(run)
    rc, out = command_output("train", "--resume", "--run-dir", run, *flags, timeout=600)
    assert rc == 2, out
    assert "Traceback" not in out, out
    assert _state(run) == before  # nothing written: no checkpoint, no config, no MLflow point or status
    assert before[1] == "FINISHED"
    (line,) = [x for x in out.splitlines() if x.startswith("error:")]
    return line


def test_resume_after_every_checkpoint_was_deleted_is_refused(trained_run, tmp_path):
    run = shutil.copytree(trained_run, tmp_path / "run")
    for ckpt in (run / "checkpoints").glob("*.ckpt"):
        ckpt.unlink()
    assert _refused(run) == (
        f"error: --resume: the checkpoints of the run in '{run}' are gone, so it would train again from step 0 "
        f"into the MLflow run that already holds its steps; restore a checkpoint into '{run / 'checkpoints'}', "
        "or start the run afresh with a new --run-dir."
    )


def test_resume_with_every_checkpoint_damaged_names_the_file_and_the_fix(trained_run, tmp_path):
    run = shutil.copytree(trained_run, tmp_path / "run")
    for ckpt in (run / "checkpoints").glob("*.ckpt"):
        ckpt.write_bytes(ckpt.read_bytes()[:1000])  # a disk that filled: each cut short
    assert _refused(run) == (
        f"error: --resume: every checkpoint in '{run / 'checkpoints'}' is damaged or truncated (the newest, "
        f"'{run / 'checkpoints' / 'last.ckpt'}', cannot be read); restore one from a backup, or start the run "
        "again with a new --run-dir."
    )


def test_resume_with_a_damaged_config_names_the_line_and_the_fix(trained_run, tmp_path):
    run = shutil.copytree(trained_run, tmp_path / "run")
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("  layout:", "\tlayout:", 1))
    line = next(i for i, x in enumerate(config.read_text().splitlines(), 1) if "\t" in x)
    said = _refused(run)
    assert said.startswith(
        f"error: config file '{config}' has a tab on line {line}; YAML indents with spaces, so replace the tab "
        f"with spaces; it is the config the run in '{run}' was started with: repair it, or pass the config"
    ), said


def test_resume_checks_the_overrides_against_the_runs_own_config(trained_run, tmp_path):
    """An override that the run's own config takes but the default config does not (its data.seq_len 256 is
    longer than 100): the resume's own refusal of the changed field, not the default config's."""
    run = shutil.copytree(trained_run, tmp_path / "run")
    assert _refused(run, "--model.max_seq_len", "100") == (
        f"error: --resume: model.max_seq_len is 100 but the run in '{run}' was started with 128; resume with the "
        "same config or use a new --run-dir."
    )


def test_resume_of_a_mela_run_with_the_triton_kernel_on_the_cpu_says_it_needs_cuda(tmp_path):
    """``--train.memory_kernel triton`` onto a CPU Mela run's config: the CUDA refusal (checked against the
    default config, a recursive model, the override would be refused as Mela's kernel); nothing in the run
    directory changes."""
    run = tmp_path / "run"
    run.mkdir()
    mela = Path(__file__).resolve().parents[2] / "experiments" / "cpu" / "mela.yaml"
    (run / "config.yaml").write_text(load_run_config(mela, ["--train.accelerator", "cpu"]).to_yaml())
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    env = {k: v for k, v in ENV.items() if k != "TRITON_INTERPRET"}  # the interpreter runs triton on the CPU
    rc, out = command_output(
        "train", "--resume", "--run-dir", run, "--train.memory_kernel", "triton", env=env
    )
    assert rc == 2 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1] == (
        "error: train.memory_kernel triton needs a CUDA GPU; set it torch on the CPU."
    ), out
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert set(tmp_path.rglob("*")) == {run, run / "config.yaml"}


def test_resuming_a_finished_run_with_no_step_left_logs_no_second_final_point(trained_run, tmp_path):
    """A finished run resumed at its own max_steps reaches the same end again: its ``final/*`` history keeps one
    point per metric, where each resume appended another at the same step."""
    from mlflow.tracking import MlflowClient

    from recursive_lightning.tracking.runs import default_tracking_uri

    run = shutil.copytree(trained_run, tmp_path / "run")
    for _ in range(2):
        code, out = command_output("train", "--resume", "--run-dir", run, timeout=600)
        assert code == 0, out
    r = run_of(run)
    assert r.info.status == "FINISHED"
    final = [k for k in r.data.metrics if k.startswith("final/")]
    assert final, r.data.metrics
    c = MlflowClient(default_tracking_uri(run))
    for key in final:
        assert len(c.get_metric_history(r.info.run_id, key)) == 1, key
