"""Child processes that do not outlive the command that started them.

A server or worker started in its own session (so that Ctrl-C in the terminal reaches only its parent, which
then stops it in order) is not reached by the terminal's hang-up or by a SIGKILL of its parent: without more,
it keeps running unattended (an ``mlflow server`` holds about 2 GB in its eleven processes). The kernel's
parent-death signal closes that window on Linux.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable


def parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux ``PR_SET_PDEATHSIG``, kept
    across ``execve``); False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def dies_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """``preexec_fn`` for :class:`subprocess.Popen`: the child gets ``sig`` when the thread that started it
    exits (SIGTERM lets a server such as ``mlflow server`` stop its own children)."""

    def arm() -> None:
        parent_death_signal(sig)

    return arm


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group ``pgid`` is left (zombies not yet reaped count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """Stop the child ``proc``, started with ``start_new_session=True``, with every process of its group: SIGTERM
    to the group, then SIGKILL to what is left after ``timeout`` seconds. Waiting for the leader is not enough:
    an ``mlflow server`` that exits leaves its uvicorn and huey workers (same group) running a minute more, and
    its job runner restarts a huey consumer that stopped."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while group_alive(pgid) and time.monotonic() < deadline:  # SIGKILLed: gone once reaped
        time.sleep(0.05)
