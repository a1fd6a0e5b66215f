"""The public Python API (``recursive_lightning.__all__``): the README's "Python API" script runs as written,
and the package import stays free of torch."""

from __future__ import annotations

import ast
import math
import re
import subprocess
import sys
from pathlib import Path

import recursive_lightning

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_script() -> str:
    """The python block of the README's "Python API" section."""
    section = README.read_text().split("### Python API\n", 1)[1].split("\n#", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_script_trains_reloads_and_evaluates_through_the_public_api(tmp_path, monkeypatch, data_cache):
    script = readme_script()
    imported = {
        (node.module, alias.name)
        for node in ast.walk(ast.parse(script))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert {module for module, _ in imported} == {"recursive_lightning"}  # nothing but the public names
    assert {name for _, name in imported} <= set(recursive_lightning.__all__)
    assert len(script.splitlines()) <= 12
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RECURSIVE_LIGHTNING_CACHE", data_cache)  # the session's tokenizer and shards
    ns: dict = {}
    exec(compile(script, "<README.md: Python API>", "exec"), ns)
    assert tuple(ns["logits"].shape) == (2, 16, ns["cfg"].vocab_size)
    result, loaded, scores = ns["result"], ns["loaded"], ns["scores"]
    assert any(k.endswith("/ppl") for k in result.metrics)
    assert result.steps == 12 and result.run_dir == (tmp_path / "runs" / "api").resolve()
    assert loaded.global_step == 12 and loaded.run.model == ns["cfg"]
    assert type(loaded.model).__name__ == "RecursiveLM"
    ppl = scores["ppl"]["heldout"]["ppl"]
    assert math.isfinite(ppl) and 1 < ppl < ns["cfg"].vocab_size  # it learnt something in 12 steps
    assert Path(scores["json_path"]).is_file()


def test_run_sweep_returns_the_sweeps_outcome(tmp_path, monkeypatch, data_cache):
    """``run_sweep`` is the library function the ``sweep`` command calls: it returns a ``SweepOutcome`` (the
    command's exit status is one of its fields)."""
    from conftest import write_sweep

    monkeypatch.setenv("TQDM_DISABLE", "1")  # what a sweep outside a terminal sets, undone after the test
    spec = write_sweep(tmp_path / "sweep.yaml", data_cache, "api-sweep", {"model.topology": ["base"]})
    outcome = recursive_lightning.run_sweep(spec, tmp_path / "sweep")
    assert isinstance(outcome, recursive_lightning.SweepOutcome)
    assert (outcome.status, outcome.exit_status, outcome.finished, outcome.failed) == ("FINISHED", 0, 1, 0)
    assert outcome.sweep_dir == (tmp_path / "sweep").resolve() and outcome.name == "api-sweep"
    assert (
        outcome.report is not None and outcome.report.parent == outcome.sweep_dir and outcome.report.is_file()
    )
    assert outcome.best_row and f"`{outcome.best_row}`" in outcome.best and not outcome.unfinished


def test_every_public_name_resolves_and_dir_lists_it():
    assert sorted(recursive_lightning.__all__) == recursive_lightning.__all__
    assert set(recursive_lightning.__all__) <= set(dir(recursive_lightning))
    for name in recursive_lightning.__all__:
        value = getattr(recursive_lightning, name)
        assert callable(value), name
        assert value is getattr(__import__("recursive_lightning", fromlist=[name]), name)
    try:
        recursive_lightning.not_a_name  # noqa: B018
    except AttributeError as e:
        assert "not_a_name" in str(e)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def test_importing_the_package_and_cli_help_load_no_heavy_library():
    heavy = ("torch", "lightning", "mlflow", "optuna", "matplotlib", "lm_eval", "transformers", "litdata")
    code = (
        "import sys, runpy\n"
        "import recursive_lightning\n"
        "sys.argv = ['recursive_lightning', '--help']\n"
        "try:\n    runpy.run_module('recursive_lightning', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(heavy)!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
