"""Evaluation at test-time depths ("think longer with the same weights"): the ``eval`` command's
``--loops 1,2,4,8`` (a looped model's loop count K') and ``--h-cycles 1,2,4`` (Mela's high-level cycles H'),
and a sweep's ``evaluate: {loops: [...], h_cycles: [...]}``.

At each count k the model runs under ``model.depth.at_depth(model, k)`` (the extrapolation rules of each
topology: model/recursive/depth.py and model/depth.py) and is evaluated as at its trained depth: the
perplexity of every set and the lm-eval tasks. The result's ``depth`` section:

    {"dial": "loops", "trained": 2,
     "counts": {"1": {"ppl": {set: {...}}, "tasks": ..., "headline": ..., "avg": ...,
                      "flops_forward_per_token": ...}, "2": {...}}}

``flops_forward_per_token`` is ``describe(cfg, seq_len=window, loops=k)["flops_forward"] / window``: one
window's forward FLOPs at depth k, per token of the window. At the trained count the numbers are the
ordinary evaluation's, bit for bit (the same computation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from recursive_lightning.errors import UserError
from recursive_lightning.evaluation.options import EvalOptions
from recursive_lightning.model.depth import at_depth, check_depth, depth_dial, trained_depth

DIALS = ("loops", "h_cycles")


def depth_request(model: torch.nn.Module, o: EvalOptions) -> tuple[str, list[int]] | None:
    """(the dial, its counts) that ``o`` asks of ``model``, checked against it before anything is computed:
    a dial the model does not have, or any count on a layout with no shared core, is one sentence
    (``o.depth_where_it_applies``: such a model is evaluated as trained only; None)."""
    given = {dial: counts for dial in DIALS if (counts := getattr(o, dial))}
    if not given:
        return None
    own = depth_dial(model)
    if o.depth_where_it_applies:
        if own not in given:
            return None
        try:
            return own, [check_depth(model, k, own) for k in given[own]]
        except UserError:  # a vanilla or unshared layout in a sweep of looped ones
            return None
    if len(given) > 1:
        raise UserError("give --loops (a looped model) or --h-cycles (Mela), not both.")
    ((dial, counts),) = given.items()
    return dial, [check_depth(model, k, dial) for k in counts]


def evaluate_depths(
    model: torch.nn.Module,
    window: int,
    dial: str,
    counts: list[int],
    measure: Callable[[int], dict[str, Any]],
) -> dict[str, Any]:
    """The ``depth`` section: ``measure(k)`` (the perplexities and tasks of one evaluation) at each count,
    run with the model at that depth, and the forward FLOPs per token of a ``window``-token window there."""
    from recursive_lightning.model.describe import describe  # heavy

    trained = trained_depth(model)
    flops = describe(model.cfg, seq_len=window)["flops_forward"]
    out: dict[str, Any] = {
        "dial": dial,
        "trained": trained,
        "window": window,
        "trained_flops_forward_per_token": flops / window,
        "counts": {},
    }
    for k in counts:
        with at_depth(model, k):
            entry = measure(k)
        flops = describe(model.cfg, seq_len=window, loops=k)["flops_forward"]
        out["counts"][str(k)] = {**entry, "flops_forward_per_token": flops / window}
    return out


def depth_prefix(dial: str, k: int | str) -> str:
    """The MLflow key prefix of one count: ``eval/loops_<k>`` or ``eval/h_cycles_<k>``."""
    return f"eval/{dial}_{k}"
