"""One node, many GPUs, on a CPU machine: the device pool is CUDA_VISIBLE_DEVICES, each
trial's `train` process gets its own devices of it, recorded as the child run's tag `devices`; a point that
asks for more than the pool has, and `--max-trials 0`, are refused before any work; a worker waiting for a
device stops on SIGTERM. Concurrency is shown by a barrier at a named point, never by a sleep."""

import fcntl
import os
import signal
import socket

import optuna
import pytest
from conftest import ENV, run_sweep
from test_sweep_grow import grow_spec, parent_and_children

from recursive_lightning.commands import sweep as sweep_command
from recursive_lightning.errors import ConfigError
from recursive_lightning.sweep.devices import device_pool, devices_needed

NAME = "grow-sweep"  # grow_spec's


def test_the_pool_is_cuda_visible_devices_and_a_trial_takes_its_count():
    assert device_pool({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == ["0", "1", "2", "3"]
    assert device_pool({"CUDA_VISIBLE_DEVICES": "3, 5"}) == ["3", "5"]
    assert device_pool({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert device_pool({"CUDA_VISIBLE_DEVICES": "-1"}) == []

    class T:
        accelerator, devices = "auto", 2

    cfg = type("C", (), {"train": T})
    assert devices_needed(cfg, ["0", "1", "2"]) == 2
    assert devices_needed(cfg, []) == 0  # no pool: nothing changes
    T.devices = "auto"
    assert devices_needed(cfg, ["0", "1", "2"]) == 3
    T.accelerator = "cpu"
    assert devices_needed(cfg, ["0", "1", "2"]) == 0


def test_two_workers_train_at_once_on_devices_0_and_1(tmp_path, data_cache):
    """CUDA_VISIBLE_DEVICES=0,1 and --workers 2: both trials hold their devices at the same instant (a barrier
    of two at the named point `devices_held`), and their child runs carry `devices` 0 and 1."""
    spec = grow_spec(tmp_path, data_cache, rows=("anchor", "mesh"))
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {
        **ENV,
        "CUDA_VISIBLE_DEVICES": "0,1",
        "RECURSIVE_LIGHTNING_FAULT": "devices_held:1:barrier=2",
        "RECURSIVE_LIGHTNING_FAULT_DIR": str(barrier),
    }
    p = run_sweep([spec, "--run-dir", tmp_path / "run", "--workers", 2], env=env)
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out
    assert len(os.listdir(barrier)) == 2  # two workers were at the barrier together
    parent, children = parent_and_children(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    assert parent.info.status == "FINISHED"
    assert sorted(r.data.tags.get("devices") for r in children) == ["0", "1"]


def test_more_devices_than_the_pool_and_max_trials_0_are_refused_before_any_work(
    tmp_path, data_cache, monkeypatch
):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    spec = grow_spec(tmp_path, data_cache, **{"train.devices": 2})
    with pytest.raises(ConfigError, match=r"train.devices asks for 2 devices .* has 1; lower train.devices"):
        sweep_command.main([str(spec), "--run-dir", str(run_dir)])
    spec = grow_spec(tmp_path, data_cache)
    with pytest.raises(ConfigError, match="--max-trials must be >= 1, not 0"):
        sweep_command.main([str(spec), "--run-dir", str(run_dir), "--max-trials", "0"])
    assert not run_dir.exists()  # nothing on disk


def test_a_worker_waiting_for_a_device_stops_on_sigterm(tmp_path, data_cache):
    """The pool's only device is held (here by the test, as another worker would): the worker says it waits,
    SIGTERM then stops it at once (exit 143, its trial waiting again, the parent KILLED). Without a pool the
    same sweep trains on the CPU and tags its run `devices` = cpu."""
    spec, run_dir = grow_spec(tmp_path, data_cache), tmp_path / "run"
    locks = run_dir / ".devices" / socket.gethostname()
    locks.mkdir(parents=True)
    with open(locks / "0.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        p = run_sweep([spec, "--run-dir", run_dir], env={**ENV, "CUDA_VISIBLE_DEVICES": "0"})
        lines = []
        for line in p.stdout:
            lines.append(line)
            if "waiting for 1 free device(s) of 0" in line:
                break
        else:
            pytest.fail("".join(lines))
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=300)
    assert p.returncode == 143, "".join(lines) + out
    study = optuna.load_study(study_name=NAME, storage=f"sqlite:///{run_dir / 'optuna.db'}")
    assert [t.state.name for t in study.get_trials()] == ["WAITING"]
    parent, _ = parent_and_children(f"sqlite:///{run_dir / 'mlflow.db'}")
    assert parent.info.status == "KILLED"

    p = run_sweep([spec, "--run-dir", run_dir], env={**ENV, "CUDA_VISIBLE_DEVICES": ""})
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    parent, (child,) = parent_and_children(f"sqlite:///{run_dir / 'mlflow.db'}")
    assert parent.info.status == "FINISHED" and child.data.tags["devices"] == "cpu"
