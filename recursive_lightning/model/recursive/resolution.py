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
S_down and S_up are views of the sequence (``_ChunkMap`` and ``_SelfAggregation`` below, with written-out
backwards), no Python loop over chunks or tokens; their padded forms (``down_padded`` / ``up_padded``: pad,
reshape, weighted sum) are the reference they are tested against and what ``torch.compile`` fuses
(``train.compile: glue`` / ``model``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.decoding import StepCache
from recursive_lightning.model.precision import no_autocast, upcast


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
        # (S_down, S_up) compiled by :meth:`compile_glue` (train.compile: glue); None: eager
        self.glue: tuple[Callable, Callable] | None = None

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
        return upcast(self.allocator(z)).softmax(-1).to(z.dtype)

    def down(self, h: torch.Tensor, offset: int | None = None) -> torch.Tensor:
        """(b, L, d) -> (b, L_t, d), Eqs. 16-18 (``offset`` overrides ω: decoding down-scales a later stretch)."""
        g, w, length = self.g, self.offset if offset is None else offset, h.shape[1]
        n = (length + w) // g  # L_t: every complete chunk of the ω-offset partition (Eq. 13-14)
        end = n * g - w  # positions from here on form the incomplete trailing chunk: dropped (Eq. 14)
        if n == 0:
            return h.new_zeros(h.shape[0], 0, h.shape[2])  # fewer than g - ω positions: no complete chunk
        if torch.compiler.is_compiling():
            return self.down_padded(h, w)  # plain ops the compiler fuses into one kernel
        if self.scorer is None:
            return _ChunkMap.apply(
                h, None, 1 / g, 0, end, g, w, n, False, False
            )  # Eq. 16 (left padding counts as zero)
        # Eq. 17-18: α = softmax of the scores within each chunk, z_j = sum_p α_p h_p (``_SelfAggregation``)
        score = upcast(self.scorer(h).squeeze(-1))
        if self.record is not None:  # α in the chunked (b, L_t, g) layout, padding slots 0 (probes)
            padded = F.pad(score.detach(), (w, end - length), value=float("-inf"))
            self.record.append({"alpha": padded.unflatten(1, (n, g)).softmax(-1).to(h.dtype)})
        return _SelfAggregation.apply(h, score, end, g, w, n)

    def up(self, z: torch.Tensor, length: int) -> torch.Tensor:
        """(b, L_t, d) -> shifted token-level update u~ of shape (b, L, d), Eqs. 19-22."""
        g, w, s = self.g, self.offset, self.shift
        n = z.shape[1]
        if s >= length:
            return z.new_zeros(z.shape[0], length, z.shape[2])  # every source lies before position 0
        # shift right by s (Eq. 22): position p >= s receives row p - s + ω of the chunked layout, up to the
        # last chunk's last row or the sequence's end; rows k < ω of chunk 0 are padding and reach no position
        end = min(length, s - w + n * g)
        if torch.compiler.is_compiling():
            return self.up_padded(z, length)  # plain ops the compiler fuses into one kernel
        if self.allocator is None:
            return _ChunkMap.apply(z, None, self.gain / g, s, end, g, w, length, True, False)  # Eq. 20
        beta = self.allocation(z)  # Eq. 21
        if self.record is not None:
            self.record.append({"beta": beta.detach()})
        # λ β in the chunked (b, L_t, g) layout: each position reads its chunk's row and its slot ρ (Eq. 12)
        return _ChunkMap.apply(z, self.gain * beta, 1.0, s, end, g, w, length, True, True)  # Eq. 19

    # ------------------------------------------------------------------ the padded form (compiled glue)
    def down_padded(self, h: torch.Tensor, offset: int | None = None) -> torch.Tensor:
        """:meth:`down` in its padded form: left-pad by ω and crop the trailing incomplete chunk (Eqs. 12-14),
        then Eqs. 16-18 on the (b, L_t, g, d) chunked layout. Plain ops, which ``torch.compile`` fuses into one
        kernel with no padded copy; in eager mode :meth:`down` does the same in views (``_ChunkMap``)."""
        g, w = self.g, self.offset if offset is None else offset
        n = (h.shape[1] + w) // g  # L_t (Eqs. 13-14)
        pad = (w, n * g - w - h.shape[1])  # a negative pad crops
        chunks = F.pad(h, (0, 0, *pad)).unflatten(1, (n, g))
        if self.scorer is None:
            return chunks.sum(2) / g  # Eq. 16 (left padding contributes zero)
        score = F.pad(upcast(self.scorer(h).squeeze(-1)), pad, value=float("-inf"))
        alpha = score.unflatten(1, (n, g)).softmax(-1).to(h.dtype)  # Eq. 17 (padding slots get 0)
        return (alpha.unsqueeze(-1) * chunks).sum(2)  # Eq. 18

    def up_padded(self, z: torch.Tensor, length: int) -> torch.Tensor:
        """:meth:`up` in its padded form: λ/g or λβ per row of the chunked layout (Eqs. 19-21), rows k < ω of
        chunk 0 zeroed (padding), then the shift by s (Eq. 22) as one pad that zero-fills the first rows and
        crops or zero-fills the end."""
        g, w, s = self.g, self.offset, self.shift
        b, n, d = z.shape
        if s >= length:
            return z.new_zeros(b, length, d)
        if self.allocator is None:
            coef = z.new_full((1, n * g), self.gain / g)  # Eq. 20
        else:
            coef = self.gain * self.allocation(z).flatten(1)  # Eq. 19, 21
        coef = F.pad(coef[:, w:], (w, 0)).unflatten(1, (n, g))  # padding rows reach no position
        u = (coef.unsqueeze(-1) * z.unsqueeze(2)).flatten(1, 2)  # (b, n g, d)
        return F.pad(u, (0, 0, s - w, length - n * g - s + w))  # Eq. 22

    def compile_glue(self, **options) -> None:
        """``torch.compile`` S_down and S_up of this step, each on its own (``train.compile: glue``): their
        padded forms fused into one kernel each, forward and backward (on a GPU a Triton kernel each instead
        of ~10 small launches). ``options`` go to ``torch.compile``."""
        if self.full_resolution:
            return
        self.glue = (torch.compile(self.down_padded, **options), torch.compile(self.up_padded, **options))

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
        if self.glue is not None and self.record is None:  # compiled S_down / S_up (probes record eagerly)
            down, up = self.glue
            return up(core(down(h)), length)
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


def _slots(a: torch.Tensor, seg: tuple[int, int, int, int], offset: int) -> torch.Tensor:
    """The (b, c, k) weights of a run from weights in the chunked (b, L_t, g) layout: chunk j's slots ρ, from ω
    in chunk 0 when it starts part-way (Eq. 12)."""
    _, j, c, k = seg
    r = offset if j == 0 else 0
    return a[:, j : j + c, r : r + k]


def _weights(a: torch.Tensor, seg: tuple[int, int, int, int], chunked: bool, offset: int) -> torch.Tensor:
    return _slots(a, seg, offset) if chunked else _views(a, seg)


# On the CPU, up to this many positions per chunk, k multiply-adds over (b, c, d) views beat one GEMM per
# chunk: ATen folds a run's (b, c) batch into one bmm, which copies the states where the run does not start at
# position 0 (an offset ω > 0 starts every later run part-way), and a (1 x k) @ (k x d) product is tiny.
# S_down + S_up forward and backward of SpiralFormer-B's three coarse steps (g = 8, 4, 2), one thread on an
# AMX Xeon, multiply-adds / GEMM (benchmarks/bench_glue.py): cpu-tiny 0.79, cpu-base 0.71, pythia-160m 0.93.
# On a GPU the GEMM stays: one kernel launch, where launches bound small steps (bench_host_overhead.py).
_LOOP_MAX_K = 8


def _chunk_sum(xv: torch.Tensor, w: torch.Tensor | None, scale: float) -> torch.Tensor:
    """(b, c, d): sum_r w[:, :, r] xv[:, :, r] over the k positions of each chunk of a run ``xv`` (b, c, k, d);
    ``w`` (b, c, k) in ``xv``'s dtype, or None for the uniform weight ``scale``."""
    k = xv.shape[2]
    if k > _LOOP_MAX_K or xv.device.type != "cpu":  # (1 x k) @ (k x d) per chunk: x read once, no product
        w = xv.new_full((1, k), scale) if w is None else w.unsqueeze(-2)
        return (w @ xv).squeeze(-2)
    if w is None:
        z = torch.mul(xv[:, :, 0], scale)
        for r in range(1, k):
            z.add_(xv[:, :, r], alpha=scale)
        return z
    z = torch.mul(xv[:, :, 0], w[:, :, :1])
    for r in range(1, k):
        z.addcmul_(xv[:, :, r], w[:, :, r : r + 1])
    return z


def _sum(
    x: torch.Tensor,
    a: torch.Tensor | None,
    scale: float,
    segs: list,
    n: int,
    chunked: bool = False,
    offset: int = 0,
) -> torch.Tensor:
    """(b, n, d): the weighted sum over each chunk's positions (zero for chunks with none)."""
    parts = [
        _chunk_sum(_views(x, seg), None if a is None else _weights(a, seg, chunked, offset), scale)
        for seg in segs
    ]
    covered = segs[-1][1] + segs[-1][2] if segs else 0
    if covered < n or not parts:  # chunks whose positions all lie at or past L (or no chunk at all)
        parts.append(x.new_zeros(x.shape[0], n - covered, x.shape[-1]))
    return torch.cat(parts, 1)


def _spread(
    z: torch.Tensor,
    a: torch.Tensor | None,
    scale: float,
    segs: list,
    start: int,
    end: int,
    length: int,
    chunked: bool = False,
    offset: int = 0,
) -> torch.Tensor:
    """(b, L, d): each position in [start, end) gets its chunk's row, weighted; zero elsewhere."""
    u = z.new_empty(z.shape[0], length, z.shape[-1])
    if start > 0:
        u[:, :start].zero_()
    if end < length:
        u[:, end:].zero_()
    for seg in segs:
        _, j, c, k = seg
        src = z[:, j : j + c].unsqueeze(2)
        if a is None:
            _views(u, seg).copy_((src * scale).expand(-1, -1, k, -1))
        else:
            torch.mul(src, _weights(a, seg, chunked, offset).unsqueeze(-1), out=_views(u, seg))
    return u


def _inner(
    x: torch.Tensor,
    z: torch.Tensor,
    segs: list,
    start: int,
    end: int,
    width: int,
    chunked: tuple[int, int] | None = None,
) -> torch.Tensor:
    """(b, width): <x[p], z[chunk(p)]> over [start, end), zero elsewhere (the gradient of per-position weights);
    with ``chunked`` = (g, ω), in the chunked (b, L_t, g) layout instead, zero at slots no position reads."""
    if chunked is not None:
        g, offset = chunked
        out = x.new_zeros(z.shape[0], z.shape[1], g)
        for seg in segs:
            prod = _views(x, seg) * z[:, seg[1] : seg[1] + seg[2]].unsqueeze(2)
            torch.sum(prod, -1, out=_slots(out, seg, offset))
        return out
    parts = [
        (_views(x, seg) * z[:, seg[1] : seg[1] + seg[2]].unsqueeze(2)).sum(-1).flatten(1) for seg in segs
    ]
    return F.pad(torch.cat(parts, 1), (start, width - end))


class _SelfAggregation(torch.autograd.Function):
    """S_down by self-aggregation (Eqs. 17-18): α = softmax of the scores within each chunk (computed in
    float32 as :meth:`ResolutionStep.allocation` does), z_j = sum_{p in chunk j} α_p h_p.

    The softmax runs over each run of chunks that tile [0, end) (chunk 0 holds g - ω positions when ω > 0):
    equal to the softmax over the left-padded layout with padding scores -inf (exp(-inf) = 0), without
    padding the scores or cropping the weights back. The backward is written out per run:

        dL/dh_p = α_p dL/dz_chunk(p)                                                    (the adjoint spread)
        dL/dα_p = <h_p, dL/dz_chunk(p)>,  dL/ds_p = α_p (dL/dα_p - sum_q in chunk α_q dL/dα_q)  (softmax)

    each written into its place of one gradient buffer (autograd's backward of the composed form adds a
    zero-filled gradient per split, pad or slice)."""

    @staticmethod
    def forward(ctx, x, score, end, g, offset, n):
        segs = _segments(0, end, g, offset)
        alphas = [_views(score, seg).softmax(-1) for seg in segs]  # float32, (b, c, k) per run
        # the weighted sum over each chunk of each run, as _sum; the runs cover every chunk
        with no_autocast(x):
            parts = [_chunk_sum(_views(x, seg), a.to(x.dtype), 1.0) for seg, a in zip(segs, alphas)]
            z = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
        ctx.save_for_backward(x, *alphas)
        ctx.meta = segs, end, score.shape, score.dtype
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, *alphas = ctx.saved_tensors
        segs, end, score_shape, score_dtype = ctx.meta
        grad_x = grad_score = None
        with no_autocast(grad):
            if ctx.needs_input_grad[0]:
                grad_x = x.new_empty(x.shape)
                if end < x.shape[1]:
                    grad_x[:, end:].zero_()
                for seg, a in zip(segs, alphas):
                    _, j, c, _ = seg
                    torch.mul(
                        grad[:, j : j + c].unsqueeze(2), a.to(x.dtype).unsqueeze(-1), out=_views(grad_x, seg)
                    )
            if ctx.needs_input_grad[1]:
                parts = []
                for seg, a in zip(segs, alphas):  # the softmax's backward per run (what autograd runs)
                    _, j, c, _ = seg
                    grad_a = (_views(x, seg) * grad[:, j : j + c].unsqueeze(2)).sum(-1)
                    parts.append(torch._softmax_backward_data(grad_a.to(score_dtype), a, -1, score_dtype))
                parts = [p.flatten(1) for p in parts]
                if end < score_shape[1]:  # dropped positions (Eq. 14): no gradient
                    parts.append(grad.new_zeros(score_shape[0], score_shape[1] - end, dtype=score_dtype))
                grad_score = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
        return grad_x, grad_score, None, None, None, None


class _ChunkMap(torch.autograd.Function):
    """S_down's weighted sum over chunks (Eqs. 16/18) or, with ``spread``, S_up's weighted broadcast with the
    shift (Eqs. 19/20, 22). The two are adjoint, so the backward of each is the other (one pass, no
    scatter-add), plus <positions, chunks> at each position for learned weights."""

    @staticmethod
    def forward(ctx, x, a, scale, start, end, g, offset, size, spread, chunked):
        """``size``: the output's chunks (sum) or positions (spread); ``chunked``: ``a`` is in the chunked
        (b, L_t, g) layout (S_up's β), else one weight per position."""
        segs = _segments(start, end, g, offset)
        ctx.save_for_backward(x if a is not None and a.requires_grad else None, a)
        ctx.meta = scale, segs, start, end, x.shape[1], spread, (g, offset) if chunked else None
        lay = {"chunked": chunked, "offset": offset}
        with no_autocast(x):
            if spread:
                return _spread(x, a, scale, segs, start, end, size, **lay)
            return _sum(x, a, scale, segs, size, **lay)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, a = ctx.saved_tensors
        scale, segs, start, end, size, spread, chunked = ctx.meta  # size: the input's chunks or positions
        lay = {"chunked": chunked is not None, "offset": chunked[1] if chunked else 0}
        grad_x = grad_a = None
        with no_autocast(grad):
            if ctx.needs_input_grad[0]:
                grad_x = (
                    _sum(grad, a, scale, segs, size, **lay)
                    if spread
                    else _spread(grad, a, scale, segs, start, end, size, **lay)
                )
            if ctx.needs_input_grad[1]:
                positions, chunks = (grad, x) if spread else (x, grad)
                grad_a = _inner(positions, chunks, segs, start, end, a.shape[1], chunked)
        return grad_x, grad_a, None, None, None, None, None, None, None, None
