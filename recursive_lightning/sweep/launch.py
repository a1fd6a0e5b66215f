"""Processes of a sweep: the worker processes a sweep command starts (``--workers N``), the ``train`` process a
trial runs in when it holds devices of this machine's pool or runs several ranks (``srun`` inside a SLURM
allocation), and how they stop: SIGTERM ends a sweep like Ctrl-C, and a worker or a ``train`` process dies
with the process that started it."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from recursive_lightning import faults, interrupts, threads
from recursive_lightning.errors import ConfigError
from recursive_lightning.files import atomic_write_text
from recursive_lightning.processes import parent_death_signal
from recursive_lightning.run_dir import RunDir
from recursive_lightning.sweep.devices import CPU, device_pool, devices_needed, hold_devices
from recursive_lightning.training import run as training_run
from recursive_lightning.training.options import TrainOptions
from recursive_lightning.training.result import TrainResult
from recursive_lightning.uris import STORAGE_ENV, TRACKING_ENV, mask_url

PARENT_ENV = "RECURSIVE_LIGHTNING_SWEEP_PARENT"  # the pid of the sweep command that spawned a worker
# run argv[2:] with PR_SET_PDEATHSIG = SIGKILL (kept across execve), unless the parent argv[1] is already gone
DIE_WITH_PARENT_EXEC = (
    "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9, 0, 0, 0); "
    "os.getppid() == int(sys.argv[1]) or os._exit(137); os.execv(sys.argv[2], sys.argv[2:])"
)


class Stop(KeyboardInterrupt):
    """SIGTERM to the sweep command: stop like Ctrl-C, exit 143. Its sentence is the one said when it stops the
    command before any trial (its checks, its study, its data); later the sweep says how it stopped itself."""

    EXIT_CODE = 143

    def __str__(self) -> str:
        return "sweep: stopped by SIGTERM while starting, before any trial; run the same command again."


def sigterm_stops(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` (a sweep command, called from the main thread) with SIGTERM raising :class:`Stop` from its first
    instant, the handler before it put back at its end."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> T:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
        try:
            return fn(*args, **kwargs)
        finally:
            signal.signal(signal.SIGTERM, previous)

    return wrapped


@contextlib.contextmanager
def worker_stops_quietly() -> Iterator[None]:
    """A worker stopped by Ctrl-C or SIGTERM exits 130 / 143 without a word: the sweep command that started
    it, in the same terminal, says once how the sweep stopped."""
    try:
        yield
    except KeyboardInterrupt as e:
        raise SystemExit(getattr(e, "EXIT_CODE", 130)) from None


T = TypeVar("T")
stop_requested = threading.Event()  # SIGTERM seen by this process, whoever's handler acted on it


def on_sigterm(signum, frame) -> None:
    stop_requested.set()
    if signal.getsignal(signal.SIGTERM) is not on_sigterm:
        return  # inside trainer.fit Lightning's handler (which calls this one) stops at the next step boundary
    if interrupts.defer_in_hook(signum, frame):
        return
    raise Stop()


def die_with_parent(parent_pid: int) -> None:
    """A worker must not train unattended once the sweep command that started it is gone: on Linux the
    kernel SIGKILLs it when its parent dies (as if it had been killed with it; its trial is resumed from its
    last checkpoint by the next run of the sweep); elsewhere a thread watches the parent."""
    if not parent_death_signal(signal.SIGKILL):

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent_pid:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def check_workers(workers: int, devices: int = 0) -> None:
    """Refuse, before anything is written, more worker processes than this machine's cores or GPUs
    (``devices``), whichever is more: each worker trains with at least one thread or holds one GPU, and hundreds
    started at once only thrash the machine."""
    bound = max(threads.cores(), devices)
    if workers > bound:
        gpus = f" and {devices} GPU(s)" if devices else ""
        raise ConfigError(
            f"--workers {workers} (or the sweep file's workers:) is more than the {threads.cores()} CPU core(s)"
            f"{gpus} this process may use; pass --workers {bound} or fewer (workers on other machines join with "
            "--attach)."
        )


def spawn_workers(n: int, sweep_file: Path, run_dir: Path, storage: str, tracking: str) -> int:
    """Run ``n`` worker processes (``sweep --attach --worker``) sharing this machine's CPU threads; returns
    the first non-zero exit code (a worker killed by a signal has a negative one), else 0. The store URLs
    reach them through the environment: their command lines (``ps``) show them with the password masked."""
    threads = max(1, (os.cpu_count() or 2) // n)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "RL_TORCH_THREADS": str(threads),
        PARENT_ENV: str(os.getpid()),
        STORAGE_ENV: storage,
        TRACKING_ENV: tracking,
    }
    cmd = [
        sys.executable,
        "-m",
        "recursive_lightning",
        "sweep",
        str(sweep_file),
        "--attach",
        "--worker",
        "--run-dir",
        str(run_dir),
        "--storage",
        mask_url(storage),
        "--tracking-uri",
        mask_url(tracking),
        "--no-report",
    ]
    procs = [subprocess.Popen(cmd, env=env) for _ in range(n)]
    try:
        codes = [p.wait() for p in procs]
    except BaseException:  # Ctrl-C / SIGTERM: stop the workers at a step boundary and wait for them
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        raise
    return next((c for c in codes if c), 0)  # a worker killed by a signal has a negative code


def multi_process(cfg) -> bool:
    """Whether a trial's training runs several ranks (DDP / FSDP, several devices or nodes)."""
    t = cfg.train
    devices = t.devices if isinstance(t.devices, int) else 2
    return t.strategy in ("ddp", "fsdp") or devices > 1 or t.num_nodes > 1


def slurm_launcher(cfg, environ: dict[str, str] | None = None) -> list[str]:
    """Inside a SLURM allocation (a job-array task running ``sweep --attach``) a multi-device trial's ranks are
    started by ``srun`` as a job step, one task per device on ``train.num_nodes`` nodes, which Lightning's
    SLURM environment then reads (as for ``train`` under ``srun``); elsewhere Lightning starts the ranks on
    this machine itself ([] here)."""
    env = os.environ if environ is None else environ
    srun = shutil.which("srun", path=env.get("PATH"))
    if "SLURM_JOB_ID" not in env or srun is None:
        return []
    t = cfg.train
    if isinstance(t.devices, int):
        per_node = t.devices
    else:  # "auto" / a list: the GPUs this allocation gives each node
        per_node = int(str(env.get("SLURM_GPUS_ON_NODE") or "1").split("(")[0] or 1)
    nodes = int(t.num_nodes)
    return [
        srun,  # a path: the die-with-the-worker wrapper execs it without a PATH search
        f"--nodes={nodes}",
        f"--ntasks={nodes * per_node}",
        f"--ntasks-per-node={per_node}",
        # each rank this job's --cpus-per-task, whatever srun's version inherits (22.05 none, 23.11 all)
        f"--cpus-per-task={env.get('SLURM_CPUS_PER_TASK') or 1}",
        "--kill-on-bad-exit=1",
        "--export=ALL",
    ]


def train_trial(
    cfg, trial_dir: Path, run_dir: Path, options: TrainOptions, who: str
) -> tuple[TrainResult, bool]:
    """Train a trial holding the devices of this machine's pool it needs (waiting while other workers hold
    them; its ``tags`` get ``devices``): in this process, or as its own ``train`` process when it holds devices
    or runs several ranks. Returns (its result, whether it trained in this process: only then did the
    ``options.callbacks`` run). ``who`` names the trial in the line shown while it waits."""
    pool = device_pool()

    def waiting() -> None:
        print(
            f"{who}: waiting for {need} free device(s) of {','.join(pool)} (other workers hold them)",
            flush=True,
        )

    need = devices_needed(cfg, pool)
    # the trial's devices, held while it trains: its `train` process sees only them
    with hold_devices(run_dir, pool, need, on_wait=waiting) as held:
        options.tags = {**(options.tags or {}), "devices": ",".join(held) or CPU}
        faults.point("devices_held")
        if held or multi_process(cfg):
            return _train_in_subprocess(cfg, trial_dir, options, held), False
        # looked up when called: a benchmark stands a fake train in
        return training_run.train(cfg, trial_dir, options), True


def _train_in_subprocess(
    cfg, trial_dir: Path, options: TrainOptions, devices: list[str] | None = None
) -> TrainResult:
    """A multi-device trial (DDP / FSDP2) runs as its own `train` command: Lightning's launcher re-executes
    that command once per rank, which it cannot do for a sweep worker. So does every trial given ``devices``
    of the pool (its ``CUDA_VISIBLE_DEVICES``: a process's CUDA devices are fixed when it first uses CUDA).
    Pruning is not available there. The trial directory's lock stays with this worker: the ``train`` process it
    starts finds it held by its starter (``run_lock``)."""
    trial_dir.mkdir(parents=True, exist_ok=True)
    cfg_file = RunDir(trial_dir).trial_config
    if devices:  # its devices, renumbered 0 .. d-1 inside it: a count (ids or `auto` would name others)
        cfg = copy.deepcopy(cfg)
        cfg.train.devices = len(devices)
    atomic_write_text(cfg_file, cfg.to_yaml())
    cmd = [
        sys.executable,
        "-m",
        "recursive_lightning",
        "train",
        "--config",
        str(cfg_file),
        "--run-dir",
        str(trial_dir),
        "--tracking-uri",
        mask_url(options.tracking_uri),  # its password through the environment, below: not in `ps`
        "--experiment",
        options.experiment,
        "--run-name",
        options.run_name,
        "--parent-run-id",
        options.parent_run_id,
    ]
    cmd += [f"--tag={k}={v}" for k, v in (options.tags or {}).items()]
    cmd += [f"--param={k}={v}" for k, v in (options.params or {}).items()]
    if options.resume:
        cmd.append("--resume")
    cmd = [*slurm_launcher(cfg), *cmd]
    if sys.platform.startswith("linux"):  # the train command dies with this worker, as the worker does
        cmd = [sys.executable, "-c", DIE_WITH_PARENT_EXEC, str(os.getpid()), *cmd]
    env = {**os.environ, TRACKING_ENV: options.tracking_uri}
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    proc = subprocess.Popen(cmd, env=env)
    try:
        code = proc.wait()
    except BaseException as e:
        # SIGTERM / Ctrl-C to this worker (SLURM's --signal=B: reaches only the worker): the `train` step stops
        # at a step boundary too (srun passes the signal on to every rank), and is waited for
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT if type(e) is KeyboardInterrupt else signal.SIGTERM)
        proc.wait()
        raise
    if code:
        raise subprocess.CalledProcessError(code, cmd)
    return TrainResult.load(trial_dir)
