"""Ctrl-C and SIGTERM stops raised where Python can carry them to the command.

A signal's Python handler runs in whatever frame the main thread is executing, and most handlers here raise
(``KeyboardInterrupt``, ``Terminated``, a sweep's ``Stop``). Two places cannot pass an exception on:

- a finalizer (a ``__del__``, a weakref callback such as SQLAlchemy's during garbage collection): Python prints
  "Exception ignored ..." with a traceback and drops the interrupt. :func:`unraisable_hook`, the commands'
  ``sys.unraisablehook``, raises it again as the signal it came from, from the main thread's next check;
- that hook itself, which Python calls from the finalizer: an exception raised in it is printed as
  "Exception ignored in sys.unraisablehook" and dropped too. A handler asks :func:`defer_in_hook` first, which
  re-delivers a signal that landed in the hook once the hook has returned.

One re-delivery is pending at a time: two stops that arrive together (Ctrl-C to a process group, then the sweep
command's SIGTERM to its workers) stop the command once, as the first of them. Python's own Ctrl-C handler
(``signal.default_int_handler``) raises wherever it lands; only a second Ctrl-C within microseconds of the first
can reach the hook that way.
"""

from __future__ import annotations

import _thread
import signal
import threading
import time
from types import FrameType
from typing import Any

from recursive_lightning import faults
from recursive_lightning.errors import Terminated

_pending = threading.Lock()  # held from a re-delivery's scheduling until it is made


def unraisable_hook(previous_hook: Any, unraisable: Any) -> None:
    """``sys.unraisablehook`` while a command runs (bound to the hook before it with ``functools.partial``): a
    Ctrl-C or SIGTERM stop caught in a finalizer is raised again as its signal; anything else goes to
    ``previous_hook``."""
    faults.point("unraisable_hook")  # tests: a SIGTERM that lands inside the hook
    exc = unraisable.exc_type
    if exc is not None and issubclass(exc, (KeyboardInterrupt, Terminated)):
        # 143: SIGTERM's stops (Terminated, a sweep's Stop); 130: Ctrl-C
        signum = signal.SIGTERM if getattr(exc, "EXIT_CODE", 130) == 143 else signal.SIGINT
        if callable(signal.getsignal(signum)):  # a Python handler turns it into the exception again
            raise_again_soon(signum)
            return
    previous_hook(unraisable)


def defer_in_hook(signum: int, frame: FrameType | None) -> bool:
    """True where a handler called with ``frame`` must return without raising: the signal landed inside
    :func:`unraisable_hook`, and is delivered again once the hook has returned."""
    while frame is not None:
        if frame.f_code is unraisable_hook.__code__:
            raise_again_soon(signum)
            return True
        frame = frame.f_back
    return False


def raise_again_soon(signum: int) -> None:
    """Deliver ``signum`` to the main thread's handler again, from another thread, once the finalizer and the
    hook have returned (set from inside them, it would be handled there at once and dropped again); nothing
    where a re-delivery is already pending."""
    if _pending.acquire(blocking=False):
        _thread.start_new_thread(_interrupt_main_soon, (signum,))


def _interrupt_main_soon(signum: int) -> None:
    try:
        time.sleep(0.01)  # the main thread leaves the finalizer and the hook in microseconds
    finally:
        _pending.release()
    _thread.interrupt_main(signum)
