"""Every edge answers in one sentence (exit 2, nothing left on disk); every printed number is true.

The hostile new user's cases live in ``tests/edge_cases.py``; each runs the command as a user types it (through
``cli.main``, in this process: most refusals come before any training) and checks its exit status, its one
sentence and that no file under the run, the inputs or the output folder changed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from edge_cases import CASES, make_inputs

ROOT = Path(__file__).resolve().parents[1]


def snapshot(*folders: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for folder in folders:
        if folder.exists():
            for p in sorted(folder.rglob("*")):
                st = p.lstat()
                out[str(p)] = (st.st_size, st.st_mtime_ns) if p.is_file() else (0, 0)
    return out


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    from recursive_lightning.cli import main

    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusals (exit 2)
        rc = e.code if isinstance(e.code, int) else 1
    return rc, capsys.readouterr().err


def one_sentence(err: str) -> str:
    """The error line (``error: ...``); fails on a traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(("error:", "usage:")) or ": error:" in line]
    assert lines, err
    return lines[-1]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hostile")
    make_inputs(folder, ROOT)
    return folder


@pytest.fixture(scope="module")
def damaged(trained_run, tmp_path_factory) -> Path:
    """A copy of the trained run whose last.ckpt was cut short (a disk filled while it was written)."""
    run = tmp_path_factory.mktemp("damaged") / "run"
    shutil.copytree(trained_run, run)
    last = run / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])
    return run


@pytest.fixture(scope="module")
def broken(trained_run, hf_model_dirs, tmp_path_factory) -> Path:
    """Copies of the trained run with one part emptied, overwritten, cut short or deleted, a sweep directory
    whose study database is not one, and Hugging Face model folders without their weights, with them cut short
    and without config.json (``{broken}/<name>`` in the cases)."""
    import json

    root = tmp_path_factory.mktemp("broken")
    for name in ("hf-no-weights", "hf-cut-weights", "hf-no-config"):
        shutil.copytree(hf_model_dirs["neox"], root / name)
    (root / "hf-no-weights" / "model.safetensors").unlink()
    weights = root / "hf-cut-weights" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (root / "hf-no-config" / "config.json").unlink()
    for name in ("empty-db", "garbage-db", "truncated-db", "no-config"):
        shutil.copytree(trained_run, root / name)
    (root / "empty-db" / "mlflow.db").write_bytes(b"")
    (root / "garbage-db" / "mlflow.db").write_bytes(b"not a database\n" * 100)
    db = root / "truncated-db" / "mlflow.db"
    db.write_bytes(db.read_bytes()[: db.stat().st_size // 2])
    (root / "no-config" / "config.yaml").unlink()
    for name in ("ckpt-folder", "store-gone"):
        shutil.copytree(trained_run, root / name)
    (
        root / "ckpt-folder" / "checkpoints" / "last.ckpt"
    ).unlink()  # a folder in its place: no sharded checkpoint
    (root / "ckpt-folder" / "checkpoints" / "last.ckpt").mkdir()
    # the store its mlflow_tracking_uri names is gone (opening it would create it, and a new run in it)
    (root / "store-gone" / "mlflow_tracking_uri").write_text(f"sqlite:///{root / 'gone' / 'store.db'}")
    sweep = root / "sweep"
    sweep.mkdir()
    (sweep / "optuna.db").write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 8)
    stores = {
        "storage": f"sqlite:///{sweep / 'optuna.db'}",
        "tracking_uri": f"sqlite:///{sweep / 'mlflow.db'}",
    }
    (sweep / "sweep.json").write_text(json.dumps({"name": "s", **stores, "parent_run_id": None}))
    return root


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_input_is_one_sentence_and_changes_nothing(
    case, trained_run, inputs, damaged, broken, tmp_path, capsys, monkeypatch
):
    name, argv, says = case
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(out)  # a default path (runs/<name>) lies in the folder that must stay as it was
    subs = {
        "{run}": str(trained_run),
        "{in}": str(inputs),
        "{out}": str(out),
        "{damaged}": str(damaged),
        "{broken}": str(broken),
    }
    args = []
    for a in [*argv, says]:  # the sentence may name an input file too
        for k, v in subs.items():
            a = a.replace(k, v)
        args.append(a)
    args, says = args[:-1], args[-1]
    before = snapshot(trained_run, inputs, out, damaged, broken)
    rc, err = run_cli(args, capsys)
    sentence = one_sentence(err)
    assert rc == 2, (rc, err)
    assert says in sentence, sentence
    assert snapshot(trained_run, inputs, out, damaged, broken) == before, f"{name} changed files"


@pytest.mark.parametrize(
    "argv, says",
    [
        (["ui", "--port", "abc"], "recursive_lightning ui: argument --port: invalid int value: 'abc'"),
        (
            ["train", "--max-steps", "many"],
            "recursive_lightning train: argument --max-steps: invalid int value",
        ),
        (["eval", "--bogus", "x"], "recursive_lightning eval: unrecognized arguments: --bogus"),
        (["report"], "recursive_lightning report: the following arguments are required: --run-dir"),
    ],
    ids=["ui-port-words", "train-max-steps-words", "eval-unknown-option", "report-no-run-dir"],
)
def test_a_command_line_argparse_refuses_is_one_sentence(argv, says, capsys):
    """A value of the wrong type, an unknown option, a missing one: one sentence (exit 2) naming the option and
    where the options are listed, as for every other bad input, not argparse's whole usage block."""
    from recursive_lightning.cli import main

    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    command = argv[0]
    assert err.startswith(f"error: {says}") and len(err.splitlines()) == 1, err
    assert err.endswith(f"; `python -m recursive_lightning {command} --help` lists the options."), err


# ----------------------------------- printed numbers and records: steps, segments, data, tokenizers, formats
def _copy_run(trained_run: Path, to: Path) -> Path:
    shutil.copytree(trained_run, to)
    return to


def test_eval_with_nothing_to_evaluate_keeps_the_last_record(trained_run, tmp_path, inputs, capsys):
    """`eval RUN --tasks none` exits 2 in one sentence and leaves eval-last.json as the last real evaluation
    wrote it (it was replaced by an empty record)."""
    run = _copy_run(trained_run, tmp_path / "run")
    rc, err = run_cli(
        ["eval", str(run), "--ppl", f"t={inputs}/text.txt", "--tasks", "none", "--no-mlflow"], capsys
    )
    assert rc == 0, err
    record = run / "eval" / "eval-last.json"
    kept = record.read_bytes()
    assert b'"t"' in kept
    rc, err = run_cli(["eval", str(run), "--tasks", "none", "--no-mlflow"], capsys)
    assert rc == 2 and "nothing to evaluate" in one_sentence(err)
    assert record.read_bytes() == kept


def test_a_resumed_run_reports_its_real_steps_and_the_sum_of_its_segments(trained_run, tmp_path, capsys):
    """`train --resume --max-steps 16` of a 12-step run: the summary says 4 steps in this segment and the run at
    step 16; result.json's seconds add the first segment's (kept in the checkpoint) to this one's."""
    import json

    import torch

    run = _copy_run(trained_run, tmp_path / "run")
    first = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)[
        "wall_clock"
    ]
    assert first["segments"] == 1 and first["seconds"] > first["data_seconds"] > 0
    from recursive_lightning.cli import main

    assert main(["train", "--run-dir", str(run), "--resume", "--max-steps", "16"]) == 0
    said = capsys.readouterr().out
    assert "trained 4 steps in" in said and "the run now at step 16" in said and "over 2 segments" in said, (
        said
    )
    result = json.loads((run / "result.json").read_text())
    assert result["steps"] == 16 and result["tokens"] == 16 * 8 * 64 and result["segments"] == 2
    assert result["seconds"] > first["seconds"]
    # its data preparation, part of those seconds, summed over the segments too (the report subtracts it)
    assert (
        first["data_seconds"]
        < result["data_seconds"]
        < result["seconds"] - first["seconds"] + first["data_seconds"]
    )
    assert result["best_checkpoint"].startswith(str(run))  # not the folder it was copied from


def test_resuming_a_finished_run_trains_no_step_and_adds_no_segment(trained_run, tmp_path, capsys):
    """`train --resume` of a run already at its max_steps: the summary says 0 steps trained (it said 12), and
    result.json keeps the run's one segment and its seconds (the no-op added a segment that no checkpoint
    kept, so a later extension reported one segment fewer)."""
    import json

    run = _copy_run(trained_run, tmp_path / "run")
    before = json.loads((run / "result.json").read_text())
    from recursive_lightning.cli import main

    assert main(["train", "--run-dir", str(run), "--resume"]) == 0
    said = capsys.readouterr().out
    assert "trained no step: the run was already at step 12" in said, said
    result = json.loads((run / "result.json").read_text())
    assert result["steps"] == before["steps"] == 12
    assert result["segments"] == before["segments"] == 1
    assert result["seconds"] == before["seconds"]  # the run's own record: it timed its end
    assert result["data_seconds"] == before["data_seconds"] > 0


def _with_data_path(trained_run: Path, tmp_path: Path, data_path: str) -> Path:
    import torch

    ckpt = torch.load(trained_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    ckpt["recursive_lightning"]["run"]["data"]["path"] = data_path
    out = tmp_path / "moved.ckpt"
    torch.save(ckpt, out)
    return out


def test_probe_uses_the_runs_own_data_unless_told(trained_run, tmp_path, capsys):
    """`probe CKPT` of a run trained on a text file probes that file (it probed the embedded corpus); a data.path
    that is gone is one sentence; `--data embedded` asks for the embedded corpus."""
    import json

    text = tmp_path / "own.txt"
    text.write_text(" ".join(f"word{i % 97} and more text" for i in range(3000)))
    ckpt = _with_data_path(trained_run, tmp_path, str(text))
    out = tmp_path / "probe"
    args = ["probe", str(ckpt), "--samples", "2", "--seq-len", "16", "--no-mlflow", "--no-attention"]
    rc, err = run_cli([*args, "--out", str(out)], capsys)
    assert rc == 0, err
    (summary,) = [p for p in out.rglob("*.json") if "data" in json.loads(p.read_text())]
    assert str(text) in json.dumps(json.loads(summary.read_text())["data"])
    gone = _with_data_path(trained_run, tmp_path, str(tmp_path / "gone.txt"))
    rc, err = run_cli(
        [*[a if a != str(ckpt) else str(gone) for a in args], "--out", str(tmp_path / "p2")], capsys
    )
    assert rc == 2 and "gone.txt" in one_sentence(err) and "--data" in one_sentence(err)
    assert not (tmp_path / "p2").exists()


def test_embedded_tasks_warn_naming_both_tokenizers():
    from types import SimpleNamespace

    from recursive_lightning.evaluation.downstream import embedded_metadata as _embedded_metadata

    for data, names in (
        (SimpleNamespace(tokenizer="init", path=None, val_fraction=0.05, cache_dir=None), "'init'"),
        (
            SimpleNamespace(tokenizer="bpe:4096", path="/my/text", val_fraction=0.05, cache_dir=None),
            "/my/text",
        ),
        (
            SimpleNamespace(tokenizer="EleutherAI/pythia-70m", path=None, val_fraction=0.05, cache_dir=None),
            "pythia",
        ),
    ):
        notes: list[str] = []
        _embedded_metadata(SimpleNamespace(run=SimpleNamespace(data=data)), ["embedded_lastword"], notes)
        assert len(notes) == 1 and names in notes[0] and "bpe:N" in notes[0], notes
    notes = []
    ok = SimpleNamespace(tokenizer="bpe:4096", path=None, val_fraction=0.05, cache_dir=None)
    _embedded_metadata(SimpleNamespace(run=SimpleNamespace(data=ok)), ["embedded_lastword"], notes)
    assert notes == []


def test_one_format_per_quantity_in_describe_and_the_summaries(capsys):
    from recursive_lightning import formatting as fmt

    assert fmt.flops(0.0397e12) == "39.7 GFLOPs" and fmt.flops(1.234e12) == "1.23 TFLOPs"
    assert fmt.flops(999.96e9) == "1.00 TFLOPs"
    assert fmt.ppl(2060.5) == "2060.50" and fmt.ppl(3.4e9) == "3.40e+09" and fmt.ppl(float("inf")) == "inf"
    assert fmt.metric("val/heldout/ppl", 1e9) == "1.00e+09" and fmt.metric("val/heldout/loss", 7.5) == "7.500"
    from recursive_lightning.cli import main

    assert main(["describe", "--preset", "cpu-tiny"]) == 0
    text = capsys.readouterr().out
    assert "e12" not in text and "GFLOPs" in text, text
    from recursive_lightning.sweep.tables import fmt_value

    assert fmt_value(4e10, "flops") == "40.0 GFLOPs" and fmt_value(1e9, "ppl") == "1.00e+09"


def test_lm_eval_records_the_commit_quietly_outside_a_git_checkout(trained_run, tmp_path, monkeypatch, capfd):
    """An embedded task evaluated from a folder outside any git checkout prints no `fatal: not a git repository`
    (lm-eval asked git and let it speak, once per trial of a sweep)."""
    from recursive_lightning.evaluation.downstream import quiet_git_commit
    from recursive_lightning.evaluation.options import EvalOptions
    from recursive_lightning.evaluation.run import evaluate_checkpoint

    monkeypatch.chdir(tmp_path)
    assert quiet_git_commit() is None
    evaluate_checkpoint(
        trained_run,
        EvalOptions(tasks=["embedded_lastword"], shots=[0], limit=2, mlflow=False, out_dir=tmp_path / "ev"),
    )
    assert "fatal" not in capfd.readouterr().err


def _readme_command(marker: str) -> list[str]:
    """The README's shell command holding ``marker`` (continuation lines joined), as argv after the module."""
    import shlex

    lines = (ROOT / "README.md").read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if marker in line)
    while i > 0 and lines[i - 1].rstrip().endswith("\\"):
        i -= 1
    text = ""
    while True:
        text += lines[i].rstrip().removesuffix("\\") + " "
        if not lines[i].rstrip().endswith("\\"):
            break
        i += 1
    argv = shlex.split(text.split("#")[0])
    return argv[argv.index("recursive_lightning") + 1 :]


@pytest.mark.parametrize("family", ["neox", "llama"])
def test_the_readme_hf_uptraining_command_works_as_printed(
    family, hf_model_dirs, data_cache, tmp_path, monkeypatch, capsys
):
    """The README's `train --config experiments/cpu/looped-mesh.yaml --init-from /path/to/pythia-70m ...` on a
    local GPT-NeoX and LLaMA directory: the source's tokenizer and sizes come with it (it was refused: the
    recipe's bpe:4096 and cpu-small sizes are not the source's). Only the run's length is shortened here."""
    import json

    from recursive_lightning.cli import main

    argv = _readme_command("--init-from /path/to/pythia-70m")
    argv = [str(hf_model_dirs[family]) if a == "/path/to/pythia-70m" else a for a in argv]
    i = argv.index("--run-dir")
    argv[i + 1] = str(tmp_path / "run")
    monkeypatch.chdir(ROOT)
    short = ["--max-steps", "1", "--data.seq_len", "32", "--data.batch_size", "2", "--data.val_batches", "1"]
    assert main([*argv, *short, "--data.cache_dir", data_cache]) == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "run" / "result.json").read_text())
    assert record["steps"] == 1
    assert (tmp_path / "run" / "init_tokenizer.json").is_file()


@pytest.mark.parametrize(
    "name, content",
    [
        ("chinese", "机器学习是人工智能的一个分支，它让计算机从数据中学习规律。".encode() * 40),
        ("one-line", b"recursivetransformersloopoverthesharedcore" * 60),
        ("symbols", "→←↑↓∀∃∈∉⊂⊃∧∨¬≠≤≥".encode() * 60),  # a binary file is refused (not UTF-8 text)
    ],
)
def test_eval_of_a_text_with_few_words_reports_an_infinite_word_perplexity(
    name, content, trained_run, tmp_path, capsys
):
    """`eval RUN --ppl doc=FILE` of a text with few whitespace-separated words (Chinese, one long line without
    spaces, a run of symbols): exp(nll / words) overflows a float, so the word perplexity is infinite (it crashed
    with `OverflowError: math range error`); the token perplexity and bits per byte still come out."""
    import json
    import math

    text = tmp_path / f"{name}.txt"
    text.write_bytes(content)
    out = tmp_path / "eval"
    args = ["eval", str(trained_run), "--ppl", f"doc={text}", "--tasks", "none", "--no-mlflow"]
    rc, err = run_cli([*args, "--out", str(out)], capsys)
    assert rc == 0, err
    (record,) = out.glob("*.json")
    r = json.loads(record.read_text())["ppl"]["doc"]
    assert r["word_perplexity"] == math.inf and r["words"] < r["tokens"]
    assert math.isfinite(r["ppl"]) and r["ppl"] > 1 and 0 < r["bits_per_byte"] < math.inf


def test_output_a_terminal_cannot_encode_a_path_with_spaces_and_a_resume_print_cleanly(trained_run, tmp_path):
    """`generate` with a prompt an ASCII terminal cannot encode prints it escaped (no UnicodeEncodeError); a
    resumed run in a directory whose path has a space prints a `ui` hint a shell reads back as one argument, and
    no warning that its own checkpoint folder is not empty."""
    import os
    import shlex
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "ascii"}
    env.pop("RECURSIVE_LIGHTNING_FAULT", None)
    gen = subprocess.run(
        [sys.executable, "-m", "recursive_lightning", "generate", str(trained_run), "--prompt", "héllo ☃"]
        + ["--max-new-tokens", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert gen.returncode == 0 and "Traceback" not in gen.stderr, gen.stderr
    assert gen.stdout.startswith("h\\xe9llo \\u2603"), gen.stdout
    run = _copy_run(trained_run, tmp_path / "with space" / "run")
    resumed = subprocess.run(
        [sys.executable, "-m", "recursive_lightning", "train", "--resume", "--run-dir", str(run)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "is not empty" not in resumed.stdout + resumed.stderr
    hint = resumed.stdout.strip().splitlines()[-1].rsplit("(", 1)[1].rstrip(")")
    assert shlex.split(hint) == ["python", "-m", "recursive_lightning", "ui", "with space/run"], hint


def test_without_a_home_the_cache_is_never_made_at_the_filesystem_root(monkeypatch, tmp_path):
    """HOME unset, or the root (some containers): the cache folder lies under the temporary directory."""
    import tempfile

    from recursive_lightning.files import default_cache_dir

    monkeypatch.delenv("RECURSIVE_LIGHTNING_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    for home in (None, "/"):
        if home is None:
            monkeypatch.delenv("HOME", raising=False)
        else:
            monkeypatch.setenv("HOME", home)
        cache = default_cache_dir()
        assert cache.is_relative_to(tempfile.gettempdir()) and cache.name == "recursive_lightning", cache
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "recursive_lightning"


def test_a_read_only_data_cache_is_one_sentence(trained_run, tmp_path, capsys):
    """`data.cache_dir` on a read-only file system (a tmpfs mounted read-only; chmod does not stop root): one
    sentence naming the field, exit 2, no run directory left."""
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True
    ).returncode:
        pytest.skip("mounting a read-only tmpfs needs root and CAP_SYS_ADMIN")
    try:
        run = tmp_path / "run"
        argv = ["train", "--config", str(trained_run / "config.yaml"), "--data.cache_dir", str(ro / "c")]
        rc, err = run_cli([*argv, "--run-dir", str(run)], capsys)
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert rc == 2, err
    assert one_sentence(err) == (
        f"error: data.cache_dir '{ro / 'c'}' cannot take the run's corpus, tokenizer and token shards "
        f"(Read-only file system: '{ro / 'c'}'); set data.cache_dir to a folder you can write to."
    )
    assert not run.exists()
