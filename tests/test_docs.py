"""The documentation cannot drift from the code: the reference pages are what ``docs/gen_reference.py`` writes
from the code today, the MkDocs site builds with ``--strict`` (a broken link, anchor or page fails), and the
commands and configs shown in the README and the pages parse (``describe`` examples run, their printed output
included)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
# the hand-written pages whose commands are checked (the reference pages are generated and checked whole)
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted(DOCS.glob("*.md"))]
HISTORY = re.compile(r"\bsessions?\b|\bissues?\b|\bwas\b.*\bbefore\b|previous code|\bearlier\b", re.I)


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _env() -> dict[str, str]:
    return {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONDONTWRITEBYTECODE": "1"}


# ------------------------------------------------------------------------------------------- reference pages
def test_reference_pages_are_what_the_generator_writes_from_the_code(tmp_path):
    out = tmp_path / "reference"
    done = subprocess.run(
        [sys.executable, str(DOCS / "gen_reference.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    committed = {p.name: p.read_text(encoding="utf-8") for p in REFERENCE.glob("*.md")}
    fresh = {p.name: p.read_text(encoding="utf-8") for p in out.glob("*.md")}
    assert sorted(committed) == sorted(fresh)
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, (
        f"docs/reference/{', '.join(stale)} no longer match(es) the code (a config field, preset or command option "
        "changed): run `.venv/bin/python docs/gen_reference.py` and commit its output"
    )


def test_every_meaning_the_generator_supplies_names_a_real_field_and_every_field_has_one():
    gen = _generator()
    package = ROOT / "recursive_lightning"
    classes = {
        "ModelConfig": package / "model" / "config.py",
        "DataConfig": package / "config.py",
        "TrainConfig": package / "config.py",
        "LoopSchedule": package / "sampled_loops.py",
    }
    fields = {cls: gen.dataclass_fields(path, cls) for cls, path in classes.items()}
    names = {f"{cls}.{f['name']}" for cls, fs in fields.items() for f in fs}
    assert set(gen.UNCOMMENTED) <= names, sorted(set(gen.UNCOMMENTED) - names)
    blank = [f"{cls}.{f['name']}" for cls, fs in fields.items() for f in fs if gen._meaning(cls, f) == "—"]
    assert not blank, (
        f"fields with neither a comment in the source nor a meaning in gen_reference.py: {blank}"
    )


# ---------------------------------------------------------------------------------------------------- mkdocs
def _build(config: Path, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=_env(),
    )


def test_the_site_builds_strictly(tmp_path):
    done = _build(ROOT / "mkdocs.yml", tmp_path / "site", ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    pages = re.findall(r"[\w/-]+\.md", str(nav))
    assert sorted(pages) == sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")), (
        "a page is not in nav"
    )
    for page in pages:
        assert (tmp_path / "site" / page.replace(".md", ".html")).is_file(), page
    assert "Benchmark methods and breakdowns" in (tmp_path / "site" / "benchmark-methods.html").read_text()


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    """The strict build is a real check: a copy of the site with one broken link and one broken anchor fails."""
    import shutil

    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("*.py"))
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks" / "README.md", tmp_path / "benchmarks" / "README.md")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text() + "\n[gone](no-such-page.md) [nowhere](models.md#no-such-heading)\n")
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "site", tmp_path)
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


# ------------------------------------------------------------------------------------------ what pages show
def _blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^ *```(\w*)\n(.*?)^ *```", text, re.S | re.M)]


def _shell_lines(body: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and prompts dropped."""
    out, current = [], ""
    for line in body.splitlines():
        line = line.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += line.removesuffix("\\") + " "
        if not line.endswith("\\"):
            out.append(current.split(" #")[0].strip())
            current = ""
    return out


def _commands() -> list[tuple[str, str]]:
    """(page, command line) of every shell command shown: in shell blocks and as inline code."""
    out = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for lang, body in _blocks(text):
            if lang in ("bash", "sh", ""):
                out += [(page.name, line) for line in _shell_lines(body)]
        for code in re.findall(r"`((?:\.venv/bin/)?python -m recursive_lightning [^`]+)`", text):
            out.append((page.name, code))
        for code in re.findall(r"`([^`\n]*\b(?:python3?|bash) (?:benchmarks|scripts)/[^`\n]+)`", text):
            out.append((page.name, code))
    return out


def _help_options() -> dict[str, set[str]]:
    """command -> the options its --help lists (docs/reference/cli.md, checked against the code above)."""
    text = (REFERENCE / "cli.md").read_text(encoding="utf-8")
    out = {}
    for command, body in re.findall(r"^## `(\w+)`\n\n```text\n(.*?)```", text, re.S | re.M):
        out[command] = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", body))
    return out


def _config_fields() -> dict[str, set[str]]:
    import dataclasses

    from recursive_lightning.config import DataConfig, TrainConfig
    from recursive_lightning.model.config import ModelConfig
    from recursive_lightning.sampled_loops import LoopSchedule

    return {
        "model": {f.name for f in dataclasses.fields(ModelConfig)},
        "data": {f.name for f in dataclasses.fields(DataConfig)},
        "train": {f.name for f in dataclasses.fields(TrainConfig)},
        "train.loops": {f.name for f in dataclasses.fields(LoopSchedule)},
    }


def _package_argv(line: str) -> list[str] | None:
    """The argv after `-m recursive_lightning` of a command line, or None for other commands."""
    try:
        argv = shlex.split(line)
    except ValueError:
        return None
    if "recursive_lightning" not in argv or argv[argv.index("recursive_lightning") - 1] != "-m":
        return None
    return argv[argv.index("recursive_lightning") + 1 :]


def test_every_shown_command_names_a_command_options_and_fields_that_exist():
    from recursive_lightning.cli import COMMANDS

    options = _help_options()
    fields = _config_fields()
    seen = 0
    problems = []
    for page, line in _commands():
        argv = _package_argv(line)
        if argv is None:
            continue
        seen += 1
        if not argv or argv[0].startswith(("-", "<")):
            continue  # `python -m recursive_lightning` alone, its --help, or `<command>` in prose
        command = argv[0]
        if command not in COMMANDS:
            problems.append(f"{page}: unknown command in `{line}`")
            continue
        for token in argv[1:]:
            flag = token.split("=", 1)[0]
            if not flag.startswith("--") or flag == "--threads":
                if (
                    re.fullmatch(r"(experiments|ablations)/[\w./-]+\.yaml", token)
                    and not (ROOT / token).is_file()
                ):
                    problems.append(f"{page}: `{token}` does not exist (`{line}`)")
                continue
            dotted = flag[2:].split(".")
            if len(dotted) > 1:
                section = ".".join(dotted[:-1])
                if section not in fields or dotted[-1] not in fields[section]:
                    problems.append(f"{page}: `{flag}` is no config field (`{line}`)")
            elif flag not in options[command]:
                problems.append(f"{page}: `{command}` has no option `{flag}` (`{line}`)")
    assert seen >= 30, seen
    assert not problems, "\n".join(problems)


class _Parsed(Exception):
    """Raised by the command's own argument parser once it has parsed: the command is not run."""


def test_every_shown_command_line_parses_with_the_commands_own_parser(monkeypatch, capsys):
    """Each command line shown goes through ``main`` and the command's argparse parser, which stops it right
    after parsing (types and choices included), so nothing runs; a line argparse refuses fails here."""
    import argparse
    import contextlib

    from recursive_lightning import cli

    original = argparse.ArgumentParser.parse_known_args

    def parse_and_stop(self, args=None, namespace=None):
        parsed = original(self, args, namespace)
        raise _Parsed(parsed)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_and_stop)
    monkeypatch.setattr(cli.thread_policy, "for_command", lambda threads: contextlib.nullcontext())
    monkeypatch.chdir(ROOT)
    problems, parsed = [], 0
    for page, line in _commands():
        argv = _package_argv(line)
        if not argv or argv[0].startswith(("-", "<")):
            continue
        try:
            cli.main(argv)
        except _Parsed:
            parsed += 1
            continue
        except SystemExit as e:
            problems.append(f"{page}: `{line}` exits {e.code}: {capsys.readouterr().err.strip()[-300:]}")
            continue
        problems.append(f"{page}: `{line}` was not parsed by an argparse parser")
    assert not problems, "\n".join(problems)
    assert parsed >= 30, parsed


def _written_run_dir(argv: list[str]) -> str | None:
    """The folder a shown `train` or `sweep` command writes: its --run-dir, else runs/<name> (train) or
    runs/sweeps/<name> (sweep) with the name of its YAML file, as the commands pick it."""
    options = dict(zip(argv, argv[1:]))
    if argv[0] not in ("train", "sweep"):
        return None
    if "--run-dir" in options:
        return options["--run-dir"]
    if argv[0] == "train":
        config = options.get("--config")
        return None if config is None else f"runs/{yaml.safe_load((ROOT / config).read_text())['name']}"
    sweep_file = next((a for a in argv[1:] if a.endswith(".yaml")), "ablations/default.yaml")
    return f"runs/sweeps/{yaml.safe_load((ROOT / sweep_file).read_text())['name']}"


def test_every_run_folder_a_command_reads_is_one_a_shown_command_writes():
    """A reader's run folder (`eval runs/...`, `probe runs/...`, `--init-from runs/...`) is one that a `train`
    or `sweep` command on the same page or in the README writes, so the commands run as written in order."""
    writes: dict[str, set[str]] = {}
    reads = []
    for page, line in _commands():
        argv = _package_argv(line)
        if not argv or argv[0].startswith(("-", "<")):
            continue
        written = _written_run_dir(argv)
        if written is not None:
            writes.setdefault(page, set()).add(written)
        for token in argv[1:]:
            value = token.split("=", 1)[-1]
            if value.startswith("runs/") and value != written:
                reads.append((page, value, line))
    assert len(reads) >= 10, reads
    problems = [
        f"{page}: `{line}` reads {value}, which no train or sweep command on {page} or README.md writes"
        for page, value, line in reads
        if not any(
            value == w or value.startswith(w + "/") for w in writes.get(page, set()) | writes["README.md"]
        )
    ]
    assert not problems, "\n".join(problems)


def test_every_shown_script_exists_and_takes_the_options_shown():
    problems = []
    for page, line in _commands():
        for i, token in enumerate(shlex.split(line.replace("[", " ").replace("]", " "))):
            if not re.fullmatch(r"(benchmarks|scripts|docs|experiments)/[\w./-]+\.(py|sh)", token):
                continue
            script = ROOT / token
            if not script.is_file():
                problems.append(f"{page}: `{token}` does not exist")
                continue
            source = script.read_text(encoding="utf-8")
            for helper in re.findall(r"^\s*(?:from|import)\s+(?:benchmarks\.)?(\w+)", source, re.M):
                if (script.parent / f"{helper}.py").is_file():  # options a benchmark takes from its helper
                    source += (script.parent / f"{helper}.py").read_text(encoding="utf-8")
            rest = shlex.split(line.replace("[", " ").replace("]", " "))[i + 1 :]
            if script.suffix != ".py":  # a shell script passes its options on (sbatch's, say)
                break
            for flag in (t.split("=", 1)[0] for t in rest if t.startswith("--") and t != "--help"):
                if f'"{flag}"' not in source and f"'{flag}'" not in source:
                    problems.append(f"{page}: `{token}` has no option `{flag}`")
            break
    assert not problems, "\n".join(problems)


def _describe_examples() -> list[tuple[str, list[str], list[str]]]:
    """(page, argv, expected output lines) of every `describe` example; expected lines are the `# ` lines
    after a `# ...` line below the command in its block."""
    out = []
    for page in PAGES:
        for lang, body in _blocks(page.read_text(encoding="utf-8")):
            if lang not in ("bash", "sh", ""):
                continue
            expected = []
            if "# ...\n" in body:
                expected = [ln.strip()[2:] for ln in body.split("# ...\n", 1)[1].splitlines() if ln.strip()]
            for line in _shell_lines(body):
                argv = _package_argv(line)
                if argv and argv[0] == "describe":
                    out.append((page.name, argv, expected))
    return out


@pytest.mark.parametrize(
    "page, argv, expected", [pytest.param(*e, id=f"{e[0]}: {' '.join(e[1])}") for e in _describe_examples()]
)
def test_every_describe_example_runs_and_prints_what_the_page_shows(
    page, argv, expected, capsys, monkeypatch
):
    from recursive_lightning.cli import main

    monkeypatch.chdir(ROOT)
    assert main(argv) == 0, capsys.readouterr().err
    printed = " ".join(capsys.readouterr().out.split())
    for line in expected:
        assert " ".join(line.split()) in printed, f"{page}: `{line}` is not what `{' '.join(argv)}` prints"


def test_every_yaml_shown_parses_and_its_fields_exist():
    from recursive_lightning.config import RunConfig
    from recursive_lightning.evaluation.options import SWEEP_FIELDS
    from recursive_lightning.sampled_loops import LoopSchedule
    from recursive_lightning.sweep.spec import TOP_KEYS

    checked = 0
    for page in PAGES:
        for lang, body in _blocks(page.read_text(encoding="utf-8")):
            if lang != "yaml":
                continue
            data = yaml.safe_load(body)
            checked += 1
            if {"axes", "base", "seeds"} & set(data):  # a sweep file
                assert set(data) <= TOP_KEYS, (page.name, set(data) - TOP_KEYS)
                assert set(data.get("evaluate") or {}) <= set(SWEEP_FIELDS), page.name
            elif set(data) == {"train"} and set(data["train"]) == {"loops"}:
                LoopSchedule.parse(data["train"]["loops"])
            else:
                RunConfig.from_dict(data)
    assert checked >= 3


def test_the_pages_python_api_block_is_the_readmes():
    readme = dict(_blocks((ROOT / "README.md").read_text(encoding="utf-8")))["python"]
    page = dict(_blocks((DOCS / "getting-started.md").read_text(encoding="utf-8")))["python"]
    assert page == readme


def test_the_readme_links_to_files_and_headings_that_exist():
    from markdown.extensions.toc import slugify

    problems = []
    for page in (ROOT / "README.md", ROOT / "CHANGELOG.md"):
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"\w+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve()
            if not file.exists():
                problems.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), re.M)
                if anchor not in {slugify(h.replace("`", ""), "-") for h in headings}:
                    problems.append(f"{page.name}: {target} (no such heading)")
    assert not problems, problems


def test_the_pages_tell_no_history():
    """Numbered work periods, issue numbers and before/after narratives belong in git and CHANGELOG.md."""
    found = []
    for page in [*PAGES, *REFERENCE.glob("*.md")]:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for m in HISTORY.finditer(line.replace("gpu_session.sh", "")):
                found.append(f"{page.relative_to(ROOT)}:{n}: {m.group(0)!r} in {line.strip()[:100]}")
    assert not found, "\n".join(found)


def test_every_gpu_session_step_is_listed_in_its_usage_and_in_the_gpu_page():
    """A lent GPU runs ``gpu_session.sh`` with step names read from its usage line and from docs/gpus.md: a step
    the script runs but neither names can only be found by reading the script."""
    script = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    steps = set(re.findall(r"^(?:if )?has ([\w-]+)", script, re.M))
    usage = " ".join(line.lstrip("# ") for line in script.splitlines()[1:6])
    listed = set(re.search(r"a comma list of (.*?) \(default", usage).group(1).replace(" ", "").split(","))
    gpu_page = (DOCS / "gpus.md").read_text()
    assert steps == listed, f"steps run {sorted(steps)} against the usage line's {sorted(listed)}"
    assert not [s for s in steps if f"`{s}`" not in gpu_page], (
        "a gpu_session.sh step docs/gpus.md does not name"
    )


def test_every_benchmark_script_is_in_the_benchmarks_readme():
    listed = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert not [s for s in scripts if f"`{s}`" not in listed], "a script benchmarks/README.md does not name"
