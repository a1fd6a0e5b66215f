"""Next-token cross-entropy that keeps no vocabulary-sized tensor besides the logits and their gradient.

``F.cross_entropy`` stores ``log_softmax(logits)`` for its backward and builds two more (N, V) tensors
there (the scattered NLL gradient, then softmax's gradient). With a 50k vocabulary these are the largest
tensors of a small model's step (200 MB each at 1024 tokens), each written and read in full. Here the
forward reduces blocks of rows to their log-sum-exp, and the backward writes

    d loss / d logits = (softmax(logits) - onehot(targets)) * grad / N

block by block straight into the gradient. Same numbers as ``F.cross_entropy`` (mean over positions), one
pass over the logits in each direction, no (N, V) temporary. With ``overwrite_logits`` the gradient is written
over the logits themselves (their last reader is this backward): no (N, V) allocation at all, which on the
CPU also spares page-faulting 200 MB in every step. Blocks are small on the CPU (they stay in
cache) and large on accelerators (few kernel launches).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

CPU_BLOCK_BYTES = 2**22  # 4 MiB of float32 logits per block: cache-resident temporaries
DEVICE_BLOCK_BYTES = 2**30


def block_rows(logits: torch.Tensor) -> int:
    budget = CPU_BLOCK_BYTES if logits.device.type == "cpu" else DEVICE_BLOCK_BYTES
    return max(1, budget // (4 * logits.shape[-1]))


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, rows: int, overwrite: bool) -> torch.Tensor:
        n, acc = logits.shape[0], torch.promote_types(logits.dtype, torch.float32)
        lse = torch.empty(n, dtype=acc, device=logits.device)
        for i in range(0, n, rows):
            lse[i : i + rows] = torch.logsumexp(logits[i : i + rows].to(acc), dim=-1)
        picked = logits.gather(1, targets[:, None]).squeeze(1).to(acc)
        ctx.save_for_backward(logits, targets, lse)
        ctx.rows, ctx.overwrite = rows, overwrite
        return (lse - picked).mean()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, targets, lse = ctx.saved_tensors
        n, rows = logits.shape[0], ctx.rows
        scale = grad.to(lse.dtype) / n
        out = logits if ctx.overwrite else torch.empty_like(logits)  # blocks are read before written
        for i in range(0, n, rows):
            x, block = logits[i : i + rows].to(lse.dtype), out[i : i + rows]
            if block.dtype == lse.dtype:  # softmax written in place into the gradient
                torch.sub(x, lse[i : i + rows, None], out=block).exp_().mul_(scale)
            else:
                block.copy_((x - lse[i : i + rows, None]).exp_().mul_(scale))
        out.scatter_add_(1, targets[:, None], (-scale).to(out.dtype).expand(n, 1))  # - onehot(targets)
        return out, None, None, None


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, overwrite_logits: bool = False
) -> torch.Tensor:
    """Mean next-token cross-entropy of logits (..., V) against integer targets (...), computed in float32
    (float64 for float64 logits); the gradient has the logits' dtype. ``overwrite_logits``: the backward
    writes the gradient into the logits' memory; only for logits that nothing reads after the backward."""
    flat, tgt = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if tgt.numel() != flat.shape[0]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match logits {tuple(logits.shape)}")
    vocab = flat.shape[-1]
    # checked where it costs no device synchronisation (CUDA kernels assert on a bad index themselves)
    if flat.device.type == "cpu" and tgt.numel() and (int(tgt.min()) < 0 or int(tgt.max()) >= vocab):
        raise ValueError(
            f"targets must lie in [0, {vocab}) (the vocabulary); got {int(tgt.min())}..{int(tgt.max())}"
        )
    return _CrossEntropy.apply(flat, tgt, block_rows(flat), overwrite_logits)
