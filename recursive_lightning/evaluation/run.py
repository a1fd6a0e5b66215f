"""The evaluation of one checkpoint (``evaluate_checkpoint``): perplexity, perplexity by context length and
lm-eval accuracy, as ``EvalOptions`` say (evaluation/options.py; the ``eval`` command: commands/eval.py; a sweep's
``evaluate:`` block).

CHECKPOINT is a ``.ckpt`` file or a run directory (its newest good checkpoint). Results go to a JSON file
(``<run_dir>/eval/eval-<checkpoint>.json`` unless ``out_dir``) and the checkpoint's MLflow run (``eval/ppl/<name>``,
``eval/ppl_ctx/<L>``, ``eval/<task>/<shots>shot/<metric>``, ``eval/avg/<shots>shot``, step = the checkpoint's
global step, the JSON as an artifact under ``eval/``). With ``loops`` / ``h_cycles`` the sets and tasks again at
each test-time depth (evaluation/depth.py): the JSON's ``depth`` section, ``eval/loops_<k>/...`` (Mela:
``eval/h_cycles_<k>/...``) and ``<json stem>-by-depth.png``. With ``exit_kl`` the sets scored with adaptive exit
(evaluation/adaptive_exit.py): the JSON's ``adaptive_exit`` section, ``eval/exit_kl_<thr>/...``.
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from recursive_lightning.errors import UserError
from recursive_lightning.evaluation.adaptive_exit import evaluate_adaptive_exit, exit_metrics, exit_request
from recursive_lightning.evaluation.depth import depth_prefix, depth_request, evaluate_depths
from recursive_lightning.evaluation.downstream import (
    NOT_ACCURACY,
    check_tasks,
    drop_unavailable,
    embedded_metadata,
    expand_tasks,
    headline,
    run_tasks,
    skipped_line,
    task_manager,
    task_metrics,
)
from recursive_lightning.evaluation.options import EvalOptions
from recursive_lightning.files import atomic_write_text
from recursive_lightning.run_dir import RunDir
from recursive_lightning.tracking.runs import (
    check_outputs,
    client,
    create_run,
    default_tracking_uri,
    ensure_experiment,
    log_artifact,
    log_metrics,
    log_params,
    set_tags,
    set_terminated,
    to_json,
)
from recursive_lightning.training.run_lock import close_if_abandoned

log = logging.getLogger(__name__)


def run_dir_of(ckpt_path: Path) -> Path:
    """``<run_dir>`` of ``<run_dir>/checkpoints/x.ckpt``; else the checkpoint's folder."""
    return RunDir.of_checkpoint(ckpt_path).path


def evaluate_checkpoint(
    path: str | os.PathLike, options: EvalOptions, *, loaded: Any = None, show: bool = False
) -> dict[str, Any]:
    """Evaluate one checkpoint (``.ckpt`` file or run directory; or ``loaded``, a checkpoint already loaded) as
    ``options`` say, and record the results. The ``default`` tasks whose data cannot be had are skipped
    (``result["skipped_tasks"]``, one line in ``result["notes"]``, printed on stderr with ``show``, else logged).
    Returns the JSON-ready result, with ``json_path`` and, unless ``options.mlflow`` is False, ``mlflow``
    (tracking URI and run id) filled in.
    """
    from recursive_lightning.evaluation.lm_eval_adapter import RecursiveLightningLM  # heavy
    from recursive_lightning.training.checkpoint import load_checkpoint  # heavy

    o = options
    if loaded is None:
        loaded = load_checkpoint(path, device="cpu")
    ckpt = Path(loaded.path).resolve()
    run_dir = run_dir_of(ckpt)
    if o.mlflow and o.tracking_uri is None:  # a run its killed writer left RUNNING: closed KILLED first
        close_if_abandoned(run_dir)
    out = Path(o.out_dir) if o.out_dir else RunDir(run_dir).eval_dir
    depths = depth_request(loaded.model, o)  # a dial the model lacks: one sentence, nothing written
    exits = exit_request(loaded.model, o)  # a model that cannot exit early: the same
    # where the results go must be writable before anything is computed
    check_outputs(
        "eval",
        out,
        o.out_dir is not None,
        (o.tracking_uri or default_tracking_uri(run_dir)) if o.mlflow else None,
    )
    sets = o.ppl_paths()
    tasks, optional = expand_tasks(o.tasks)
    if not tasks and not sets:
        # an empty record would replace the last one (eval-last.json) and say nothing
        raise UserError(
            "eval has nothing to evaluate: no tasks (--tasks none) and no perplexity set; name tasks with "
            "--tasks or pass a text set with --ppl NAME=PATH."
        )
    shots = list(o.shots) if tasks else []
    lm = RecursiveLightningLM.from_loaded(
        loaded, device=o.device, batch_size=o.batch_size, max_length=o.max_length, stride=o.stride
    )
    texts = _read_sets(sets)
    tm, tasks, skipped, notes = _runnable_tasks(loaded, tasks, optional, o, bool(sets), out)
    if not tasks:
        shots = []
    for line in notes:  # before the (long) evaluation starts
        if show:
            print(f"note: {line}", file=sys.stderr)
        else:
            log.warning("%s", line)
    result = _empty_result(loaded, lm, ckpt, run_dir, o, skipped, notes)
    result["ppl"] = _perplexities(lm, texts, sets, o)
    if o.context_lengths:
        result["ppl_ctx"] = _by_context_length(lm, loaded, texts, sets, o)
    if tasks:
        _downstream(result, lm, tm, tasks, shots, o.limit)
    if depths:

        def measure(k: int) -> dict[str, Any]:
            entry: dict[str, Any] = {"ppl": _perplexities(lm, texts, sets, o, f" at {depths[0]}={k}")}
            if tasks:
                entry.update(tasks={}, headline={}, avg={})
                _downstream(entry, lm, tm, tasks, shots, o.limit)
                entry.pop("lm_eval_version", None)
            return entry

        result["depth"] = evaluate_depths(lm.model, lm.max_length, *depths, measure)
    if exits:
        result["adaptive_exit"] = evaluate_adaptive_exit(
            lm.model, lm.tokenizer, texts, exits, lm.max_length, o.stride, o.exit_max_tokens, lm.batch_size
        )
    return _record(result, loaded, ckpt, run_dir, out, o)


def _empty_result(
    loaded: Any, lm: Any, ckpt: Path, run_dir: Path, o: EvalOptions, skipped: list, notes: list[str]
) -> dict[str, Any]:
    """The evaluation's record before any number: the checkpoint, its model, the window and the notes."""
    model = lm.model
    return {
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
        "stride": o.stride or lm.max_length,
        "ppl": {},
        "ppl_ctx": {},
        "tasks": {},
        "headline": {},
        "avg": {},
        "limit": o.limit,
        "skipped_tasks": skipped,
        "notes": notes,
    }


def _record(
    result: dict[str, Any], loaded: Any, ckpt: Path, run_dir: Path, out: Path, o: EvalOptions
) -> dict[str, Any]:
    """Write the result as ``eval-<checkpoint>.json`` in ``out`` with its plots and, unless ``o.mlflow`` is
    False, log it to the checkpoint's MLflow run."""
    json_path = out / f"eval-{ckpt.stem if ckpt.is_file() else ckpt.name}.json"
    result["json_path"] = str(json_path)
    _plot_by_context_length(result, loaded, json_path)
    _plot_by_depth(result, loaded, json_path)
    if o.mlflow:
        result["mlflow"] = _mlflow_target(loaded, run_dir, o.tracking_uri)
    atomic_write_text(json_path, to_json(result))
    if o.mlflow:
        _log_mlflow(result, json_path)
    return result


def _read_sets(sets: dict[str, str]) -> dict[str, list[str]]:
    """The documents of each perplexity set (read before any evaluation: a bad path fails early)."""
    from recursive_lightning.evaluation.perplexity import read_texts  # heavy

    texts = {name: read_texts(p) for name, p in sets.items()}
    for name, docs in texts.items():
        if not docs:
            raise UserError(f"perplexity set '{name}' ({sets[name]}) holds no text.")
    return texts


def _runnable_tasks(
    loaded: Any, tasks: list[str], optional: set[str], o: EvalOptions, has_sets: bool, out: Path
) -> tuple[Any, list[str], dict[str, str], list[str]]:
    """(lm-eval task manager, the tasks to run, {skipped default task: why}, notes to show before running)."""
    notes: list[str] = []
    if not tasks:
        return None, tasks, {}, notes
    tm = task_manager(tasks, o.include_path, metadata=embedded_metadata(loaded, tasks, notes))
    check_tasks(tm, tasks)
    tasks, skipped = drop_unavailable(tm, tasks, optional)
    if skipped:
        notes.insert(0, skipped_line(skipped))
    if not tasks and not has_sets:
        raise UserError(
            f"eval has nothing to evaluate: every task was skipped ({', '.join(skipped)}: their data "
            f"cannot be had) and no --ppl set was given; {out} is left as it was."
        )
    return tm, tasks, skipped, notes


def _perplexities(
    lm: Any, texts: dict[str, list[str]], sets: dict[str, str], o: EvalOptions, at: str = ""
) -> dict[str, Any]:
    from recursive_lightning.evaluation.perplexity import perplexity  # heavy

    out = {}
    for name, docs in texts.items():
        r = perplexity(
            lm.model,
            lm.tokenizer,
            docs,
            lm.max_length,
            o.stride,
            lm.batch_size,
            label=f"eval perplexity {name}{at}",
        )
        out[name] = {**r, "path": str(sets[name])}
    return out


def _by_context_length(
    lm: Any, loaded: Any, texts: dict[str, list[str]], sets: dict[str, str], o: EvalOptions
) -> dict[str, Any]:
    from recursive_lightning.evaluation.perplexity import perplexity_by_context_length  # heavy

    name = o.ctx_set or next(iter(sets), None)
    if name is None or name not in texts:
        raise UserError(
            "--context-lengths needs a text set: pass one with --ppl NAME=PATH (and --ctx-ppl NAME)."
        )
    by_len = perplexity_by_context_length(
        lm.model,
        lm.tokenizer,
        texts[name],
        o.context_lengths,
        block=o.ctx_block,
        max_tokens=o.ctx_max_tokens,
        mode=o.ctx_mode,
        batch_size=lm.batch_size,
        label=f"eval context {name}",
    )
    return {
        "set": name,
        "train_seq_len": loaded.run.data.seq_len,
        "lengths": {str(k): v for k, v in by_len.items()},
    }


def _downstream(
    result: dict[str, Any], lm: Any, tm: Any, tasks: list[str], shots: list[int], limit: int | float | None
) -> None:
    """lm-eval ``tasks`` at each of ``shots`` into ``result`` (``tasks``, ``headline``, ``avg``)."""
    import lm_eval  # heavy

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


def _plot_by_context_length(result: dict[str, Any], loaded: Any, json_path: Path) -> None:
    points = {
        int(L): r["ppl"]
        for L, r in result["ppl_ctx"].get("lengths", {}).items()
        if "ppl" in r and math.isfinite(r["ppl"])  # a diverged model's nan / inf has no place on log axes
    }
    if not points:
        return
    from recursive_lightning.evaluation.context_plot import plot_ppl_by_context  # heavy

    png = plot_ppl_by_context(
        {f"{loaded.run.name} @ {loaded.global_step}": points},
        json_path.with_name(json_path.stem + "-ppl-by-context.png"),
        train_length=loaded.run.data.seq_len,
        title=f"perplexity by context length ({result['ppl_ctx']['set']})",
    )
    result["ppl_ctx"]["plot"] = str(png)


def _plot_by_depth(result: dict[str, Any], loaded: Any, json_path: Path) -> None:
    if not result.get("depth"):
        return
    from recursive_lightning.evaluation.depth_plot import plot_by_depth  # heavy

    section = result["depth"]
    png = plot_by_depth(
        section,
        json_path.with_name(json_path.stem + "-by-depth.png"),
        title=f"{loaded.run.name} @ step {loaded.global_step}: test-time depth ({section['dial']})",
    )
    if png is not None:
        section["plot"] = str(png)


# ---------------------------------------------------------------------------------------------- MLflow
def _mlflow_target(loaded: Any, run_dir: Path, tracking_uri: str | None) -> dict[str, Any]:
    """The checkpoint's training run in the tracking store, or a new run tagged with the checkpoint."""
    uri = tracking_uri or default_tracking_uri(run_dir)
    c = client(uri)
    run_id = loaded.mlflow_run_id
    run_id = run_id or RunDir(run_dir).recorded_run_id()
    if run_id:
        try:
            c.get_run(run_id)
            return {"tracking_uri": uri, "run_id": run_id, "created": False}
        except Exception:
            log.info("MLflow run %s of the checkpoint is not in %s; creating a new run", run_id, uri)
    exp = ensure_experiment(uri, loaded.run.name, RunDir(run_dir).artifacts)
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


def metric_name(name: str) -> str:
    """``name`` (a perplexity set, a task, a metric) as one part of an MLflow metric key: characters MLflow
    refuses become ``_`` (``flat_metrics`` and a sweep's metric checks name keys with it)."""
    return re.sub(r"[^\w\-. /:]", "_", name)


def flat_metrics(result: dict[str, Any], prefix: str = "eval") -> dict[str, float]:
    """The MLflow metrics of a result: eval/ppl/<name>, eval/ppl_ctx/<L>, eval/<task>/<k>shot/<metric>,
    eval/avg/<k>shot; at each test-time depth k the same under eval/loops_<k>/ (Mela: eval/h_cycles_<k>/), and
    eval/loops_<k>/flops_forward_per_token; with adaptive exit eval/exit_kl_<thr>/... and eval/exit_reference/...
    (``adaptive_exit.exit_metrics``)."""
    out: dict[str, float] = exit_metrics(result.get("adaptive_exit"), metric_name, prefix)
    depth = result.get("depth") or {}
    for k, entry in depth.get("counts", {}).items():
        out.update(flat_metrics(entry, depth_prefix(depth["dial"], k)))
        out[f"{depth_prefix(depth['dial'], k)}/flops_forward_per_token"] = entry["flops_forward_per_token"]
    for name, r in result.get("ppl", {}).items():
        out[f"{prefix}/ppl/{metric_name(name)}"] = r["ppl"]
        out[f"{prefix}/bpb/{metric_name(name)}"] = r["bits_per_byte"]
    for L, r in result.get("ppl_ctx", {}).get("lengths", {}).items():
        if "ppl" in r:
            out[f"{prefix}/ppl_ctx/{L}"] = r["ppl"]
            out[f"{prefix}/ppl_ctx_last/{L}"] = r["ppl_last"]
    for k, tasks in result.get("tasks", {}).items():
        for t, entry in tasks.items():
            for m, v in entry["metrics"].items():
                out[f"{prefix}/{metric_name(t)}/{k}shot/{metric_name(m)}"] = v
    for k, v in result.get("avg", {}).items():
        if v is not None:
            out[f"{prefix}/avg/{k}shot"] = v
    return {k: v for k, v in out.items() if isinstance(v, int | float) and math.isfinite(v)}


def _log_mlflow(result: dict[str, Any], json_path: Path) -> None:
    target = result["mlflow"]
    uri, run_id = target["tracking_uri"], target["run_id"]
    log_metrics(uri, run_id, flat_metrics(result), step=int(result.get("global_step") or 0))
    if result.get("skipped_tasks"):
        set_tags(uri, run_id, {"eval.skipped_tasks": ", ".join(result["skipped_tasks"])})
    log_artifact(uri, run_id, json_path, subdir="eval")
    for plot in (result.get("ppl_ctx", {}).get("plot"), (result.get("depth") or {}).get("plot")):
        if plot:
            log_artifact(uri, run_id, plot, subdir="eval")
    if target.get("created"):
        set_terminated(uri, run_id)
