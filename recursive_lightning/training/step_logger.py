"""An MLflow logger that logs each step of a metric once, across resumes.

A run killed after its last checkpoint logged the steps since; resumed from that checkpoint it trains them
again (to the same values) and Lightning's ``MLFlowLogger`` would log them a second time, so the run's
history holds two points per retrained step. This logger reads, when a run resumes, the last step each
metric already has and skips the points at or before it.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import MLFlowLogger

from recursive_lightning.tracking.runs import client


def last_logged_steps(tracking_uri: str, run_id: str) -> dict[str, int]:
    """The last step logged of each metric of the run."""
    c = client(tracking_uri)
    return {
        key: max((m.step for m in c.get_metric_history(run_id, key)), default=-1)
        for key in c.get_run(run_id).data.metrics
    }


def step_once_logger(experiment: str, tracking_uri: str, run_id: str, resumed: bool):
    """Lightning's ``MLFlowLogger`` for ``run_id``; on a resumed run it skips the steps already logged."""

    class _StepOnce(MLFlowLogger):
        def __init__(self) -> None:
            super().__init__(
                experiment_name=experiment, tracking_uri=tracking_uri, run_id=run_id, log_model=False
            )
            self._logged = last_logged_steps(tracking_uri, run_id) if resumed else {}

        def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
            if self._logged and step is not None:
                metrics = {k: v for k, v in metrics.items() if step > self._logged.get(k, -1)}
                if not metrics:
                    return
            super().log_metrics(metrics, step)

        def finalize(self, status: str = "success") -> None:
            """Nothing: the run's status is the command's to set (``mlflow_run.finish_run`` once its result is
            written, ``mlflow_run.RunCloser`` whatever stops it), not Lightning's at the end of fit, which would
            mark it FINISHED before the final validation and print MLflow's "View run" lines."""

    return _StepOnce()
