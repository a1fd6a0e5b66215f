"""Sweep files (``ablations/*.yaml``): a base run config plus named axes crossed into a grid.

    name: mesh-buffer-cpu
    description: MeSH Table 4 (B = N_loop + 1 + k)
    base: ../experiments/cpu/looped-mesh.yaml     # a run YAML (relative to this file) or an inline mapping
    overrides: {train.max_steps: 200}             # dotted fields applied to every trial
    axes:
      model.buffer: [3, 4, 5, 6]                  # a field and its values
      variant:                                    # a named axis of rows, each a set of dotted overrides
        anchor: {model.topology: anchor}
        mesh: {model.topology: mesh}
    seeds: [0, 1]                                 # shorthand for the axis train.seed
    search:                                       # instead of a grid: Optuna TPE over ranges and choices
      n_trials: 20
      space: {train.lr: {low: 1.0e-4, high: 3.0e-3, log: true}, model.topology: {choices: [anchor, mesh]}}
    metric: val/heldout/loss                      # minimised; reported as PPL too
    max_retries: 2
    workers: 2                                    # worker processes (default 1; --workers overrides)
    pruning: {enabled: false, warmup_steps: 100}
    evaluate: {ppl: {name: path}, tasks: [], limit: 50, shots: [0],   # after each trial (evaluation/options.py)
               context_lengths: [256, 1024, 4096], ctx_set: name, ctx_max_tokens: 16384,
               loops: [1, 2, 4, 8], h_cycles: [1, 2, 4],   # test-time depths (looped / Mela trials)
               exit_kl: [5.0e-4, 1.0e-3], exit_max_tokens: 2048}  # adaptive exit (full-resolution looped)
    report: {plot: line, x: model.buffer,         # hints for the report's figures; baseline: the row the
             baseline: anchor}                    # report's paired differences (same seed) are taken to

Every trial config is built and validated before anything trains, so a bad sweep fails in one sentence.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursive_lightning.config import RunConfig, check_model_types, check_name, load_yaml, set_dotted
from recursive_lightning.errors import ConfigError, UserError
from recursive_lightning.evaluation.options import SWEEP_FIELDS, check_depths, check_thresholds

TOP_KEYS = {
    "name",
    "description",
    "base",
    "overrides",
    "axes",
    "seeds",
    "search",
    "metric",
    "max_retries",
    "pruning",
    "evaluate",
    "report",
    "workers",
}
SCALAR = (str, int, float, bool, type(None))
SEED_AXIS = "train.seed"
# evaluate: of a sweep file -> EvalOptions fields (evaluation/options.py)
EVALUATE_KEYS = set(SWEEP_FIELDS)


@dataclass
class Axis:
    name: str
    labels: list[Any]  # grid values as Optuna sees them (primitives)
    overrides: dict[Any, dict[str, Any]]  # label -> dotted overrides


@dataclass
class SweepSpec:
    name: str
    path: Path | None
    base: dict[str, Any]
    axes: list[Axis]
    description: str = ""
    search: dict[str, Any] | None = None
    metric: str = "val/heldout/loss"
    max_retries: int = 2
    pruning: dict[str, Any] = field(default_factory=dict)
    evaluate: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)
    workers: int = 1

    # ------------------------------------------------------------------ grid
    def grid(self) -> list[dict[str, Any]]:
        """Every grid point as {axis name: label}, in a deterministic order."""
        if not self.axes:
            return [{}]
        return [
            dict(zip([a.name for a in self.axes], combo))
            for combo in itertools.product(*[a.labels for a in self.axes])
        ]

    def points(self) -> list[dict[str, Any]]:
        """The points whose configs decide the sweep: every grid point, or the base alone for a search."""
        return self.grid() if self.search is None else [{}]

    def at(self, point: dict[str, Any]) -> str:
        """How a sentence names ``point``: "sweep 'name' at axis=label, ..." ("sweep 'name'" for the base)."""
        where = ", ".join(f"{k}={v}" for k, v in point.items())
        return f"sweep '{self.name}'" + (f" at {where}" if where else "")

    def trial_config(self, point: dict[str, Any]) -> RunConfig:
        data = copy.deepcopy(self.base)
        for axis in self.axes:
            if axis.name in point:
                for key, value in axis.overrides[point[axis.name]].items():
                    set_dotted(data, key, value)
        for key, value in point.items():  # search-space parameters are plain dotted fields
            if key not in {a.name for a in self.axes}:
                set_dotted(data, key, value)
        if isinstance(data.get("model"), dict):
            if data["model"].get("layout") is not None:
                data["model"]["layout"] = str(data["model"]["layout"])
            data["model"] = check_model_types(data["model"])
        data["name"] = self.name
        return RunConfig.from_dict(data)

    def search_values(self) -> list[dict[str, Any]]:
        """Each choice and each range end of every ``search.space`` parameter, as a one-field point."""
        if self.search is None:
            return []
        out = []
        for name, dist in self.search["space"].items():
            values = dist["choices"] if "choices" in dist else [dist["low"], dist["high"]]
            out += [{name: value} for value in values]
        return out

    def checked_points(self) -> list[dict[str, Any]]:
        """The points checked before any training: :meth:`points`, and for a search each value of
        :meth:`search_values` on the base (a value every trial that draws it would fail on)."""
        return self.points() + self.search_values()

    def validate(self) -> SweepSpec:
        for point in self.points():
            try:
                self.trial_config(point)
            except ConfigError as e:
                raise ConfigError(f"{self.at(point)}: {e}") from None
        for point in self.search_values():
            self._check_search_value(point)
        return self

    def _check_search_value(self, point: dict[str, Any]) -> None:
        """One sentence for a search value that no trial drawing it can train: it fails on the base and beside
        every combination of the other parameters' choices (the first 64), which a trial may draw with it."""
        ((name, _),) = point.items()
        others = [
            [(k, c) for c in d["choices"]]
            for k, d in self.search["space"].items()
            if k != name and "choices" in d
        ]
        first = None
        for combo in itertools.chain([()], itertools.islice(itertools.product(*others), 64)):
            try:
                self.trial_config({**dict(combo), **point})
                return
            except ConfigError as e:
                first = first or e
        raise ConfigError(f"{self.at(point)}: {first}") from None


def row_name(point: dict[str, Any], axes: list[str]) -> str:
    """A report row's name: the labels of the grid point's axes other than the seed, joined by ", " (the
    names ``report.baseline`` takes)."""
    return ", ".join(str(point[a]) for a in axes if a in point and a != SEED_AXIS)


def row_names(axes: list[Axis]) -> list[str]:
    """Every row of a grid sweep's report, in grid order (empty when only seeds vary)."""
    names = [a.name for a in axes if a.name != SEED_AXIS]
    if not names:
        return []
    return [
        row_name(dict(zip(names, combo)), names)
        for combo in itertools.product(*[a.labels for a in axes if a.name != SEED_AXIS])
    ]


def point_key(point: dict[str, Any]) -> str:
    """A short, stable name for a grid point (its trial directory)."""
    text = json.dumps(point, sort_keys=True, default=str)
    readable = "-".join(f"{str(v)}" for v in point.values())
    readable = "".join(c if c.isalnum() or c in "-._" else "_" for c in readable)[:60] or "point"
    return f"{readable}-{hashlib.sha1(text.encode()).hexdigest()[:6]}"


def _parse_axis(name: str, values: Any, where: str) -> Axis:
    if isinstance(values, dict):
        if not values:
            raise ConfigError(f"{where}: axis '{name}' is empty; give it at least one row.")
        overrides = {}
        for label, row in values.items():
            if not isinstance(row, dict):
                raise ConfigError(
                    f"{where}: row '{label}' of axis '{name}' must be a mapping of dotted fields, not {row!r}."
                )
            overrides[str(label)] = {str(k): v for k, v in row.items()}
        return Axis(name, list(overrides), overrides)
    if not isinstance(values, list):
        raise ConfigError(
            f"{where}: axis '{name}' must be a list of values or a mapping of named rows, not {values!r}."
        )
    if not values:
        raise ConfigError(f"{where}: axis '{name}' is empty; give it at least one value.")
    if "." not in name:
        raise ConfigError(
            f"{where}: axis '{name}' must be a dotted config field like model.buffer (or a mapping of named rows)."
        )
    labels = []
    for v in values:
        if not isinstance(v, SCALAR):
            raise ConfigError(
                f"{where}: axis '{name}' holds {v!r}; values must be numbers, strings or booleans."
            )
        labels.append(v)
    if len(set(map(repr, labels))) != len(labels):
        raise ConfigError(f"{where}: axis '{name}' repeats a value.")
    return Axis(name, labels, {v: {name: v} for v in labels})


def load_sweep(
    path: str | Path, relative_to: str | Path | None = None, base_needed: bool = True
) -> SweepSpec:
    """``relative_to``: the folder a relative ``base:`` resolves from, when the file is a copy kept elsewhere
    (a run directory's sweep.yaml); default the file's own folder. ``base_needed`` False: a ``base:`` file that
    is not there (a sweep directory moved to another machine) reads as an empty base; what reads the spec
    then (the report) takes each trial's config from its own directory."""
    path = Path(path)
    raw = load_yaml(path, "sweep file", "ablations/default.yaml", "name, base, overrides and axes")
    where = f"sweep file '{path}'"
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise ConfigError(f"{where}: '{unknown[0]}' is not a sweep field; use {', '.join(sorted(TOP_KEYS))}.")
    base, missing = _base_config(raw, path, relative_to, base_needed, where)
    axes = _axes(raw, where)
    search = _search(raw.get("search"), where)
    max_retries = raw.get("max_retries", 2)
    if not isinstance(max_retries, int) or max_retries < 0:
        raise ConfigError(f"{where}: max_retries must be an integer >= 0, not {max_retries!r}.")
    workers = raw.get("workers", 1)
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"{where}: workers must be an integer >= 1, not {workers!r}.")
    evaluate = _evaluate_block(raw.get("evaluate") or {}, where)
    name = raw.get("name") or path.stem
    if not isinstance(name, str):
        raise ConfigError(f"{where}: name must be a string.")
    check_name(name, f"{where}: name")
    report = _report_hints(raw.get("report") or {}, axes, search, where)
    spec = SweepSpec(
        name=name,
        path=path,
        base=base,
        axes=axes,
        description=str(raw.get("description", "")),
        search=search,
        metric=str(raw.get("metric", "val/heldout/loss")),
        max_retries=max_retries,
        pruning=dict(raw.get("pruning") or {}),
        evaluate=dict(evaluate),
        report=dict(report),
        workers=workers,
    )
    # without its base a grid point's config is incomplete: nothing to validate (the trials hold theirs)
    return spec if missing else spec.validate()


def _base_config(
    raw: dict, path: Path, relative_to: str | Path | None, base_needed: bool, where: str
) -> tuple[dict, bool]:
    """(the base run config with the file's ``overrides`` applied, whether its ``base:`` file is missing)."""
    base, missing = raw.get("base"), False
    if isinstance(base, str):
        base_path = (Path(relative_to or path.parent) / base).resolve()
        if base_path.is_file():
            base = load_yaml(base_path)
        elif base_needed:
            raise ConfigError(
                f"{where}: base config '{base}' does not exist (paths are relative to the sweep file)."
            )
        else:
            base, missing = {}, True
    elif base is None:
        base = {}
    elif not isinstance(base, dict):
        raise ConfigError(f"{where}: base must be a run YAML path or a mapping, not {base!r}.")
    base = copy.deepcopy(base)
    for key, value in (raw.get("overrides") or {}).items():
        set_dotted(base, str(key), value)
    return base, missing


def _axes(raw: dict, where: str) -> list[Axis]:
    """The grid's axes, ``seeds:`` as the axis ``train.seed``."""
    if not isinstance(raw.get("axes") or {}, dict):
        raise ConfigError(
            f"{where}: axes must be a mapping of a field (or a named axis) to its values, e.g. "
            "`axes: {model.topology: [base, mesh]}`, not a {type(raw['axes']).__name__}."
        )
    axes = [_parse_axis(str(k), v, where) for k, v in (raw.get("axes") or {}).items()]
    if raw.get("seeds") is not None:
        if any(a.name == "train.seed" for a in axes):
            raise ConfigError(f"{where}: give seeds either as `seeds:` or as the axis train.seed, not both.")
        axes.append(_parse_axis("train.seed", raw["seeds"], where))
    return axes


def _search(search: Any, where: str) -> dict | None:
    """A ``search:`` block checked: a non-empty space of ranges or choices, ``n_trials`` >= 1."""
    if search is None:
        return None
    if not isinstance(search, dict) or not isinstance(search.get("space"), dict) or not search["space"]:
        raise ConfigError(
            f"{where}: search needs a non-empty `space` mapping of dotted fields to ranges or choices."
        )
    for k, v in search["space"].items():
        if not isinstance(v, dict) or not ({"low", "high"} <= set(v) or "choices" in v):
            raise ConfigError(
                f"{where}: search.space.{k} must be {{low, high[, log, step]}} or {{choices: [...]}}."
            )
        if "choices" in v and (not isinstance(v["choices"], list) or not v["choices"]):
            raise ConfigError(f"{where}: search.space.{k}.choices must be a non-empty list of values.")
        if "choices" not in v:
            _check_range(k, v, where)
    if int(search.get("n_trials", 0)) < 1:
        raise ConfigError(f"{where}: search.n_trials must be >= 1.")
    return search


def _check_range(name: str, dist: dict, where: str) -> None:
    """One sentence for a search range Optuna cannot sample: ends that are not numbers, low above high, a log
    range that does not start above 0."""
    low, high = dist["low"], dist["high"]
    if not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in (low, high)
    ):
        raise ConfigError(
            f"{where}: search.space.{name}: low and high must be numbers, not {low!r} and {high!r}."
        )
    if low > high:
        raise ConfigError(f"{where}: search.space.{name}: low {low} is above high {high}; swap them.")
    if dist.get("log") and low <= 0:
        raise ConfigError(f"{where}: search.space.{name}: a log range needs low > 0, not {low}.")


def _evaluate_block(evaluate: Any, where: str) -> dict:
    """The ``evaluate:`` block's keys and the shapes of its values checked (what they name, the text sets and
    tasks, is checked before the first trial: ``sweep/checks.py``)."""
    if not isinstance(evaluate, dict) or set(evaluate) - EVALUATE_KEYS:
        bad = sorted(set(evaluate) - EVALUATE_KEYS) if isinstance(evaluate, dict) else [repr(evaluate)]
        raise ConfigError(
            f"{where}: evaluate.{bad[0]} is not an evaluate field; use {', '.join(sorted(EVALUATE_KEYS))}."
        )
    _check_context_lengths(evaluate, where)
    try:
        for dial in ("loops", "h_cycles"):
            check_depths(evaluate.get(dial), f"evaluate.{dial}")
        check_thresholds(evaluate.get("exit_kl"), "evaluate.exit_kl")
    except UserError as e:
        raise ConfigError(f"{where}: {e}") from None
    if evaluate.get("exit_kl") and not evaluate.get("ppl"):
        raise ConfigError(f"{where}: evaluate.exit_kl scores text sets: add evaluate.ppl {{name: path}}.")
    most = evaluate.get("exit_max_tokens", 1)
    if isinstance(most, bool) or not isinstance(most, int) or most < 1:
        raise ConfigError(
            f"{where}: evaluate.exit_max_tokens must be a whole number of tokens >= 1, not {most!r}."
        )
    tasks = evaluate.get("tasks")
    if tasks is not None and not (
        isinstance(tasks, str) or (isinstance(tasks, list) and all(isinstance(t, str) and t for t in tasks))
    ):
        raise ConfigError(
            f"{where}: evaluate.tasks must be a list of lm-eval task names (or default), not {tasks!r}."
        )
    return evaluate


def _check_context_lengths(evaluate: dict, where: str) -> None:
    """``evaluate.context_lengths``: positive token counts, and a text set to score them on."""
    lengths = evaluate.get("context_lengths")
    if lengths is None:
        return
    if (
        not isinstance(lengths, list)
        or not lengths
        or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in lengths)
    ):
        raise ConfigError(
            f"{where}: evaluate.context_lengths must be a list of positive token counts, not {lengths!r}."
        )
    if not evaluate.get("ppl"):
        raise ConfigError(
            f"{where}: evaluate.context_lengths needs a text set: add evaluate.ppl {{name: path}} (and ctx_set)."
        )


def _report_hints(report: Any, axes: list[Axis], search: dict | None, where: str) -> dict:
    """The ``report:`` block: a mapping whose ``baseline``, if given, is a row of the grid."""
    if not isinstance(report, dict):
        raise ConfigError(
            f"{where}: report must be a mapping such as {{plot: bar, baseline: <row>}}, not {report!r}."
        )
    if report.get("baseline") is not None:
        rows = row_names(axes)
        if search is not None or str(report["baseline"]) not in rows:
            valid = ", ".join(rows) if search is None and rows else "none (a search, or no axis but seeds)"
            raise ConfigError(
                f"{where}: report.baseline '{report['baseline']}' is not a row of this sweep; the rows are: {valid}."
            )
    return report
