"""The LightningModule that trains any model of the package (vanilla, looped, multi-resolution)."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.trainer.states import TrainerFn
from torchmetrics.text import Perplexity

from recursive_lightning import faults
from recursive_lightning.config import RunConfig
from recursive_lightning.model.build import build_model
from recursive_lightning.model.describe import describe
from recursive_lightning.model.loss import cross_entropy
from recursive_lightning.sampled_loops import LoopSchedule
from recursive_lightning.training import parallel
from recursive_lightning.training.cuda_graphs import GraphedStep
from recursive_lightning.training.loop_flops import LoopFlops
from recursive_lightning.training.optim import build_optimizer

# dense bf16 peak FLOP/s of known accelerators, for MFU
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def accelerator_peak_flops() -> float | None:
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, peak in PEAK_FLOPS.items():
            if key in name:
                return peak
    return None


class RecursiveLMModule(L.LightningModule):
    """Wraps the model :func:`build_model` makes for the run (``RecursiveLM`` or ``MelaLM``) with the papers'
    optimiser, schedule, metrics and checkpoint extras. ``run`` is ``RunConfig.to_dict()``.

    ``val_names`` names the validation dataloaders; each gets ``val/<name>/ppl`` and ``val/<name>/loss``.
    """

    def __init__(
        self,
        run: dict[str, Any],
        val_names: tuple[str, ...] = ("heldout",),
        tokenizer_json: str | None = None,
    ) -> None:
        super().__init__()
        # in every checkpoint; not handed to the logger: train logs the resolved config once (run_params)
        self.save_hyperparameters({"run": run, "val_names": list(val_names)}, logger=False)
        self.run_cfg = RunConfig.from_dict(run)
        self.model = build_model(self.run_cfg.model)
        self.val_names = tuple(val_names)
        self.val_ppl = torch.nn.ModuleList(Perplexity() for _ in val_names)
        self.tokenizer_json = tokenizer_json  # stored in every checkpoint: it is self-contained
        self.mlflow_run_id: str | None = None
        seq = self.run_cfg.data.seq_len
        stats = describe(self.run_cfg.model, seq_len=seq)
        self.flops_per_token = 3 * stats["flops_forward"] / seq  # forward + backward (2x)
        # train.loops: a loop count per optimizer step (sampled_loops.py), its FLOPs counted per depth
        t = self.run_cfg.train
        self.loop_schedule = LoopSchedule.parse(t.loops) if t.loops is not None else None
        self.loop_flops = (
            LoopFlops(self.run_cfg.model, seq, self.loop_schedule.backprop).warm()
            if self.loop_schedule
            else None
        )
        self._step_flops_per_token = self.flops_per_token
        # train/flops = train/tokens x this: 3 x forward per token, under train.loops the expectation over the
        # distribution (as ``loop_flops.expected_training_flops`` and the sweep report's training FLOPs)
        self.train_flops_per_token = (
            self.loop_schedule.expectation(self.loop_flops.training) / seq
            if self.loop_schedule
            else self.flops_per_token
        )
        self.peak_flops = accelerator_peak_flops()
        self._clock = time.perf_counter  # tests substitute a deterministic clock
        self._t_ref: float | None = None  # when the interval of the next step's tokens/s began
        self._measured_steps = 0  # steps of this fit so far (the first is warm-up and not reported)
        self._step_tokens = 0
        self._configured = False
        self.graphed_step: GraphedStep | None = None  # train.cuda_graphs (configure_model)
        self._compile_cache: str | None = None  # inductor's cache directory under train.compile
        self._graphs_before = (0, 0)  # parallel.compiled_graphs() before the model was compiled
        # this step's train/* values: Lightning hands them to the logger only after the step's checkpoint
        # is written, so a checkpoint carries them and a resumed run logs them if the kill lost them
        self._step_metrics: dict[str, Any] = {}
        self._restored_step_metrics: dict[str, Any] | None = None

    # -------------------------------------------------------------- parallelism (FSDP2, compile, AC)
    def configure_model(self) -> None:
        if self._configured:
            return
        self._configured = True
        t = self.run_cfg.train
        if t.activation_checkpointing:
            parallel.apply_activation_checkpointing(self.model)
        if t.memory_kernel == "triton":  # Mela's chunk updates and their backward as fused kernels
            self.model.use_memory_kernel()
        if t.compile:
            self._compile_cache = parallel.persistent_compile_cache()
            self._graphs_before = parallel.compiled_graphs()
            parallel.compile_model(self.model, t.compile)
        if (
            t.cuda_graphs
        ):  # train.cuda_graphs: each step's forward + backward replayed (training/cuda_graphs.py)
            self.model.shared_grads_in_place = False  # a replay runs no Python state (model/shared_grad.py)
            self.graphed_step = GraphedStep(
                lambda batch: self._loss(batch, training=True)[0], list(self.model.parameters())
            )
        mesh = getattr(self, "device_mesh", None)
        if mesh is not None:
            dp = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
            prec = "bf16" if "bf16" in str(self.trainer.precision) else None
            parallel.apply_fsdp(self.model, dp, prec)

    # -------------------------------------------------------------- steps
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(
        self, batch: torch.Tensor, training: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch = batch.long()
        x, y = batch[:, :-1], batch[:, 1:]
        logits = self.model(x)
        loss = cross_entropy(logits, y, overwrite_logits=training)  # training reads no logits after backward
        return loss, logits, y

    def sampled_loops(self) -> int | None:
        """The loop count of this optimizer step under ``train.loops`` (None: the layout's K): a function of
        (train.seed, global step) only, so every rank and micro-batch of the step, and a resumed run, draw it
        alike."""
        if self.loop_schedule is None:
            return None
        return self.loop_schedule.sample(self.run_cfg.train.seed, self.global_step)

    def training_loss(self, batch: torch.Tensor, loops: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, targets) of a training forward at ``loops`` loop steps with gradients through the last
        ``train.loops.backprop`` (None: as built); the model is back at its layout's K afterwards, so
        validation and checkpoints see the trained depth."""
        if loops is None:
            loss, _, y = self._loss(batch, training=True)
            return loss, y
        model = self.model
        model.loops, model.backprop_loops = loops, self.loop_schedule.backprop
        try:
            loss, _, y = self._loss(batch, training=True)
        finally:  # the backward needs no flag: the graph (and which steps it holds) is built by now
            model.loops = model.backprop_loops = None
        return loss, y

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        faults.point("training_step")  # tests: a kill -9 in the middle of a step (faults.py)
        loops = self.sampled_loops()
        if self.graphed_step is not None:  # forward and backward replayed here; backward() below skips them
            loss, y = self.graphed_step(batch), batch[:, 1:]
        else:
            loss, y = self.training_loss(batch, loops)
        if loops is not None:
            self._step_flops_per_token = self.loop_flops.training(loops) / self.run_cfg.data.seq_len
        tokens = y.numel() * self.trainer.world_size
        step = self.global_step + 1
        metrics: dict[str, Any] = {
            "train/loss": loss.detach(),
            "train/lr": self.trainer.optimizers[0].param_groups[0]["lr"],
            "train/tokens": float(step * tokens * self.run_cfg.train.accumulate),
        }
        metrics["train/flops"] = metrics["train/tokens"] * self.train_flops_per_token
        if loops is not None:
            metrics["train/loops"] = float(loops)
        for name, value in metrics.items():
            shown = name == "train/loss"
            self.log(name, value, prog_bar=shown, on_step=True, on_epoch=False, sync_dist=False)
        self._step_metrics = metrics
        self._step_tokens = tokens * self.run_cfg.train.accumulate
        return loss

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.graphed_step is None:
            super().backward(loss, *args, **kwargs)
        else:  # train.cuda_graphs: the training step's graph ran the backward; its gradients, after zero_grad
            self.graphed_step.restore_grads()

    # -------------------------------------------------------------- throughput over training time only
    # train/tokens_per_sec at a step = that step's tokens / the wall-clock since the previous step ended: the
    # forward, backward, optimiser step and data loading of steady training. An interval that holds a
    # validation or a checkpoint write is measured from the step's own start instead (those are not training
    # time), and the first step of every fit (warm-up: allocations, compilation) is not reported.
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        now = self._clock()
        if self._t_ref is not None and self._measured_steps > 0:
            tps = self._step_tokens / max(now - self._t_ref, 1e-9)
            extra = {"train/tokens_per_sec": tps}
            if self.peak_flops:
                # the step's own FLOPs: at its sampled depth under train.loops (training/loop_flops.py)
                mfu = tps * self._step_flops_per_token / (self.peak_flops * self.trainer.world_size)
                extra["train/mfu"] = mfu
            for name, value in extra.items():
                self.log(name, value, prog_bar=name == "train/tokens_per_sec", on_step=True, on_epoch=False)
            self._step_metrics.update(extra)
        elif self._t_ref is not None and self._measured_steps == 0:
            self._first_step(now - self._t_ref)
        self._measured_steps += 1
        self._t_ref = now

    def _first_step(self, seconds: float) -> None:
        """train/first_step_sec: the wall-clock of each fit's first optimizer step (warm-up: allocations, and
        under train.compile, train.cuda_graphs or train.memory_kernel triton the compilation or capture), printed
        where it is long."""
        t = self.run_cfg.train
        self.log("train/first_step_sec", seconds, on_step=True, on_epoch=False)
        self._step_metrics["train/first_step_sec"] = seconds
        if t.compile or t.cuda_graphs or t.memory_kernel == "triton":
            made, loaded = parallel.compiled_graphs() if t.compile else (0, 0)
            graphs = (made - self._graphs_before[0], loaded - self._graphs_before[1])
            self.print(parallel.first_step_line(seconds, t, graphs, self._compile_cache))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._t_ref is None:
            self._t_ref = self._clock()

    def on_validation_epoch_start(self) -> None:
        for m in self.val_ppl:
            m.reset()

    def validation_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        loss, logits, y = self._loss(batch)
        self.val_ppl[dataloader_idx].update(logits.float(), y)

    def on_validation_epoch_end(self) -> None:
        for name, metric in zip(self.val_names, self.val_ppl):
            ppl = metric.compute()  # already over every rank (torchmetrics syncs its states in compute)
            # sync_dist averages the identical per-rank values: a no-op that keeps Lightning from warning
            self.log(f"val/{name}/ppl", ppl, sync_dist=True)
            self.log(f"val/{name}/loss", ppl.log(), sync_dist=True)
        self._t_ref = None  # validation time is not training throughput
        if self.trainer.state.fn == TrainerFn.VALIDATING:
            # train's validation after fit logs at step G, where no training step logged: the tokens and FLOPs
            # of its G steps there too, so that curves against them (MLflow's metric x-axis) reach it
            d = self.run_cfg.data
            tokens = float(
                self.global_step
                * d.batch_size
                * d.seq_len
                * self.run_cfg.train.accumulate
                * self.trainer.world_size
            )
            self.log("train/tokens", tokens, sync_dist=False)
            self.log("train/flops", tokens * self.train_flops_per_token, sync_dist=False)

    # -------------------------------------------------------------- optimisation
    def configure_optimizers(self):
        opt, sched = build_optimizer(self.model, self.run_cfg.train)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    # -------------------------------------------------------------- self-contained checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._t_ref = None  # the checkpoint write is not training time
        checkpoint["recursive_lightning"] = {
            "run": self.run_cfg.to_dict(),
            "tokenizer_json": self.tokenizer_json,
            "mlflow_run_id": self.mlflow_run_id,
            "val_names": list(self.val_names),
            "format": 1,
        }
        if self._trainer is not None:  # what train.precision resolved to: a resume continues in it
            checkpoint["recursive_lightning"]["precision"] = str(self.trainer.precision)
        if self._step_metrics and self._trainer is not None:
            checkpoint["recursive_lightning"]["step_metrics"] = {
                "step": int(self.trainer.fit_loop.epoch_loop._batches_that_stepped),  # the step they log at
                "metrics": {k: float(v) for k, v in self._step_metrics.items()},
            }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        extra = checkpoint.get("recursive_lightning", {})
        self.tokenizer_json = extra.get("tokenizer_json", self.tokenizer_json)
        self.mlflow_run_id = extra.get("mlflow_run_id", self.mlflow_run_id)
        self._restored_step_metrics = extra.get("step_metrics")

    def on_train_start(self) -> None:
        """After a resume: log the checkpoint's step metrics unless the run already has them (a kill between
        the checkpoint and Lightning's logging of that step loses them otherwise)."""
        restored, self._restored_step_metrics = self._restored_step_metrics, None
        logger = self.logger
        if not restored or not self.trainer.is_global_zero or logger is None:
            return
        if isinstance(logger, MLFlowLogger):
            history = logger.experiment.get_metric_history(logger.run_id, "train/loss")
            if any(m.step == restored["step"] for m in history):
                return
        logger.log_metrics(restored["metrics"], step=restored["step"])
