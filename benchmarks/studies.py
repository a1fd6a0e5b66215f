"""What the CPU studies (``study_*.py``) share: running a study's sweep file with the package's ``sweep``
command, resumable, optionally as a short smoke run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def run_study_sweep(
    sweep_file: Path, out: Path, steps: int | None, evaluate: dict[str, Any] | None = None
) -> tuple[Path, dict[str, Any]]:
    """Run ``sweep_file`` into ``out/sweep`` (its copy, ``base`` made absolute and ``evaluate`` updated, written
    to ``out/sweep.yaml``); ``steps``: train that many steps instead (a smoke run). Returns the sweep directory
    and the sweep file as run."""
    raw = yaml.safe_load(sweep_file.read_text())
    raw["base"] = str((sweep_file.parent / raw["base"]).resolve())
    raw["evaluate"].update(evaluate or {})
    if steps is not None:  # a smoke run
        raw["overrides"].update({"train.max_steps": steps, "train.warmup_steps": 1, "train.val_every": steps})
        raw["overrides"]["train.checkpoint_every"] = steps
    spec = out / "sweep.yaml"
    out.mkdir(parents=True, exist_ok=True)
    spec.write_text(yaml.safe_dump(raw, sort_keys=False))
    run_dir = out / "sweep"
    cmd = [sys.executable, "-m", "recursive_lightning", "sweep", str(spec), "--run-dir", str(run_dir)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return run_dir, raw
