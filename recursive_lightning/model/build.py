"""One builder for every model family: ``model.arch`` picks the class."""

from __future__ import annotations

from torch import nn

from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.mela.model import MelaLM
from recursive_lightning.model.recursive.model import RecursiveLM


def build_model(cfg: ModelConfig) -> nn.Module:
    """``RecursiveLM`` (vanilla / Transformer++, looped, multi-resolution) or ``MelaLM`` (``arch: mela``)."""
    if cfg.arch == "mela":
        return MelaLM(cfg)
    return RecursiveLM(cfg)
