"""The MLflow screenshots of docs/results.md: serve a finished sweep directory with ``ui``, open the links it
prints in headless Chromium and save the runs table, its chart view, the parent run's page and the best trial's
page as small PNGs.

    .venv/bin/python scripts/mlflow_screenshots.py SWEEP_DIR docs/mlflow
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=20000",
]


def shoot(url: str, path: Path, width: int, height: int, crop: int | None = None, warm: bool = False) -> None:
    """``warm``: load the page once before the screenshot, in the same profile (the chart view's plots load
    their metric histories after the page; a first visit's budget can end before they are drawn)."""
    from PIL import Image

    with tempfile.TemporaryDirectory() as profile:
        raw = Path(profile) / "shot.png"
        for _ in range(warm):
            subprocess.run(
                [
                    shutil.which("chromium") or "chromium",
                    *FLAGS,
                    f"--user-data-dir={profile}",
                    "--dump-dom",
                    url,
                ],
                capture_output=True,
                timeout=180,
                check=True,
            )
        subprocess.run(
            [
                shutil.which("chromium") or "chromium",
                *FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                f"--screenshot={raw}",
                url,
            ],
            capture_output=True,
            timeout=180,
            check=True,
        )
        im = Image.open(raw).convert("RGB")
        if crop:
            im = im.crop((0, 0, im.width, crop))
        im.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def main(sweep_dir: str, out: str) -> int:
    from recursive_lightning.tracking.runs import client
    from recursive_lightning.tracking.ui import store_of
    from recursive_lightning.tracking.view import run_url

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ui = subprocess.Popen(
        [sys.executable, "-m", "recursive_lightning", "ui", sweep_dir, "--port", "5420"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        lines = [ui.stdout.readline() for _ in range(3)]
        table, parent = (ln.split(": ", 1)[1].strip() for ln in lines[1:3])
        entry, rest = parent.split("#/experiments/", 1)
        server = urlsplit(entry)  # its path: the server's page that opens the route
        exp_id, parent_id = rest.split("/runs/")[0], rest.split("/runs/")[1].split("?")[0]
        best = client(store_of(sweep_dir)).get_run(parent_id).data.tags["best_trial_run_id"]
        shoot(table, out_dir / "runs-table.png", 1700, 620)
        shoot(f"{table}&compareRunsMode=CHART", out_dir / "chart-view.png", 1700, 1100, crop=900, warm=True)
        shoot(parent, out_dir / "parent-run.png", 1700, 1400, crop=1000)
        origin = f"{server.scheme}://{server.netloc}"
        shoot(run_url(origin, exp_id, best, page=server.path), out_dir / "trial-run.png", 1700, 1000)
    finally:
        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
