"""``python -m recursive_lightning eval CHECKPOINT``: perplexity, perplexity by context length, lm-eval accuracy.

    python -m recursive_lightning eval runs/looped-mesh                       # the default tasks, 0/5-shot
    python -m recursive_lightning eval runs/x/checkpoints/last.ckpt --ppl wiki=wiki.txt \\
        --context-lengths 256,512,1024,2048 --tasks lambada_openai,piqa --shots 0 --limit 200

CHECKPOINT is a ``.ckpt`` file or a run directory (its newest good checkpoint). Results go to a table on the
terminal, a JSON file (``<run_dir>/eval/eval-<checkpoint>.json`` unless ``--out``) and the checkpoint's MLflow
run (``eval/ppl/<name>``, ``eval/ppl_ctx/<L>``, ``eval/<task>/<shots>shot/<metric>``, ``eval/avg/<shots>shot``,
step = the checkpoint's global step, the JSON as an artifact under ``eval/``).

Downstream protocol (MeSH App. B, SpiralFormer App. F): LAMBADA OpenAI/Standard, HellaSwag, PIQA, WinoGrande,
ARC-E, ARC-C, SciQ and MMLU-continuation through the LM Evaluation Harness, 0-shot and 5-shot; the headline
metric is ``acc_norm`` (accuracy normalised by the byte length of the target) for PIQA, HellaSwag, ARC-E,
ARC-C and SciQ and ``acc`` for LAMBADA, WinoGrande and cMMLU (MeSH Table 2).

Without ``--tasks`` (or with the name ``default`` in it) the tasks are ``DEFAULT_TASKS``: those nine plus the two
tasks built from the embedded corpus's held-out documents, ``embedded_lastword`` (``acc``) and
``embedded_nextsent`` (``acc_norm``; ``data/embedded_tasks.py``, configs in ``evaluation/tasks/``), which need no
network. A default task whose data cannot be had (a Hub dataset not cached on an offline machine) is skipped, and
one line says which and why; a task named explicitly that cannot be had is an error. ``eval/avg/<k>shot`` is the
mean headline accuracy over the tasks that ran.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import difflib
import logging
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from recursive_lightning.errors import UserError

log = logging.getLogger(__name__)

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
# built from the embedded corpus (data/embedded_tasks.py, not imported here: it pulls in the data pipeline)
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


# ---------------------------------------------------------------------------------------------- tasks
def task_manager(
    tasks: Sequence[str],
    include_path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Any:
    """An lm-eval ``TaskManager`` that indexes only what ``tasks`` need when it can (local folders, the
    built-in folders of the papers' tasks, the embedded tasks' folder), and all of lm-eval's tasks otherwise.
    ``metadata`` reaches every task's config (the embedded tasks read ``cache_dir`` from it)."""
    from lm_eval.tasks import TaskManager

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
    import lm_eval.tasks as lm_tasks

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
        "(tests/data has examples)."
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
    import subprocess

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
    import lm_eval
    import lm_eval.evaluator

    lm_eval.evaluator.get_git_commit_hash = quiet_git_commit  # recorded in the result, quietly

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


# ---------------------------------------------------------------------------------------------- evaluate
def run_dir_of(ckpt_path: Path) -> Path:
    """``<run_dir>`` of ``<run_dir>/checkpoints/x.ckpt``; else the checkpoint's folder."""
    parent = ckpt_path.parent
    return parent.parent if parent.name == "checkpoints" else parent


def _parse_sets(ppl_sets: dict[str, str] | Sequence[str] | None) -> dict[str, str]:
    if not ppl_sets:
        return {}
    if isinstance(ppl_sets, dict):
        return {str(k): str(v) for k, v in ppl_sets.items()}
    out = {}
    for item in ppl_sets:
        name, eq, path = str(item).partition("=")
        if not eq:
            name, path = Path(item).stem, item
        if not name or not path:
            raise UserError(f"--ppl '{item}' must look like NAME=PATH.")
        out[name] = path
    return out


def evaluate_checkpoint(
    path: str | os.PathLike,
    ppl_sets: dict[str, str] | Sequence[str] | None = None,
    tasks: str | Sequence[str] | None = (DEFAULT_ALIAS,),
    shots: Sequence[int] = DEFAULT_SHOTS,
    limit: int | float | None = None,
    *,
    context_lengths: Sequence[int] | None = None,
    ctx_set: str | None = None,
    ctx_block: int = 128,
    ctx_max_tokens: int | None = None,
    ctx_mode: str = "stream",
    stride: int | None = None,
    max_length: int | None = None,
    batch_size: int = 16,
    device: str = "cpu",
    include_path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    out_dir: str | os.PathLike | None = None,
    tracking_uri: str | None = None,
    mlflow: bool = True,
    loaded: Any = None,
    show: bool = False,
) -> dict[str, Any]:
    """Evaluate one checkpoint (``.ckpt`` file or run directory) and record the results.

    ``ppl_sets`` maps a name to a text set (see ``perplexity.read_texts``); ``context_lengths`` evaluates the
    set ``ctx_set`` (default: the first) at each length (``perplexity.perplexity_by_context_length``);
    ``tasks`` are lm-eval task names (local ones with ``include_path``), each run at every ``shots`` value;
    ``default`` among them stands for ``DEFAULT_TASKS``, those of which whose data cannot be had are skipped
    (``result["skipped_tasks"]``, one line in ``result["notes"]``, printed or logged).
    Returns the JSON-ready result, with ``json_path`` and, unless ``mlflow=False``, ``mlflow`` (tracking URI
    and run id) filled in.
    """
    from recursive_lightning.evaluation.lm_eval_adapter import RecursiveLightningLM
    from recursive_lightning.evaluation.perplexity import perplexity, perplexity_by_context_length, read_texts
    from recursive_lightning.tracking.runs import (
        atomic_write_text,
        check_outputs,
        default_tracking_uri,
        to_json,
    )
    from recursive_lightning.training.checkpoint import load_checkpoint

    if loaded is None:
        loaded = load_checkpoint(path, device="cpu")
    ckpt = Path(loaded.path).resolve()
    run_dir = run_dir_of(ckpt)
    out = Path(out_dir) if out_dir else run_dir / "eval"
    # where the results go must be writable before anything is computed
    check_outputs(
        "eval", out, out_dir is not None, (tracking_uri or default_tracking_uri(run_dir)) if mlflow else None
    )
    sets = _parse_sets(ppl_sets)
    tasks, optional = expand_tasks(tasks)
    if context_lengths is not None:
        context_lengths = check_context_lengths(context_lengths)
    if not tasks and not sets:
        # an empty record would replace the last one (eval-last.json) and say nothing
        raise UserError(
            "eval has nothing to evaluate: no tasks (--tasks none) and no perplexity set; name tasks with "
            "--tasks or pass a text set with --ppl NAME=PATH."
        )
    shots = [int(s) for s in shots] if tasks else []
    if any(s < 0 for s in shots):
        raise UserError(f"shots must be >= 0, not {shots}.")
    lm = RecursiveLightningLM.from_loaded(
        loaded, device=device, batch_size=batch_size, max_length=max_length, stride=stride
    )
    model, tok = lm.model, lm.tokenizer
    texts = {name: read_texts(p) for name, p in sets.items()}  # fail early on a bad path
    for name, docs in texts.items():
        if not docs:
            raise UserError(f"perplexity set '{name}' ({sets[name]}) holds no text.")
    tm = None
    skipped: dict[str, str] = {}
    notes: list[str] = []
    if tasks:
        tm = task_manager(tasks, include_path, metadata=_embedded_metadata(loaded, tasks, notes))
        check_tasks(tm, tasks)
        tasks, skipped = drop_unavailable(tm, tasks, optional)
        if skipped:
            notes.insert(0, skipped_line(skipped))
        if not tasks:
            shots = []
            if not sets:
                raise UserError(
                    f"eval has nothing to evaluate: every task was skipped ({', '.join(skipped)}: their data "
                    f"cannot be had) and no --ppl set was given; {out} is left as it was."
                )
    for line in notes:  # before the (long) evaluation starts
        if show:
            print(f"note: {line}", file=sys.stderr)
        else:
            log.warning("%s", line)

    result: dict[str, Any] = {
        "checkpoint": str(ckpt),
        "run_dir": str(run_dir),
        "run_name": loaded.run.name,
        "global_step": loaded.global_step,
        "model": {
            "layout": model.cfg.layout,
            "topology": model.cfg.topology,
            "max_seq_len": model.cfg.max_seq_len,
        },
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "window": lm.max_length,
        "stride": stride or lm.max_length,
        "ppl": {},
        "ppl_ctx": {},
        "tasks": {},
        "headline": {},
        "avg": {},
        "limit": limit,
        "skipped_tasks": skipped,
        "notes": notes,
    }
    for name, docs in texts.items():
        r = perplexity(
            model, tok, docs, lm.max_length, stride, lm.batch_size, label=f"eval perplexity {name}"
        )
        result["ppl"][name] = {**r, "path": str(sets[name])}
    if context_lengths:
        name = ctx_set or next(iter(sets), None)
        if name is None or name not in texts:
            raise UserError(
                "--context-lengths needs a text set: pass one with --ppl NAME=PATH (and --ctx-ppl NAME)."
            )
        by_len = perplexity_by_context_length(
            model,
            tok,
            texts[name],
            context_lengths,
            block=ctx_block,
            max_tokens=ctx_max_tokens,
            mode=ctx_mode,
            batch_size=lm.batch_size,
            label=f"eval context {name}",
        )
        result["ppl_ctx"] = {
            "set": name,
            "train_seq_len": loaded.run.data.seq_len,
            "lengths": {str(k): v for k, v in by_len.items()},
        }
    if tasks:
        import lm_eval

        result["lm_eval_version"] = getattr(lm_eval, "__version__", "?")
        for k in shots:
            res = run_tasks(lm, tasks, k, limit, tm)
            metrics = task_metrics(res, tasks)
            result["tasks"][str(k)] = {
                t: {"metrics": m, "n_samples": res.get("n-samples", {}).get(t)} for t, m in metrics.items()
            }
            heads = {t: h for t in tasks if (h := headline(t, metrics[t])) is not None}
            result["headline"][str(k)] = {t: {"metric": m, "value": v} for t, (m, v) in heads.items()}
            accs = [v for m, v in heads.values() if not any(x in m for x in NOT_ACCURACY)]
            result["avg"][str(k)] = sum(accs) / len(accs) if accs else None

    json_path = out / f"eval-{ckpt.stem if ckpt.is_file() else ckpt.name}.json"
    result["json_path"] = str(json_path)
    points = {
        int(L): r["ppl"]
        for L, r in result["ppl_ctx"].get("lengths", {}).items()
        if "ppl" in r and math.isfinite(r["ppl"])  # a diverged model's nan / inf has no place on log axes
    }
    if points:
        from recursive_lightning.evaluation.context_plot import plot_ppl_by_context

        png = plot_ppl_by_context(
            {f"{loaded.run.name} @ {loaded.global_step}": points},
            json_path.with_name(json_path.stem + "-ppl-by-context.png"),
            train_length=loaded.run.data.seq_len,
            title=f"perplexity by context length ({result['ppl_ctx']['set']})",
        )
        result["ppl_ctx"]["plot"] = str(png)
    if mlflow:
        result["mlflow"] = _mlflow_target(loaded, run_dir, tracking_uri)
    atomic_write_text(json_path, to_json(result))
    if mlflow:
        _log_mlflow(result, json_path)
    if show:
        print_report(result)
    return result


# ---------------------------------------------------------------------------------------------- MLflow
def _embedded_metadata(loaded: Any, tasks: Sequence[str], notes: list[str]) -> dict[str, Any] | None:
    """lm-eval metadata for the embedded tasks: the cache folder of the checkpoint's run (``data.cache_dir``, else
    ``$RECURSIVE_LIGHTNING_CACHE`` or ``~/.cache/recursive_lightning``); a note in ``notes`` when the checkpoint
    trained on the embedded corpus with fewer held-out documents than the tasks are built from."""
    if not any(t in EMBEDDED_NAMES for t in tasks):
        return None
    from recursive_lightning.data.embedded_tasks import HELDOUT_FRACTION, default_cache_dir

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


def _mlflow_target(loaded: Any, run_dir: Path, tracking_uri: str | None) -> dict[str, Any]:
    """The checkpoint's training run in the tracking store, or a new run tagged with the checkpoint."""
    from recursive_lightning.tracking.runs import (
        RUN_ID_FILE,
        client,
        create_run,
        default_tracking_uri,
        ensure_experiment,
        log_params,
    )

    uri = tracking_uri or default_tracking_uri(run_dir)
    c = client(uri)
    run_id = loaded.mlflow_run_id
    if not run_id and (run_dir / RUN_ID_FILE).is_file():
        run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    if run_id:
        try:
            c.get_run(run_id)
            return {"tracking_uri": uri, "run_id": run_id, "created": False}
        except Exception:
            log.info("MLflow run %s of the checkpoint is not in %s; creating a new run", run_id, uri)
    exp = ensure_experiment(uri, loaded.run.name, run_dir / "mlartifacts")
    new_id = create_run(
        uri,
        exp,
        f"eval-{loaded.run.name}",
        tags={
            "checkpoint": str(loaded.path),
            "recursive_lightning.kind": "eval",
            "training_run_id": str(run_id or ""),
        },
    )
    log_params(uri, new_id, {**loaded.run.flat(), "checkpoint": str(loaded.path)})
    return {"tracking_uri": uri, "run_id": new_id, "created": True}


def _safe(name: str) -> str:
    return re.sub(r"[^\w\-. /:]", "_", name)


def flat_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The MLflow metrics of a result: eval/ppl/<name>, eval/ppl_ctx/<L>, eval/<task>/<k>shot/<metric>, eval/avg/<k>shot."""
    out: dict[str, float] = {}
    for name, r in result.get("ppl", {}).items():
        out[f"eval/ppl/{_safe(name)}"] = r["ppl"]
        out[f"eval/bpb/{_safe(name)}"] = r["bits_per_byte"]
    for L, r in result.get("ppl_ctx", {}).get("lengths", {}).items():
        if "ppl" in r:
            out[f"eval/ppl_ctx/{L}"] = r["ppl"]
            out[f"eval/ppl_ctx_last/{L}"] = r["ppl_last"]
    for k, tasks in result.get("tasks", {}).items():
        for t, entry in tasks.items():
            for m, v in entry["metrics"].items():
                out[f"eval/{_safe(t)}/{k}shot/{_safe(m)}"] = v
    for k, v in result.get("avg", {}).items():
        if v is not None:
            out[f"eval/avg/{k}shot"] = v
    return {k: v for k, v in out.items() if isinstance(v, int | float) and math.isfinite(v)}


def _log_mlflow(result: dict[str, Any], json_path: Path) -> None:
    from recursive_lightning.tracking.runs import log_artifact, log_metrics, set_terminated

    target = result["mlflow"]
    uri, run_id = target["tracking_uri"], target["run_id"]
    log_metrics(uri, run_id, flat_metrics(result), step=int(result.get("global_step") or 0))
    if result.get("skipped_tasks"):
        from recursive_lightning.tracking.runs import client

        client(uri).set_tag(run_id, "eval.skipped_tasks", ", ".join(result["skipped_tasks"]))
    log_artifact(uri, run_id, json_path, subdir="eval")
    if result.get("ppl_ctx", {}).get("plot"):
        log_artifact(uri, run_id, result["ppl_ctx"]["plot"], subdir="eval")
    if target.get("created"):
        set_terminated(uri, run_id)


# ---------------------------------------------------------------------------------------------- output
def print_report(result: dict[str, Any]) -> None:
    from recursive_lightning import formatting as fmt

    rows_ppl = [
        (n, fmt.ppl(r["ppl"]), f"{r['bits_per_byte']:.4f}", str(r["tokens"]))
        for n, r in result["ppl"].items()
    ]
    ctx = result.get("ppl_ctx", {}).get("lengths", {})
    rows_ctx = [
        (L, fmt.ppl(r["ppl"]), fmt.ppl(r["ppl_last"]), str(r["segments"]), "yes" if r["extrapolated"] else "")
        if "ppl" in r
        else (L, "-", "-", "-", f"skipped: {r['skipped']}")
        for L, r in ctx.items()
    ]
    shots = list(result["headline"])
    tasks = sorted(
        {t for k in shots for t in result["headline"][k]},
        key=lambda t: (t not in PAPER_METRIC, list(PAPER_METRIC).index(t) if t in PAPER_METRIC else 0, t),
    )
    rows_task = []
    for t in tasks:
        cells = []
        metric = ""
        for k in shots:
            h = result["headline"][k].get(t)
            cells.append(
                fmt.accuracy(h["value"])
                if h and not any(x in h["metric"] for x in NOT_ACCURACY)
                else (f"{h['value']:.3f}" if h else "-")
            )
            metric = h["metric"] if h else metric
        rows_task.append((t, metric, *cells))
    if shots:
        rows_task.append(
            (
                "average",
                "",
                *[fmt.accuracy(result["avg"][k]) if result["avg"][k] is not None else "-" for k in shots],
            )
        )
    title = f"{result['run_name']} @ step {result['global_step']} ({Path(result['checkpoint']).name})"
    tables = [
        ("perplexity", ("set", "ppl", "bits/byte", "tokens"), rows_ppl),
        (
            f"perplexity by context length ({result.get('ppl_ctx', {}).get('set', '')})",
            ("L", "ppl", "ppl last block", "segments", "beyond max_seq_len"),
            rows_ctx,
        ),
        ("downstream accuracy (%)", ("task", "metric", *[f"{k}-shot" for k in shots]), rows_task),
    ]
    try:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        console.print(f"[bold]{title}[/bold]")
        for name, header, rows in tables:
            if rows:
                table = Table(title=name)
                for h in header:
                    table.add_column(h)
                for r in rows:
                    table.add_row(*map(str, r))
                console.print(table)
        console.print(f"results: {result['json_path']}")
        if result.get("ppl_ctx", {}).get("plot"):
            console.print(f"plot: {result['ppl_ctx']['plot']}")
        if result.get("mlflow"):
            console.print(f"MLflow run {result['mlflow']['run_id']} in {result['mlflow']['tracking_uri']}")
    except ImportError:
        print(title)
        for name, header, rows in tables:
            if rows:
                print(f"\n{name}\n" + "\t".join(header))
                for r in rows:
                    print("\t".join(map(str, r)))
        print(f"results: {result['json_path']}")
        if result.get("ppl_ctx", {}).get("plot"):
            print(f"plot: {result['ppl_ctx']['plot']}")


# ---------------------------------------------------------------------------------------------- CLI
def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"{what} must be a comma-separated list of integers, not '{text}'.") from None


def check_context_lengths(lengths: Sequence[int]) -> list[int]:
    """``lengths`` as a list of positive token counts, or one sentence naming the bad value."""
    out = list(lengths)
    if not out:
        raise UserError("--context-lengths is empty; give token counts, e.g. --context-lengths 256,1024.")
    bad = [L for L in out if not isinstance(L, int) or isinstance(L, bool) or L < 1]
    if bad:
        raise UserError(
            f"--context-lengths must be positive numbers of tokens, not {bad[0]!r}; e.g. --context-lengths 256,1024."
        )
    return out


def _limit(text: str | None) -> int | float | None:
    if text is None:
        return None
    try:
        v = float(text)
    except ValueError:
        raise UserError(
            f"--limit must be a number of examples (or a fraction below 1), not '{text}'."
        ) from None
    if v <= 0:
        raise UserError(f"--limit must be positive, not {text}.")
    return int(v) if v >= 1 and v.is_integer() else v


def _split_tasks(values: Iterable[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [t for v in values for t in v.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="recursive_lightning eval",
        description="Perplexity, perplexity by context length and lm-eval downstream accuracy of a checkpoint.",
    )
    p.add_argument("checkpoint", help="a .ckpt file or a run directory (its newest good checkpoint)")
    p.add_argument(
        "--ppl",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a perplexity text set: .txt (one document), .jsonl/.json ('text' fields) or a folder; repeatable",
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        help=f"lm-eval tasks, comma-separated (default: {','.join(DEFAULT_TASKS)}, each skipped with a note when "
        "its data cannot be had; 'default' names that list); 'none' for no tasks",
    )
    p.add_argument("--shots", default="0,5", help="few-shot counts, comma-separated (default 0,5)")
    p.add_argument("--limit", default=None, help="at most N examples per task (a fraction if below 1)")
    p.add_argument(
        "--context-lengths",
        default=None,
        help="e.g. 1024,4096,16384: perplexity of a --ppl set at each length",
    )
    p.add_argument(
        "--ctx-ppl",
        default=None,
        metavar="NAME",
        help="the --ppl set for --context-lengths (default: the first)",
    )
    p.add_argument(
        "--ctx-block", type=int, default=128, help="last-block size of the context-length table (default 128)"
    )
    p.add_argument(
        "--ctx-max-tokens", type=int, default=None, help="scored tokens per context length (default: all)"
    )
    p.add_argument(
        "--ctx-mode",
        choices=("stream", "documents"),
        default="stream",
        help="stream: the --ppl set joined into one token stream, cut into segments of each length (default); "
        "documents: one segment from the start of each document at least that long",
    )
    p.add_argument(
        "--stride",
        type=int,
        default=None,
        help="sliding-window stride in tokens (default: the window, disjoint)",
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="window / context in tokens (default: the model's max_seq_len)",
    )
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass (default 16)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--out", default=None, help="folder of the JSON result (default <run_dir>/eval)")
    p.add_argument(
        "--tracking-uri", default=None, help="MLflow tracking URI (default sqlite:///<run_dir>/mlflow.db)"
    )
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    p.add_argument(
        "--include-path",
        action="append",
        default=[],
        metavar="DIR",
        help="folder of local task YAMLs; repeatable",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tasks = _split_tasks(args.tasks)
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    for flag in ("batch_size", "max_length", "stride", "ctx_block", "ctx_max_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1, not {value}.")
    evaluate_checkpoint(
        args.checkpoint,
        ppl_sets=args.ppl,
        tasks=[DEFAULT_ALIAS] if tasks is None else tasks,
        shots=_ints(args.shots, "--shots"),
        limit=_limit(args.limit),
        context_lengths=None
        if args.context_lengths is None
        else check_context_lengths(_ints(args.context_lengths, "--context-lengths")),
        ctx_set=args.ctx_ppl,
        ctx_block=args.ctx_block,
        ctx_max_tokens=args.ctx_max_tokens,
        ctx_mode=args.ctx_mode,
        stride=args.stride,
        max_length=args.max_length,
        batch_size=args.batch_size,
        device=device,
        include_path=args.include_path or None,
        out_dir=args.out,
        tracking_uri=args.tracking_uri,
        mlflow=not args.no_mlflow,
        show=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
