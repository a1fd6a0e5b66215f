"""Named fault points for the fault-injection tests; a no-op unless a test sets the environment variable.

``RECURSIVE_LIGHTNING_FAULT=NAME[:N[:hang]]`` makes the process SIGKILL itself the N-th time (default the
first) it reaches :func:`point` ``(NAME)``: the same as a ``kill -9`` at exactly that instant, with no cleanup,
no ``finally`` and no atexit. With ``hang`` it stops there instead (sleeps until killed), to stand for a
process that is still at work. With ``barrier=K`` it waits there until K processes (this one included) have
reached the point, each leaving a file in ``RECURSIVE_LIGHTNING_FAULT_DIR``: it shows that K processes are
there at the same instant (e.g. two trials holding their devices), with no timing guessed. With ``pause`` it waits there for SIGTERM or SIGINT (handled as the process
handles them), then goes on: a scheduler's pre-emption at exactly that instant, whenever the test sends it; the
file named by ``RECURSIVE_LIGHTNING_FAULT_MARK``, if set, is created once it waits. With ``raise`` it raises
``OSError(ENOSPC)`` there: a disk that fills at exactly that instant. Only tests set them; nothing else reads
them.
"""

from __future__ import annotations

import errno
import os
import signal
import time

ENV = "RECURSIVE_LIGHTNING_FAULT"
MARK_ENV = "RECURSIVE_LIGHTNING_FAULT_MARK"
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
    if mode == "pause":
        _pause()
        return
    if mode == "raise":
        raise OSError(errno.ENOSPC, f"No space left on device (fault point {name})")
    if mode == "hang":
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)


def _pause() -> None:
    """Wait for SIGTERM / SIGINT, pass it to the handler in place (Lightning's: stop at this step), return."""
    got: list[int] = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def seen(signum, frame) -> None:
        got.append(signum)
        for s, h in previous.items():  # the process's own handlers in place, as at any other instant
            signal.signal(s, h)
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    for s in previous:
        signal.signal(s, seen)
    try:
        mark = os.environ.get(MARK_ENV)
        if mark:
            with open(mark, "w") as f:
                f.write(str(os.getpid()))
        while not got:
            time.sleep(0.05)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
