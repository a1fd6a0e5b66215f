"""Precision control shared by the model's hand-written kernels."""

from __future__ import annotations

import contextlib

import torch


def no_autocast(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off on ``t``'s device, so a region runs in its inputs' own dtype (autocast would turn its
    GEMMs to half precision); a no-op where the device has no autocast (the meta device of describe)."""
    device = t.device.type
    return (
        torch.autocast(device, enabled=False)
        if torch.amp.is_autocast_available(device)
        else contextlib.nullcontext()
    )


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least float32: half precision is upcast, float32 / float64 unchanged (``.float()`` would
    round the float64 reference runs to float32)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
