"""A sweep whose every trial failed: the report and the command's last lines say that (how many trials, where
their errors and files are), not that a metric is missing from finished trials."""

from __future__ import annotations

from conftest import ENV, command_output, sweep_output, write_sweep


def test_a_sweep_whose_every_trial_failed_says_so(tmp_path, data_cache):
    spec = write_sweep(
        tmp_path / "s.yaml", data_cache, "s", {"variant": {"a": {"model.topology": "base"}}}, max_retries=0
    )
    run_dir = tmp_path / "out"
    # a disk that fills as the trial starts training: the trial fails, the sweep goes on to its report
    env = {**ENV, "RECURSIVE_LIGHTNING_FAULT": "before_training:1:raise"}
    code, out = sweep_output(spec, "--run-dir", run_dir, env=env, timeout=600)
    assert code != 0 and "Traceback" not in out, out
    said = (
        f'best: none: every trial failed (1 of 1); their errors are listed under "Failed trials" in '
        f"{run_dir / 'report.md'}, and each trial's files are in its folder under trials/"
    )
    assert said in out.splitlines(), out
    assert "no finished trial has" not in out, out
    header = (
        "**Every trial failed** (1 of 1), so no metric was recorded: each one's error is listed under *Failed "
        "trials* below, and its files are in its folder under `trials/`."
    )
    assert header in (run_dir / "report.md").read_text().splitlines()
    code, out = command_output("report", "--run-dir", run_dir, "--no-mlflow", timeout=600)
    assert code == 0 and header in out.splitlines(), out
