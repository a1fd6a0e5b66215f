"""Multi-resolution recursion (SpiralFormer Sec. 2.2-2.3): one loop step at chunk size g.

    z  = S_down(h)          (Eqs. 16-18)  mean pooling or self-aggregation within chunks
    z^ = f_core(z)          (Eq. 9)       the shared core on the short sequence (L_t = floor(L / g))
    u  = S_up(z^)           (Eqs. 19-21)  uniform broadcast or output-dependent allocation, gain λ
    u~ = CausalShift(u, s)  (Eq. 22)      right shift by s (g-1: overlap; >= g: parallel)

Chunks use the offset maps π(i) = floor((i + ω) / g), ρ(i) = (i + ω) - g π(i) (Eq. 12): the sequence
is left-padded by ω so chunk 0 holds the first g - ω tokens, and the incomplete trailing chunk is
dropped (Eq. 14). We keep L_t = floor((L + ω) / g) chunks: Eq. 13's floor(L / g) when ω = 0, and with
ω > 0 it also keeps the last *complete* chunk, so a position's output never depends on how many tokens
follow it (training-time forward == token-by-token decoding). Positions that receive no update get zero. Everything is reshapes and one pad;
no Python loop over chunks or tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

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
        g, w = self.g, self.offset if offset is None else offset
        n = (h.shape[1] + w) // g  # L_t: every complete chunk of the ω-offset partition (Eq. 13-14)
        # left-pad by ω and crop the incomplete trailing chunk in one F.pad (a negative pad crops)
        pad = (w, n * g - w - h.shape[1])
        chunks = rearrange(F.pad(h, (0, 0, *pad)), "b (n g) d -> b n g d", g=g)
        if self.scorer is None:
            return chunks.sum(2) / g  # Eq. 16 (left padding contributes zero)
        score = F.pad(self.scorer(h).squeeze(-1).float(), pad, value=float("-inf"))
        alpha = rearrange(score, "b (n g) -> b n g", g=g).softmax(-1).to(h.dtype)  # Eq. 17
        if self.record is not None:
            self.record.append({"alpha": alpha.detach()})
        return (alpha.unsqueeze(-1) * chunks).sum(2)  # Eq. 18 (multiply + sum: faster than a bmm of 1 x g)

    def up(self, z: torch.Tensor, length: int) -> torch.Tensor:
        """(b, L_t, d) -> shifted token-level update u~ of shape (b, L, d), Eqs. 19-22."""
        g, w, s = self.g, self.offset, self.shift
        n = z.shape[1]
        if s - w >= length:
            return z.new_zeros(z.shape[0], length, z.shape[2])  # every source lies before position 0
        if self.allocator is None:
            coef = z.new_full((n * g,), self.gain / g)  # Eq. 20
        else:
            beta = self.allocation(z)  # Eq. 21
            if self.record is not None:
                self.record.append({"beta": beta.detach()})
            coef = self.gain * beta.flatten(1)  # Eq. 19
        # row k = q + ω of the chunked layout holds source position q; rows k < ω are padding: zero weight
        coef = F.pad(coef[..., w:], (w, 0)).unflatten(-1, (n, g))
        u = rearrange(coef.unsqueeze(-1) * z.unsqueeze(2), "b n g d -> b (n g) d")
        # shift right by s (Eq. 22): position p reads row p - s + ω; one F.pad zero-fills the first rows and
        # crops or zero-fills the end (a negative pad crops)
        return F.pad(u, (0, 0, s - w, length - n * g - s + w))

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
