"""The backward of one chunk's fused memory update (``memory_kernel.py``) as two Triton kernels, and the
autograd Function that runs an update with gradients on the fused kernels (``train.memory_kernel: triton``).

The forward keeps what the backward reads: Z, P = GELU'(Z) * D W_2^T, D and R = V - Y of the surprise, and
every Newton-Schulz iterate X_i, A_i, B_i (as the PyTorch path's ``_NewtonSchulz`` saves them). Given the
gradients of M_t and S_t:

    orthogonal_step_backward (per memory tensor, sequence, head):
        dM_{t-1} = alpha dM_t (+ the floor's d||M|| M / ||M||),  d alpha = <dM_t, M_{t-1}>
        dX_5 = s dM_t;  ds = <dM_t, X_5> where s < 1 (d tau, d sum theta: the floor, neural_memory.step_floors)
        5 x backwards { dB = G X^T;  dA = b dB + c (dB A + A dB);  G = a G + B G + (dA + dA^T) X }
        dS_t = G / n - <G, S> S / (n^2 ||S||) + d||S|| S / ||S||,  n = ||S|| + eps
    store_surprise_backward (per sequence, head), with G_1, G_2 the total gradients of S_1, S_2:
        dS_{t-1} = eta G,  d eta = <G, S_{t-1}>
        dP = K G_1,  dK = P G_1^T + dZ W_1^T,  dH = D G_2^T + dY W_2^T,  dD = H G_2 + dE W_2
        dE = GELU'(Z) dP,  dZ = GELU''(Z) E dP + GELU'(Z) dH  (E = D W_2^T, H = GELU(Z))
        dV = 2 theta dD = -dY,  d theta_i = 2 <dD_i, R_i> (+ the floor's),  dW_1 = K^T dZ (+),
        dW_2 = dE^T D + H^T dY (+)

the surprise's second derivatives written out (the PyTorch path takes them from autograd through
``gelu_backward``). Four launches a chunk with gradients, forward and backward, where the PyTorch path runs
about 170 kernels. Tested against the PyTorch path's gradients in float64 under ``TRITON_INTERPRET=1``
(``tests/model/test_memory_kernel.py``) and on CUDA (``tests/test_cuda.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from recursive_lightning.model.mela.memory_kernel import (
    INV_SQRT_2PI,
    _frobenius,
    _gelu,
    _gelu_grad,
    _load,
    _store,
    _strides,
    _tuned,
    fused_update_memory,
    launch_update,
    matmul_precision,
)


@triton.jit
def _gelu_grad2(z):
    """d^2 GELU / dz^2 = phi(z) (2 - z^2), exact."""
    return tl.exp(-0.5 * z * z) * (2.0 - z * z) * INV_SQRT_2PI


@triton.jit
def _inner(p_ptr, sp_r, sp_c, q_ptr, sq_r, sq_c, R, K, BLK: tl.constexpr):
    """<P, Q> = sum P * Q of two R x K matrices."""
    r = tl.arange(0, BLK)
    total = tl.zeros((BLK, BLK), dtype=q_ptr.dtype.element_ty)
    for i0 in range(0, R, BLK):
        for j0 in range(0, K, BLK):
            total += _load(p_ptr, i0 + r, j0 + r, sp_r, sp_c, R, K) * _load(
                q_ptr, i0 + r, j0 + r, sq_r, sq_c, R, K
            )
    return tl.sum(tl.sum(total, axis=1), axis=0)


@triton.jit
def _floor_backward(gw_ptr, sg_r, sg_c, w_ptr, sw_r, sw_c, theta_ptr, st_c, x5_ptr, norm, C, D, E,
                    FLOOR: tl.constexpr, TINY: tl.constexpr, BLK: tl.constexpr):  # fmt: skip
    """The bounded step's terms: s = min(1, ||S|| / tau), tau = max(FLOOR sum theta ||M||, TINY)
    (neural_memory._NewtonSchulz): (s, d||S||, d sum theta, d||M|| / ||M||)."""
    r = tl.arange(0, BLK)
    theta = tl.zeros((BLK,), dtype=theta_ptr.dtype.element_ty)
    for c0 in range(0, C, BLK):
        theta += tl.load(theta_ptr + (c0 + r) * st_c, mask=c0 + r < C, other=0.0)
    rate = FLOOR * tl.sum(theta, axis=0)
    w_norm = _frobenius(w_ptr, sw_r, sw_c, D, E, BLK)
    tau = tl.maximum(rate * w_norm, TINY)
    scale = tl.minimum(norm / tau, 1.0)
    ds = tl.where(scale < 1.0, _inner(gw_ptr, sg_r, sg_c, x5_ptr, E, 1, D, E, BLK), 0.0)  # <dM_t, X_5>
    d_tau = -ds * norm / (tau * tau)  # to tau before its clamp, as _NewtonSchulz returns it
    per_w = tl.where(w_norm > 0, d_tau * rate / tl.maximum(w_norm, TINY), 0.0)
    return scale, ds / tau, FLOOR * d_tau * w_norm, per_w


@triton.jit
def _iteration_backward(gi_ptr, go_ptr, x_ptr, a_ptr, b_ptr, db_ptr, da_ptr, D, E, NS_A: tl.constexpr,
                        NS_B: tl.constexpr, NS_C: tl.constexpr, BLK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """One Newton-Schulz iterate backwards, G (gi) to G' (go), from its X, A and B; dB, dA are D x D scratch."""
    r = tl.arange(0, BLK)
    for i0 in range(0, D, BLK):  # dB = G X^T
        for j0 in range(0, D, BLK):
            acc = tl.zeros((BLK, BLK), dtype=x_ptr.dtype.element_ty)
            for k0 in range(0, E, BLK):
                gg = _load(gi_ptr, i0 + r, k0 + r, E, 1, D, E)
                xx = _load(x_ptr, j0 + r, k0 + r, E, 1, D, E)
                acc += tl.dot(gg, tl.trans(xx), input_precision=PRECISION)
            _store(db_ptr, i0 + r, j0 + r, D, 1, D, D, acc)
    tl.debug_barrier()
    for i0 in range(0, D, BLK):  # dA = b dB + c (dB A + A dB)
        for j0 in range(0, D, BLK):
            acc = NS_B * _load(db_ptr, i0 + r, j0 + r, D, 1, D, D)
            for k0 in range(0, D, BLK):
                db_a = _load(db_ptr, i0 + r, k0 + r, D, 1, D, D)
                prod = tl.dot(db_a, _load(a_ptr, k0 + r, j0 + r, D, 1, D, D), input_precision=PRECISION)
                a_db = _load(a_ptr, i0 + r, k0 + r, D, 1, D, D)
                prod += tl.dot(a_db, _load(db_ptr, k0 + r, j0 + r, D, 1, D, D), input_precision=PRECISION)
                acc += NS_C * prod
            _store(da_ptr, i0 + r, j0 + r, D, 1, D, D, acc)
    tl.debug_barrier()
    for i0 in range(0, D, BLK):  # G' = a G + B G + (dA + dA^T) X
        for j0 in range(0, E, BLK):
            acc = NS_A * _load(gi_ptr, i0 + r, j0 + r, E, 1, D, E)
            for k0 in range(0, D, BLK):
                bb = _load(b_ptr, i0 + r, k0 + r, D, 1, D, D)
                acc += tl.dot(bb, _load(gi_ptr, k0 + r, j0 + r, E, 1, D, E), input_precision=PRECISION)
                sym = _load(da_ptr, i0 + r, k0 + r, D, 1, D, D) + _load(da_ptr, i0 + r, k0 + r, 1, D, D, D)
                acc += tl.dot(sym, _load(x_ptr, k0 + r, j0 + r, E, 1, D, E), input_precision=PRECISION)
            _store(go_ptr, i0 + r, j0 + r, E, 1, D, E, acc)
    tl.debug_barrier()


@triton.jit
def orthogonal_step_backward_kernel(
    gw1_ptr, gw2_ptr, s_ptr, w1_ptr, w2_ptr, theta_ptr, alpha_ptr, x_ptr, a_ptr, b_ptr,
    gs_ptr, dw_ptr, scal_ptr, g_ptr, db_ptr, da_ptr,
    sg1_b, sg1_h, sg1_r, sg1_c, sg2_b, sg2_h, sg2_r, sg2_c,
    sw1_b, sw1_h, sw1_r, sw1_c, sw2_b, sw2_h, sw2_r, sw2_c, st_b, st_h, st_c, sa_b, sa_h,
    H, C, D, E, BH,
    FLOOR: tl.constexpr, EPS: tl.constexpr, TINY: tl.constexpr, STEPS: tl.constexpr,
    NS_A: tl.constexpr, NS_B: tl.constexpr, NS_C: tl.constexpr, BLK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """For memory tensor ``pid // BH`` of one (sequence, head) (W_2 in its D x E transpose): dS_t (gs), the
    decay's and the floor's part of dM_{t-1} (dw) and (d alpha, d sum theta) (scal), from dM_t (gw) and the
    forward's S_t (s) and iterates (x, a, b). G ping-pongs between two slots of g; dB, dA are D x D scratch."""
    pid = tl.program_id(0)
    bh = pid % BH
    b, h = bh // H, bh % H
    first = pid < BH
    w_ptr = tl.where(first, w1_ptr + b * sw1_b + h * sw1_h, w2_ptr + b * sw2_b + h * sw2_h)
    sw_r = tl.where(first, sw1_r, sw2_c)
    sw_c = tl.where(first, sw1_c, sw2_r)
    gw_ptr = tl.where(first, gw1_ptr + b * sg1_b + h * sg1_h, gw2_ptr + b * sg2_b + h * sg2_h)
    sg_r = tl.where(first, sg1_r, sg2_c)
    sg_c = tl.where(first, sg1_c, sg2_r)
    s_ptr += pid * D * E
    x_ptr += pid * (STEPS + 1) * D * E
    a_ptr += pid * STEPS * D * D
    b_ptr += pid * STEPS * D * D
    g_ptr += pid * 2 * D * E
    r = tl.arange(0, BLK)
    norm = _frobenius(s_ptr, E, 1, D, E, BLK)
    scale = 1.0
    d_norm = 0.0  # d||S_t|| from the floor
    d_theta = norm * 0.0  # d sum theta from the floor (a tensor: it is stored)
    per_w = 0.0  # d||M_{t-1}|| / ||M_{t-1}||
    if FLOOR > 0:
        scale, d_norm, d_theta, per_w = _floor_backward(
            gw_ptr, sg_r, sg_c, w_ptr, sw_r, sw_c, theta_ptr + b * st_b + h * st_h, st_c,
            x_ptr + STEPS * D * E, norm, C, D, E, FLOOR, TINY, BLK,
        )  # fmt: skip
    alpha = tl.load(alpha_ptr + b * sa_b + h * sa_h)
    d_alpha = tl.zeros((BLK, BLK), dtype=s_ptr.dtype.element_ty)
    for i0 in range(0, D, BLK):  # M_t = alpha M_{t-1} + s X_5: dX_5 into g's slot 0, dM_{t-1}'s two terms
        for j0 in range(0, E, BLK):
            gw = _load(gw_ptr, i0 + r, j0 + r, sg_r, sg_c, D, E)
            w = _load(w_ptr, i0 + r, j0 + r, sw_r, sw_c, D, E)
            d_alpha += gw * w
            _store(g_ptr, i0 + r, j0 + r, E, 1, D, E, scale * gw)
            _store(dw_ptr + pid * D * E, i0 + r, j0 + r, E, 1, D, E, alpha * gw + per_w * w)
    tl.store(scal_ptr + 2 * pid, tl.sum(tl.sum(d_alpha, axis=1), axis=0))
    tl.store(scal_ptr + 2 * pid + 1, d_theta)
    tl.debug_barrier()
    for i in range(STEPS):  # the iterates backwards
        _iteration_backward(
            g_ptr + (i % 2) * D * E, g_ptr + ((i + 1) % 2) * D * E, x_ptr + (STEPS - 1 - i) * D * E,
            a_ptr + (STEPS - 1 - i) * D * D, b_ptr + (STEPS - 1 - i) * D * D, db_ptr + pid * D * D,
            da_ptr + pid * D * D, D, E, NS_A, NS_B, NS_C, BLK, PRECISION,
        )  # fmt: skip
    g_ptr += (STEPS % 2) * D * E  # dX_0; X_0 = S / n, n = ||S|| + eps
    n = norm + EPS
    per_s = d_norm - _inner(g_ptr, E, 1, s_ptr, E, 1, D, E, BLK) / (n * n)
    inv = 1.0 / tl.maximum(norm, TINY)
    for i0 in range(0, D, BLK):
        for j0 in range(0, E, BLK):
            gg = _load(g_ptr, i0 + r, j0 + r, E, 1, D, E)
            ss = _load(s_ptr, i0 + r, j0 + r, E, 1, D, E)
            _store(gs_ptr + pid * D * E, i0 + r, j0 + r, E, 1, D, E, gg / n + per_s * inv * ss)


@triton.jit
def _total(gs_ptr, gm_ptr, rows, cols, s_r, s_c, D, E):
    """A D x E tile of S_t's total gradient: through M_t (gs, from the orthogonal step's backward) and direct
    (gm, with strides s_r, s_c)."""
    return _load(gs_ptr, rows, cols, E, 1, D, E) + _load(gm_ptr, rows, cols, s_r, s_c, D, E)


@triton.jit
def _momentum_backward(g1_ptr, g2_ptr, gm1_ptr, gm2_ptr, s1_ptr, s2_ptr, ds1_ptr, ds2_ptr, eta,
                       sm1_r, sm1_c, sm2_r, sm2_c, ss1_r, ss1_c, ss2_r, ss2_c, D, E, BLK: tl.constexpr):  # fmt: skip
    """S_t = eta S_{t-1} + g: dS_{t-1} = eta G into ds1, ds2 (S_2's E x D); returns d eta = <G, S_{t-1}>."""
    r = tl.arange(0, BLK)
    d_eta = tl.zeros((BLK, BLK), dtype=s1_ptr.dtype.element_ty)
    for k0 in range(0, D, BLK):
        for e0 in range(0, E, BLK):
            g1 = _total(g1_ptr, gm1_ptr, k0 + r, e0 + r, sm1_r, sm1_c, D, E)
            g2 = _total(g2_ptr, gm2_ptr, k0 + r, e0 + r, sm2_c, sm2_r, D, E)
            d_eta += g1 * _load(s1_ptr, k0 + r, e0 + r, ss1_r, ss1_c, D, E)
            d_eta += g2 * _load(s2_ptr, k0 + r, e0 + r, ss2_c, ss2_r, D, E)
            _store(ds1_ptr, k0 + r, e0 + r, E, 1, D, E, eta * g1)
            _store(ds2_ptr, k0 + r, e0 + r, 1, D, D, E, eta * g2)
    return tl.sum(tl.sum(d_eta, axis=1), axis=0)


@triton.jit
def _through_gelu(k_ptr, d_ptr, z_ptr, w2_ptr, g1_ptr, g2_ptr, gm1_ptr, gm2_ptr, de_ptr, dz_ptr,
                  sk_r, sk_c, sw2_r, sw2_c, sm1_r, sm1_c, sm2_r, sm2_c, C, D, E,
                  BLK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """dP = K G_1, E = D W_2^T, dH = D G_2^T: dE = GELU'(Z) dP (de) and dZ's first two terms (dz)."""
    r = tl.arange(0, BLK)
    for c0 in range(0, C, BLK):
        for e0 in range(0, E, BLK):
            dp = tl.zeros((BLK, BLK), dtype=z_ptr.dtype.element_ty)
            ee = tl.zeros((BLK, BLK), dtype=z_ptr.dtype.element_ty)
            dh = tl.zeros((BLK, BLK), dtype=z_ptr.dtype.element_ty)
            for k0 in range(0, D, BLK):
                x = _load(k_ptr, c0 + r, k0 + r, sk_r, sk_c, C, D)
                g1 = _total(g1_ptr, gm1_ptr, k0 + r, e0 + r, sm1_r, sm1_c, D, E)
                dp += tl.dot(x, g1, input_precision=PRECISION)
                dd = _load(d_ptr, c0 + r, k0 + r, D, 1, C, D)
                ee += tl.dot(dd, _load(w2_ptr, k0 + r, e0 + r, sw2_c, sw2_r, D, E), input_precision=PRECISION)
                g2 = _total(g2_ptr, gm2_ptr, k0 + r, e0 + r, sm2_c, sm2_r, D, E)
                dh += tl.dot(dd, g2, input_precision=PRECISION)
            z = _load(z_ptr, c0 + r, e0 + r, E, 1, C, E)
            slope = _gelu_grad(z)
            _store(de_ptr, c0 + r, e0 + r, E, 1, C, E, slope * dp)
            _store(dz_ptr, c0 + r, e0 + r, E, 1, C, E, _gelu_grad2(z) * ee * dp + slope * dh)


@triton.jit
def _through_residual(theta_ptr, z_ptr, p_ptr, r_ptr, w2_ptr, de_ptr, g1_ptr, g2_ptr, gm1_ptr, gm2_ptr,
                      dv_ptr, dk_ptr, dth_ptr, floor_theta, st_c, sw2_r, sw2_c, sm1_r, sm1_c, sm2_r, sm2_c,
                      C, D, E, BLK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """dD = H G_2 + dE W_2: dV = 2 theta dD (dv), d theta = 2 <dD, R> + the floor's (dth), and dK's first term
    P G_1^T (dk)."""
    r = tl.arange(0, BLK)
    for c0 in range(0, C, BLK):
        theta = tl.load(theta_ptr + (c0 + r) * st_c, mask=c0 + r < C, other=0.0)
        d_theta = tl.zeros((BLK,), dtype=z_ptr.dtype.element_ty)
        for n0 in range(0, D, BLK):
            dd = tl.zeros((BLK, BLK), dtype=z_ptr.dtype.element_ty)
            dk = tl.zeros((BLK, BLK), dtype=z_ptr.dtype.element_ty)
            for e0 in range(0, E, BLK):
                hh = _gelu(_load(z_ptr, c0 + r, e0 + r, E, 1, C, E))
                g2 = _total(g2_ptr, gm2_ptr, n0 + r, e0 + r, sm2_c, sm2_r, D, E)
                dd += tl.dot(hh, tl.trans(g2), input_precision=PRECISION)
                de = _load(de_ptr, c0 + r, e0 + r, E, 1, C, E)
                dd += tl.dot(de, _load(w2_ptr, e0 + r, n0 + r, sw2_r, sw2_c, E, D), input_precision=PRECISION)
                pp = _load(p_ptr, c0 + r, e0 + r, E, 1, C, E)
                g1 = _total(g1_ptr, gm1_ptr, n0 + r, e0 + r, sm1_r, sm1_c, D, E)
                dk += tl.dot(pp, tl.trans(g1), input_precision=PRECISION)
            d_theta += tl.sum(2.0 * dd * _load(r_ptr, c0 + r, n0 + r, D, 1, C, D), axis=1)
            _store(dv_ptr, c0 + r, n0 + r, D, 1, C, D, 2.0 * theta[:, None] * dd)
            _store(dk_ptr, c0 + r, n0 + r, D, 1, C, D, dk)
        tl.store(dth_ptr + c0 + r, d_theta + floor_theta, mask=c0 + r < C)


@triton.jit
def _second_layer(z_ptr, d_ptr, w2_ptr, de_ptr, dv_ptr, dz_ptr, dw_ptr, dw2_ptr, sw2_r, sw2_c, C, D, E,
                  BLK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Y = H W_2 with dY = -dV: dZ += GELU'(Z) dY W_2^T (dz), and dW_2 = dE^T D + H^T dY + the orthogonal step's
    part (dw, D x E) into dw2 (E x D)."""
    r = tl.arange(0, BLK)
    for c0 in range(0, C, BLK):
        for e0 in range(0, E, BLK):
            acc = tl.zeros((BLK, BLK), dtype=z_ptr.dtype.element_ty)
            for n0 in range(0, D, BLK):
                dy = -_load(dv_ptr, c0 + r, n0 + r, D, 1, C, D)
                acc += tl.dot(
                    dy, _load(w2_ptr, n0 + r, e0 + r, sw2_c, sw2_r, D, E), input_precision=PRECISION
                )
            z = _load(z_ptr, c0 + r, e0 + r, E, 1, C, E)
            dz = _load(dz_ptr, c0 + r, e0 + r, E, 1, C, E)
            _store(dz_ptr, c0 + r, e0 + r, E, 1, C, E, dz + _gelu_grad(z) * acc)
    for e0 in range(0, E, BLK):
        for n0 in range(0, D, BLK):
            acc = _load(dw_ptr, e0 + r, n0 + r, 1, E, E, D)
            for c0 in range(0, C, BLK):
                de = _load(de_ptr, c0 + r, e0 + r, E, 1, C, E)
                acc += tl.dot(
                    tl.trans(de), _load(d_ptr, c0 + r, n0 + r, D, 1, C, D), input_precision=PRECISION
                )
                hh = _gelu(_load(z_ptr, c0 + r, e0 + r, E, 1, C, E))
                dy = -_load(dv_ptr, c0 + r, n0 + r, D, 1, C, D)
                acc += tl.dot(tl.trans(hh), dy, input_precision=PRECISION)
            _store(dw2_ptr, e0 + r, n0 + r, D, 1, E, D, acc)


@triton.jit
def _first_layer(k_ptr, w1_ptr, dz_ptr, dw_ptr, dk_ptr, dw1_ptr, sk_r, sk_c, sw1_r, sw1_c, C, D, E,
                 BLK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Z = K W_1: dK += dZ W_1^T (dk), dW_1 = K^T dZ + the orthogonal step's part (dw) into dw1."""
    r = tl.arange(0, BLK)
    for c0 in range(0, C, BLK):
        for n0 in range(0, D, BLK):
            acc = _load(dk_ptr, c0 + r, n0 + r, D, 1, C, D)
            for e0 in range(0, E, BLK):
                dz = _load(dz_ptr, c0 + r, e0 + r, E, 1, C, E)
                acc += tl.dot(
                    dz, tl.trans(_load(w1_ptr, n0 + r, e0 + r, sw1_r, sw1_c, D, E)), input_precision=PRECISION
                )
            _store(dk_ptr, c0 + r, n0 + r, D, 1, C, D, acc)
    for k0 in range(0, D, BLK):
        for e0 in range(0, E, BLK):
            acc = _load(dw_ptr, k0 + r, e0 + r, E, 1, D, E)
            for c0 in range(0, C, BLK):
                x = _load(k_ptr, c0 + r, k0 + r, sk_r, sk_c, C, D)
                acc += tl.dot(
                    tl.trans(x), _load(dz_ptr, c0 + r, e0 + r, E, 1, C, E), input_precision=PRECISION
                )
            _store(dw1_ptr, k0 + r, e0 + r, E, 1, D, E, acc)


@triton.jit
def store_surprise_backward_kernel(
    k_ptr, theta_ptr, eta_ptr, w1_ptr, w2_ptr, s1_ptr, s2_ptr, gm1_ptr, gm2_ptr,
    z_ptr, p_ptr, d_ptr, r_ptr, gs_ptr, dw_ptr, scal_ptr, de_ptr, dz_ptr,
    dk_ptr, dv_ptr, dth_ptr, dw1_ptr, dw2_ptr, ds1_ptr, ds2_ptr, deta_ptr, dalpha_ptr,
    sk_b, sk_h, sk_r, sk_c, st_b, st_h, st_c, se_b, se_h,
    sw1_b, sw1_h, sw1_r, sw1_c, sw2_b, sw2_h, sw2_r, sw2_c,
    ss1_b, ss1_h, ss1_r, ss1_c, ss2_b, ss2_h, ss2_r, ss2_c,
    sm1_b, sm1_h, sm1_r, sm1_c, sm2_b, sm2_h, sm2_r, sm2_c,
    H, C, D, E, BH,
    BLK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dK, dV, d theta, dM_{t-1}, dS_{t-1}, d eta, d alpha of one (sequence, head) into contiguous outputs, from
    the gradients of S_t (gs: through M_t; gm1, gm2: direct), the orthogonal step's backward (dw, scal) and the
    forward's z, p, d, r; dE and dZ (C x E) are scratch."""
    pid = tl.program_id(0)
    b, h = pid // H, pid % H
    k_ptr += b * sk_b + h * sk_h
    w1_ptr += b * sw1_b + h * sw1_h
    w2_ptr += b * sw2_b + h * sw2_h
    gm1_ptr += b * sm1_b + h * sm1_h
    gm2_ptr += b * sm2_b + h * sm2_h
    g1_ptr = gs_ptr + pid * D * E  # S_1's gradient through M_1 (D x E)
    g2_ptr = gs_ptr + (BH + pid) * D * E  # S_2's, transposed (D x E)
    CE, CD = pid * C * E, pid * C * D
    d_eta = _momentum_backward(
        g1_ptr, g2_ptr, gm1_ptr, gm2_ptr, s1_ptr + b * ss1_b + h * ss1_h, s2_ptr + b * ss2_b + h * ss2_h,
        ds1_ptr + pid * D * E, ds2_ptr + pid * E * D, tl.load(eta_ptr + b * se_b + h * se_h),
        sm1_r, sm1_c, sm2_r, sm2_c, ss1_r, ss1_c, ss2_r, ss2_c, D, E, BLK,
    )  # fmt: skip
    tl.store(deta_ptr + pid, d_eta)
    tl.store(dalpha_ptr + pid, tl.load(scal_ptr + 2 * pid) + tl.load(scal_ptr + 2 * (BH + pid)))
    _through_gelu(
        k_ptr, d_ptr + CD, z_ptr + CE, w2_ptr, g1_ptr, g2_ptr, gm1_ptr, gm2_ptr, de_ptr + CE, dz_ptr + CE,
        sk_r, sk_c, sw2_r, sw2_c, sm1_r, sm1_c, sm2_r, sm2_c, C, D, E, BLK, PRECISION,
    )  # fmt: skip
    tl.debug_barrier()
    floor_theta = tl.load(scal_ptr + 2 * pid + 1) + tl.load(scal_ptr + 2 * (BH + pid) + 1)
    _through_residual(
        theta_ptr + b * st_b + h * st_h, z_ptr + CE, p_ptr + CE, r_ptr + CD, w2_ptr, de_ptr + CE, g1_ptr, g2_ptr,
        gm1_ptr, gm2_ptr, dv_ptr + CD, dk_ptr + CD, dth_ptr + pid * C, floor_theta, st_c, sw2_r, sw2_c,
        sm1_r, sm1_c, sm2_r, sm2_c, C, D, E, BLK, PRECISION,
    )  # fmt: skip
    tl.debug_barrier()
    _second_layer(
        z_ptr + CE, d_ptr + CD, w2_ptr, de_ptr + CE, dv_ptr + CD, dz_ptr + CE, dw_ptr + (BH + pid) * D * E,
        dw2_ptr + pid * E * D, sw2_r, sw2_c, C, D, E, BLK, PRECISION,
    )  # fmt: skip
    tl.debug_barrier()
    _first_layer(
        k_ptr, w1_ptr, dz_ptr + CE, dw_ptr + pid * D * E, dk_ptr + CD, dw1_ptr + pid * D * E,
        sk_r, sk_c, sw1_r, sw1_c, C, D, E, BLK, PRECISION,
    )  # fmt: skip


# the backward's loops stage up to six operand tiles at once: 64-wide tiles fit an SM's shared memory (227 KB) with
# two pipeline stages, not the default three (sm_90, float32: 132 and 196 KB against 212 and 324 KB)
BACKWARD_CONFIGS = (
    triton.Config({"BLK": 32}, num_warps=4),
    triton.Config({"BLK": 64}, num_warps=8, num_stages=2),
)
orthogonal_step_backward = _tuned(orthogonal_step_backward_kernel, BACKWARD_CONFIGS)
store_surprise_backward = _tuned(store_surprise_backward_kernel, BACKWARD_CONFIGS)


class FusedUpdate(torch.autograd.Function):
    """One chunk's update on the fused kernels, differentiable in k, v, theta, eta_t, alpha_t, M_{t-1} and
    S_{t-1}: two launches forward (keeping their scratch), two backward."""

    @staticmethod
    def forward(ctx, k, v, theta, eta_t, alpha_t, w1, w2, s1, s2, ns_steps, coefficients, step_floor, eps):
        new_w, new_s, scratch = launch_update(
            k,
            v,
            theta,
            eta_t,
            alpha_t,
            [w1, w2],
            [s1, s2],
            ns_steps,
            coefficients,
            step_floor,
            eps,
            save=True,
        )
        keep = [scratch[name] for name in ("z", "g", "d", "r", "x", "a", "b")]
        ctx.save_for_backward(k, theta, eta_t, alpha_t, w1, w2, s1, s2, new_s, *keep)
        ctx.constants = (ns_steps, coefficients, step_floor, eps)
        return new_w[0], new_w[1].transpose(-2, -1), new_s[0], new_s[1].transpose(-2, -1)

    @staticmethod
    @once_differentiable  # the kernels' gradients carry no graph: a second derivative is refused, not dropped
    def backward(ctx, gw1, gw2, gs1, gs2):
        k, theta, eta_t, alpha_t, w1, w2, s1, s2, new_s, z, p, d, r, x, a, bm = ctx.saved_tensors
        ns_steps, (ns_a, ns_b, ns_c), step_floor, eps = ctx.constants
        B, H, C, D = k.shape
        E = w1.shape[-1]
        BH = B * H
        precision = matmul_precision(k.dtype)

        def empty(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=k.dtype, device=k.device)

        gs, dw, g = empty(2 * BH, D, E), empty(2 * BH, D, E), empty(2 * BH, 2, D, E)
        scal, db, da = empty(2 * BH, 2), empty(2 * BH, D, D), empty(2 * BH, D, D)
        orthogonal_step_backward[(2 * BH,)](
            gw1, gw2, new_s, w1, w2, theta, alpha_t, x, a, bm, gs, dw, scal, g, db, da,
            *_strides(gw1), *_strides(gw2), *_strides(w1), *_strides(w2), *_strides(theta),
            *_strides(alpha_t)[:2], H, C, D, E, BH, FLOOR=float(step_floor), EPS=float(eps),
            TINY=torch.finfo(k.dtype).tiny, STEPS=ns_steps, NS_A=ns_a, NS_B=ns_b, NS_C=ns_c, PRECISION=precision,
        )  # fmt: skip
        de, dz = empty(BH, C, E), empty(BH, C, E)
        dk, dv, dth = empty(B, H, C, D), empty(B, H, C, D), empty(B, H, C)
        dw1, dw2, ds1, ds2 = empty(B, H, D, E), empty(B, H, E, D), empty(B, H, D, E), empty(B, H, E, D)
        deta, dalpha = empty(B, H, 1, 1), empty(B, H, 1, 1)
        store_surprise_backward[(BH,)](
            k, theta, eta_t, w1, w2, s1, s2, gs1, gs2, z, p, d, r, gs, dw, scal, de, dz,
            dk, dv, dth, dw1, dw2, ds1, ds2, deta, dalpha,
            *_strides(k), *_strides(theta), *_strides(eta_t)[:2], *_strides(w1), *_strides(w2),
            *_strides(s1), *_strides(s2), *_strides(gs1), *_strides(gs2), H, C, D, E, BH, PRECISION=precision,
        )  # fmt: skip
        return dk, dv, dth, deta, dalpha, dw1, dw2, ds1, ds2, None, None, None, None


def fused_update(
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
    """``NeuralMemory.update_memory`` of one chunk on the fused kernels (arguments as
    ``memory_kernel.fused_update_memory``): through :class:`FusedUpdate` where autograd records, else without
    keeping the backward's scratch."""
    inputs = (k, v, theta, eta_t, alpha_t, *weights, *momentum)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return fused_update_memory(
            k, v, theta, eta_t, alpha_t, weights, momentum,
            ns_steps=ns_steps, coefficients=coefficients, step_floor=step_floor, eps=eps,
        )  # fmt: skip
    w1, w2, s1, s2 = FusedUpdate.apply(*inputs, ns_steps, coefficients, step_floor, eps)
    return [w1, w2], [s1, s2]
