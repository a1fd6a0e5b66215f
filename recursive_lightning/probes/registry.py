"""The probes of a looped / multi-resolution transformer, in the order of ``probes.json`` and the figures.

Each probe is one module holding its metric, the part of the summary it owns (every plotted number) and
its figures; the ``probe`` command goes through :data:`PROBES`. A single run is drawn as the comparison
of one model (:class:`~recursive_lightning.probes.figures.Sheet` names the files and titles).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recursive_lightning.probes import attention, cka, coefficients, mesh, skew, spectra, subspace
from recursive_lightning.probes.captured import Capture
from recursive_lightning.probes.figures import Sheet

FORMAT_VERSION = 1

Results = Mapping[str, tuple[Capture, dict[str, Any]]]


@dataclass(frozen=True)
class Probe:
    summarize: Callable[[Capture, dict[str, Any]], dict[str, Any]]  # its keys of probes.json
    draw: Callable[[Results, Sheet], list[Path]]  # its figures
    metrics: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # its probe/... MLflow scalars


PROBES: dict[str, Probe] = {
    "skew": Probe(skew.summarize, skew.draw, skew.metrics),  # MeSH Fig. 3
    "cka": Probe(cka.summarize, cka.draw, cka.metrics),  # MeSH Fig. 4
    "spectra": Probe(spectra.summarize, spectra.draw, spectra.metrics),  # MeSH Fig. 5, effective rank
    "shared_subspace": Probe(subspace.summarize, subspace.draw),  # MeSH App. E.8, Fig. 10
    "mesh": Probe(mesh.summarize, mesh.draw),  # MeSH App. F, Fig. 11
    "coefficients": Probe(coefficients.summarize, coefficients.draw),  # MeSH App. E.3
    "attention": Probe(attention.summarize, attention.draw, attention.metrics),  # SpiralFormer Sec. 4.1
}


def summarize(cap: Capture, meta: dict[str, Any]) -> dict[str, Any]:
    """JSON-ready summary of a :class:`Capture` (means and stds over samples, full matrices)."""
    out: dict[str, Any] = {"format": FORMAT_VERSION, **meta}
    for probe in PROBES.values():
        out.update(probe.summarize(cap, meta))
    return out


def scalar_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """A few headline numbers for MLflow (``probe/...``)."""
    out: dict[str, Any] = {}
    for probe in PROBES.values():
        if probe.metrics is not None:
            out.update(probe.metrics(summary))
    return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(float(v))}


def draw(results: Results, sheet: Sheet) -> list[Path]:
    """Every probe's figures of ``{label: (capture, summary)}``: one run (``sheet.title`` set) or a comparison."""
    return [f for probe in PROBES.values() for f in probe.draw(results, sheet)]
