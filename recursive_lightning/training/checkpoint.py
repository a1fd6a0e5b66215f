"""Checkpoints: atomic writes, damage detection, and self-contained loading for eval/probe/generate.

A checkpoint carries the resolved run config and the tokenizer JSON (``checkpoint["recursive_lightning"]``),
so ``load_checkpoint(path)`` needs nothing else. Files are written to a temporary name and renamed,
so a killed process never leaves a half-written ``last.ckpt``; the previous periodic checkpoints stay.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from recursive_lightning import faults
from recursive_lightning import threads as thread_policy
from recursive_lightning.config import RunConfig
from recursive_lightning.errors import UserError
from recursive_lightning.files import absent, no_space_is_one_sentence
from recursive_lightning.model.build import build_model
from recursive_lightning.run_dir import RunDir, SweepDir, checkpoints_newest_first
from recursive_lightning.training import parallel

HF_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


class CheckpointError(UserError):
    """A checkpoint is missing, truncated or not one of ours."""


def save_atomic(checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """torch.save to ``<path>.tmp``, fsync, then os.replace: readers see the old or the new file, never half.

    A write that fails removes ``<path>.tmp`` (a full disk: one sentence naming the file, ``DiskFull``); Ctrl-C
    while the file is written takes effect once it is in place (inside torch.save it would surface as the zip
    writer's own error, not as an interrupt)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with _ctrl_c_after_the_write(), no_space_is_one_sentence(path):
        try:
            with open(tmp, "wb") as f:
                torch.save(
                    checkpoint, _FaultPoint(f, f"checkpoint_write_{path.stem}") if faults.active() else f
                )
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


@contextlib.contextmanager
def _ctrl_c_after_the_write() -> Iterator[None]:
    """Python's Ctrl-C (SIGINT's default handler) held back until the block ends, then raised."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    got: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if got:
        raise KeyboardInterrupt


class _FaultPoint:
    """A file whose every write passes the named fault point first (tests only: ``faults.py``)."""

    def __init__(self, f: Any, name: str) -> None:
        self.f, self.name = f, name

    def write(self, data: Any) -> int:
        faults.point(self.name)
        return self.f.write(data)

    def __getattr__(self, name: str) -> Any:  # flush, tell, ...: the file's own
        return getattr(self.f, name)


def candidates(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Checkpoints of a run, newest first: last.ckpt, then periodic step checkpoints, then best."""
    return checkpoints_newest_first(ckpt_dir)


def read_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict[str, Any]:
    """Load with ``weights_only=True``; a damaged file raises one sentence that names the file and the
    previous good checkpoint beside it."""
    path = Path(path)
    if path.is_dir() and not (path / ".metadata").is_file():  # no sharded checkpoint: an empty folder, say
        hint = _previous_good(path, _loads)
        raise CheckpointError(
            f"checkpoint '{path}' is a folder but no sharded checkpoint (no .metadata inside){hint}; move it "
            "aside, or pass a .ckpt file."
        )
    if path.is_dir():  # a sharded (distributed) checkpoint directory
        return _read_distributed(path)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint '{path}' {absent(path)}; pass the path of a .ckpt file or a run directory."
        )
    if not _zip_header(path):  # torch.save writes a zip archive; a truncated one still starts with its header
        raise CheckpointError(
            f"checkpoint '{path}' is not a checkpoint file (torch.save did not write it); pass a .ckpt file "
            "from a run's checkpoints/ folder, or the run directory."
        )
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, bad pickle, I/O error: all reported the same way
        hint = _previous_good(path, _readable)
        raise CheckpointError(
            f"checkpoint '{path}' is damaged or truncated ({type(e).__name__}){hint}."
        ) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"'{path}' is not a Lightning checkpoint (no state_dict).")
    return ckpt


def _zip_header(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            head = f.read(4)
        return head == b"PK\x03\x04" or len(head) < 4  # an empty file: damaged, reported so
    except OSError:
        return True  # unreadable: torch.load reports it as a damaged file


def _previous_good(path: Path, usable: Callable[[Path], bool]) -> str:
    """The end of a damaged checkpoint's sentence: the newest other checkpoint beside it that is ``usable``, and
    how to resume from it ("" when there is none)."""
    others = [p for p in candidates(path.parent) if p != path and usable(p)]
    if not others:
        return ""
    return f"; the previous good checkpoint is '{others[0]}' (resume with --ckpt-path {others[0]})"


def _readable(p: Path) -> bool:
    try:
        with zipfile.ZipFile(p) as z:
            return z.testzip() is None
    except Exception:
        return False


def _read_distributed(path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # heavy

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.ckpt"
        dcp_to_torch_save(path, out)
        ckpt = torch.load(out, map_location="cpu", weights_only=True)
    meta = path / "meta.pt"
    if meta.exists():
        ckpt.update(torch.load(meta, map_location="cpu", weights_only=True))
    if "state_dict" not in ckpt and "model" in ckpt:
        ckpt["state_dict"] = {
            f"model.{k}" if not k.startswith("model.") else k: v for k, v in ckpt["model"].items()
        }
    return ckpt


def latest_good(ckpt_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint that loads; damaged ones are skipped (a folder without the ``.metadata`` of a
    sharded checkpoint too)."""
    for p in candidates(ckpt_dir):
        if _loads(p):
            return p
    return None


def _loads(p: Path) -> bool:
    """Whether the checkpoint ``p`` loads: a sharded one's folder holds its ``.metadata``, a file is a whole
    zip archive."""
    return (p / ".metadata").is_file() if p.is_dir() else _readable(p)


def _no_checkpoint(path: Path) -> str:
    """The sentence for a folder with no readable checkpoint: a sweep directory names one of its trials."""
    if SweepDir.is_sweep(path):
        trials = sorted(p for p in SweepDir(path).trials.glob("*") if latest_good(RunDir(p).checkpoints))
        example = f", e.g. '{trials[0]}'" if trials else " (none has a checkpoint yet)"
        return f"'{path}' is a sweep directory; pass one of its trial run directories{example}."
    return f"no readable checkpoint under '{path}'; train first or pass a .ckpt file."


@dataclass
class Loaded:
    model: torch.nn.Module  # RecursiveLM or MelaLM
    run: RunConfig
    tokenizer: Any  # tokenizers.Tokenizer
    mlflow_run_id: str | None
    path: Path
    global_step: int


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu") -> Loaded:
    """Rebuild the model, its run config and its tokenizer from one checkpoint path (file, sharded
    directory, or a run directory whose newest good checkpoint is used)."""
    path = Path(path)
    if path.is_dir() and not (path / "meta.pt").exists() and not (path / ".metadata").exists():
        found = latest_good(RunDir(path).checkpoints) or latest_good(path)
        if found is None and any((path / f).is_file() for f in HF_WEIGHTS):  # not one of this package's runs
            raise CheckpointError(
                f"'{path}' holds Hugging Face model weights, not a run of this package"
                + (
                    ""
                    if (path / "config.json").is_file()
                    else " (and no config.json, which such a folder needs)"
                )
                + "; pass a run directory or .ckpt file of this package (train --init-from reads such a folder)."
            )
        if found is None:
            raise CheckpointError(_no_checkpoint(path))
        newest = (candidates(RunDir(path).checkpoints) or candidates(path))[0]
        if newest != found:  # say so: the results will be an older step's
            print(
                f"warning: '{newest}' is damaged or truncated; using the newest good checkpoint '{found}' instead.",
                file=sys.stderr,
                flush=True,
            )
        path = found
    ckpt = read_checkpoint(path)
    extra = ckpt.get("recursive_lightning")
    if not extra:
        raise CheckpointError(
            f"'{path}' was not written by recursive_lightning (no config/tokenizer inside)."
        )
    run = RunConfig.from_dict(extra["run"])
    model = build_model(run.model)
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    state = {
        k.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", ""): v for k, v in state.items()
    }
    model.load_state_dict(state)
    model.to(device).eval()
    loaded = Loaded(model, run, None, extra.get("mlflow_run_id"), path, int(ckpt.get("global_step", 0)))
    keep_trained_kernels(loaded, device)
    # inside a CLI command (eval, probe, generate): torch's threads for this model's width
    thread_policy.apply_for(model)
    if extra.get("tokenizer_json"):
        loaded.tokenizer = Tokenizer.from_str(extra["tokenizer_json"])
    return loaded


def keep_trained_kernels(loaded: Loaded, device: str | torch.device) -> None:
    """A Mela run trained with ``train.memory_kernel: triton`` keeps its fused memory updates where they run
    (``parallel.fused_memory_runs_on``: eval, generate and the lm-eval adapter on a GPU): the PyTorch path's
    updates in a few launches a chunk. Elsewhere, and for every other run, the model is left as built."""
    if loaded.run.train.memory_kernel == "triton" and parallel.fused_memory_runs_on(device):
        loaded.model.use_memory_kernel()


def save_model_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    run: RunConfig,
    tokenizer: Any = None,
    global_step: int = 0,
    mlflow_run_id: str | None = None,
) -> Path:
    """Write a self-contained, Lightning-compatible checkpoint of a bare model (e.g. converted Pythia weights)."""
    path = Path(path)
    ckpt = {
        "state_dict": {f"model.{k}": v.detach().cpu() for k, v in model.state_dict().items()},
        "global_step": global_step,
        "recursive_lightning": {
            "run": run.to_dict(),
            "tokenizer_json": tokenizer.to_str() if tokenizer is not None else None,
            "mlflow_run_id": mlflow_run_id,
            "val_names": ["heldout"],
            "format": 1,
        },
    }
    save_atomic(ckpt, path)
    return path
