"""Downstream accuracy through the LM Evaluation Harness: which tasks (names, ``default``, local YAMLs), their
data (a default task whose data cannot be had is skipped with a note), running them, and the metric the papers
report for each.

Downstream protocol (MeSH App. B, SpiralFormer App. F): LAMBADA OpenAI/Standard, HellaSwag, PIQA, WinoGrande,
ARC-E, ARC-C, SciQ and MMLU-continuation through the LM Evaluation Harness, 0-shot and 5-shot; the headline
metric is ``acc_norm`` (accuracy normalised by the byte length of the target) for PIQA, HellaSwag, ARC-E,
ARC-C and SciQ and ``acc`` for LAMBADA, WinoGrande and cMMLU (MeSH Table 2).

Without a task list (or with the name ``default`` in it) the tasks are ``DEFAULT_TASKS``: those nine plus the
two tasks built from the embedded corpus's held-out documents, ``embedded_lastword`` (``acc``) and
``embedded_nextsent`` (``acc_norm``; ``data/embedded_tasks.py``, configs in ``evaluation/tasks/``), which need
no network. ``eval/avg/<k>shot`` is the mean headline accuracy over the tasks that ran.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recursive_lightning.data.embedded_tasks import HELDOUT_FRACTION, default_cache_dir
from recursive_lightning.errors import UserError

PAPER_TASKS = (
    "lambada_openai",
    "lambada_standard",
    "hellaswag",
    "piqa",
    "winogrande",
    "arc_easy",
    "arc_challenge",
    "sciq",
    "mmlu_continuation",
)
# built from the embedded corpus (data/embedded_tasks.py, imported only where needed: it pulls in the data pipeline)
EMBEDDED_TASKS = ("embedded_lastword", "embedded_nextsent")
DEFAULT_TASKS = (*PAPER_TASKS, *EMBEDDED_TASKS)
DEFAULT_ALIAS = "default"  # in a task list: DEFAULT_TASKS, each skipped when its data cannot be had
DEFAULT_SHOTS = (0, 5)
# MeSH Table 2 / SpiralFormer Table 3: length-normalised accuracy for five tasks, accuracy for the rest.
PAPER_METRIC = {
    "lambada_openai": "acc",
    "lambada_standard": "acc",
    "hellaswag": "acc_norm",
    "piqa": "acc_norm",
    "winogrande": "acc",
    "arc_easy": "acc_norm",
    "arc_challenge": "acc_norm",
    "sciq": "acc_norm",
    "mmlu_continuation": "acc",
    "embedded_lastword": "acc",
    "embedded_nextsent": "acc_norm",
}
# Built-in task folders, so that the paper's tasks are indexed in milliseconds instead of the ~15 s that
# lm-eval needs to index all of its thousands of task YAMLs.
BUILTIN_DIRS = {
    "lambada_openai": "lambada",
    "lambada_standard": "lambada",
    "hellaswag": "hellaswag",
    "piqa": "piqa",
    "winogrande": "winogrande",
    "arc_easy": "arc",
    "arc_challenge": "arc",
    "sciq": "sciq",
    "mmlu_continuation": "mmlu/continuation",
    "wikitext": "wikitext",
}
LOCAL_BUILDERS = {
    "json",
    "csv",
    "parquet",
    "text",
    "arrow",
    "pandas",
    "webdataset",
    "imagefolder",
    "audiofolder",
}
# the lm-eval configs of the embedded tasks (and their tag ``embedded``)
EMBEDDED_DIR = Path(__file__).parent / "tasks"
EMBEDDED_NAMES = {*EMBEDDED_TASKS, "embedded"}
NOT_ACCURACY = ("perplexity", "bits_per_byte", "byte_perplexity", "word_perplexity", "bpb")


def task_manager(
    tasks: Sequence[str],
    include_path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Any:
    """An lm-eval ``TaskManager`` that indexes only what ``tasks`` need when it can (local folders, the
    built-in folders of the papers' tasks, the embedded tasks' folder), and all of lm-eval's tasks otherwise.
    ``metadata`` reaches every task's config (the embedded tasks read ``cache_dir`` from it)."""
    from lm_eval.tasks import TaskManager  # heavy

    paths = [str(p) for p in _as_list(include_path)]
    for p in paths:
        if not Path(p).exists():
            raise UserError(f"--include-path '{p}' does not exist; pass a folder of task YAML files.")
    named = [t for t in tasks if not _is_yaml_path(t)]
    if any(t in EMBEDDED_NAMES for t in named):
        paths.append(str(EMBEDDED_DIR))
        _quiet_custom_dataset_warning()
    local = TaskManager(include_path=paths, include_defaults=False, metadata=metadata) if paths else None
    missing = [t for t in named if local is None or t not in local.all_tasks]
    if not missing and local is not None:
        return local
    import lm_eval.tasks as lm_tasks  # heavy

    root = Path(lm_tasks.__file__).parent
    if all(t in BUILTIN_DIRS for t in missing):
        dirs = sorted({str(root / BUILTIN_DIRS[t]) for t in missing})
        return TaskManager(include_path=dirs + paths, include_defaults=False, metadata=metadata)
    _fail_unknown([t for t in missing if t not in BUILTIN_DIRS], [root, *map(Path, paths)])
    return TaskManager(include_path=paths or None, metadata=metadata)


class _CustomDatasetNote(logging.Filter):
    """Drops lm-eval's warning that a ``custom_dataset`` task takes ``--metadata`` (printed for every load of
    the embedded tasks, whose metadata we pass ourselves)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith(EMBEDDED_TASKS) and "Custom kwargs can be passed" in msg)


def _quiet_custom_dataset_warning() -> None:
    lm_log = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _CustomDatasetNote) for f in lm_log.filters):
        lm_log.addFilter(_CustomDatasetNote())


class _ShotOverride(logging.Filter):
    """lm-eval's "Overwriting default num_fewshot of T from a to b": every ``--shots`` value the user asked for
    overrides a task's default, and the results table names the shots; nothing for the user to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Overwriting default num_fewshot")


def _quiet_shot_override() -> None:
    log = logging.getLogger("lm_eval.evaluator")
    if not any(isinstance(f, _ShotOverride) for f in log.filters):
        log.addFilter(_ShotOverride())


_NAME_RE = re.compile(r"^\s*-?\s*['\"]?(?:task|group|tag)['\"]?\s*:\s*['\"]?([^\s'\"#\[\],]+)", re.M)


def _fail_unknown(names: Sequence[str], roots: Sequence[Path]) -> None:
    """A name that no task YAML even mentions is unknown: say so in ~2 s instead of indexing every task."""
    pending, seen = set(names), set()
    for root in roots:
        for f in root.rglob("*.y*ml"):
            text = f.read_text(errors="ignore")
            seen.update(_NAME_RE.findall(text))
            pending -= {t for t in pending if t in text or f.stem == t}
    if pending:
        t = sorted(pending)[0]
        hint = difflib.get_close_matches(t, sorted(seen | set(BUILTIN_DIRS)), n=1)
        extra = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise UserError(
            f"task '{t}' is not an lm-eval task{extra}; for a local task pass the folder of its YAML with --include-path."
        )


def _as_list(x: Any) -> list:
    if x is None:
        return []
    if isinstance(x, str | os.PathLike):
        return [x]
    return list(x)


def _is_yaml_path(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) and Path(name).is_file()


def check_tasks(tm: Any, tasks: Sequence[str]) -> None:
    known = set(tm.all_tasks)
    for t in tasks:
        if t not in known and not _is_yaml_path(t):
            hint = difflib.get_close_matches(t, sorted(known), n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            raise UserError(
                f"task '{t}' is not an lm-eval task{extra}; for a local task pass the folder of its YAML with --include-path."
            )


def _data_error(e: BaseException) -> BaseException | None:
    """The dataset-availability error inside ``e``'s chain, if that is what went wrong."""
    names = {
        "OfflineModeIsEnabled",
        "LocalEntryNotFoundError",
        "DatasetNotFoundError",
        "DataFilesNotFoundError",
        "EmptyDatasetError",
        "HfHubHTTPError",
        "RepositoryNotFoundError",
        "GatedRepoError",
    }
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ConnectionError | FileNotFoundError) or type(e).__name__ in names:
            return e
        e = e.__cause__ or e.__context__
    return None


def _dataset_of(tm: Any, name: str) -> str | None:
    entry = tm.task_index.get(name) if hasattr(tm, "task_index") else None
    cfg = getattr(entry, "cfg", None) or {}
    return cfg.get("dataset_path")


def _offline_sentence(tm: Any, name: str, err: BaseException) -> str:
    ds = _dataset_of(tm, name)
    if ds is None:
        m = re.search(r"reach '([^']+)'", str(err)) or re.search(r"'([\w.-]+/[\w.-]+)'", str(err))
        ds = m.group(1) if m else None
    first = (str(err).splitlines() or [""])[0][:160]
    if ds in LOCAL_BUILDERS or (ds and Path(ds).exists()):
        return (
            f"task '{name}' could not read its local data ({first}); check `dataset_kwargs: data_files` in its YAML "
            "(relative paths resolve from the current directory, so absolute paths are safest)."
        )
    what = f"the Hugging Face dataset '{ds}'" if ds else "a Hugging Face dataset"
    entry = tm.task_index.get(name) if hasattr(tm, "task_index") else None
    is_group = getattr(getattr(entry, "kind", None), "name", "") == "GROUP"
    cfg = getattr(entry, "cfg", None) or {}
    split = cfg.get("test_split") or cfg.get("validation_split") or "test"
    copy = (
        "copies of the YAMLs of its tasks (same task names)"
        if is_group
        else f"a copy of the task's YAML (same `task: {name}`)"
    )
    return (
        f"task '{name}' needs {what}, which is not in the local datasets cache and cannot be downloaded offline; "
        f"run once with network access to cache it, or point the harness at a local copy: {copy} with `dataset_path: json` "
        f"and `dataset_kwargs: {{data_files: {{{split}: /abs/path/{name}.jsonl}}}}`, in a folder passed with --include-path "
        "(tests/fixtures has examples)."
    )


def expand_tasks(tasks: str | Sequence[str] | None) -> tuple[list[str], set[str]]:
    """The task names of ``tasks`` (a list, or one comma-separated string) with ``default`` expanded to
    ``DEFAULT_TASKS`` (and the tag ``embedded`` to the embedded tasks) and ``none`` dropped, and the set of those that came only from ``default`` (they may be
    skipped when their data cannot be had; a task named explicitly may not)."""
    if isinstance(tasks, str):
        tasks = tasks.split(",")
    if tasks is not None and (
        not isinstance(tasks, list | tuple) or not all(isinstance(t, str) for t in tasks)
    ):
        raise UserError(f"tasks must be a list of lm-eval task names (or 'default'), not {tasks!r}.")
    names = [t.strip() for t in (tasks or [])]
    names = [t for t in names if t and t.lower() != "none"]
    explicit = {t for t in names if t.lower() != DEFAULT_ALIAS}
    explicit |= set(EMBEDDED_TASKS) if "embedded" in explicit else set()
    out: list[str] = []
    for t in names:
        group = {DEFAULT_ALIAS: DEFAULT_TASKS, "embedded": EMBEDDED_TASKS}.get(t.lower(), (t,))
        for name in group:
            if name not in out:
                out.append(name)
    return out, {t for t in out if t not in explicit}


def _offline() -> bool:
    return any(
        os.environ.get(k, "").lower() in ("1", "true", "yes", "on")
        for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )


def _skip_reason(tm: Any, name: str, err: BaseException) -> str:
    ds = _dataset_of(tm, name)
    if ds in LOCAL_BUILDERS or (ds and Path(ds).exists()):
        return (str(err).splitlines() or [type(err).__name__])[0][:160]
    if _offline() or type(err).__name__ in ("OfflineModeIsEnabled", "LocalEntryNotFoundError"):
        return "their Hugging Face datasets are not in the local cache and this machine is offline"
    return f"their Hugging Face datasets could not be downloaded ({type(err).__name__})"


def drop_unavailable(tm: Any, tasks: Sequence[str], optional: set[str]) -> tuple[list[str], dict[str, str]]:
    """``tasks`` less the ``optional`` ones whose data cannot be loaded, and ``{skipped task: why}``; a task that
    is not optional is kept either way (``run_tasks`` then fails in one sentence naming it)."""
    kept, skipped = [], {}
    for t in tasks:
        if t in optional:
            try:
                tm.load([t])
            except UserError as e:
                skipped[t] = str(e)
                continue
            except Exception as e:
                err = _data_error(e)
                if err is None:
                    raise
                skipped[t] = _skip_reason(tm, t, err)
                continue
        kept.append(t)
    return kept, skipped


def skipped_line(skipped: dict[str, str]) -> str:
    """One line naming the skipped default tasks and why (tasks with the same reason together)."""
    by_reason: dict[str, list[str]] = {}
    for t, why in skipped.items():
        by_reason.setdefault(why, []).append(t)
    parts = [f"{', '.join(ts)} ({why})" for why, ts in by_reason.items()]
    return (
        f"skipped default tasks {'; '.join(parts)}; run once with network access to cache their data, "
        "or name the tasks to run with --tasks or a sweep's evaluate.tasks (embedded_lastword, embedded_nextsent "
        "need no network)."
    )


def quiet_git_commit() -> str | None:
    """The commit of the git checkout around the current directory, or None outside one, without a word on
    stderr (lm-eval's own asks git and lets it print `fatal: not a git repository` once per evaluation)."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def run_tasks(
    lm: Any, tasks: Sequence[str], shots: int, limit: int | float | None, tm: Any
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of ``tasks`` at ``shots``; a dataset that cannot be had offline becomes
    one UserError sentence naming the task."""
    import lm_eval  # heavy
    import lm_eval.evaluator  # heavy

    lm_eval.evaluator.get_git_commit_hash = quiet_git_commit  # recorded in the result, quietly
    _quiet_shot_override()

    try:
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            num_fewshot=shots,
            limit=limit,
            task_manager=tm,
            bootstrap_iters=0,
            log_samples=False,
        )
    except UserError:
        raise
    except Exception as e:
        err = _data_error(e)
        if err is None:
            raise
        culprit = tasks[0]
        for t in tasks:  # which task it was: load each alone (cheap once the others' data is cached)
            try:
                tm.load([t])
            except Exception as e2:
                if _data_error(e2) is not None:
                    culprit, err = t, _data_error(e2)
                    break
        raise UserError(_offline_sentence(tm, culprit, err)) from None


def _metric_key(key: str) -> str:
    metric, _, flt = key.partition(",")
    return metric if flt in ("", "none") else f"{metric}_{flt}"


def task_metrics(results: dict[str, Any], tasks: Sequence[str]) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` for the requested tasks and groups (stderr and non-numbers left out)."""
    out = {}
    table = {**results.get("results", {}), **results.get("groups", {})}
    for t in tasks:
        row = table.get(t) or table.get(Path(t).stem if _is_yaml_path(t) else t) or {}
        vals = {}
        for k, v in row.items():
            if (
                k in ("alias", "sample_len", "sample_count")
                or "_stderr" in k
                or isinstance(v, bool)
                or not isinstance(v, int | float)
            ):
                continue
            vals[_metric_key(k)] = float(v)
        out[t] = vals
    return out


def headline(task: str, metrics: dict[str, float]) -> tuple[str, float] | None:
    """The metric the papers report for ``task`` (acc_norm or acc), else acc / acc_norm / exact_match / first."""
    for m in (PAPER_METRIC.get(task), "acc", "acc_norm", "exact_match"):
        if m and m in metrics:
            return m, metrics[m]
    for m, v in metrics.items():
        return m, v
    return None


def embedded_metadata(loaded: Any, tasks: Sequence[str], notes: list[str]) -> dict[str, Any] | None:
    """lm-eval metadata for the embedded tasks: the cache folder of the checkpoint's run (``data.cache_dir``, else
    ``$RECURSIVE_LIGHTNING_CACHE`` or ``~/.cache/recursive_lightning``); a note in ``notes`` when the checkpoint
    trained on the embedded corpus with fewer held-out documents than the tasks are built from."""
    if not any(t in EMBEDDED_NAMES for t in tasks):
        return None
    data = getattr(loaded.run, "data", None)
    if data is not None and data.path is None and float(data.val_fraction) < HELDOUT_FRACTION:
        notes.append(
            f"the checkpoint trained on the embedded corpus with data.val_fraction={data.val_fraction}, below the "
            f"{HELDOUT_FRACTION} the embedded tasks are built from, so some of their documents were in its training "
            f"split; train with data.val_fraction >= {HELDOUT_FRACTION} for a clean score."
        )
    mismatch = foreign_tokenizer(data)
    if mismatch:
        notes.append(
            f"{', '.join(t for t in tasks if t in EMBEDDED_NAMES)} are built from the embedded corpus for a model "
            f"whose tokenizer was trained on it (data.tokenizer 'bpe:N', as `train` makes by default), but this "
            f"checkpoint's tokenizer is {mismatch}: its accuracy there says little about the model."
        )
    cache = Path(data.cache_dir).expanduser().resolve() if data is not None and data.cache_dir else None
    return {"cache_dir": str(cache or default_cache_dir())}


def foreign_tokenizer(data: Any) -> str | None:
    """A description of the run's tokenizer when it is not a ``bpe:N`` trained on the embedded corpus (the
    tokenizer the embedded tasks are made for), else None."""
    if data is None:
        return None
    spec = str(getattr(data, "tokenizer", "") or "")
    if spec.startswith("bpe:") and getattr(data, "path", None) is None:
        return None
    if spec.startswith("bpe:"):
        return f"'{spec}' trained on data.path '{data.path}'"
    if spec.strip() == "init":
        return "'init' (the tokenizer of its train.init_from source)"
    return f"'{spec}'"
