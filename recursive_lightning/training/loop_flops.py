"""FLOPs of a training step at a sampled loop count (``train.loops``; sampled_loops.py): the forward at r loop
steps plus twice the part that gets gradients (the backward of a matrix product costs two forward ones): the
embedding, prelude, topology start/finish, coda, norm and head, and the last ``backprop`` loop steps.

Both are counted, not derived: one meta-device forward at depth r with ``RecursiveLM.backprop_loops`` set,
the FLOPs of every operation split by whether gradients were on when it ran (the model runs the first
r - backprop loop steps under ``torch.no_grad``). Counting convention as ``describe`` (model/describe.py).

Past the trained K every loop step repeats the last trained step (model/recursive/depth.py: same parameters,
shapes and resolution), so forward(r) is affine in r beyond K and the gradient part is constant once the
last ``backprop`` steps all lie past K: depths beyond ``K + backprop + 1`` are extended from the last two
counted ones (exact; tested against counts), and a Poisson tail of hundreds of depths costs no extra forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from recursive_lightning.model.build import build_on_meta
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.recursive.model import RecursiveLM
from recursive_lightning.sampled_loops import LoopSchedule


class _GradSplitCounter(FlopCounterMode):
    """A FlopCounterMode that also sums the FLOPs of the operations run with gradients enabled."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.with_grad = 0

    def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        if func_packet in self.flop_registry and torch.is_grad_enabled():
            self.with_grad += self.flop_registry[func_packet](*args, **kwargs, out_val=out)
        return super()._count_flops(func_packet, out, args, kwargs)


class LoopFlops:
    """Forward and gradient-part FLOPs of one ``seq_len`` sequence of ``cfg``'s model at each loop count,
    backpropagating through the last ``backprop`` loop steps (None: all); counted once per depth."""

    def __init__(self, cfg: ModelConfig, seq_len: int, backprop: int | None) -> None:
        self.seq_len, self.backprop = seq_len, backprop
        self._model = build_on_meta(RecursiveLM, cfg)
        self._model.shared_grads_in_place = False  # same forward FLOPs; its buffers need a real device
        self.trained = self._model.layout.n_loop
        self.counted_up_to = self.trained + (backprop or 1) + 1  # beyond: extended (module docstring)
        self._counts: dict[int, tuple[int, int]] = {}

    def _count(self, loops: int) -> tuple[int, int]:
        if loops not in self._counts:
            model = self._model
            idx = torch.zeros(1, self.seq_len, dtype=torch.long, device="meta")
            counter = _GradSplitCounter()
            model.loops, model.backprop_loops = loops, self.backprop
            try:
                with counter, torch.enable_grad():
                    model(idx)
            finally:
                model.loops = model.backprop_loops = None
            self._counts[loops] = (counter.get_total_flops(), counter.with_grad)
        return self._counts[loops]

    def counts(self, loops: int) -> tuple[int, int]:
        """(forward FLOPs, FLOPs of the operations with gradients) of one sequence at ``loops`` loop steps."""
        top = self.counted_up_to
        if loops <= top:
            return self._count(loops)
        (f1, g1), (f2, g2) = self._count(top - 1), self._count(top)
        return f2 + (loops - top) * (f2 - f1), g2 + (loops - top) * (g2 - g1)

    def training(self, loops: int) -> int:
        """Training FLOPs of one sequence at ``loops``: forward + 2 x the part with gradients."""
        forward, grad = self.counts(loops)
        return forward + 2 * grad

    def warm(self) -> LoopFlops:
        """Count every depth that is counted rather than extended (before training: no step waits for it)."""
        for k in range(1, self.counted_up_to + 1):
            self._count(k)
        return self


def expected_training_flops(cfg: ModelConfig, seq_len: int, loops: Any) -> dict[str, Any]:
    """What ``describe`` adds for a run with ``train.loops``: the distribution, its mean loop count and the
    expected training FLOPs per token, E[forward(r) + 2 grad(r)] / seq_len over the distribution's support
    (sampled_loops.LoopSchedule.pmf), beside the same at the layout's K with every loop step differentiated."""
    schedule = LoopSchedule.parse(loops)
    flops = LoopFlops(cfg, seq_len, schedule.backprop)
    fixed = LoopFlops(cfg, seq_len, None).training(flops.trained)
    return {
        "train_loops": str(schedule),
        "train_loops_mean": schedule.expectation(float),
        "flops_train_per_token_expected": schedule.expectation(flops.training) / seq_len,
        "flops_train_per_token_at_trained_depth": fixed / seq_len,
    }
