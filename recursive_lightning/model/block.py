"""The transformer layer: GPT-NeoX (Pythia) by default, LLaMA-style by config.

Parallel residual (Pythia): x + Attn(LN1(x)) + MLP(LN2(x)); sequential otherwise.
Attention goes through ``F.scaled_dot_product_attention``, or flash-attn on CUDA when installed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.precision import upcast
from recursive_lightning.model.shared_grad import Linear

try:  # flash-attn is optional; used only for CUDA half-precision tensors
    from flash_attn import flash_attn_func
except Exception:  # pragma: no cover - not installed on CPU machines
    flash_attn_func = None


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


class Rotary(nn.Module):
    """GPT-NeoX rotary embedding on the first ``rotary_pct`` of each head's dims (rotate-half form).

    ``table``: also keep cos/sin of positions 0 .. max_seq_len-1 (a non-persistent buffer, float32 values, the
    module's dtype after ``.to()``), so the common forward slices them instead of recomputing: one
    view instead of ~8 kernels per call site, which matters where kernel launches bound the step."""

    def __init__(self, cfg: ModelConfig, table: bool = False) -> None:
        super().__init__()
        self.dim = int(cfg.head_dim * cfg.rotary_pct)
        self.base = cfg.rotary_base
        self.table = table
        if table:
            cos, sin = self.cos_sin(torch.arange(cfg.max_seq_len), torch.float32)
            self.register_buffer("cos_table", cos, persistent=False)
            self.register_buffer("sin_table", sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the rotary angles at integer ``positions`` of shape (l,) or (b, l): (..., l, dim)."""
        inv_freq = 1.0 / (
            self.base
            ** (torch.arange(0, self.dim, 2, device=positions.device, dtype=torch.float32) / self.dim)
        )
        freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_sin_range(
        self, start: int, length: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of positions start .. start+length-1: from the table where it reaches, else computed."""
        if self.table and start + length <= self.cos_table.shape[0] and self.cos_table.device == device:
            cos, sin = self.cos_table[start : start + length], self.sin_table[start : start + length]
            return cos.to(dtype), sin.to(dtype)  # no-op when the table has the activations' dtype
        return self.cos_sin(torch.arange(start, start + length, device=device), dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (b, l, h, hd); cos/sin: (l, dim), or (b, l, dim) for per-row positions."""
        return _rotate_half_reference(x, cos, sin, self.dim)


class _QKVRotary(torch.autograd.Function):
    """The attention input (b, l, h + 2 kv, hd) -> q, k rotated (RoFormer's rotary embedding in GPT-NeoX's
    rotate-half form on the first ``dim`` of each head's dims) and v, each (b, heads, l, hd): what
    :meth:`Rotary.forward` on the query and key heads and the head split compute, with a written-out backward.

    Autograd's backward of the composed form materialises a zero-filled full-size gradient for every slice
    (the head split, the rotary dims and their halves: six per layer) and adds them up, ~31 ATen calls per
    layer; here the inverse rotation R(-θ) writes each head group's gradient into its place of one buffer:
    4 calls for q and for k, one copy for v (the forward: 4 instead of 6). With x = (x1, x2) the two halves of
    the rotary dims, forward and backward are

        y1 = x1 cos1 - x2 sin1,   y2 = x2 cos2 + x1 sin2                 (rotate-half: y = x cos + R(x) sin)
        dx1 = dy1 cos1 + dy2 sin2, dx2 = dy2 cos2 - dy1 sin1              (R^T)

    and the dims past ``dim`` pass through. The second product and the sum are one multiply-add (``addcmul``),
    so values equal :meth:`Rotary.forward`'s to one rounding, gradients autograd's to rounding."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, heads, dim):
        half, nqk = dim // 2, heads[0] + heads[1]
        x = qkv[:, :, :nqk]
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
        out = qkv.new_empty(x.shape, dtype=torch.result_type(x, cos))  # rotary in cos/sin's dtype
        torch.mul(x[..., :dim], cos, out=out[..., :dim])
        out[..., :half].addcmul_(x[..., half:dim], sin[..., :half], value=-1)
        out[..., half:dim].addcmul_(x[..., :half], sin[..., half:])
        if dim < x.shape[-1]:
            out[..., dim:].copy_(x[..., dim:])
        ctx.save_for_backward(cos, sin)
        ctx.meta = heads, dim, qkv.shape, qkv.dtype
        q, k, v = out[:, :, : heads[0]], out[:, :, heads[0] :], qkv[:, :, nqk:]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k, grad_v):
        cos, sin = ctx.saved_tensors
        heads, dim, shape, dtype = ctx.meta
        half, nqk = dim // 2, heads[0] + heads[1]
        grad = torch.empty(shape, dtype=dtype, device=cos.device)
        for g, lo, hi in ((grad_q, 0, heads[0]), (grad_k, heads[0], nqk)):
            target = grad[:, :, lo:hi]
            if g is None:
                target.zero_()
                continue
            g = g.transpose(1, 2)
            out = target if g.dtype == dtype else torch.empty_like(g)  # mixed precision: sum in g's dtype
            torch.mul(g[..., :dim], cos, out=out[..., :dim])
            out[..., :half].addcmul_(g[..., half:dim], sin[..., half:])
            out[..., half:dim].addcmul_(g[..., :half], sin[..., :half], value=-1)
            if dim < g.shape[-1]:
                out[..., dim:].copy_(g[..., dim:])
            if out is not target:
                target.copy_(out)
        if grad_v is None:
            grad[:, :, nqk:].zero_()
        else:
            grad[:, :, nqk:].copy_(grad_v.transpose(1, 2))
        return grad, None, None, None, None


def qkv_rotary(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: tuple[int, int], dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of shape (b, heads, l, hd) from the attention input (b, l, h + 2 kv, hd), queries and keys
    rotated on their first ``dim`` dims; ``heads`` = (h, kv). cos/sin: (l, dim) or (b, l, dim).

    Equal to ``Rotary.forward`` on ``qkv[:, :, :h + kv]`` and the head split (``_QKVRotary``), in fewer calls;
    without rotary dims, where cos/sin need their own gradient or under ``torch.compile``, the composed form."""
    h, kvh = heads
    if (
        dim == 0 or cos.requires_grad or sin.requires_grad or torch.compiler.is_compiling()
    ):  # the compiler fuses
        qk = _rotate_half_reference(qkv[:, :, : h + kvh], cos, sin, dim)
        return (
            qk[:, :, :h].transpose(1, 2),
            qk[:, :, h:].transpose(1, 2),
            qkv[:, :, h + kvh :].transpose(1, 2),
        )
    return _QKVRotary.apply(qkv, cos, sin, heads, dim)


def _rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    """GPT-NeoX rotary in its composed form (the reference the fused path is tested against)."""
    if dim == 0:
        return x
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    rot, rest = x[..., :dim], x[..., dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


class KV:
    """Keys and values one attention layer has seen so far (the decoding cache of one layer, one call site)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=-2), torch.cat([self.v, v], dim=-2)
        self.k, self.v = k, v
        return k, v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.qkv = Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=cfg.bias)
        self.proj = Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.rotary = Rotary(cfg)
        self.capture: list[torch.Tensor] | None = None  # set to a list to record attention maps (probes)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        kv: KV | None = None,
    ) -> torch.Tensor:
        """Causal self-attention; ``mask`` (b, l, l), True = may attend, replaces the causal mask (packed
        sequences, see ``evaluation/prefix_sharing.py``); ``kv`` prepends the keys/values of earlier calls
        and keeps these (decoding, ``model/decoding.py``)."""
        h, kvh = self.n_heads, self.kv_heads
        qkv = self.qkv(x).unflatten(-1, (-1, self.head_dim))  # (b, l, h + 2 kv, hd)
        q, k, v = qkv_rotary(qkv, cos, sin, (h, kvh), self.rotary.dim)  # q and k rotated together
        sees_all = False  # a single new query after cached positions attends to every key
        if kv is not None:
            past = kv.length
            k, v = kv.extend(k, v)
            if past and mask is None and q.shape[-2] == 1:
                sees_all = True
            elif past and mask is None:  # new query j sits at position past + j and sees keys 0 .. past + j
                new = torch.arange(q.shape[-2], device=q.device)
                mask = (new[:, None] + past >= torch.arange(k.shape[-2], device=q.device)).unsqueeze(0)
        if self.capture is not None:
            y = self._explicit(q, k, v, mask)
        elif mask is not None or sees_all:
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=None if mask is None else mask.unsqueeze(1),
                enable_gqa=self.kv_heads != self.n_heads,
            )
        elif flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            y = flash_attn_func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True
            ).transpose(1, 2)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.n_heads
            )
        return self.proj(y.transpose(1, 2).flatten(2))  # (b, h, l, hd) -> (b, l, h hd)

    def _explicit(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Materialised softmax(QK^T) so probes can read the attention map; same output as SDPA."""
        rep = self.n_heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        length = q.shape[-2]
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        if allowed is not None:
            mask = ~allowed.unsqueeze(1)
        scores = upcast(scores)  # half precision only
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1).to(q.dtype)
        self.capture.append(attn.detach())
        return attn @ v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        self.up = Linear(cfg.d_model, cfg.hidden * (2 if self.gated else 1), bias=cfg.bias)
        self.down = Linear(cfg.hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """One transformer layer: 12d^2 + 13d parameters in the GPT-NeoX configuration."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.norm1, self.norm2 = make_norm(cfg), make_norm(cfg)
        self.attn, self.mlp = Attention(cfg), MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        kv: KV | None = None,
    ) -> torch.Tensor:
        if self.parallel:
            return x + self.attn(self.norm1(x), cos, sin, mask, kv) + self.mlp(self.norm2(x))
        x = x + self.attn(self.norm1(x), cos, sin, mask, kv)
        return x + self.mlp(self.norm2(x))


class Stack(nn.Module):
    """A run of layers (prelude, one core, or coda); rotary positions 0..L-1 of its input unless given."""

    def __init__(self, cfg: ModelConfig, n_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg) for _ in range(n_layers))
        self.rotary = Rotary(cfg, table=True)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        kv: list[KV] | None = None,
    ) -> torch.Tensor:
        """``kv``: one cache per layer; positions then continue after what the cache holds."""
        if positions is None:
            start = kv[0].length if kv else 0
            cos, sin = self.rotary.cos_sin_range(start, x.shape[1], x.device, x.dtype)
        else:
            cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, kv[i] if kv is not None else None)
        return x
