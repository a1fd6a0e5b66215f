"""``SweepOutcome``: how a ``run_sweep`` ended, and the line it prints for each ending (finished, failed, a
worker's part done, or the grid points left and the command that finishes them)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursive_lightning.sweep.options import SweepOptions
from recursive_lightning.sweep.ranking import summary_line
from recursive_lightning.sweep.spec import SweepSpec
from recursive_lightning.sweep.study import unfinished
from recursive_lightning.uris import MASK, STORAGE_ENV, mask_url

EXIT_FAILED = 1  # a grid point failed after its retries (the MLflow parent run ends FAILED)
EXIT_UNFINISHED = 3  # trials are left (a worker crashed, or trials run elsewhere): re-run or wait


@dataclass
class SweepOutcome:
    """How a ``run_sweep`` ended. ``status``: FINISHED (every grid point finished), FAILED (one failed after its
    retries), UNFINISHED (points left: re-run or wait), PREPARED (``prepare``), DONE (a worker's part ended:
    other live workers run the last trials); ``exit_status`` the ``sweep`` command's (0, ``EXIT_FAILED``,
    ``EXIT_UNFINISHED``). ``finished`` / ``failed``: the report's trial counts, ``best_row`` and ``best`` its
    winning row and summary line, ``report`` its ``report.md`` (all None without a report); ``unfinished``: the
    grid points still waiting or running; ``storage`` and ``tracking_uri`` with their passwords masked."""

    sweep_dir: Path
    name: str
    status: str
    exit_status: int
    storage: str
    tracking_uri: str
    finished: int | None = None
    failed: int | None = None
    best_row: str | None = None
    best: str | None = None
    report: Path | None = None
    unfinished: list[str] = field(default_factory=list)


def password_hint(storage: str) -> str:
    """Where a command shown with a masked ``--storage`` finds the password."""
    if mask_url(storage) == storage:
        return ""
    return (
        f" (the password shown as {MASK}: put the URL in {STORAGE_ENV}, or the password in PGPASSWORD or "
        "~/.pgpass)"
    )


@dataclass
class Outcomes:
    """What every ``SweepOutcome`` of one ``run_sweep`` shares, and how each ending makes one (and says it)."""

    spec: SweepSpec
    sweep_file: Path
    run_dir: Path
    storage: str
    tracking: str
    options: SweepOptions

    def made(self, status: str, exit_status: int, **more: Any) -> SweepOutcome:
        # the stores as the package shows them: a password stays out of reprs and logs
        storage, tracking = mask_url(self.storage), mask_url(self.tracking)
        return SweepOutcome(self.run_dir, self.spec.name, status, exit_status, storage, tracking, **more)

    def ended(self, status: str, crashed: int, report: dict[str, Any] | None, seconds: float) -> SweepOutcome:
        """The parent run's ``status`` said: finished, failed, or the grid points left and how to finish them."""
        name = self.spec.name
        counts = {}
        if report is not None:
            counts = {
                "finished": len(report["rows"]),
                "failed": len(report["failed"]),
                "best_row": report["best_row"],
                "best": summary_line(report),
                "report": Path(report["path"]),
            }
        if status == "FINISHED":
            print(f"[sweep {name}] finished in {seconds:.0f}s", flush=True)
            return self.made("FINISHED", 0, **counts)
        if status == "FAILED":
            print(
                f"[sweep {name}] FAILED: some grid points failed after their retries; see the report",
                file=sys.stderr,
                flush=True,
            )
            return self.made("FAILED", EXIT_FAILED, **counts)
        pending = unfinished(self.spec, self.storage)
        left = pending["waiting"] + pending["running"]
        o = self.options
        if o.attach and not crashed and pending["running"] and not pending["waiting"] and not o.max_trials:
            # a scheduler's worker is done: live workers (their heartbeats advance) run the last trials
            print(
                f"[sweep {name}] this worker is done: no grid point is waiting and live workers run "
                f"{', '.join(pending['running'])}; the worker that ends the last trial closes the sweep",
                flush=True,
            )
            return self.made("DONE", 0, unfinished=left, **counts)
        print(self._how_to_finish(crashed, left), file=sys.stderr, flush=True)
        return self.made("UNFINISHED", EXIT_UNFINISHED, unfinished=left, **counts)

    def _how_to_finish(self, crashed: int, left: list[str]) -> str:
        o, storage = self.options, self.storage
        again = (
            f"sweep {self.sweep_file} --attach --storage {mask_url(storage)}"
            if o.attach
            else f"sweep {self.sweep_file} --run-dir {self.run_dir}"
            + (f" --storage {mask_url(storage)}" if o.storage else "")
        )
        why = (
            f"a worker process exited with code {crashed}"
            if crashed
            else "trials are still waiting or running (other machines or --max-trials)"
        )
        shown = ", ".join(left[:6]) + (f" and {len(left) - 6} more" if len(left) > 6 else "")
        return (
            f"[sweep {self.spec.name}] not finished: {why}; unfinished grid point(s) {shown or '(none named)'}: run "
            f"`{again}`{password_hint(storage)} to finish them (the report is partial until then)"
        )
