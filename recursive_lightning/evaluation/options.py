"""What an evaluation of a checkpoint does: ``EvalOptions``, shared by the ``eval`` command (built from its
arguments, commands/eval.py) and a sweep's ``evaluate:`` block (``EvalOptions.from_sweep``), checked when
made, one sentence per bad field."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recursive_lightning.errors import UserError
from recursive_lightning.evaluation.downstream import DEFAULT_ALIAS, DEFAULT_SHOTS
from recursive_lightning.model.layout import check_depth_bound

# a sweep's evaluate: keys -> EvalOptions fields (the other fields take their defaults)
SWEEP_FIELDS = {
    "ppl": "ppl_sets",
    "tasks": "tasks",
    "limit": "limit",
    "shots": "shots",
    "include_path": "include_path",
    "context_lengths": "context_lengths",
    "ctx_set": "ctx_set",
    "ctx_max_tokens": "ctx_max_tokens",
    "ctx_block": "ctx_block",
    "ctx_mode": "ctx_mode",
    "loops": "loops",
    "h_cycles": "h_cycles",
    "exit_kl": "exit_kl",
    "exit_max_tokens": "exit_max_tokens",
}
CTX_MODES = ("stream", "documents")
EXIT_MAX_TOKENS = 4096  # tokens per set scored with adaptive exit (token by token: slow)


@dataclass
class EvalOptions:
    """``ppl_sets`` maps a name to a text set (``perplexity.read_texts``; or a list of ``NAME=PATH``);
    ``context_lengths`` evaluates the set ``ctx_set`` (default: the first) at each length
    (``perplexity.perplexity_by_context_length``: last blocks of ``ctx_block`` tokens, at most
    ``ctx_max_tokens`` scored per length, ``ctx_mode`` stream or documents); ``tasks`` are lm-eval task names
    (local ones with ``include_path``; ``default`` stands for ``DEFAULT_TASKS``), each run at every ``shots``
    value on at most ``limit`` examples. ``loops`` / ``h_cycles``: test-time depths (evaluation/depth.py), each
    set and task evaluated again at each loop count (a looped model) or each count of Mela's high-level
    cycles; ``depth_where_it_applies`` (a sweep's trials): a model whose dial was not given is evaluated only
    as trained, where the ``eval`` command refuses it. ``exit_kl``: KL thresholds of adaptive exit
    (evaluation/adaptive_exit.py), the first ``exit_max_tokens`` tokens of each set scored token by token at
    each (a sweep's trial that cannot exit early is evaluated without). ``stride`` / ``max_length``: the sliding window (default: the model's
    max_seq_len, disjoint). Results go to ``out_dir`` (default ``<run_dir>/eval``) and, unless ``mlflow`` is
    False, the checkpoint's MLflow run in ``tracking_uri`` (default: the run directory's store)."""

    ppl_sets: dict[str, str] | Sequence[str] | None = None
    tasks: str | Sequence[str] | None = (DEFAULT_ALIAS,)
    shots: Sequence[int] = DEFAULT_SHOTS
    limit: int | float | None = None
    context_lengths: Sequence[int] | None = None
    ctx_set: str | None = None
    ctx_block: int = 128
    ctx_max_tokens: int | None = None
    ctx_mode: str = "stream"
    stride: int | None = None
    max_length: int | None = None
    batch_size: int = 16
    device: str = "cpu"
    include_path: str | os.PathLike | Sequence[str | os.PathLike] | None = None
    out_dir: str | os.PathLike | None = None
    tracking_uri: str | None = None
    mlflow: bool = True
    loops: Sequence[int] | None = None
    h_cycles: Sequence[int] | None = None
    exit_kl: Sequence[float] | None = None
    exit_max_tokens: int = EXIT_MAX_TOKENS
    depth_where_it_applies: bool = False

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_length", "stride", "ctx_block", "ctx_max_tokens", "exit_max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, not {value}.")
        if self.context_lengths is not None:
            self.context_lengths = check_context_lengths(self.context_lengths)
        if self.ctx_mode not in CTX_MODES:
            raise UserError(f"--ctx-mode must be stream or documents, not {self.ctx_mode!r}.")
        self.loops = check_depths(self.loops, "--loops")
        self.h_cycles = check_depths(self.h_cycles, "--h-cycles")
        self.exit_kl = check_thresholds(self.exit_kl, "--exit-kl")
        self.shots = [int(s) for s in self.shots]
        sets = parse_sets(self.ppl_sets)
        if self.context_lengths and self.ctx_set is not None and sets and self.ctx_set not in sets:
            raise UserError(
                f"--ctx-ppl '{self.ctx_set}' is not one of the --ppl sets ({', '.join(sets)}); name one of them."
            )
        if any(s < 0 for s in self.shots):
            raise UserError(f"shots must be >= 0, not {self.shots}.")

    def ppl_paths(self) -> dict[str, str]:
        """``ppl_sets`` as ``{name: path}``."""
        return parse_sets(self.ppl_sets)

    @classmethod
    def from_sweep(cls, evaluate: Mapping[str, Any], here: Path, tracking_uri: str) -> EvalOptions:
        """The options of a sweep's ``evaluate:`` block (``SWEEP_FIELDS``), its paths relative to the sweep file's
        folder ``here`` (``embedded:heldout`` as it is); no tasks and 0-shot unless it names them."""
        ppl = {
            k: v if ":" in str(v) and not Path(str(v)).exists() else str((here / v).resolve())
            for k, v in (evaluate.get("ppl") or {}).items()
        }
        include = evaluate.get("include_path")
        return cls(
            ppl_sets=ppl or None,
            tasks=evaluate.get("tasks") or [],
            shots=evaluate.get("shots", [0]),
            limit=evaluate.get("limit"),
            tracking_uri=tracking_uri,
            include_path=str((here / include).resolve()) if include else None,
            context_lengths=evaluate.get("context_lengths"),
            ctx_set=evaluate.get("ctx_set"),
            ctx_max_tokens=evaluate.get("ctx_max_tokens"),
            ctx_block=evaluate.get("ctx_block", 128),
            ctx_mode=evaluate.get("ctx_mode", "stream"),
            loops=evaluate.get("loops"),
            h_cycles=evaluate.get("h_cycles"),
            exit_kl=evaluate.get("exit_kl"),
            exit_max_tokens=evaluate.get("exit_max_tokens", EXIT_MAX_TOKENS),
            depth_where_it_applies=True,
        )


def parse_sets(ppl_sets: dict[str, str] | Sequence[str] | None) -> dict[str, str]:
    """``{name: path}`` of a mapping or of ``NAME=PATH`` items (a bare ``PATH``: its stem names it)."""
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
        if name in out:
            raise UserError(f"--ppl names the set '{name}' twice; give each set its own NAME (NAME=PATH).")
        out[name] = path
    return out


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


def check_depths(counts: Sequence[int] | None, flag: str) -> list[int] | None:
    """``counts`` (loop or cycle counts) as a sorted list without repeats, or one sentence naming ``flag``."""
    if counts is None:
        return None
    example = f"e.g. {flag} 1,2,4,8" if flag.startswith("--") else f"e.g. {flag}: [1, 2, 4, 8]"
    if isinstance(counts, str | bytes) or not isinstance(counts, Sequence) or not counts:
        raise UserError(f"{flag} must be a non-empty list of whole counts >= 1, not {counts!r}; {example}.")
    bad = [k for k in counts if isinstance(k, bool) or not isinstance(k, int) or k < 1]
    if bad:
        raise UserError(f"{flag} must be whole counts >= 1, not {bad[0]!r}; {example}.")
    check_depth_bound(max(counts), flag)
    return sorted(set(counts))


def check_thresholds(values: Sequence[float] | None, flag: str) -> list[float] | None:
    """``values`` (adaptive exit's KL thresholds, nats) as a sorted list without repeats, or one sentence naming
    ``flag``."""
    if values is None:
        return None
    example = f"e.g. {flag} 5e-4,1e-3" if flag.startswith("--") else f"e.g. {flag}: [5.0e-4, 1.0e-3]"
    if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not values:
        raise UserError(
            f"{flag} must be a non-empty list of KL thresholds >= 0 in nats, not {values!r}; {example}."
        )
    bad = [
        v
        for v in values
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < float("inf")
    ]
    if bad:
        raise UserError(f"{flag} must be finite KL thresholds >= 0 in nats, not {bad[0]!r}; {example}.")
    return sorted({float(v) for v in values})
