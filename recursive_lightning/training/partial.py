"""Train only some parts of the model for the first steps, then everything (``train.train_only``).

Uptraining recipes start by training the new or re-purposed parts (the recurrence's topology parameters, the
shared core) while the copied embeddings, prelude, coda and head stay as the pretrained model left them, then
unfreeze everything. ``train.train_only: [topology, core]`` with ``train.train_only_steps: N`` does that:
for optimizer steps 0 .. N-1 the gradients of every other parameter are dropped (set to ``None``) before
clipping and the optimizer step, so AdamW leaves those parameters and their moments untouched (no weight
decay, no step count); from step N on everything trains. The backward still computes every gradient (the
switch is stateless and keyed on the global step, so ``--resume`` continues it exactly).
"""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback

from recursive_lightning.config import PARTS
from recursive_lightning.errors import ConfigError


def _clean(name: str) -> str:
    return name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")


def frozen_parameters(model: torch.nn.Module, parts: list[str]) -> list[torch.nn.Parameter]:
    """The parameters outside ``parts`` (a tied embedding/head trains if either part is named)."""
    prefixes = tuple(p for part in parts for p in PARTS[part])
    trained = {
        id(p) for n, p in model.named_parameters(remove_duplicate=False) if _clean(n).startswith(prefixes)
    }
    if not trained:
        raise ConfigError(
            f"train.train_only {list(parts)} selects no parameter of this model; name parts it has "
            "(a base topology has no topology parameters, a full-resolution layout no resolution ones)."
        )
    return [p for p in model.parameters() if id(p) not in trained]


class TrainOnly(Callback):
    """Drop the gradients of every part not in ``parts`` while the global step is below ``steps``."""

    def __init__(self, parts: list[str], steps: int) -> None:
        self.parts, self.steps = list(parts), steps
        self._frozen: list[torch.nn.Parameter] | None = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self._frozen = frozen_parameters(pl_module.model, self.parts)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Lightning calls this before gradient clipping, so the clip norm covers the trained parts only
        if trainer.global_step < self.steps:
            for p in self._frozen or ():
                p.grad = None
