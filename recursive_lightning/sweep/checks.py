"""Checks of a sweep file's late fields (its ``evaluate:`` block, read only after a trial has trained), made
before the first training step so that a typo costs seconds, not a trained trial."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from recursive_lightning.data.sources import DataError
from recursive_lightning.errors import ConfigError, UserError
from recursive_lightning.evaluation.downstream import check_tasks, expand_tasks, task_manager
from recursive_lightning.evaluation.run import metric_name
from recursive_lightning.validation import is_example_limit


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def check_evaluate_block(evaluate: dict, here: Path, where: str) -> None:
    """A sweep's ``evaluate:`` block (read only after each trial has trained), checked before the first step:
    shots, limit, the ctx_* fields, that each ``ppl`` path and ``include_path`` exist (relative to ``here``, the
    sweep file's folder, as the runner reads them), that ``ctx_set`` names a ``ppl`` set and that every task is
    one lm-eval knows."""
    if not evaluate:
        return
    shots = evaluate.get("shots", [0])
    if (
        not isinstance(shots, list)
        or not shots
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shots)
    ):
        raise ConfigError(
            f"{where}: evaluate.shots must be a list of few-shot counts >= 0, e.g. [0, 5], not {shots!r}."
        )
    limit = evaluate.get("limit")
    if limit is not None and not is_example_limit(limit):
        raise ConfigError(
            f"{where}: evaluate.limit must be a positive number of examples (a whole number, or a fraction below 1), not {limit!r}."
        )
    for key in ("ctx_block", "ctx_max_tokens"):
        if evaluate.get(key) is not None and not _positive_int(evaluate[key]):
            raise ConfigError(
                f"{where}: evaluate.{key} must be a positive number of tokens, not {evaluate[key]!r}."
            )
    if evaluate.get("ctx_mode", "stream") not in ("stream", "documents"):
        raise ConfigError(
            f"{where}: evaluate.ctx_mode must be stream or documents, not {evaluate['ctx_mode']!r}."
        )
    ppl = evaluate.get("ppl") or {}
    if not isinstance(ppl, dict):
        raise ConfigError(f"{where}: evaluate.ppl must be a mapping {{name: path}}, not {ppl!r}.")
    for name, path in ppl.items():
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{where}: evaluate.ppl.{name} must be a path, not {path!r}.")
        if ":" in path and not Path(path).exists():  # embedded:heldout and friends
            continue
        if not (here / path).expanduser().exists():
            raise ConfigError(
                f"{where}: evaluate.ppl.{name} '{path}' does not exist (paths are relative to the sweep file's "
                "folder); fix the path or remove the set."
            )
    ctx_set = evaluate.get("ctx_set")
    if ctx_set is not None and ctx_set not in ppl:
        raise ConfigError(
            f"{where}: evaluate.ctx_set '{ctx_set}' is not a set of evaluate.ppl ({', '.join(ppl) or 'none'})."
        )
    include = evaluate.get("include_path")
    if include is not None and not (here / str(include)).expanduser().is_dir():
        raise ConfigError(
            f"{where}: evaluate.include_path '{include}' is not a folder (relative to the sweep file's folder)."
        )
    tasks, _ = expand_tasks(evaluate.get("tasks") or [])
    if tasks:
        try:
            check_tasks(task_manager(tasks, str((here / str(include)).resolve()) if include else None), tasks)
        except UserError as e:
            raise ConfigError(f"{where}: evaluate.tasks: {e}") from None
    elif not ppl:
        raise ConfigError(
            f"{where}: evaluate has nothing to evaluate (no tasks and no ppl set); add evaluate.tasks or "
            "evaluate.ppl, or remove the block."
        )


def trial_metrics(evaluate: dict) -> list[str]:
    """The metric names a sweep's trial produces (``val/heldout/*`` and what its ``evaluate:`` block adds, as
    ``evaluation.run.flat_metrics`` names them); ``eval/<task>/<k>shot/`` prefixes end in ``/``."""
    names = ["val/heldout/loss", "val/heldout/ppl"]
    for name in (evaluate.get("ppl") or {}) if isinstance(evaluate.get("ppl"), dict) else {}:
        names += [f"eval/ppl/{metric_name(str(name))}", f"eval/bpb/{metric_name(str(name))}"]
    for length in evaluate.get("context_lengths") or []:
        names += [f"eval/ppl_ctx/{length}", f"eval/ppl_ctx_last/{length}"]
    tasks, _ = expand_tasks(evaluate.get("tasks") or [])
    for k in evaluate.get("shots", [0]) if tasks else []:
        names += [f"eval/{metric_name(t)}/{k}shot/" for t in tasks] + [f"eval/avg/{k}shot"]
    return names


def check_late_fields(spec: Any, here: Path, where: str) -> None:
    """Every field of a sweep that is read only after a trial has trained, checked before the first step: the
    ``evaluate:`` block, the ranking ``metric`` (a trial must produce it), ``pruning`` and ``report.plot``."""
    check_evaluate_block(spec.evaluate, here, where)
    names = trial_metrics(spec.evaluate)
    metric = spec.metric
    if not any(
        metric == n or (n.endswith("/") and metric.startswith(n) and len(metric) > len(n)) for n in names
    ):
        shown = ", ".join(n + "<metric>" if n.endswith("/") else n for n in names)
        raise ConfigError(
            f"{where}: metric '{metric}' is not one a trial of this sweep produces; choose one of {shown}."
        )
    pruning = spec.pruning or {}
    unknown = sorted(set(pruning) - {"enabled", "warmup_steps"})
    if unknown:
        raise ConfigError(f"{where}: pruning.{unknown[0]} is not a pruning field; use enabled, warmup_steps.")
    warm = pruning.get("warmup_steps", 0)
    if isinstance(warm, bool) or not isinstance(warm, int) or warm < 0:
        raise ConfigError(f"{where}: pruning.warmup_steps must be an integer >= 0, not {warm!r}.")
    plot = (spec.report or {}).get("plot", "auto")
    if plot not in ("auto", "bar", "line"):
        raise ConfigError(f"{where}: report.plot must be auto, bar or line, not {plot!r}.")
    unknown = sorted(set(spec.report or {}) - {"plot", "baseline"})
    if unknown:
        raise ConfigError(f"{where}: report.{unknown[0]} is not a report field; use plot, baseline.")


def check_grid_data(spec: Any) -> None:
    """The data of every grid point (``data.path``, split into train and validation as training splits it),
    checked before the first trial: a path that every trial and every retry would fail on is one sentence."""
    from recursive_lightning.data.prepare import check_data  # heavy

    seen = set()
    for point in spec.points():
        d = spec.trial_config(point).data
        if (d.path, d.val_fraction) in seen:
            continue
        seen.add((d.path, d.val_fraction))
        try:
            check_data(d.path, d.val_fraction)
        except DataError as e:
            raise ConfigError(f"{spec.at(point)}: data.path: {str(e)[:1].lower()}{str(e)[1:]}") from None
