"""``train.cuda_graphs``: the settings a captured step cannot replay are refused in one sentence, and the
training step's graphed path (on the CPU: the same step run eagerly, with the backward inside the training step
and Lightning's backward skipped) trains to the losses of the plain path, step for step. The capture itself
runs on CUDA only: ``tests/test_cuda.py`` (values and gradients against eager, replays on new inputs)."""

from __future__ import annotations

import pytest
from test_training import losses

from recursive_lightning.config import RunConfig
from recursive_lightning.errors import ConfigError
from recursive_lightning.training import parallel
from recursive_lightning.training.run import train


@pytest.mark.parametrize(
    "train_cfg,named",
    [
        ({"loops": {"distribution": "uniform", "low": 1, "high": 2}}, "train.loops"),
        ({"accumulate": 2}, "train.accumulate > 1"),
        ({"strategy": "fsdp"}, "train.strategy ddp or fsdp"),
        ({"devices": 2}, "train.devices other than 1"),
        ({"compile": "glue"}, "train.compile"),
    ],
)
def test_settings_a_graph_cannot_replay_are_refused(tiny_run, train_cfg, named):
    cfg = tiny_run()
    cfg["train"].update(cuda_graphs=True, **train_cfg)
    with pytest.raises(ConfigError, match=f"train.cuda_graphs cannot be combined with {named} "):
        RunConfig.from_dict(cfg)


def test_cuda_graphs_on_the_cpu_is_refused_before_any_work(tmp_path, tiny_run):
    cfg = tiny_run()
    cfg["train"].update(cuda_graphs=True, accelerator="cpu")
    with pytest.raises(ConfigError, match="train.cuda_graphs needs a CUDA GPU; set it false on the CPU"):
        train(RunConfig.from_dict(cfg), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_graphed_training_step_trains_to_the_plain_steps_losses(tmp_path, tiny_run, monkeypatch):
    monkeypatch.setattr(
        parallel, "check_supported", lambda cfg: None
    )  # the CPU runs the graphed path eagerly
    got = {}
    for graphs in (False, True):
        cfg = tiny_run()
        cfg["train"].update(cuda_graphs=graphs, max_steps=6, val_every=6, checkpoint_every=6)
        train(RunConfig.from_dict(cfg), tmp_path / str(graphs))
        got[graphs] = losses(tmp_path / str(graphs))
    assert len(got[True]) == 6 and got[True] == got[False]


def test_a_sweep_point_with_cuda_graphs_on_the_cpu_is_refused_before_any_trial(tmp_path, data_cache):
    """The machine-kind check runs on every grid point before the sweep writes anything: one sentence naming the
    point, exit 2, no run directory (not three failed attempts of its trial)."""
    from conftest import sweep_file, sweep_output

    rows = {"plain": {"train.cuda_graphs": False}, "graphs": {"train.cuda_graphs": True}}
    spec = sweep_file(tmp_path, data_cache, rows)
    code, out = sweep_output(spec, "--run-dir", tmp_path / "run", "--no-report")
    (line,) = [x for x in out.splitlines() if x.startswith("error:")]
    assert code == 2 and "Traceback" not in out, out
    assert (
        "at variant=graphs" in line and "train.cuda_graphs needs a CUDA GPU; set it false on the CPU" in line
    )
    assert not (tmp_path / "run").exists()
