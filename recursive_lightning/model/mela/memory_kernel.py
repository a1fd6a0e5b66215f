"""One chunk's memory update (Eqs. 8, 10, 11 with the step floor) as two fused Triton kernels
(``train.memory_kernel: triton``); its backward is ``memory_kernel_backward.py``.

    store_surprise:   Z = K W_1,  Y = GELU(Z) W_2,  D = 2 theta (V - Y)                   (Eq. 8's backward)
                      S_2 = eta S_2 + GELU(Z)^T D,  S_1 = eta S_1 + K^T (GELU'(Z) * D W_2^T)  (Eq. 11)
    orthogonal_step:  X = S / (||S|| + eps);  5 x { A = X X^T;  X = a X + (b A + c A A) X }   (Eq. 10, NS-5)
                      M = alpha M + min(1, ||S|| / tau) X,  tau = floor * sum theta * ||M||    (step_floors)

The PyTorch path runs this as about 25 kernels a chunk (five GEMMs for the surprise, fifteen for Newton-Schulz,
the element-wise work between them); here it is two launches, one program per (sequence, head) for the surprise
and one per (memory tensor, sequence, head) for the orthogonal step, each looping over square tiles of its
matrices (32 or 64 wide, :data:`CONFIGS`) in global memory (an L2-resident scratch) with a barrier between
dependent phases. A memory head's state at mela-400m (W_1, W_2 and their momenta, 192 x 384 each in float32) is
576 KB, above an SM's shared memory, so the tiles stream rather than stay resident.

Only Mela's preset update runs here: a 2-layer memory MLP with momentum, forgetting and Newton-Schulz
(``memory_update: newton_schulz``, ``memory_depth: 2``); anything else keeps the PyTorch path
(``neural_memory.py``). An update without gradients (the HLR cycles before the last, validation) launches the
two kernels alone; one with gradients (the last cycle in training) keeps their scratch for the backward's two
kernels (``memory_kernel_backward.FusedUpdate``). Float32 operands multiply in TF32 where torch's float32 matmul precision is
not ``highest`` (as the PyTorch path's GEMMs do), float64 in full precision. Tested against the PyTorch path in
float64 under ``TRITON_INTERPRET=1`` on the CPU (``tests/model/test_memory_kernel.py``) and on CUDA
(``tests/test_cuda.py``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# the tile side (tl.dot needs >= 16) and warps per program: on a GPU the fastest of these for an update's (C, D, E)
# is timed on its first launch (Triton's autotuner); the first alone under Triton's interpreter
CONFIGS = (
    triton.Config({"BLK": 32}, num_warps=4),
    triton.Config({"BLK": 64}, num_warps=8),
)
SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)


@triton.jit
def _load(ptr, rows, cols, s_r, s_c, n_r, n_c):
    """The (rows, cols) tile of a matrix with strides (s_r, s_c) and n_r x n_c elements, zeros outside."""
    mask = (rows[:, None] < n_r) & (cols[None, :] < n_c)
    return tl.load(
        ptr + rows[:, None] * s_r + cols[None, :] * s_c, mask=mask, other=0.0, cache_modifier=".cg"
    )


@triton.jit
def _store(ptr, rows, cols, s_r, s_c, n_r, n_c, value):
    mask = (rows[:, None] < n_r) & (cols[None, :] < n_c)
    tl.store(ptr + rows[:, None] * s_r + cols[None, :] * s_c, value, mask=mask)


@triton.jit
def _gelu(z):
    return 0.5 * z * (1.0 + tl.math.erf(z * SQRT_HALF))


@triton.jit
def _gelu_grad(z):
    """d GELU / dz, exact (aten's gelu_backward with approximate='none')."""
    return 0.5 * (1.0 + tl.math.erf(z * SQRT_HALF)) + z * INV_SQRT_2PI * tl.exp(-0.5 * z * z)


@triton.jit
def store_surprise_kernel(
    k_ptr, v_ptr, theta_ptr, eta_ptr, w1_ptr, w2_ptr, s1_ptr, s2_ptr, out_ptr, z_ptr, g_ptr, d_ptr, r_ptr,
    sk_b, sk_h, sk_r, sk_c, sv_b, sv_h, sv_r, sv_c, st_b, st_h, st_c, se_b, se_h,
    sw1_b, sw1_h, sw1_r, sw1_c, sw2_b, sw2_h, sw2_r, sw2_c,
    ss1_b, ss1_h, ss1_r, ss1_c, ss2_b, ss2_h, ss2_r, ss2_c,
    H, C, D, E, BH,
    SAVE: tl.constexpr, BLK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """S_1, S_2 of one (sequence, head) into out[0], out[1] (both D x E: S_2 transposed), through the scratch
    Z = K W_1 (z), GELU'(Z) * D W_2^T (g), both C x E, and D = 2 theta (V - Y) (d, C x D); with ``SAVE`` also
    R = V - Y (r, C x D), which the backward (``memory_kernel_backward.py``) reads with z, g and d."""
    pid = tl.program_id(0)
    b, h = pid // H, pid % H
    k_ptr += b * sk_b + h * sk_h
    v_ptr += b * sv_b + h * sv_h
    theta_ptr += b * st_b + h * st_h
    w1_ptr += b * sw1_b + h * sw1_h
    w2_ptr += b * sw2_b + h * sw2_h
    s1_ptr += b * ss1_b + h * ss1_h
    s2_ptr += b * ss2_b + h * ss2_h
    eta = tl.load(eta_ptr + b * se_b + h * se_h)
    z_ptr += pid * C * E
    g_ptr += pid * C * E
    d_ptr += pid * C * D
    r_ptr += pid * C * D
    r = tl.arange(0, BLK)
    for c0 in range(0, C, BLK):  # Z = K W_1
        for e0 in range(0, E, BLK):
            acc = tl.zeros((BLK, BLK), dtype=z_ptr.dtype.element_ty)
            for k0 in range(0, D, BLK):
                x = _load(k_ptr, c0 + r, k0 + r, sk_r, sk_c, C, D)
                w = _load(w1_ptr, k0 + r, e0 + r, sw1_r, sw1_c, D, E)
                acc += tl.dot(x, w, input_precision=PRECISION)
            _store(z_ptr, c0 + r, e0 + r, E, 1, C, E, acc)
    tl.debug_barrier()
    for c0 in range(0, C, BLK):  # D = 2 theta (V - GELU(Z) W_2)  (Eq. 8: minus its gradient in Y)
        theta = tl.load(theta_ptr + (c0 + r) * st_c, mask=c0 + r < C, other=0.0)
        for n0 in range(0, D, BLK):
            acc = tl.zeros((BLK, BLK), dtype=z_ptr.dtype.element_ty)
            for e0 in range(0, E, BLK):
                a = _gelu(_load(z_ptr, c0 + r, e0 + r, E, 1, C, E))
                w = _load(w2_ptr, e0 + r, n0 + r, sw2_r, sw2_c, E, D)
                acc += tl.dot(a, w, input_precision=PRECISION)
            v = _load(v_ptr, c0 + r, n0 + r, sv_r, sv_c, C, D)
            _store(d_ptr, c0 + r, n0 + r, D, 1, C, D, 2.0 * theta[:, None] * (v - acc))
            if SAVE:
                _store(r_ptr, c0 + r, n0 + r, D, 1, C, D, v - acc)
    tl.debug_barrier()
    for e0 in range(0, E, BLK):
        for n0 in range(0, D, BLK):  # S_2 = eta S_2 + GELU(Z)^T D, stored transposed (D x E)
            acc = tl.zeros((BLK, BLK), dtype=z_ptr.dtype.element_ty)
            for c0 in range(0, C, BLK):
                a = _gelu(_load(z_ptr, c0 + r, e0 + r, E, 1, C, E))
                dl = _load(d_ptr, c0 + r, n0 + r, D, 1, C, D)
                acc += tl.dot(tl.trans(a), dl, input_precision=PRECISION)
            s = _load(s2_ptr, e0 + r, n0 + r, ss2_r, ss2_c, E, D)
            _store(out_ptr + BH * D * E + pid * D * E, e0 + r, n0 + r, 1, E, E, D, eta * s + acc)
        for c0 in range(0, C, BLK):  # GELU'(Z) * D W_2^T, the gradient reaching W_1's output
            acc = tl.zeros((BLK, BLK), dtype=z_ptr.dtype.element_ty)
            for n0 in range(0, D, BLK):
                dl = _load(d_ptr, c0 + r, n0 + r, D, 1, C, D)
                w = _load(w2_ptr, e0 + r, n0 + r, sw2_r, sw2_c, E, D)
                acc += tl.dot(dl, tl.trans(w), input_precision=PRECISION)
            z = _load(z_ptr, c0 + r, e0 + r, E, 1, C, E)
            _store(g_ptr, c0 + r, e0 + r, E, 1, C, E, _gelu_grad(z) * acc)
    tl.debug_barrier()
    for k0 in range(0, D, BLK):  # S_1 = eta S_1 + K^T (GELU'(Z) * D W_2^T)
        for e0 in range(0, E, BLK):
            acc = tl.zeros((BLK, BLK), dtype=z_ptr.dtype.element_ty)
            for c0 in range(0, C, BLK):
                x = _load(k_ptr, c0 + r, k0 + r, sk_r, sk_c, C, D)
                g = _load(g_ptr, c0 + r, e0 + r, E, 1, C, E)
                acc += tl.dot(tl.trans(x), g, input_precision=PRECISION)
            s = _load(s1_ptr, k0 + r, e0 + r, ss1_r, ss1_c, D, E)
            _store(out_ptr + pid * D * E, k0 + r, e0 + r, E, 1, D, E, eta * s + acc)


@triton.jit
def _frobenius(ptr, s_r, s_c, R, K, BLK: tl.constexpr):
    r = tl.arange(0, BLK)
    total = tl.zeros((BLK, BLK), dtype=ptr.dtype.element_ty)
    for i0 in range(0, R, BLK):
        for j0 in range(0, K, BLK):
            x = _load(ptr, i0 + r, j0 + r, s_r, s_c, R, K)
            total += x * x
    return tl.sqrt(tl.sum(tl.sum(total, axis=1), axis=0))


@triton.jit
def _iteration(xi_ptr, xo_ptr, ai_ptr, bi_ptr, D, E, NS_A: tl.constexpr, NS_B: tl.constexpr, NS_C: tl.constexpr,
               BLK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """One Newton-Schulz iterate: X (xi) to X' = a X + (b A + c A A) X (xo), A = X X^T (ai) and B (bi), D x D."""
    r = tl.arange(0, BLK)
    for i0 in range(0, D, BLK):  # A = X X^T
        for j0 in range(0, D, BLK):
            acc = tl.zeros((BLK, BLK), dtype=xi_ptr.dtype.element_ty)
            for k0 in range(0, E, BLK):
                xi = _load(xi_ptr, i0 + r, k0 + r, E, 1, D, E)
                xj = _load(xi_ptr, j0 + r, k0 + r, E, 1, D, E)
                acc += tl.dot(xi, tl.trans(xj), input_precision=PRECISION)
            _store(ai_ptr, i0 + r, j0 + r, D, 1, D, D, acc)
    tl.debug_barrier()
    for i0 in range(0, D, BLK):  # B = b A + c A A
        for j0 in range(0, D, BLK):
            acc = NS_B * _load(ai_ptr, i0 + r, j0 + r, D, 1, D, D)
            for k0 in range(0, D, BLK):
                ai = _load(ai_ptr, i0 + r, k0 + r, D, 1, D, D)
                aj = _load(ai_ptr, k0 + r, j0 + r, D, 1, D, D)
                acc += NS_C * tl.dot(ai, aj, input_precision=PRECISION)
            _store(bi_ptr, i0 + r, j0 + r, D, 1, D, D, acc)
    tl.debug_barrier()
    for i0 in range(0, D, BLK):  # X' = a X + B X
        for j0 in range(0, E, BLK):
            acc = NS_A * _load(xi_ptr, i0 + r, j0 + r, E, 1, D, E)
            for k0 in range(0, D, BLK):
                bb = _load(bi_ptr, i0 + r, k0 + r, D, 1, D, D)
                xx = _load(xi_ptr, k0 + r, j0 + r, E, 1, D, E)
                acc += tl.dot(bb, xx, input_precision=PRECISION)
            _store(xo_ptr, i0 + r, j0 + r, E, 1, D, E, acc)
    tl.debug_barrier()


@triton.jit
def orthogonal_step_kernel(
    s_ptr, w1_ptr, w2_ptr, theta_ptr, alpha_ptr, out_ptr, x_ptr, a_ptr, b_ptr,
    sw1_b, sw1_h, sw1_r, sw1_c, sw2_b, sw2_h, sw2_r, sw2_c, st_b, st_h, st_c, sa_b, sa_h,
    H, C, D, E, BH,
    FLOOR: tl.constexpr, EPS: tl.constexpr, TINY: tl.constexpr, STEPS: tl.constexpr,
    NS_A: tl.constexpr, NS_B: tl.constexpr, NS_C: tl.constexpr, SAVE: tl.constexpr, BLK: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """M = alpha M + min(1, ||S|| / max(tau, TINY)) NewtonSchulz(S) for memory tensor ``pid // BH`` (0: W_1,
    1: W_2 in its D x E transpose) of one (sequence, head); S is s[pid], D x E. Iterate i reads X_i from slot
    i of x and writes X_{i+1}, A_i and B_i = b A_i + c A_i A_i (D x D) to slots of x, a and b: two slots of x
    and one of a and b, which ping-pong, or with ``SAVE`` STEPS + 1 and STEPS, every iterate kept for the
    backward. The floor, eps and TINY are compile-time constants, so they enter the arithmetic in the tensors'
    dtype: a launch passes a Python float argument as fp32, which would round a float64 update's floor and eps."""
    pid = tl.program_id(0)
    bh = pid % BH
    b, h = bh // H, bh % H
    first = pid < BH  # selects, not branches: a stride of 1 is a compile-time constant on one side only
    w_ptr = tl.where(first, w1_ptr + b * sw1_b + h * sw1_h, w2_ptr + b * sw2_b + h * sw2_h)
    sw_r = tl.where(first, sw1_r, sw2_c)
    sw_c = tl.where(first, sw1_c, sw2_r)
    XSLOTS = STEPS + 1 if SAVE else 2
    ASLOTS = STEPS if SAVE else 1
    s_ptr += pid * D * E
    x_ptr += pid * XSLOTS * D * E
    a_ptr += pid * ASLOTS * D * D
    b_ptr += pid * ASLOTS * D * D
    out_ptr += pid * D * E
    r = tl.arange(0, BLK)
    norm = _frobenius(s_ptr, E, 1, D, E, BLK)
    for i0 in range(0, D, BLK):
        for j0 in range(0, E, BLK):
            s = _load(s_ptr, i0 + r, j0 + r, E, 1, D, E)
            _store(x_ptr, i0 + r, j0 + r, E, 1, D, E, s / (norm + EPS))
    tl.debug_barrier()
    for i in range(STEPS):  # a loop, not unrolled: a fifth of the code to compile
        _iteration(
            x_ptr + (i % XSLOTS) * D * E, x_ptr + ((i + 1) % XSLOTS) * D * E, a_ptr + (i % ASLOTS) * D * D,
            b_ptr + (i % ASLOTS) * D * D, D, E, NS_A, NS_B, NS_C, BLK, PRECISION,
        )  # fmt: skip
    scale = 1.0
    if FLOOR > 0:  # the bounded step (neural_memory.step_floors)
        theta = tl.zeros((BLK,), dtype=theta_ptr.dtype.element_ty)
        for c0 in range(0, C, BLK):
            theta += tl.load(theta_ptr + b * st_b + h * st_h + (c0 + r) * st_c, mask=c0 + r < C, other=0.0)
        tau = FLOOR * tl.sum(theta, axis=0) * _frobenius(w_ptr, sw_r, sw_c, D, E, BLK)
        scale = tl.minimum(norm / tl.maximum(tau, TINY), 1.0)
    alpha = tl.load(alpha_ptr + b * sa_b + h * sa_h)
    for i0 in range(0, D, BLK):  # M_t = alpha_t M_{t-1} + step  (Eq. 10)
        for j0 in range(0, E, BLK):
            w = _load(w_ptr, i0 + r, j0 + r, sw_r, sw_c, D, E)
            x = _load(x_ptr + (STEPS % XSLOTS) * D * E, i0 + r, j0 + r, E, 1, D, E)
            _store(out_ptr, i0 + r, j0 + r, E, 1, D, E, alpha * w + scale * x)


def _tuned(kernel, configs: tuple = CONFIGS):
    """``kernel`` tuned over ``configs`` once per shape (C, D, E) and, for the forward kernels, per ``SAVE``
    (keeping the backward's scratch adds stores, which may favour another tile)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # read with triton.jit's, at import
    key = [name for name in ("C", "D", "E", "SAVE") if name in kernel.arg_names]
    return triton.autotune(list(configs[:1] if interpreted else configs), key=key)(kernel)


store_surprise = _tuned(store_surprise_kernel)
orthogonal_step = _tuned(orthogonal_step_kernel)


def supported(depth: int, update: str, has_momentum: bool) -> bool:
    """Whether :func:`fused_update_memory` computes this memory's update."""
    return depth == 2 and update == "newton_schulz" and has_momentum


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def fused_update_memory(
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    eta_t: torch.Tensor,
    alpha_t: torch.Tensor,
    weights: list[torch.Tensor],
    momentum: list[torch.Tensor],
    *,
    ns_steps: int,
    coefficients: tuple[float, float, float],
    step_floor: float,
    eps: float = 1e-7,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``NeuralMemory.update_memory`` of one chunk, without autograd: k, v (b, h, C, d), theta (b, h, C), eta_t
    and alpha_t (b, h, 1, 1), weights and momentum [W_1 (b, h, d, e), W_2 (b, h, e, d)] in one dtype (float32
    or float64, any strides); Newton-Schulz's ``coefficients`` (a, b, c). Returns M_t and S_t, W_2's and S_2's
    as transposed views of d x e buffers."""
    new_weights, new_momentum, _ = launch_update(
        k, v, theta, eta_t, alpha_t, weights, momentum, ns_steps, coefficients, step_floor, eps, save=False
    )
    return (
        [new_weights[0], new_weights[1].transpose(-2, -1)],
        [new_momentum[0], new_momentum[1].transpose(-2, -1)],
    )


def matmul_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: full for float64 and under torch's ``highest``, else TF32."""
    if dtype == torch.float64 or torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def launch_update(
    k: torch.Tensor,
    v: torch.Tensor,
    theta: torch.Tensor,
    eta_t: torch.Tensor,
    alpha_t: torch.Tensor,
    weights: list[torch.Tensor],
    momentum: list[torch.Tensor],
    ns_steps: int,
    coefficients: tuple[float, float, float],
    step_floor: float,
    eps: float,
    save: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The two launches of one chunk's update: M_t and S_t as (2, b, h, d, e) buffers (W_2's and S_2's
    transposed) and the scratch, which with ``save`` keeps what the backward reads: z, g, d, r (b h, C, .) and
    every Newton-Schulz iterate (x: 2 b h, steps + 1, d, e; a and b: 2 b h, steps, d, d)."""
    B, H, C, D = k.shape
    E = weights[0].shape[-1]
    dtype, device = k.dtype, k.device
    precision = matmul_precision(dtype)
    BH = B * H

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    scratch = {"z": empty(BH, C, E), "g": empty(BH, C, E), "d": empty(BH, C, D)}
    scratch["r"] = empty(BH, C, D) if save else scratch["d"]  # written only with SAVE
    new_momentum = empty(2, B, H, D, E)
    w1, w2 = weights
    s1, s2 = momentum
    store_surprise[(BH,)](
        k, v, theta, eta_t, w1, w2, s1, s2, new_momentum, scratch["z"], scratch["g"], scratch["d"], scratch["r"],
        *_strides(k), *_strides(v), *_strides(theta), *_strides(eta_t)[:2],
        *_strides(w1), *_strides(w2), *_strides(s1), *_strides(s2),
        H, C, D, E, BH, SAVE=save, PRECISION=precision,
    )  # fmt: skip
    new_weights = empty(2, B, H, D, E)
    scratch["x"] = empty(2 * BH, ns_steps + 1 if save else 2, D, E)
    scratch["a"], scratch["b"] = (empty(2 * BH, ns_steps if save else 1, D, D) for _ in range(2))
    ns_a, ns_b, ns_c = coefficients
    orthogonal_step[(2 * BH,)](
        new_momentum, w1, w2, theta, alpha_t, new_weights, scratch["x"], scratch["a"], scratch["b"],
        *_strides(w1), *_strides(w2), *_strides(theta), *_strides(alpha_t)[:2],
        H, C, D, E, BH, FLOOR=float(step_floor), EPS=float(eps), TINY=torch.finfo(dtype).tiny,
        STEPS=ns_steps, NS_A=ns_a, NS_B=ns_b, NS_C=ns_c, SAVE=save, PRECISION=precision,
    )  # fmt: skip
    return new_weights, new_momentum, scratch
