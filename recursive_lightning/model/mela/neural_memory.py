"""Mela's neural memory: an MLP whose weights M are updated at test time, once per chunk of C patches.

    k, v = W_k x, W_v x                                   (Eq. 7)
    l(M; x) = ||N(k; M) - v||^2                           (Eq. 8, associative loss)
    y     = N(q; M),  q = W_q x                           (Eq. 9; M = M_t or M_{t-1}, see below)
    S_t   = eta_t S_{t-1} - sum_{i in chunk t} theta_i grad l(M_{t-1}; x_i)     (Eq. 11)
    M_t   = alpha_t M_{t-1} + NewtonSchulz-k(S_t)         (Eq. 10)

``t`` counts chunks: every position of chunk t is scored against M_{t-1}, the state before the chunk, and
their per-position-weighted gradients sum to the chunk's surprise. The simpler forms of Sec. 2.1 are
``memory_update`` values: ``plain`` (Eq. 1: M_t = M_{t-1} - theta grad), ``momentum`` (Eqs. 2-3),
``forgetting`` (Eqs. 4-5), ``newton_schulz`` (Eqs. 10-11, every Mela size).

The memory is ``memory_heads`` independent MLPs of ``memory_depth`` bias-free layers (GELU between them)
on d/heads dims; one state per (sequence, head). The gradient of Eq. 8 is written out as the MLP's
backward (batched matmuls over batch and heads, no Python loop over positions; the loop is over chunks,
which Eq. 10 makes sequential) and stays differentiable, so the outer parameters (projections, theta /
eta / alpha heads, the initial memory M_0) learn through every inner update.

Which state a chunk reads [reading, ``memory_read``]: Eq. 9 retrieves from M_{t-1}, the state before the
chunk. Mela's decoder must read chunk j's memory from chunks before j (``model/mela/model.py``), so decoder chunk j gets
the HMM's output at chunk j-1. With ``after`` (default) that output retrieves from the memory *after* chunk
j-1's update: decoder chunk j then reads the state built from chunks 0..j-1, the same state Eq. 9 gives
chunk j, which is "the memory as it stood after chunk j-1" of our design notes. ``before`` applies Eq. 9
inside the HMM literally: the memory then reaches the decoder one chunk late, and at the paper's training
length (4,096 tokens = 2 chunks) the H-module's updates are never read (``train`` warns, naming them).

Readings of ours (the paper is silent): q and k are L2-normalised per head (as in Titans); theta, eta and
alpha are sigmoids of linear maps of the normed input, theta per position (scaled by ``max_lr``, as Titans'
max_lr: Newton-Schulz is blind to the scale, the unnormalised updates of Eqs. 1-5 diverge at sigmoid(0) =
0.5), eta and alpha per chunk from its mean; the retrieved heads are concatenated and projected by W_o; the memory MLP has no biases, so
Newton-Schulz applies to every memory tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.autograd.function import once_differentiable

from recursive_lightning.model.precision import no_autocast, upcast

# Muon's quintic coefficients (Jordan et al. 2024), Newton-Schulz-5 in Eq. 10
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    g: torch.Tensor, steps: int = 5, eps: float = 1e-7, floor: torch.Tensor | None = None
) -> torch.Tensor:
    """Approximate orthogonalisation of the last two dims (Muon): X <- aX + (bA + cA^2)X, A = XX^T, on the
    wide orientation (the m x m Gram matrix of the shorter side); three batched GEMMs a step with the scalings
    fused in, and a hand-written backward (:class:`_NewtonSchulz`). With ``floor`` (shape ``g.shape[:-2] + (1,
    1)``) the result is scaled by ||g||_F / max(||g||_F, floor): the bounded step of :func:`step_floors`."""
    return newton_schulz_all([g], steps, eps, None if floor is None else [floor])[0]


def newton_schulz_all(
    gs: list[torch.Tensor], steps: int = 5, eps: float = 1e-7, floors: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """:func:`newton_schulz` of each tensor (each with its ``floors`` entry), the ones of one wide shape in one
    batched call: an MLP memory's W_1 (d x e d) and W_2 (e d x d) are both d x e d in the wide orientation, so
    one chunk's update runs one iteration loop instead of two (half the kernel launches that bound a GPU step,
    ``docs/benchmarks.md``: Mela). The Frobenius normalisation is per matrix, so each result is that of its own call."""
    tall = [g.shape[-2] > g.shape[-1] for g in gs]
    # (batch, m, n) with m <= n: flattened, then tall matrices transposed (a view)
    wide = [g.reshape(-1, *g.shape[-2:]) for g in gs]
    wide = [x.transpose(-2, -1) if t else x for x, t in zip(wide, tall)]
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(wide):
        groups.setdefault((x.shape[-2:], x.dtype, x.device), []).append(i)
    out: list[torch.Tensor] = [None] * len(gs)  # type: ignore[list-item]
    for members in groups.values():
        flat = [wide[i] for i in members]
        tau = None
        if floors is not None:
            taus = [floors[i].reshape(-1, 1, 1) for i in members]
            tau = taus[0] if len(taus) == 1 else torch.cat(taus)
        done = _NewtonSchulz.apply(flat[0] if len(flat) == 1 else torch.cat(flat), tau, steps, eps)
        for i, x in zip(members, done.split([f.shape[0] for f in flat])):
            out[i] = (x.transpose(-2, -1) if tall[i] else x).reshape(gs[i].shape)
    return out


class _NewtonSchulz(torch.autograd.Function):
    """Backward of the k iterations in closed form (A and B = bA + cA^2 are symmetric):

        X' = aX + BX          dX = aG + BG,   dB = G X^T
        B  = bA + cAA         dA = b dB + c (dB A + A dB)
        A  = XX^T             dX += (dA + dA^T) X

    three GEMMs of the size of X and two of A's per step, no element-wise pass over X; autograd through
    the same loop takes four and three. With a floor tau the output is X_k s, s = min(1, |g| / tau): that
    adds ds = <G, X_k> and, where s < 1, d|g| = ds / tau and dtau = -ds |g| / tau^2."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, tau: torch.Tensor | None, steps: int, eps: float) -> torch.Tensor:
        with no_autocast(g):  # in the update's own dtype, forward and backward
            return _NewtonSchulz._forward(ctx, g, tau, steps, eps)

    @staticmethod
    def _forward(ctx, g: torch.Tensor, tau: torch.Tensor | None, steps: int, eps: float) -> torch.Tensor:
        a, b, c = NS_COEFFICIENTS
        norm = torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True)
        x = g / (norm + eps)
        saved = []
        for _ in range(steps):
            A = torch.bmm(x, x.transpose(-2, -1))
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # bA + cA^2
            saved += [x, A, B]
            x = torch.baddbmm(x, B, x, beta=a)  # aX + BX
        ctx.eps, ctx.bounded = eps, tau is not None
        if tau is None:
            ctx.save_for_backward(g, norm, *saved)
            return x
        tau = tau.to(g.dtype).clamp_min(torch.finfo(g.dtype).tiny)
        scale = (norm / tau).clamp(max=1.0)
        ctx.save_for_backward(g, norm, tau, scale, x, *saved)
        return x * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = ctx.saved_tensors  # read once: activation checkpointing unpacks each saved tensor once
        with no_autocast(saved[0]):
            return _NewtonSchulz._backward(ctx, grad.to(saved[0].dtype), saved)

    @staticmethod
    def _backward(ctx, grad: torch.Tensor, saved: tuple[torch.Tensor, ...]):
        a, b, c = NS_COEFFICIENTS
        g, norm, *saved = saved
        d_norm = d_tau = None
        if ctx.bounded:
            tau, scale, out, *saved = saved
            ds = torch.where(scale < 1, (grad * out).sum(dim=(-2, -1), keepdim=True), 0.0)
            d_norm, d_tau = ds / tau, -ds * norm / (tau * tau)
            grad = grad * scale
        for i in range(len(saved) - 3, -1, -3):
            x, A, B = saved[i : i + 3]
            dB = torch.bmm(grad, x.transpose(-2, -1))
            dx = torch.baddbmm(grad, B, grad, beta=a)
            dA = torch.baddbmm(torch.baddbmm(dB, dB, A, beta=b, alpha=c), A, dB, alpha=c)
            grad = torch.baddbmm(dx, dA + dA.transpose(-2, -1), x)
        # x_0 = g / (|g| + eps): dg = G / n - <G, g> g / (n^2 |g|); the floor's d|g| adds d|g| g / |g|
        n = norm + ctx.eps
        inner = (grad * g).sum(dim=(-2, -1), keepdim=True)
        per_g = -inner / (n * n) if d_norm is None else d_norm - inner / (n * n)
        return grad / n + per_g * g / norm.clamp_min(torch.finfo(g.dtype).tiny), d_tau, None, None


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``F.normalize(x, dim=-1, eps=eps)``: x / max(||x||, eps) over the last dim. Eagerly with its backward
    written out (:class:`_L2Normalize`); under ``torch.compile`` composed, which the compiler fuses."""
    if torch.compiler.is_compiling():
        return F.normalize(x, dim=-1, eps=eps)
    return _L2Normalize.apply(x, eps)


class _L2Normalize(torch.autograd.Function):
    """y = x / n, n = max(||x||, eps) (``F.normalize``'s operations, so its values and dtypes under autocast)
    and dx = (g - y <g, y>) / n, where <g, y> counts only where ||x|| > eps (a clamped n is a constant): five
    calls, where autograd through the composition takes about twelve per normalisation (docs/benchmarks.md: host
    calls)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        n = x.norm(2, dim=-1, keepdim=True).clamp_min(eps)
        y = x / n
        ctx.save_for_backward(y, n)
        ctx.eps = eps
        return y

    @staticmethod
    @once_differentiable  # n is saved without a graph: a second derivative is refused, not wrong
    def backward(ctx, grad: torch.Tensor):
        y, n = ctx.saved_tensors
        inner = torch.linalg.vecdot(grad, y).unsqueeze(-1).masked_fill_(n <= ctx.eps, 0.0)
        return torch.addcmul(grad, y, inner, value=-1) / n, None


def step_floors(weights: list[torch.Tensor], theta: torch.Tensor, floor: float) -> list[torch.Tensor]:
    """tau_t = floor * sum_i theta_i * ||M_{t-1}||_F per memory tensor, sequence and head, (b, h, 1, 1) [reading,
    ``memory_step_floor``]: Eq. 10's step becomes NewtonSchulz(S_t) * ||S_t||_F / max(||S_t||_F, tau_t), Muon's
    Frobenius normalisation with a floor relative to the memory's scale (applied by :class:`_NewtonSchulz`,
    which has the norm). The orthogonalised step of Eq. 10 while the surprise is large against the memory; a
    step that shrinks with the surprise below that.

    Newton-Schulz is blind to the surprise's scale: a surprise that vanishes as the memory fits its chunk still
    moves M by unit singular values, in a direction set by what is left of the gradient. That is normalised
    gradient descent with a fixed step, whose effective learning rate 1 / ||S_t|| passes any stability limit
    near a fit, so the memory orbits chaotically: with the literal Eq. 10 a perturbation of 1e-13 in M_0 grows
    about 5x a chunk in float64 and float32 leaves float64 after ~8 chunks (``docs/models.md``: Numerics). Below the
    floor the step is gradient descent at a learning rate theta_i / tau_t, stable once the floor is above the
    associative loss's curvature: above ~1.2 for ``cpu-mela`` at initialisation, between 3 and 6 after 120 training
    steps (measured, ``benchmarks/bench_mela_numerics.py``); 6 by default. The floor scales with ||M_{t-1}||
    rather than being absolute: with forgetting (alpha_t ~ 0.5 at initialisation) an absolute floor lets the
    memory decay to M = 0, where the bias-free MLP's surprise is exactly zero. The paper adopts the
    orthogonalised update because it "stabilize[s] the learning of memory parameters" (Sec. 5.3); the floor
    keeps it stable when the surprise is small. ``memory_step_floor: 0`` is Eq. 10 literally."""
    rate = floor * theta.sum(-1)[..., None, None]  # (b, h, 1, 1): floor * sum_i theta_i
    return [rate * torch.linalg.vector_norm(w, dim=(-2, -1), keepdim=True) for w in weights]


def mlp_forward(x: torch.Tensor, weights: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """N(x; M) for x (..., n, d_in), weights (..., d_i, d_{i+1}); also the pre-activations."""
    y, pre, _ = _mlp_layers(x, weights)
    return y, pre


def _mlp_layers(
    x: torch.Tensor, weights: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """N(x; M), the pre-activation z_i of each layer and each layer's input (x, GELU(z_1), ...)."""
    pre, inputs = [], []
    for i, w in enumerate(weights):
        inputs.append(x)
        z = x @ w
        pre.append(z)
        x = F.gelu(z) if i < len(weights) - 1 else z
    return x, pre, inputs


def surprise(
    k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor, weights: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The momentary surprise -sum_i theta_i grad_M ||N(k_i; M) - v_i||^2 (Eqs. 8, 11; Titans' sign: the
    descent direction) for one chunk: k, v (..., C, d), theta (..., C). The MLP's backward written out, each
    GELU derivative one ``gelu_backward`` (differentiable: the outer parameters learn through it)."""
    y, pre, inputs = _mlp_layers(k, weights)
    delta = 2 * theta.unsqueeze(-1) * (v - y)  # -d l / d y, weighted per position
    grads: list[torch.Tensor] = [None] * len(weights)  # type: ignore[list-item]
    for i in range(len(weights) - 1, -1, -1):
        grads[i] = inputs[i].transpose(-2, -1) @ delta
        if i:
            delta = torch.ops.aten.gelu_backward(delta @ weights[i].transpose(-2, -1), pre[i - 1])
    return grads


def _decay(
    weights: list[torch.Tensor], steps: list[torch.Tensor], alpha_t: torch.Tensor | None
) -> list[torch.Tensor]:
    """M_t = alpha_t M_{t-1} + step (Eqs. 4, 10), or M_{t-1} + step without forgetting (Eqs. 1, 2)."""
    if alpha_t is None:
        return [w + u for w, u in zip(weights, steps)]
    return [torch.addcmul(u, alpha_t, w) for w, u in zip(weights, steps)]


@dataclass
class MemoryState:
    """One neural memory's state between chunks: the weights M_t and the surprise S_t, per (batch, head)."""

    weights: list[torch.Tensor]
    momentum: list[torch.Tensor] | None

    def numel(self) -> int:
        return sum(t.numel() for t in self.weights + (self.momentum or []))


class NeuralMemory(nn.Module):
    """One neural memory sub-layer of a memory block: x (b, n, d) -> retrieved y (b, n, d)."""

    def __init__(
        self,
        d: int,
        heads: int,
        depth: int,
        expansion: int,
        chunk_size: int,
        update: str = "newton_schulz",
        ns_steps: int = 5,
        read: str = "after",
        max_lr: float = 0.01,
        step_floor: float = 0.0,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.chunk_size = heads, d // heads, chunk_size
        self.update, self.ns_steps, self.read, self.max_lr = update, ns_steps, read, max_lr
        self.step_floor = step_floor  # the bounded orthogonal step's floor (step_floors)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # W_q, W_k, W_v (Eqs. 7, 9)
        self.out = nn.Linear(d, d, bias=False)  # W_o over the concatenated heads [reading]
        self.theta = nn.Linear(d, heads)  # per-position learning rate theta_i
        self.eta = nn.Linear(d, heads) if update != "plain" else None  # surprise decay eta_t (Eq. 3)
        self.alpha = nn.Linear(d, heads) if update in ("forgetting", "newton_schulz") else None  # Eq. 4
        dims = [self.head_dim] + [expansion * self.head_dim] * (depth - 1) + [self.head_dim]
        self.init_weights = nn.ParameterList(  # M_0, learned (hierarchical_memory.py: memory_carry)
            nn.Parameter(torch.empty(heads, i, o)) for i, o in zip(dims[:-1], dims[1:])
        )
        self.record: list[dict[str, torch.Tensor]] | None = None  # probes: per-chunk update statistics
        self.glue: tuple[Callable, Callable] | None = None  # project, update_memory compiled (compile_glue)
        # the fused update of each chunk (use_memory_kernel)
        self.kernel: Callable | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in self.init_weights:
            nn.init.normal_(w, std=1 / math.sqrt(w.shape[-2]))

    def initial_state(self, batch: int) -> MemoryState:
        weights = [w.unsqueeze(0).expand(batch, *w.shape) for w in self.init_weights]
        momentum = [torch.zeros_like(w) for w in weights] if self.eta is not None else None
        return MemoryState(weights, momentum)

    def forward(self, x: torch.Tensor, state: MemoryState | None = None) -> tuple[torch.Tensor, MemoryState]:
        """x (b, n, d) with n a multiple of C; returns y and the state after the last chunk."""
        b, n, _ = x.shape
        C = self.chunk_size
        if n % C:
            raise ValueError(f"neural memory input of {n} patches is not a multiple of chunk_size {C}")
        state = state or self.initial_state(b)
        q, k, v, theta, eta, alpha = (self.project if self.glue is None else self.glue[0])(x)
        with no_autocast(x):
            ys, state = self._store_and_retrieve(q, k, v, theta, eta, alpha, state)
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=2)
        y = rearrange(y, "b h n d -> b n (h d)").to(x.dtype)
        return self.out(y), state

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The chunk loop's inputs from x (b, n, d): q, k, v (b, h, n, d) (Eqs. 7, 9), theta (b, h, n) and the
        chunks' eta, alpha (b, h, n / C) or None, in float32; the region ``compile_glue`` compiles beside the
        chunk update (the projections, normalisation and gates fused around their GEMMs)."""
        qkv = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        qk, v = qkv.split(
            [2, 1]
        )  # split and unbind: each backward is one cat / stack, a slice's pads with zeros
        q, k = l2_normalize(qk).unbind(0)  # [reading], as in Titans; q and k in one pass
        theta, eta, alpha = self._gates(x)
        # the inner loop in float32 even under autocast [reading]: Newton-Schulz lifts an update's near-null
        # directions towards singular value 1, so bf16 rounding there (~4e-3) would be written into the memory
        # as O(1) updates (docs/models.md: Numerics); the projections above stay in the autocast dtype. Its GEMMs
        # read TF32 operands where train runs under autocast on CUDA (training/parallel.tf32_under_mixed_precision)
        q, k, v, theta = (upcast(t) for t in (q, k, v.squeeze(0), theta))
        eta, alpha = (None if t is None else upcast(t) for t in (eta, alpha))
        return q, k, v, theta, eta, alpha

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """theta (b, h, n), per position; eta and alpha (b, h, n / C), per chunk, or None: the three linear maps
        as one (their weights concatenated), eta's and alpha's taken at the chunk's mean of the mapped positions,
        which equals the map of the chunk's mean input (the maps are affine)."""
        b, n, _ = x.shape
        maps = [m for m in (self.theta, self.eta, self.alpha) if m is not None]
        if len(maps) == 1:
            g = F.linear(x, self.theta.weight, self.theta.bias)
        else:
            g = F.linear(x, torch.cat([m.weight for m in maps]), torch.cat([m.bias for m in maps]))
        h = self.heads
        per_position, per_chunk = g.split([h, g.shape[-1] - h], dim=-1)
        theta = rearrange(self.max_lr * torch.sigmoid(per_position), "b n h -> b h n")
        if len(maps) == 1:
            return theta, None, None
        rates = torch.sigmoid(per_chunk.view(b, n // self.chunk_size, self.chunk_size, -1).mean(2))
        rates = rearrange(rates, "b c (k h) -> k b h c", h=h)
        # one unbind: its backward is one stack, where an index's is a zero-filled copy each
        eta, *alpha = rates.unbind(0)
        return theta, eta, alpha[0] if alpha else None

    def _store_and_retrieve(
        self, q, k, v, theta, eta, alpha, state: MemoryState
    ) -> tuple[list[torch.Tensor], MemoryState]:
        """The chunk loop of Eqs. 9-11 over (b, h, n, d) float32 inputs: each chunk's memories are stored
        (Eqs. 8, 10, 11) and its queries retrieve from the memory before or after that (``read``, Eq. 9)."""
        C = self.chunk_size
        n = q.shape[2]
        weights = [upcast(w) for w in state.weights]
        momentum = state.momentum and [upcast(m) for m in state.momentum]
        state = MemoryState(weights, momentum)
        # one split per input rather than a slice per chunk: autograd joins the chunks' gradients with one cat,
        # where a slice's backward pads each chunk's gradient to the full length and the chunks' are summed
        # (the HMM passes one chunk at a time: then the inputs are the chunk's, with no split or unbind to undo)
        one = n == C
        qs, ks, vs, thetas = ((x,) if one else x.split(C, dim=2) for x in (q, k, v, theta))
        etas, alphas = (
            [None] * (n // C) if x is None else (x[..., None],) if one else x[..., None, None].unbind(2)
            for x in (eta, alpha)
        )
        ys = []
        for t in range(n // C):
            if self.read == "before":
                ys.append(self.retrieve_memories(qs[t], state))  # Eq. 9: M_{t-1}
            state = self.store_memories(t, ks[t], vs[t], thetas[t], etas[t], alphas[t], state)
            if self.read == "after":
                ys.append(self.retrieve_memories(qs[t], state))  # M_t: the state after this chunk
        return ys, state

    @staticmethod
    def retrieve_memories(q: torch.Tensor, state: MemoryState) -> torch.Tensor:
        """y = N(q; M) (Eq. 9) for one chunk's queries q (b, h, C, d)."""
        return mlp_forward(q, state.weights)[0]

    def store_memories(
        self,
        t: int,
        k: torch.Tensor,
        v: torch.Tensor,
        theta: torch.Tensor,
        eta_t: torch.Tensor | None,
        alpha_t: torch.Tensor | None,
        state: MemoryState,
    ) -> MemoryState:
        """The test-time update of chunk ``t`` (k, v (b, h, C, d), theta (b, h, C); the chunk's eta_t, alpha_t
        (b, h, 1, 1) or None): its surprise against M_{t-1} (Eq. 8) into S_t (Eq. 11) and M_t (Eq. 10)."""
        if self.record is None:
            if self.kernel is not None:  # memory_kernel.py: two launches, two more in the backward
                return MemoryState(*self.kernel(k, v, theta, eta_t, alpha_t, state.weights, state.momentum))
            update = self.update_memory if self.glue is None else self.glue[1]
            return MemoryState(*update(k, v, theta, eta_t, alpha_t, state.weights, state.momentum))
        grads, steps, momentum = self._steps(k, v, theta, eta_t, state.weights, state.momentum)
        self._record(t, grads, steps, theta, eta_t, alpha_t)
        return MemoryState(_decay(state.weights, steps, alpha_t), momentum)

    def update_memory(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        theta: torch.Tensor,
        eta_t: torch.Tensor | None,
        alpha_t: torch.Tensor | None,
        weights: list[torch.Tensor],
        momentum: list[torch.Tensor] | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """M_t and S_t from one chunk (eta_t, alpha_t (b, h, 1, 1) or None): tensors in, tensors out, the
        region ``compile_glue`` compiles (one graph, reused by every chunk)."""
        _, steps, momentum = self._steps(k, v, theta, eta_t, weights, momentum)
        return _decay(weights, steps, alpha_t), momentum

    def _steps(self, k, v, theta, eta_t, weights, momentum):
        """(-theta grad, the step added to the decayed M_{t-1}, S_t) of one chunk."""
        grads = surprise(k, v, theta, weights)  # -theta grad (Eq. 1's step)
        steps = grads
        if momentum is not None:  # Eqs. 3, 5, 11: S_t = eta_t S_{t-1} - theta grad
            momentum = [torch.addcmul(u, eta_t, m) for m, u in zip(momentum, grads)]
            steps = momentum
        if self.update == "newton_schulz":  # Eq. 10, its step bounded below the floor (step_floors)
            floors = step_floors(weights, theta, self.step_floor) if self.step_floor else None
            steps = newton_schulz_all(steps, self.ns_steps, floors=floors)
        return grads, steps, momentum

    def compile_glue(self, **options) -> None:
        """``torch.compile`` the memory's input projections and gates (:meth:`project`) and one chunk's update
        (:meth:`update_memory`) as regions of their own (``train.compile: glue``): the surprise, momentum,
        Newton-Schulz and decay of a chunk fused, and the normalisation, gates and casts around the projections'
        GEMMs, where eager mode launches a kernel per operation (``docs/benchmarks.md``: Mela)."""
        self.glue = (torch.compile(self.project, **options), torch.compile(self.update_memory, **options))

    def use_memory_kernel(self) -> None:
        """Run each chunk update as the fused Triton kernels of ``memory_kernel.py`` (``train.memory_kernel:
        triton``): two launches, and where autograd records two more in the backward
        (``memory_kernel_backward.py``), which gives the outer parameters the gradients :meth:`update_memory`'s
        backward gives them."""
        from recursive_lightning.model.mela import memory_kernel, memory_kernel_backward  # optional

        if not memory_kernel.supported(len(self.init_weights), self.update, self.eta is not None):
            raise ValueError(f"the fused memory update computes newton_schulz at depth 2, not {self.update}")
        self.kernel = functools.partial(
            memory_kernel_backward.fused_update,
            ns_steps=self.ns_steps,
            coefficients=NS_COEFFICIENTS,
            step_floor=self.step_floor,
        )

    def _record(self, t, grads, steps, theta, eta_t, alpha_t) -> None:
        for i, (grad, step) in enumerate(zip(grads, steps)):
            self.record.append(
                {
                    "chunk": t,
                    "tensor": i,
                    "surprise_norm": grad.norm(dim=(-2, -1)).mean().item(),
                    "theta": theta.mean().item(),
                    "eta": eta_t.mean().item() if eta_t is not None else float("nan"),
                    "alpha": alpha_t.mean().item() if alpha_t is not None else 1.0,
                    "update_singular_values": torch.linalg.svdvals(step.float()).mean(dim=(0, 1)).cpu(),
                }
            )
