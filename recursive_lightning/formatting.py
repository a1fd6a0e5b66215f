"""One printed format per quantity, used by describe, the report, eval's tables and the CLI summaries.

- FLOPs: three significant digits with an SI prefix, ``40.3 GFLOPs``, ``1.23 TFLOPs`` (never ``0.040e12``);
- parameter counts: ``1,234,567 (1.2M)``;
- perplexity: two decimals below ``PPL_BOUND`` (``2060.50``), beyond it ``3.40e+09`` (a diverged or untrained
  model's value, unreadable as a long integer), ``nan`` / ``inf`` as such;
- a loss: three decimals; an accuracy: a percentage with two decimals; wall-clock: whole seconds.
"""

from __future__ import annotations

import math

PPL_BOUND = 1e5  # perplexities from here on are printed in scientific notation

_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def _three_digits(x: float) -> str:
    """``x`` (>= 1, < 1000) with three significant digits: 1.23, 12.3, 123."""
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def flops(x: float) -> str:
    """``40.3 GFLOPs``: three significant digits and an SI prefix."""
    if not math.isfinite(x):
        return f"{x} FLOPs"
    sign, x = ("-" if x < 0 else ""), abs(x)
    for scale, prefix in _PREFIXES:
        if x >= scale * 0.9995:  # 999.96e9 would round to "1000 G": it is 1.00 T
            return f"{sign}{_three_digits(x / scale)} {prefix}FLOPs"
    return f"{sign}{x:.0f} FLOPs"


def params(n: int) -> str:
    """``1,234,567 (1.2M)``."""
    return f"{n:,} ({n / 1e6:.1f}M)"


def ppl(x: float) -> str:
    """A perplexity: ``2060.50``; ``3.40e+09`` from ``PPL_BOUND`` on; ``nan`` / ``inf``."""
    if not math.isfinite(x):
        return str(x)
    return f"{x:.2e}" if abs(x) >= PPL_BOUND else f"{x:.2f}"


def loss(x: float) -> str:
    return f"{x:.3f}"


def accuracy(x: float) -> str:
    """A fraction in [0, 1] as a percentage: ``53.20``."""
    return f"{100 * x:.2f}"


def seconds(x: float) -> str:
    return f"{x:.0f}s"


def metric(name: str, x: float) -> str:
    """A logged metric by its name: a perplexity (``.../ppl``) as :func:`ppl`, a loss as :func:`loss`, an
    accuracy (``acc``) as a fraction with four decimals, anything else with four significant digits."""
    if not isinstance(x, int | float):
        return str(x)
    last = name.rsplit("/", 1)[-1]
    if last.startswith("ppl") or last.endswith("ppl"):
        return ppl(x)
    if "loss" in last:
        return loss(x)
    if not math.isfinite(x):
        return str(x)
    if "acc" in last:
        return f"{x:.4f}"
    return f"{x:.4g}" if abs(x) >= PPL_BOUND or (x and abs(x) < 1e-3) else f"{x:.3f}"
