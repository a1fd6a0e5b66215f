"""Named fault points for the fault-injection tests; a no-op unless a test sets the environment variable.

``RECURSIVE_LIGHTNING_FAULT=NAME[:N[:hang]]`` makes the process SIGKILL itself the N-th time (default the
first) it reaches :func:`point` ``(NAME)``: the same as a ``kill -9`` at exactly that instant, with no cleanup,
no ``finally`` and no atexit. With ``hang`` it stops there instead (sleeps until killed), to stand for a
process that is still at work. With ``barrier=K`` it waits there until K processes (this one included) have
reached the point, each leaving a file in ``RECURSIVE_LIGHTNING_FAULT_DIR``: it shows that K processes are
there at the same instant (e.g. two trials holding their devices), with no timing guessed. Only tests set it;
nothing else reads it.
"""

from __future__ import annotations

import os
import signal
import time

ENV = "RECURSIVE_LIGHTNING_FAULT"
_seen: dict[str, int] = {}


def active() -> bool:
    return bool(os.environ.get(ENV))


def point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, rest = spec.partition(":")
    if target != name:
        return
    nth, _, mode = rest.partition(":")
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] != int(nth or 1):
        return
    if mode.startswith("barrier="):
        folder = os.environ["RECURSIVE_LIGHTNING_FAULT_DIR"]
        open(os.path.join(folder, f"{name}.{os.getpid()}"), "w").close()
        while sum(f.startswith(f"{name}.") for f in os.listdir(folder)) < int(mode.split("=")[1]):
            time.sleep(0.05)
        return
    if mode == "hang":
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)
