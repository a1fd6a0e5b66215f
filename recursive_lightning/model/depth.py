"""Test-time depth, one dial per family: a looped model's loop count K' (``--loops``; the rules for
every topology in :mod:`recursive_lightning.model.recursive.depth`) and Mela's high-level cycles H'
(``--h-cycles``, Mela Sec. 3.2: the HLR's H).

Mela at H' cycles [our reading; Mela trains and evaluates at one H]: the L- and H-modules run H' cycles, the
first H'-1 without gradients as in training. With MemStack (Eq. 12-13) the last min(H, H') cycles fuse through
the last trained fusions, ends aligned, so z(H) (the memory rows) is always the last fusion's output and z(i)
still reaches decoder layer i; a fusion no cycle reaches at H' < H adds nothing (as MemStack adds nothing at
chunk 0).

    with at_depth(model, 8):
        logits = model(idx)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from recursive_lightning.errors import UserError
from recursive_lightning.model.layout import check_depth_bound
from recursive_lightning.model.mela.model import MelaLM
from recursive_lightning.model.recursive.depth import check_loops


def depth_dial(model: torch.nn.Module) -> str:
    """The name of the model's depth dial: ``h_cycles`` for Mela, ``loops`` for the looped families."""
    return "h_cycles" if isinstance(model, MelaLM) else "loops"


def trained_depth(model: torch.nn.Module) -> int:
    """The depth the model was built (trained) with: K loop steps, or Mela's H cycles."""
    return model.cfg.h_cycles if isinstance(model, MelaLM) else model.layout.n_loop


def check_depth(model: torch.nn.Module, k: object, dial: str | None = None) -> int:
    """``k`` as a depth of ``model`` asked for with ``--<dial>``, or one sentence naming the fix."""
    own = depth_dial(model)
    if dial is not None and dial != own:
        flag, fix = f"--{dial.replace('_', '-')}", f"--{own.replace('_', '-')}"
        what = (
            "Mela's depth dial is its high-level cycles"
            if own == "h_cycles"
            else "a looped model's depth dial is the loop count of its shared core"
        )
        raise UserError(f"{flag} does not apply to this {model.cfg.arch} model: {what}; use {fix}.")
    if own == "loops":
        k = check_loops(model.layout, k)
    elif isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UserError(f"--h-cycles must be whole cycle counts >= 1, not {k!r}; e.g. --h-cycles 1,2,4,8.")
    check_depth_bound(k, f"--{own.replace('_', '-')}")
    return k


@contextlib.contextmanager
def at_depth(model: torch.nn.Module, k: int | None) -> Iterator[torch.nn.Module]:
    """Within the block ``model`` runs at depth ``k`` (None: as trained); checked with :func:`check_depth`."""
    if k is None:
        yield model
        return
    k = check_depth(model, k)
    target = model.hmm if isinstance(model, MelaLM) else model
    attr = "h_cycles" if isinstance(model, MelaLM) else "loops"
    before = getattr(target, attr)
    setattr(target, attr, k)
    try:
        yield model
    finally:
        setattr(target, attr, before)
