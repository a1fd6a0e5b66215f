"""Precision control shared by the model's hand-written kernels."""

from __future__ import annotations

import contextlib

import torch


def no_autocast(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off on ``t``'s device, so a region runs in its inputs' own dtype (autocast would turn its
    GEMMs to half precision); a no-op where the device has no autocast (the meta device of describe)."""
    device = t.device.type
    # CUDA and the CPU always have autocast: no availability query there, which dynamo (torch 2.11) cannot
    # trace; a graph break inside the ``with`` makes every call's resumed frame guard on a new context manager
    # ("L['___stack0'] got deallocated"), recompiling until dynamo gives up on the compiled memory update
    if device in ("cuda", "cpu") or torch.amp.is_autocast_available(device):
        return torch.autocast(device, enabled=False)
    return contextlib.nullcontext()


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least float32: half precision is upcast, float32 / float64 unchanged (``.float()`` would
    round the float64 reference runs to float32). Float32 and float64 are returned without a call into ATen
    (``promote_types`` is one host-side operator call per tensor: the neural memory upcasts ten a block)."""
    if t.dtype in _AT_LEAST_FLOAT32:
        return t
    return t.to(torch.promote_types(t.dtype, torch.float32))


_AT_LEAST_FLOAT32 = (torch.float32, torch.float64)
