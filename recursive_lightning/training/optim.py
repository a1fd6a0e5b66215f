"""AdamW and the cosine schedule of MeSH App. B / SpiralFormer App. F."""

from __future__ import annotations

import math

import torch
from torch import nn

from recursive_lightning.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; no decay for biases, norms, routers' biases and scalar coefficients."""
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def cosine_with_warmup(
    step: int, total: int, warmup_ratio: float, min_ratio: float, warmup_steps: int | None = None
) -> float:
    """Multiplier of the peak LR: linear warm-up over ``warmup_steps`` (Mela: 500) or else warmup_ratio * total
    (MeSH: 1%), cosine to min_ratio at total."""
    if warmup_steps is not None:
        warmup = warmup_steps
    else:
        warmup = max(1, round(warmup_ratio * total)) if warmup_ratio > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(
    model: nn.Module, cfg: TrainConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    opt = torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=1e-8,
        fused=False,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: cosine_with_warmup(s, cfg.max_steps, cfg.warmup_ratio, cfg.min_lr_ratio, cfg.warmup_steps),
    )
    return opt, sched
