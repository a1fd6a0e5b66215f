"""Multi-resolution recursion (SpiralFormer Sec. 2.2-2.3): one loop step at chunk size g.

    z  = S_down(h)          (Eqs. 16-18)  mean pooling or self-aggregation within chunks
    z^ = f_core(z)          (Eq. 9)       the shared core on the short sequence (L_t = floor(L / g))
    u  = S_up(z^)           (Eqs. 19-21)  uniform broadcast or output-dependent allocation, gain λ
    u~ = CausalShift(u, s)  (Eq. 22)      right shift by s (g-1: overlap; >= g: parallel)

Chunks use the offset maps π(i) = floor((i + ω) / g), ρ(i) = (i + ω) - g π(i) (Eq. 12): the sequence
is left-padded by ω so chunk 0 holds the first g - ω tokens, and the incomplete trailing chunk is
dropped (Eq. 14). We keep L_t = floor((L + ω) / g) chunks: Eq. 13's floor(L / g) when ω = 0, and with
ω > 0 it also keeps the last *complete* chunk, so a position's output never depends on how many tokens
follow it (training-time forward == token-by-token decoding). Positions that receive no update get zero.
S_down and S_up are views of the sequence (``_ChunkMap`` below), no Python loop over chunks
or tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.autograd.function import once_differentiable

from recursive_lightning.model.config import ModelConfig


def chunk_maps(length: int, g: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """π(i) and ρ(i) of Eq. 12 for i = 0..L-1 (π = -1 marks positions dropped by Eq. 14)."""
    i = torch.arange(length)
    pi, rho = (i + offset) // g, (i + offset) % g
    pi = torch.where(pi <= (length + offset) // g - 1, pi, torch.full_like(pi, -1))
    return pi, rho


class ResolutionStep(nn.Module):
    """The down-scale → core → up-scale → shift transition of one loop step at chunk size ``g``."""

    def __init__(self, cfg: ModelConfig, g: int, offset: int, shift: int, gain: float) -> None:
        super().__init__()
        self.g, self.offset, self.shift, self.gain = g, offset, shift, gain
        learn_down = g > 1 and cfg.downscale == "self_aggregation"
        learn_up = g > 1 and cfg.upscale == "allocation"
        # at g = 1 both operators are the identity, so no scorer/router exists (LoopedFormer exactly)
        self.scorer = nn.Linear(cfg.d_model, 1) if learn_down else None  # A^(t), Eq. 17
        self.allocator = nn.Linear(cfg.d_model, g) if learn_up else None  # B^(t), Eq. 21
        self.record: list[dict[str, torch.Tensor]] | None = None

    @property
    def full_resolution(self) -> bool:
        """g = 1 without shift or gain: the step is the core itself (LoopedFormer)."""
        return self.g == 1 and self.shift == 0 and self.gain == 1

    @property
    def causal(self) -> bool:
        """s >= g - 1 (Prop. 1): no position's update depends on a later token."""
        return self.full_resolution or self.shift >= self.g - 1

    def allocation(self, z: torch.Tensor) -> torch.Tensor:
        """β = softmax(B^(t) z) over the g positions of each chunk (Eq. 21)."""
        return self.allocator(z).float().softmax(-1).to(z.dtype)

    def down(self, h: torch.Tensor, offset: int | None = None) -> torch.Tensor:
        """(b, L, d) -> (b, L_t, d), Eqs. 16-18 (``offset`` overrides ω: decoding down-scales a later stretch)."""
        g, w, length = self.g, self.offset if offset is None else offset, h.shape[1]
        n = (length + w) // g  # L_t: every complete chunk of the ω-offset partition (Eq. 13-14)
        end = n * g - w  # positions from here on form the incomplete trailing chunk: dropped (Eq. 14)
        if n == 0:
            return h.new_zeros(h.shape[0], 0, h.shape[2])  # fewer than g - ω positions: no complete chunk
        if self.scorer is None:
            return _ChunkMap.apply(
                h, None, 1 / g, 0, end, g, w, n, False
            )  # Eq. 16 (left padding counts as zero)
        # Eq. 17: softmax within each chunk over the left-padded, cropped layout (padding scores -inf)
        score = F.pad(self.scorer(h).squeeze(-1).float(), (w, end - length), value=float("-inf"))
        alpha = rearrange(score, "b (n g) -> b n g", g=g).softmax(-1).to(h.dtype)
        if self.record is not None:
            self.record.append({"alpha": alpha.detach()})
        weight = F.pad(alpha.flatten(1), (-w, length - end))  # α of each position p at row p + ω
        return _ChunkMap.apply(h, weight, 1.0, 0, end, g, w, n, False)  # Eq. 18

    def up(self, z: torch.Tensor, length: int) -> torch.Tensor:
        """(b, L_t, d) -> shifted token-level update u~ of shape (b, L, d), Eqs. 19-22."""
        g, w, s = self.g, self.offset, self.shift
        n = z.shape[1]
        if s >= length:
            return z.new_zeros(z.shape[0], length, z.shape[2])  # every source lies before position 0
        # shift right by s (Eq. 22): position p >= s receives row p - s + ω of the chunked layout, up to the
        # last chunk's last row or the sequence's end; rows k < ω of chunk 0 are padding and reach no position
        end = min(length, s - w + n * g)
        if self.allocator is None:
            return _ChunkMap.apply(z, None, self.gain / g, s, end, g, w, length, True)  # Eq. 20
        beta = self.allocation(z)  # Eq. 21
        if self.record is not None:
            self.record.append({"beta": beta.detach()})
        weight = F.pad(self.gain * beta.flatten(1), (s - w, length - n * g - s + w))  # λ β at each position
        return _ChunkMap.apply(z, weight, 1.0, s, end, g, w, length, True)  # Eq. 19

    def forward(
        self,
        h: torch.Tensor,
        core: Callable[[torch.Tensor], torch.Tensor],
        cache: StepCache | None = None,
    ) -> torch.Tensor:
        if cache is not None and not self.full_resolution:
            return self.extend(h, core, cache)
        length = h.shape[1]
        if self.full_resolution:
            return core(h)  # full resolution: u~ = f_core(h)
        if length + self.offset < self.g:
            return torch.zeros_like(h)  # no complete chunk yet: no position receives an update
        return self.up(core(self.down(h)), length)

    # ------------------------------------------------------------------ decoding (SpiralFormer Alg. 2)
    def extend(
        self, h: torch.Tensor, core: Callable[[torch.Tensor], torch.Tensor], cache: StepCache
    ) -> torch.Tensor:
        """u~ for new positions P .. P+l-1 given the states of positions 0 .. P-1 in ``cache``.

        Every chunk that the new positions complete (in-chunk index ρ = g - 1, Alg. 2's chunk trigger) is
        down-scaled and run through the core once, the core's KV cache continuing at that chunk's coarse
        position; then position i reads the update of its source position i - s (Eq. 22), which lies in an
        already complete chunk when s >= g - 1 (Prop. 1). Equal to :meth:`forward` on the whole sequence."""
        if not self.causal:
            raise ValueError(
                f"cached decoding needs a causal shift (s >= g - 1, Prop. 1); this step has s={self.shift}, "
                f"g={self.g}"
            )
        g, w, s = self.g, self.offset, self.shift
        past = cache.seen
        total = cache.seen = past + h.shape[1]
        # pending: states from the first position of the first incomplete chunk on
        pending = h if cache.pending is None else torch.cat([cache.pending, h], dim=1)
        done, now = (past + w) // g, (total + w) // g  # complete chunks before / after (Eqs. 13-14)
        if now > done:
            end = now * g - w - max(0, done * g - w)
            z_hat = core(self.down(pending[:, :end], offset=w if done == 0 else 0))
            cache.z_hat = z_hat if cache.z_hat is None else torch.cat([cache.z_hat, z_hat], dim=1)
            pending = pending[:, end:]
        cache.pending = pending
        src = torch.arange(past, total, device=h.device) - s  # Eq. 22: position i receives source i - s
        if cache.z_hat is None or not bool((src >= 0).any()):
            return torch.zeros_like(h)
        chunk, slot = torch.div(src + w, g, rounding_mode="floor").clamp(min=0), (src + w) % g  # Eq. 12
        z = cache.z_hat[:, chunk]  # (b, l, d): the summary of each new position's source chunk
        if self.allocator is None:
            u = (self.gain / g) * z  # Eq. 20
        else:
            beta = self.allocation(z)  # Eq. 21
            u = self.gain * beta.gather(-1, slot.expand(z.shape[0], -1).unsqueeze(-1)) * z  # Eq. 19
        return u * (src >= 0).to(u.dtype)[:, None]


@dataclass
class StepCache:
    """What a multi-resolution step keeps between decoding calls: how many positions it has seen, their
    input states h^(t) from the first incomplete chunk on, and the core outputs z^ of every complete chunk."""

    seen: int = 0
    pending: torch.Tensor | None = None  # (b, positions of the incomplete chunk seen so far, d)
    z_hat: torch.Tensor | None = None  # (b, complete chunks, d)


# ---------------------------------------------------------------------------------------------- chunk maps
# S_down and S_up are adjoint linear maps between positions and chunks, each with per-position weights:
#     chunk_sum:    z[j] = sum_{p in chunk j} a[p] x[p]        (Eqs. 16/18: a = 1/g or α)
#     chunk_spread: u[p] = a[p] z[chunk(p)]                    (Eqs. 19/20: a = λ/g or λβ)
# over the positions p in [start, end), position p in chunk (p - start + ω) // g (Eq. 12; start = 0 for
# S_down, s for S_up and its shift, Eq. 22). Each is a few views of the sequence, split where chunk 0 starts
# part-way (offset ω) and where the sequence ends mid-chunk, so neither pads nor copies the (b, L, d) states:
# the backward of one is the other (plus a per-position inner product for learned weights), one pass each.


def _segments(start: int, end: int, g: int, offset: int) -> list[tuple[int, int, int, int]]:
    """(first position, first chunk, chunks, positions per chunk) of the runs that tile [start, end)."""
    out, p, j = [], start, 0
    if end <= start:  # no complete chunk (S_down of fewer than g - ω positions)
        return out
    if offset:  # chunk 0 holds g - ω positions (its first ω rows are padding)
        k = min(g - offset, end - p)
        out.append((p, 0, 1, k))
        p, j = p + k, 1
    full = (end - p) // g
    if full:
        out.append((p, j, full, g))
        p, j = p + full * g, j + full
    if p < end:  # the sequence ends mid-chunk (S_up: the shift pushes the last chunk past L)
        out.append((p, j, 1, end - p))
    return out


def _views(x: torch.Tensor, seg: tuple[int, int, int, int]) -> torch.Tensor:
    p, _, c, k = seg
    return x[:, p : p + c * k].unflatten(1, (c, k))  # (b, c, k, ...)


def _sum(x: torch.Tensor, a: torch.Tensor | None, scale: float, segs: list, n: int) -> torch.Tensor:
    """(b, n, d): the weighted sum over each chunk's positions (zero for chunks with none)."""
    parts = []
    for seg in segs:
        # (1 x k) @ (k x d) per chunk: a GEMM reads x once and writes no (b, c, k, d) product
        w = x.new_full((1, seg[3]), scale) if a is None else _views(a, seg).unsqueeze(-2)
        parts.append((w @ _views(x, seg)).squeeze(-2))
    covered = segs[-1][1] + segs[-1][2] if segs else 0
    if covered < n or not parts:  # chunks whose positions all lie at or past L (or no chunk at all)
        parts.append(x.new_zeros(x.shape[0], n - covered, x.shape[-1]))
    return torch.cat(parts, 1)


def _spread(
    z: torch.Tensor, a: torch.Tensor | None, scale: float, segs: list, start: int, end: int, length: int
) -> torch.Tensor:
    """(b, L, d): each position in [start, end) gets its chunk's row, weighted; zero elsewhere."""
    u = z.new_empty(z.shape[0], length, z.shape[-1])
    u[:, :start].zero_()
    u[:, end:].zero_()
    for seg in segs:
        _, j, c, k = seg
        src = z[:, j : j + c].unsqueeze(2)
        if a is None:
            _views(u, seg).copy_((src * scale).expand(-1, -1, k, -1))
        else:
            torch.mul(src, _views(a, seg).unsqueeze(-1), out=_views(u, seg))
    return u


def _inner(x: torch.Tensor, z: torch.Tensor, segs: list, start: int, end: int) -> torch.Tensor:
    """(b, L): <x[p], z[chunk(p)]> over [start, end), zero elsewhere (the gradient of per-position weights)."""
    parts = [
        (_views(x, seg) * z[:, seg[1] : seg[1] + seg[2]].unsqueeze(2)).sum(-1).flatten(1) for seg in segs
    ]
    return F.pad(torch.cat(parts, 1), (start, x.shape[1] - end))


def _no_autocast(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Run in the states' dtype (autocast would turn the GEMMs of ``_sum`` to half precision)."""
    device = t.device.type
    return (
        torch.autocast(device, enabled=False)
        if torch.amp.is_autocast_available(device)
        else contextlib.nullcontext()
    )


class _ChunkMap(torch.autograd.Function):
    """S_down's weighted sum over chunks (Eqs. 16/18) or, with ``spread``, S_up's weighted broadcast with the
    shift (Eqs. 19/20, 22). The two are adjoint, so the backward of each is the other (one pass, no
    scatter-add), plus <positions, chunks> at each position for learned weights."""

    @staticmethod
    def forward(ctx, x, a, scale, start, end, g, offset, size, spread):
        """``size``: the output's chunks (sum) or positions (spread)."""
        segs = _segments(start, end, g, offset)
        ctx.save_for_backward(x if a is not None and a.requires_grad else None, a)
        ctx.meta = scale, segs, start, end, x.shape[1], spread
        with _no_autocast(x):
            return _spread(x, a, scale, segs, start, end, size) if spread else _sum(x, a, scale, segs, size)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, a = ctx.saved_tensors
        scale, segs, start, end, size, spread = ctx.meta  # size: the input's chunks or positions
        grad_x = grad_a = None
        with _no_autocast(grad):
            if ctx.needs_input_grad[0]:
                grad_x = (
                    _sum(grad, a, scale, segs, size)
                    if spread
                    else _spread(grad, a, scale, segs, start, end, size)
                )
            if ctx.needs_input_grad[1]:
                positions, chunks = (grad, x) if spread else (x, grad)
                grad_a = _inner(positions, chunks, segs, start, end)
        return grad_x, grad_a, None, None, None, None, None, None, None
