"""Refusing before any work: the device and example-limit checks, and undoing a refused command's files.

A bad input is refused in one sentence with exit status 2 and changes nothing on disk:
:func:`undo_on_refusal` removes what a command created in its output folder before it was refused (or stopped
before it wrote anything of value). A sweep's
late fields (its ``evaluate:`` block) are checked in ``sweep/checks.py``.
"""

from __future__ import annotations

import contextlib
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

from recursive_lightning.errors import Terminated, UserError
from recursive_lightning.run_dir import RunDir

# ``generate``: one forward pass per token (over a window that slides past the model's context); a count past
# this runs for hours on a CPU and its text is never read
MAX_NEW_TOKENS = 100_000


@contextlib.contextmanager
def undo_on_refusal(
    folder: str | Path, keep_if: str = RunDir.CHECKPOINTS, kept_on_stop_by: str | None = None
) -> Iterator[None]:
    """On a :class:`UserError` inside the block, remove what the block created in ``folder`` (the folder too if
    it did not exist), unless ``folder/keep_if`` appeared (work was done: a checkpoint is never thrown away).
    With ``kept_on_stop_by``, a stop (Ctrl-C, SIGTERM) is undone the same way while ``folder`` holds neither
    that file (e.g. the record of an MLflow run) nor ``keep_if``: nothing of value was written yet."""
    folder = Path(folder)
    existed = folder.exists()
    before = set(folder.iterdir()) if existed and folder.is_dir() else set()
    try:
        yield
    except (UserError, KeyboardInterrupt, Terminated) as e:
        if not isinstance(e, UserError) and (
            kept_on_stop_by is None or (folder / kept_on_stop_by).exists() or (folder / keep_if).exists()
        ):
            raise
        if (folder / keep_if).exists() and (folder / keep_if) not in before:
            raise
        if not existed:
            shutil.rmtree(folder, ignore_errors=True)
        elif folder.is_dir():
            for p in set(folder.iterdir()) - before:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        raise


def check_device(name: str) -> None:
    """One sentence for a device torch does not know, or CUDA asked for where there is none."""
    import torch  # heavy

    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device '{name}' is not a torch device; use cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device '{name}': this machine has no CUDA device; use --device cpu.")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(
            f"--device '{name}': this machine has {torch.cuda.device_count()} CUDA device(s); use cuda:0 to "
            f"cuda:{torch.cuda.device_count() - 1}."
        )


def check_max_new_tokens(n: int) -> None:
    """``generate --max-new-tokens``: a whole count in [1, ``MAX_NEW_TOKENS``], or one sentence naming the bound."""
    if not 1 <= n <= MAX_NEW_TOKENS:
        raise UserError(
            f"--max-new-tokens must lie in [1, {MAX_NEW_TOKENS}] (one forward pass each), not {n}; generate "
            "longer texts in several calls, each continuing the last."
        )


def is_example_limit(value: object) -> bool:
    """Whether ``value`` is an lm-eval example limit (``eval --limit``, a sweep's ``evaluate.limit``): a whole
    number of examples >= 1, or a fraction of each task between 0 and 1; no bool, infinity or NaN."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        return False
    return value < 1 or value == int(value)
