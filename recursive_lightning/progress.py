"""Progress of long work (eval, probe, report): tokens done, tokens/s and time left.

On a terminal it is a tqdm bar. Elsewhere (the log file of a sweep worker or a cluster job) a bar's carriage
returns make noise, so it prints one plain line at most every ``every`` seconds (30 by default) and a last
line when done; work that ends before the first line is due prints nothing. Time comes from ``clock``, so
tests drive it without sleeping.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

PLAIN_EVERY_S = 30.0


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """``update(n)`` after each piece of ``total`` units; ``close()`` (or a ``with`` block) at the end."""

    def __init__(
        self,
        label: str,
        total: int,
        unit: str = "tok",
        *,
        stream: TextIO | None = None,
        clock: Callable[[], float] | None = None,
        every: float = PLAIN_EVERY_S,
        bar: bool | None = None,
    ) -> None:
        self.label, self.total, self.unit = label, max(0, int(total)), unit
        self.stream = stream if stream is not None else sys.stderr
        self.clock, self.every = clock or time.monotonic, every  # looked up now: tests replace it
        self.done, self.lines = 0, 0
        self.start = self.last = self.clock()
        if bar is None:
            isatty = getattr(self.stream, "isatty", lambda: False)
            bar = bool(isatty()) and not os.environ.get("TQDM_DISABLE")
        self._bar: Any = None
        if bar:
            from tqdm.auto import tqdm  # heavy

            self._bar = tqdm(
                total=self.total,
                desc=label,
                unit=unit,
                unit_scale=True,
                dynamic_ncols=True,
                file=self.stream,
                leave=False,
            )

    def line(self) -> str:
        """``label: done/total unit (pct), rate unit/s, time left`` as of now."""
        elapsed = max(self.clock() - self.start, 1e-9)
        rate = self.done / elapsed
        pct = 100.0 * self.done / self.total if self.total else 100.0
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = _duration(left) if left != float("inf") else "?"
        return (
            f"{self.label}: {self.done:,}/{self.total:,} {self.unit} ({pct:.0f}%), "
            f"{rate:,.0f} {self.unit}/s, {eta} left"
        )

    def update(self, n: int) -> None:
        self.done += int(n)
        if self._bar is not None:
            self._bar.update(int(n))
            return
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            self.lines += 1
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            return
        if self.lines:  # a log that showed progress also shows the end
            elapsed = max(self.clock() - self.start, 1e-9)
            print(
                f"{self.label}: {self.done:,} {self.unit} in {_duration(elapsed)} "
                f"({self.done / elapsed:,.0f} {self.unit}/s)",
                file=self.stream,
                flush=True,
            )
            self.lines = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def tracked(items: Iterable[T], label: str, tokens: Callable[[T], int], unit: str = "tok") -> Iterator[T]:
    """``items`` with a :class:`Progress` of ``sum(tokens(item))`` units, advanced after each item's work."""
    items = list(items)
    with Progress(label, sum(tokens(x) for x in items), unit) as p:
        for x in items:
            yield x
            p.update(tokens(x))
