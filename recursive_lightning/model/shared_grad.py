"""Weight gradients of the shared core, summed over its loop steps in one buffer.

A core that runs T times in one forward gets T weight gradients per Linear, dW = sum_t g_t^T x_t. Autograd
computes each product into a fresh tensor and adds it to the running sum: T GEMMs plus T - 1 passes of
read-read-write over a weight-sized tensor. SpiralFormer-B runs its core 4 times (Pythia-160M: 113 MB of core
weights, so 3 extra passes of 340 MB per step), LoopedFormer twice. Here every use's backward accumulates its
product straight into one buffer (``addmm_``, a GEMM with beta = 1), and the use that autograd reaches last,
the first in forward order, hands the sum over as the weight's gradient; the others report none. The bias
gradients are summed the same way, db += g^T 1 as a GEMV with beta = 1 (one call per use instead of a
reduction and autograd's addition). Same gradients (to rounding: the sum is associated differently), one
accumulation pass fewer per extra use: 160M SpiralFormer-B fwd+bwd -40 ms on an AVX2 CPU, LoopedFormer -9 ms
(benchmarks/README.md). Only weights of ``SHARED_MIN_NUMEL`` elements or more: below that the Python
Function per use costs more than the pass it saves.

Ordering: use t's output feeds use t+1's input (through the rest of the step, the topology and S_down), so
autograd runs use t+1's backward before use t's; use 0's backward is the last of a backward pass.

Only where it is exact and safe: grad mode on, no autocast (mixed precision sums bf16 products in float32,
which a float32 buffer cannot reproduce), and the model not compiled, FSDP-sharded or activation-checkpointed
(``training/parallel.py`` turns it off there: recomputation would replay forward uses, and FSDP2 and
``torch.compile`` trace or hook each use themselves).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable


class GradBuffer:
    """One forward's running weight-gradient sum of one Linear: how many uses it saw, and the sum so far."""

    __slots__ = ("uses", "sum", "bias_sum")

    def __init__(self) -> None:
        self.uses = 0
        self.sum: torch.Tensor | None = None
        self.bias_sum: torch.Tensor | None = None


_ONES: dict[tuple, torch.Tensor] = {}


def _ones(n: int, like: torch.Tensor) -> torch.Tensor:
    """A cached vector of n ones (the bias gradient sum_rows g = g^T 1 as a GEMV that accumulates)."""
    key = (n, like.dtype, like.device)
    if key not in _ONES:
        if len(_ONES) > 16:
            _ONES.clear()
        _ONES[key] = torch.ones(n, dtype=like.dtype, device=like.device)
    return _ONES[key]


class _SharedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, buffer: GradBuffer):
        ctx.save_for_backward(x, weight)
        ctx.buffer, ctx.use, ctx.has_bias = buffer, buffer.uses, bias is not None
        buffer.uses += 1
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        buffer: GradBuffer = ctx.buffer
        grad_w = grad_b = None
        g2 = grad.reshape(-1, grad.shape[-1])
        # torch.mm on the 2-D views: the GEMMs ``grad @ weight`` folds to, without matmul's dispatch layer
        grad_x = torch.mm(g2, weight).view(*grad.shape[:-1], -1) if ctx.needs_input_grad[0] else None
        first = ctx.use == buffer.uses - 1  # the first use backpropagated: a fresh sum
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            if buffer.sum is None or first:
                buffer.sum = torch.mm(g2.t(), x2)
            else:
                buffer.sum.addmm_(g2.t(), x2)  # dW += g^T x in the GEMM itself (beta = 1)
            if ctx.use == 0:  # the last use backpropagated: hand the sum to autograd
                grad_w, buffer.sum = buffer.sum, None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            # db += g^T 1 in one GEMV (beta = 1), instead of a reduction per use and autograd's add per use
            ones = _ones(g2.shape[0], g2)
            if buffer.bias_sum is None or first:
                buffer.bias_sum = torch.mv(g2.t(), ones)
            else:
                buffer.bias_sum.addmv_(g2.t(), ones)
            if ctx.use == 0:
                grad_b, buffer.bias_sum = buffer.bias_sum, None
        return grad_x, grad_w, grad_b, None


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) whose weight gradient goes to ``grad_buffer`` while one
    is set (by :func:`accumulate_weight_grads`)."""

    grad_buffer: GradBuffer | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffer = self.grad_buffer
        if (
            buffer is None
            or not torch.is_grad_enabled()
            or not self.weight.requires_grad
            or torch.is_autocast_enabled(x.device.type)
        ):
            return F.linear(x, self.weight, self.bias)
        return _SharedLinear.apply(x, self.weight, self.bias, buffer)


# The smallest weight (elements) whose gradients are summed in one buffer. The saving is one pass over a
# weight-sized tensor per extra use; the cost, a Python autograd Function per use. One thread on an AMX Xeon,
# a Linear used 4 times by 2048 tokens, forward + backward, buffer / autograd (benchmarks/bench_glue.py):
# 64 -> 192 1.14, 256 -> 768 1.03, 768 -> 2304 1.02, 768 -> 3072 0.99; the 160M SpiralFormer-B step gained
# 40 ms (1.3 %) on the machine before, an AVX2 VM. So only weights of a million elements or more (the 160M
# core's QKV and MLP weights, not its attention output) take this path.
SHARED_MIN_NUMEL = 1 << 20


@contextlib.contextmanager
def accumulate_weight_grads(
    modules: Iterable[nn.Module], enabled: bool = True, min_numel: int = SHARED_MIN_NUMEL
) -> Iterator[None]:
    """Within the block, every :class:`Linear` in ``modules`` with a weight of at least ``min_numel`` elements
    sums its weight gradients over its uses in one buffer (a fresh one per forward, so graphs built by
    different forwards never share a sum); smaller ones keep autograd's own sum."""
    linears = []
    if enabled and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        linears = [
            m
            for module in modules
            for m in module.modules()
            if isinstance(m, Linear) and m.weight.numel() >= min_numel
        ]
    for linear in linears:
        linear.grad_buffer = GradBuffer()
    try:
        yield
    finally:
        for linear in linears:
            linear.grad_buffer = None
