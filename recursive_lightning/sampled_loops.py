"""``train.loops``: training with a sampled number of loop steps per optimizer step (Huginn, Geiping
et al. 2025, "Scaling up test-time compute with latent reasoning: a recurrent depth approach", Sec. 3.3).

Huginn samples the iteration count r of every training step from a log-normal Poisson distribution (as we read
its Sec. 3.3; the paper's text was not at hand to check equation numbers and wording),

    tau ~ N(log(r_bar) - sigma^2 / 2, sigma),        r ~ Poisson(e^tau) + 1,

with sigma = 1/2, and backpropagates through the last k iterations only (truncated backpropagation; the
first r - k run without gradients). Since E[e^tau] = r_bar, E[r] = r_bar + 1. Our readings:

- ``mean: M`` is the mean loop count E[r] itself, so we draw with r_bar = M - 1 (M = 1: r = 1 always).
- ``uniform: low..high``: r uniform over the whole numbers low..high, both included.
- ``backprop: k`` (None: every loop step) is Huginn's k: the last min(r, k) loop steps get gradients.
- r of optimizer step s is a pure function of (train.seed, s): every rank draws the same r (FSDP2 needs the
  same layer calls on every rank) and a resumed run draws again what the killed one drew.
- every micro-batch of one optimizer step (``train.accumulate``) runs at that step's r.

``LoopSchedule.pmf()`` is the distribution itself, to 1e-9: the expectations of ``describe`` (training FLOPs
per token) sum over it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from recursive_lightning import formatting as fmt
from recursive_lightning.errors import ConfigError

if TYPE_CHECKING:
    from recursive_lightning.model.config import ModelConfig

DISTRIBUTIONS = {  # distribution -> (required fields, optional fields with defaults)
    "poisson-lognormal": (("mean",), {"sigma": 0.5, "backprop": None}),
    "uniform": (("low", "high"), {"backprop": None}),
}
TAIL = 1e-9  # the pmf stops where the tail mass left falls below this
EXAMPLE = "e.g. train.loops: {distribution: poisson-lognormal, mean: 4, backprop: 2}"


def _int(value: Any, field: str, least: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"train.loops.{field} must be a whole number >= {least}, not {value!r}.")
    return value


def _number(value: Any, field: str, positive: bool, least: float) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < least or (positive and value <= 0):
        bound = "> 0" if positive else f">= {least:g}"
        raise ConfigError(f"train.loops.{field} must be a finite number {bound}, not {value!r}.")
    return float(value)


@dataclass(frozen=True)
class LoopSchedule:
    """The loop-count distribution of ``train.loops`` and its truncated backpropagation."""

    distribution: str
    mean: float | None = None
    sigma: float = 0.5
    low: int | None = None
    high: int | None = None
    backprop: int | None = None

    @classmethod
    def parse(cls, value: Any) -> LoopSchedule:
        """``train.loops`` as a schedule, or one sentence naming the field and the fix."""
        if isinstance(value, LoopSchedule):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"train.loops must be a mapping of fields ({EXAMPLE}), not {value!r}.")
        dist = value.get("distribution")
        if dist not in DISTRIBUTIONS:
            raise ConfigError(
                f"train.loops.distribution {dist!r} is unknown; choose {' or '.join(DISTRIBUTIONS)} ({EXAMPLE})."
            )
        required, optional = DISTRIBUTIONS[dist]
        allowed = ("distribution", *required, *optional)
        for key in value:
            if key not in allowed:
                raise ConfigError(
                    f"train.loops.{key} is not a field of the {dist} distribution; its fields are "
                    f"{', '.join(allowed)}."
                )
        for key in required:
            if value.get(key) is None:
                raise ConfigError(
                    f"train.loops.{key} is missing: the {dist} distribution needs {', '.join(required)}."
                )
        fields = {**optional, **{k: v for k, v in value.items() if k != "distribution"}}
        backprop = fields.pop("backprop")
        if backprop is not None:
            backprop = _int(backprop, "backprop", 1)
        if dist == "uniform":
            low, high = _int(fields["low"], "low", 1), _int(fields["high"], "high", 1)
            if low > high:
                raise ConfigError(
                    f"train.loops.low {low} exceeds train.loops.high {high}; give low <= high (loop counts "
                    "low..high, both included)."
                )
            return cls(dist, low=low, high=high, backprop=backprop)
        mean = _number(fields["mean"], "mean", False, 1.0)
        return cls(dist, mean=mean, sigma=_number(fields["sigma"], "sigma", True, 0.0), backprop=backprop)

    def to_dict(self) -> dict[str, Any]:
        """The ``train.loops`` mapping, every field of the distribution given."""
        if self.distribution == "uniform":
            return {"distribution": "uniform", "low": self.low, "high": self.high, "backprop": self.backprop}
        return {
            "distribution": self.distribution,
            "mean": self.mean,
            "sigma": self.sigma,
            "backprop": self.backprop,
        }

    def __str__(self) -> str:
        grads = "all loop steps" if self.backprop is None else f"the last {self.backprop} loop steps"
        if self.distribution == "uniform":
            what = f"uniform {self.low}..{self.high}"
        else:
            what = f"poisson-lognormal mean {self.mean:g} sigma {self.sigma:g}"
        return f"{what}, gradients through {grads}"

    # ------------------------------------------------------------------ drawing
    def sample(self, seed: int, step: int) -> int:
        """The loop count of optimizer step ``step`` of a run seeded ``seed``: a pure function of both."""
        rng = random.Random(f"recursive_lightning train.loops {seed} {step}")  # str seeds: SHA-512, stable
        if self.distribution == "uniform":
            return rng.randint(self.low, self.high)
        if self.mean == 1.0:
            return 1
        r_bar = self.mean - 1.0  # E[r] = r_bar + 1 = M (module docstring)
        tau = rng.gauss(math.log(r_bar) - self.sigma**2 / 2, self.sigma)  # Huginn Sec. 3.3
        return 1 + _poisson(rng, math.exp(tau))  # r ~ Poisson(e^tau) + 1

    # ------------------------------------------------------------------ the distribution
    @cached_property
    def _pmf(self) -> tuple[tuple[int, float], ...]:
        if self.distribution == "uniform":
            n = self.high - self.low + 1
            return tuple((k, 1.0 / n) for k in range(self.low, self.high + 1))
        if self.mean == 1.0:
            return ((1, 1.0),)
        return _poisson_lognormal_pmf(math.log(self.mean - 1.0) - self.sigma**2 / 2, self.sigma)

    def pmf(self) -> dict[int, float]:
        """P(r = k) for every loop count k of the support, the tail cut where its mass falls below 1e-9."""
        return dict(self._pmf)

    def expectation(self, f: Any) -> float:
        """E[f(r)] = sum over the (truncated) support of P(k) f(k)."""
        return sum(p * f(k) for k, p in self._pmf)


def _poisson(rng: random.Random, lam: float) -> int:
    """A Poisson(lam) draw by inversion; lam split into parts of at most 500 (a sum of Poissons is Poisson),
    so that e^-lam never underflows."""
    parts = max(1, math.ceil(lam / 500.0))
    total = 0
    for _ in range(parts):
        rate, u = lam / parts, rng.random()
        k, p = 0, math.exp(-lam / parts)
        cdf = p
        while u > cdf and (p > 0 or k < rate):
            k += 1
            p *= rate / k
            cdf += p
        total += k
    return total


def _poisson_lognormal_pmf(mu: float, sigma: float, nodes: int = 1601) -> tuple[tuple[int, float], ...]:
    """P(r = n + 1) = integral of N(tau; mu, sigma) Poisson(n; e^tau) dtau, by the trapezoid rule over
    mu +- 9 sigma (spectrally accurate for this smooth, Gaussian-weighted integrand); the support from 1 up
    to where the tail mass left is below :data:`TAIL`."""
    h = 18.0 * sigma / (nodes - 1)
    taus = [mu - 9.0 * sigma + i * h for i in range(nodes)]
    weights = [h * math.exp(-0.5 * ((t - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi)) for t in taus]
    top = math.exp(taus[-1])
    n_max = int(top + 12 * math.sqrt(top) + 30)
    mass = [0.0] * (n_max + 1)
    for t, w in zip(taus, weights):
        lam = math.exp(t)
        lo, hi = max(0, int(lam - 12 * math.sqrt(lam) - 12)), min(n_max, int(lam + 12 * math.sqrt(lam) + 30))
        for n in range(lo, hi + 1):  # Poisson(n; lam), in logs
            mass[n] += w * math.exp(n * t - lam - math.lgamma(n + 1))
    out, total = [], 0.0
    for n, p in enumerate(mass):
        out.append((n + 1, p))
        total += p
        if 1.0 - total < TAIL:
            break
    return tuple(out)


def parse_text(text: str, backprop: int | None = None) -> dict[str, Any]:
    """``describe --train-loops``: ``poisson-lognormal:M[:SIGMA]`` or ``uniform:LOW-HIGH`` (``backprop``
    from ``--train-backprop``) as a ``train.loops`` mapping, or one sentence naming the flag."""
    name, _, rest = text.partition(":")
    parts = rest.split(":") if name == "poisson-lognormal" else rest.split("-")
    try:
        if name == "poisson-lognormal" and 1 <= len(parts) <= 2:
            spec: dict[str, Any] = {"distribution": name, "mean": float(parts[0])}
            if len(parts) == 2:
                spec["sigma"] = float(parts[1])
        elif name == "uniform" and len(parts) == 2:
            spec = {"distribution": name, "low": int(parts[0]), "high": int(parts[1])}
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"--train-loops '{text}' is not a loop distribution; give poisson-lognormal:MEAN[:SIGMA] "
            "(e.g. poisson-lognormal:4) or uniform:LOW-HIGH (e.g. uniform:2-6)."
        ) from None
    return {**spec, "backprop": backprop}


def format_training(d: dict[str, Any]) -> str:
    """``describe``'s lines for ``train.loops`` (the keys of training/loop_flops.expected_training_flops)."""
    ratio = d["flops_train_per_token_expected"] / d["flops_train_per_token_at_trained_depth"]
    return "\n".join(
        [
            f"train.loops       {d['train_loops']} (mean {d['train_loops_mean']:.3f} loop steps)",
            f"training FLOPs    {fmt.flops(d['flops_train_per_token_expected'])} per token expected "
            "(forward at r + 2x the part with gradients)",
            f"                  {ratio:.3f}x training at the layout's K with every step differentiated "
            f"({fmt.flops(d['flops_train_per_token_at_trained_depth'])} per token)",
        ]
    )


def check_train_loops(value: Any, model: ModelConfig) -> dict[str, Any] | None:
    """``train.loops`` of a run of ``model`` in its full form (every field given), or one sentence."""
    if value is None:
        return None
    if model.arch == "mela":
        raise ConfigError(
            "train.loops does not apply to a Mela model: Mela's depth dial is its high-level cycles "
            "(model.h_cycles), and training with sampled cycles is not supported; remove train.loops."
        )
    schedule = LoopSchedule.parse(value)
    layout = model.parsed_layout
    if layout.kind in ("vanilla", "unshared"):
        has = "no loop" if layout.kind == "vanilla" else "distinct cores, each applied once,"
        raise ConfigError(
            f"train.loops needs a looped layout: model.layout '{layout.text}' has {has} and no shared core to "
            "loop; use one such as 2+4R4+2 or 4+8x{1/4,1/2,1}+4, or remove train.loops."
        )
    return schedule.to_dict()
