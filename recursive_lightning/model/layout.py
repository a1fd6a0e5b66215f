"""The layout grammar: how many layers go where and how the shared core is looped.

    24                        vanilla: 24 distinct layers, no recurrence
    4+8R2+4                   Prelude-Recurrent-Coda (MeSH App. B): 4-layer prelude, an 8-layer
                              shared core looped 2 times, 4-layer coda
    4+8+8+4                   distinct cores applied once each, topology at the block
                              boundaries (MeSH Table 8, "vanilla+mesh")
    4+8x{1/8,1/4,1/2,1}+4     multi-resolution recursion (SpiralFormer Sec. 2.2): the shared core
                              runs once per resolution r_t = 1/g_t ("×" is accepted for "x")

A layout is resolved into a list of loop *steps*; step t applies core ``core_index[t]`` at chunk
size ``chunk[t]`` (1 = full resolution). Topologies and resolution operators only ever see steps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from recursive_lightning.errors import ConfigError

_INT = re.compile(r"^\d+$")
_LOOP = re.compile(r"^(\d+)R(\d+)$")
_MULTIRES = re.compile(r"^(\d+)[x×]\{([^}]*)\}$")

EXAMPLES = "e.g. '24', '4+8R2+4', '4+8+8+4' or '4+8x{1/8,1/4,1/2,1}+4'"
# Bounds far beyond any paper's model (MeSH and SpiralFormer loop 2-8 times, Huginn's test-time recurrence goes
# to 64; the deepest LLMs have ~128 layers) that keep a mistyped count from running for hours: MeSH's buffer
# makes a step's cost grow with the steps before it, so `describe` of 1,000 MeSH steps already takes minutes.
MAX_LOOP_STEPS = 256  # loop steps of a layout, and a test-time depth (--loops, --h-cycles)
MAX_UNROLLED_LAYERS = 4096  # layers of a layout's unrolled computation graph


@dataclass(frozen=True)
class Layout:
    """A parsed layout string."""

    text: str
    prelude: int
    cores: tuple[int, ...]  # layers of each distinct core (one entry when the core is shared)
    coda: int
    core_index: tuple[int, ...]  # per loop step: which core runs
    chunk: tuple[int, ...]  # per loop step: chunk size g_t = 1 / r_t (1 = full resolution)

    @property
    def kind(self) -> str:
        if not self.core_index:
            return "vanilla"
        if len(self.cores) > 1:
            return "unshared"
        return "multires" if "x" in self.text or "×" in self.text else "looped"

    @property
    def n_loop(self) -> int:
        """Number of loop steps K (N_loop in MeSH, T in SpiralFormer)."""
        return len(self.core_index)

    @property
    def n_layers(self) -> int:
        """Distinct (parameter-holding) transformer layers."""
        return self.prelude + sum(self.cores) + self.coda

    @property
    def n_compute(self) -> int:
        """Layers of the unrolled computation graph (MeSH App. B, depth-aware init)."""
        return self.prelude + sum(self.cores[i] for i in self.core_index) + self.coda

    @property
    def resolutions(self) -> tuple[Fraction, ...]:
        return tuple(Fraction(1, g) for g in self.chunk)


def _check_size(text: str, steps: int, unrolled: int) -> None:
    """One sentence for a layout of more loop steps or unrolled layers than the bounds above (checked before
    the steps are listed: R100000000 would fill the memory)."""
    if steps > MAX_LOOP_STEPS:
        raise ConfigError(
            f"model.layout '{text}' has {steps} loop steps, more than the {MAX_LOOP_STEPS} this package runs "
            "(papers loop 2-64 times); lower the loop count, e.g. 4+8R4+4."
        )
    if unrolled > MAX_UNROLLED_LAYERS:
        raise ConfigError(
            f"model.layout '{text}' unrolls to {unrolled} layers, more than the {MAX_UNROLLED_LAYERS} this "
            "package runs; use fewer layers or loop steps, e.g. 4+8R4+4."
        )


def check_depth_bound(k: int, flag: str) -> None:
    """One sentence for a test-time depth (``flag``: ``--loops``, ``--h-cycles`` or a sweep's
    ``evaluate.loops``) beyond :data:`MAX_LOOP_STEPS`; training's sampled loop counts are not bounded here."""
    if k > MAX_LOOP_STEPS:
        example = f"e.g. {flag} 1,2,4,8" if flag.startswith("--") else f"e.g. {flag}: [1, 2, 4, 8]"
        raise ConfigError(
            f"{flag} {k} exceeds {MAX_LOOP_STEPS}, the most loop steps a test-time depth may run (papers go to "
            f"64); {example}."
        )


def _int(part: str, what: str, text: str) -> int:
    if not _INT.match(part):
        raise ConfigError(f"model.layout '{text}': the {what} '{part}' is not a whole number ({EXAMPLES}).")
    return int(part)


def _resolution(token: str, text: str) -> int:
    token = token.strip()
    try:
        r = Fraction(token)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(
            f"model.layout '{text}': resolution '{token}' is not a fraction like 1/8 ({EXAMPLES})."
        ) from None
    if r <= 0 or r > 1 or r.numerator != 1:
        raise ConfigError(
            f"model.layout '{text}': resolution '{token}' must be 1/g with a whole g >= 1 (SpiralFormer Eq. 13)."
        )
    return r.denominator


def parse_layout(text: str | int) -> Layout:
    """Parse a layout string; every mistake raises one ConfigError sentence naming ``model.layout``."""
    text = str(text).replace(" ", "")
    if not text:
        raise ConfigError(f"model.layout is empty; write a layout, {EXAMPLES}.")
    parts = text.split("+")
    if len(parts) == 1:
        if _LOOP.match(parts[0]) or _MULTIRES.match(parts[0]):
            raise ConfigError(
                f"model.layout '{text}' needs a prelude and a coda around the core: write "
                "N_pre+N_coreRN_loop+N_coda (use 0 for none), e.g. 0+8R2+0."
            )
        n = _int(parts[0], "layer count", text)
        if n < 1:
            raise ConfigError(f"model.layout '{text}' has no layers; use at least 1.")
        _check_size(text, 0, n)
        return Layout(text, n, (), 0, (), ())
    if len(parts) == 2:
        raise ConfigError(
            f"model.layout '{text}' has two blocks; a recurrent layout is prelude+core+coda, "
            f"{EXAMPLES} (use 0 for an empty prelude or coda)."
        )
    prelude = _int(parts[0], "prelude size", text)
    coda = _int(parts[-1], "coda size", text)
    middle = parts[1:-1]
    if len(middle) == 1 and (m := _LOOP.match(middle[0])):
        core, loops = int(m.group(1)), int(m.group(2))
        if loops < 1:
            raise ConfigError(
                f"model.layout '{text}': the core must loop at least once (R1 or more), not R{loops}."
            )
        if core < 1:
            raise ConfigError(f"model.layout '{text}': the shared core needs at least one layer.")
        _check_size(text, loops, prelude + core * loops + coda)
        return Layout(text, prelude, (core,), coda, (0,) * loops, (1,) * loops)
    if len(middle) == 1 and (m := _MULTIRES.match(middle[0])):
        core = int(m.group(1))
        tokens = [t for t in m.group(2).split(",")]
        if not m.group(2).strip() or any(not t.strip() for t in tokens):
            raise ConfigError(
                f"model.layout '{text}': the resolution schedule is empty or has an empty entry."
            )
        chunk = tuple(_resolution(t, text) for t in tokens)
        if core < 1:
            raise ConfigError(f"model.layout '{text}': the shared core needs at least one layer.")
        _check_size(text, len(chunk), prelude + core * len(chunk) + coda)
        return Layout(text, prelude, (core,), coda, (0,) * len(chunk), chunk)
    if len(middle) == 1 and (m := re.match(r"^(\d+)R(.*)$", middle[0])):  # a loop count that is no count
        raise ConfigError(
            f"model.layout '{text}': the loop count after R must be a whole number of at least 1, not "
            f"{m.group(2)!r}; e.g. {m.group(1)}R2."
        )
    for part in middle:
        if "R" in part or "{" in part:
            raise ConfigError(
                f"model.layout '{text}': '{part}' cannot be combined with other cores; "
                f"use one looped core, {EXAMPLES}."
            )
    cores = tuple(_int(p, "core size", text) for p in middle)
    if any(c < 1 for c in cores):
        raise ConfigError(f"model.layout '{text}': every core needs at least one layer.")
    _check_size(text, len(cores), prelude + sum(cores) + coda)
    return Layout(text, prelude, cores, coda, tuple(range(len(cores))), (1,) * len(cores))


def schedule(direction: str, start: Fraction | str, steps: int) -> list[Fraction]:
    """Named resolution schedules (SpiralFormer Sec. 2.4): ``coarse-to-fine`` r_t = 2 r_(t-1) from
    ``start``; ``fine-to-coarse`` r_t = r_(t-1) / 2 from ``start``."""
    r = Fraction(start)
    if direction not in ("coarse-to-fine", "fine-to-coarse"):
        raise ConfigError(
            f"schedule direction '{direction}' is unknown; use coarse-to-fine or fine-to-coarse."
        )
    factor = Fraction(2) if direction == "coarse-to-fine" else Fraction(1, 2)
    out = [r * factor**t for t in range(steps)]
    if any(x > 1 or x.numerator != 1 for x in out):
        raise ConfigError(f"schedule {direction} from {start} over {steps} steps leaves (0, 1]; start lower.")
    return out


def format_multires(prelude: int, core: int, resolutions: list[Fraction], coda: int) -> str:
    rs = ",".join("1" if r == 1 else f"1/{r.denominator}" for r in resolutions)
    return f"{prelude}+{core}x{{{rs}}}+{coda}"


def layout_from_ratio(
    total_layers: int,
    recurrence_ratio: float,
    resolutions: list[Fraction] | None = None,
    loops: int = 2,
) -> str:
    """The recurrence-ratio axis (SpiralFormer Fig. 3): N_loop / N_total = ratio with N_pre = N_post.

    ``total_layers`` counts distinct layers; the remaining layers are split evenly between prelude
    and coda (so N_total - N_loop must be even). Ratio 0 gives the vanilla layout.
    """
    if not 0 <= recurrence_ratio < 1:
        raise ConfigError(f"recurrence_ratio {recurrence_ratio} must lie in [0, 1).")
    n_loop = round(total_layers * recurrence_ratio)
    if n_loop == 0:
        return str(total_layers)
    rest = total_layers - n_loop
    if rest % 2:
        n_loop += 1
        rest -= 1
    side = rest // 2
    if resolutions is None:
        return f"{side}+{n_loop}R{loops}+{side}"
    return format_multires(side, n_loop, resolutions, side)
