"""One training step's forward + backward captured as a CUDA graph and replayed (the benchmarks' ``graphs`` mode):
``train.cuda_graphs``' :class:`~recursive_lightning.training.cuda_graphs.GraphedStep` around ``model.loss``.

    step = graphed_step(model, idx, targets)   # captures on the first call; idx / targets give the static shapes
    step()                                     # replays on the captured inputs
    step(new_idx, new_targets)                 # copies new inputs in, then replays

bf16 autocast around each replayed step when ``autocast`` (captured with autocast's weight cache off). On the
CPU (``--smoke``) the step runs eagerly.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from recursive_lightning.training.cuda_graphs import GraphedStep  # noqa: E402


def graphed_step(
    model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor, autocast: bool = True
) -> Callable[..., torch.Tensor]:
    """A replay of ``model.loss(idx, targets).backward()``, captured now (bf16 autocast when ``autocast``)."""
    if hasattr(model, "shared_grads_in_place"):
        model.shared_grads_in_place = (
            False  # the captured backward replays no Python state (model/shared_grad.py)
        )
    step = GraphedStep(model.loss, list(model.parameters()))
    last = [idx, targets]

    def run(new_idx: torch.Tensor | None = None, new_tgt: torch.Tensor | None = None) -> torch.Tensor:
        if new_idx is not None:
            last[:] = [new_idx, new_tgt]
        with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast and idx.is_cuda):
            return step(*last)

    run()  # the capture (and its first replay) belongs to the set-up, not to the timed steps
    run.step = step  # type: ignore[attr-defined]
    return run
