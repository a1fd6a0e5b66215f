"""The Lightning callbacks a sweep's trial trains with: Optuna's pruning, and the named fault points inside
training that the tests use (``recursive_lightning.faults``)."""

from __future__ import annotations

from recursive_lightning import faults


class PruningCallback:
    """Report the validation loss by global step to Optuna; stop the trainer when the pruner says so."""

    def __new__(cls, trial, monitor: str, warmup_steps: int):
        import lightning as L  # heavy

        class _Cb(L.Callback):
            pruned = False

            def on_validation_end(self, trainer, pl_module) -> None:
                value = trainer.callback_metrics.get(monitor)
                if value is None or trainer.sanity_checking:
                    return
                trial.report(float(value), step=trainer.global_step)
                if trainer.global_step >= warmup_steps and trial.should_prune():
                    self.pruned = True
                    trainer.should_stop = True

        return _Cb()


def fault_callback(cfg):
    """Test-only: the named fault points inside training (see ``recursive_lightning.faults``)."""
    import lightning as L  # heavy

    t = cfg.train

    class _Faults(L.Callback):
        fired = False

        def on_train_batch_end(self, trainer, *args) -> None:
            if not self.fired and t.checkpoint_every < trainer.global_step < t.max_steps:
                self.fired = True  # once per trial, after its first checkpoint
                faults.point("mid_training")

        def on_validation_start(self, trainer, pl_module) -> None:
            if trainer.global_step >= t.max_steps:  # last.ckpt at max_steps is written, no result yet
                faults.point("final_validation")

        def on_fit_end(self, trainer, pl_module) -> None:  # after the last checkpoint, before result.json
            faults.point("after_last_checkpoint")

    return _Faults()
