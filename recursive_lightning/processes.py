"""Child processes that do not outlive the command that started them.

A server or worker started in its own session (so that Ctrl-C in the terminal reaches only its parent, which
then stops it in order) is not reached by the terminal's hang-up or by a SIGKILL of its parent: without more,
it keeps running unattended (an ``mlflow server`` holds about 2 GB in its eleven processes). The kernel's
parent-death signal closes that window on Linux.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable


def parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux ``PR_SET_PDEATHSIG``, kept
    across ``execve``); False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def dies_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """``preexec_fn`` for :class:`subprocess.Popen`: the child gets ``sig`` when the thread that started it
    exits (SIGTERM lets a server such as ``mlflow server`` stop its own children)."""

    def arm() -> None:
        parent_death_signal(sig)

    return arm
