"""One builder for every model family: ``model.arch`` picks the class."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.mela.model import MelaLM
from recursive_lightning.model.recursive.model import RecursiveLM


def build_model(cfg: ModelConfig) -> nn.Module:
    """``RecursiveLM`` (vanilla / Transformer++, looped, multi-resolution) or ``MelaLM`` (``arch: mela``)."""
    if cfg.arch == "mela":
        return MelaLM(cfg)
    return RecursiveLM(cfg)


# every in-place initialiser of torch.nn.init (normal_, kaiming_uniform_, zeros_, ...)
_INITIALISERS = frozenset(
    getattr(nn.init, n) for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")
)


class _SkipInitOnMeta(TorchFunctionMode):
    """Weight initialisation draws values, which meta tensors do not hold: on the meta device an initialiser
    returns its tensor untouched (torch runs the meta kernels of ``normal_`` and friends in Python)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _INITIALISERS:
            tensor = args[0] if args else kwargs.get("tensor")  # torch.overrides passes it by name
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def build_on_meta(cls: type[nn.Module], cfg: ModelConfig) -> nn.Module:
    """``cls(cfg)`` on the meta device: shapes and structure, no weights allocated or initialised."""
    with torch.device("meta"), _SkipInitOnMeta():
        return cls(cfg)
