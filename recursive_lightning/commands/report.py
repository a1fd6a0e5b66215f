"""``python -m recursive_lightning report``: a sweep's report written again (``sweep.report.write_report``) and
printed with its path."""

from __future__ import annotations

from recursive_lightning.errors import ArgumentParser
from recursive_lightning.sweep.report import write_report


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="recursive_lightning report", description="Tables and plots of a sweep.")
    p.add_argument("--run-dir", required=True, help="the sweep's run directory")
    p.add_argument(
        "--out", help="write report.md, report.html and the figures here (default: the run directory)"
    )
    p.add_argument("--no-mlflow", action="store_true", help="do not log the report to the sweep's parent run")
    args = p.parse_args(argv)
    out = write_report(args.run_dir, log=not args.no_mlflow, out=args.out)
    print(out["markdown"])
    print(f"\nreport: {out['path']}")
    return 0
