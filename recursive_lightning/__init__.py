"""Recursive (looped) transformer language models in PyTorch Lightning: MeSH, SpiralFormer, Mela.

The public Python API (the CLI, ``python -m recursive_lightning``, wraps the same functions)::

    cfg = preset("cpu-tiny", layout="1+2R2+1", topology="mesh")   # a ModelConfig
    model = build_model(cfg)                                      # RecursiveLM or MelaLM
    result = train(RunConfig.from_dict({...}), "runs/x")          # a TrainResult (TrainOptions: resume=True, ...)
    loaded = load_checkpoint("runs/x")                            # model, run config, tokenizer
    evaluate("runs/x", ppl_sets={"heldout": "embedded:heldout"}, tasks=None)
    outcome = run_sweep("ablations/default.yaml", "runs/sweeps/default")  # a SweepOutcome

Names are imported on first use (PEP 562), so ``import recursive_lightning`` loads no torch, lightning or
mlflow: the lm-eval start-up hook imports this package in every interpreter.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a few ms at every start)
if TYPE_CHECKING:
    from typing import Any

    from recursive_lightning.api import EvalOptions, SweepOptions, SweepOutcome, evaluate, run_sweep
    from recursive_lightning.config import RunConfig
    from recursive_lightning.model.build import build_model
    from recursive_lightning.model.config import ModelConfig, preset
    from recursive_lightning.training.checkpoint import load_checkpoint
    from recursive_lightning.training.module import RecursiveLMModule
    from recursive_lightning.training.options import TrainOptions
    from recursive_lightning.training.result import TrainResult
    from recursive_lightning.training.run import train

# public name -> the module that defines it
_SOURCES = {
    "ModelConfig": "recursive_lightning.model.config",
    "preset": "recursive_lightning.model.config",
    "build_model": "recursive_lightning.model.build",
    "RecursiveLMModule": "recursive_lightning.training.module",
    "RunConfig": "recursive_lightning.config",
    "train": "recursive_lightning.training.run",
    "TrainOptions": "recursive_lightning.training.options",
    "TrainResult": "recursive_lightning.training.result",
    "SweepOptions": "recursive_lightning.api",
    "SweepOutcome": "recursive_lightning.api",
    "EvalOptions": "recursive_lightning.api",
    "run_sweep": "recursive_lightning.api",
    "evaluate": "recursive_lightning.api",
    "load_checkpoint": "recursive_lightning.training.checkpoint",
}

__all__ = [
    "EvalOptions",
    "ModelConfig",
    "RecursiveLMModule",
    "RunConfig",
    "SweepOptions",
    "SweepOutcome",
    "TrainOptions",
    "TrainResult",
    "build_model",
    "evaluate",
    "load_checkpoint",
    "preset",
    "run_sweep",
    "train",
]


def __getattr__(name: str) -> Any:
    if name not in _SOURCES:
        raise AttributeError(f"module 'recursive_lightning' has no attribute '{name}'")
    value = getattr(importlib.import_module(_SOURCES[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
