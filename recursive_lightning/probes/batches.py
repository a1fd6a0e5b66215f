"""The batch loop both captures run (looped transformers: :mod:`.capture`; Mela: :mod:`.mela`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from recursive_lightning.progress import tracked


def run_batches(
    model: nn.Module,
    tokens: torch.Tensor,
    batch_size: int,
    step: Callable[[int, torch.Tensor], None],
    progress: bool | Callable[[Iterable], Iterable] = True,
    desc: str = "probe",
) -> float:
    """``step(start, batch)`` for every batch of ``tokens [N, L]`` (on the model's device), in eval mode
    and without gradients (the mode is restored after); returns the seconds it took. ``progress``: a
    bar on a terminal, a line every 30 s in a log, or a callable wrapping the list of batch starts."""
    starts = list(range(0, tokens.shape[0], batch_size))
    it: Iterable = starts
    if callable(progress):
        it = progress(starts)
    elif progress:
        it = tracked(starts, desc, lambda s0: tokens[s0 : s0 + batch_size].numel())
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            for s0 in it:
                step(s0, tokens[s0 : s0 + batch_size].to(device))
    finally:
        model.train(was_training)
    return time.perf_counter() - t0
