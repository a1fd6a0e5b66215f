"""The device pool of a sweep's workers on one machine: which GPUs a trial's ``train`` process may use.

The pool is ``CUDA_VISIBLE_DEVICES`` when it is set (SLURM sets it to a job's GPUs), else every GPU torch sees;
empty without a GPU. A trial that asks for ``d`` devices (``train.devices``; ``auto`` is the whole pool) holds
``d`` of them for its lifetime: an exclusive ``flock`` on ``<run-dir>/.devices/<host>/<device>.lock`` each,
which the kernel releases when the holding worker dies, so workers of one sweep on one machine never share a
device. Its ``train`` process sees only them (its ``CUDA_VISIBLE_DEVICES``), and its MLflow child run records
them as the tag ``devices`` (``cpu`` without a pool).

Before any training a sweep refuses a grid point that asks for more devices than the pool has
(``check_devices``) or that this machine's kind cannot train (``check_machine``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from recursive_lightning.config import device_count
from recursive_lightning.errors import ConfigError
from recursive_lightning.run_dir import SweepDir
from recursive_lightning.sweep.spec import SweepSpec

CPU = "cpu"  # the `devices` tag of a trial that ran without a device pool


def device_pool(environ: dict[str, str] | None = None) -> list[str]:
    """The GPUs this machine's workers share: ``CUDA_VISIBLE_DEVICES`` when set (ids or UUIDs, in order; an
    empty value or ``-1`` means none), else ``0 .. n-1`` for the ``n`` GPUs torch sees."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        out = []
        for d in (x.strip() for x in visible.split(",")):
            if not d or d.startswith("-"):
                break  # CUDA ignores every id from the first invalid one on
            out.append(d)
        return out
    try:
        import torch  # heavy

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:
        return []


def devices_needed(cfg: Any, pool: list[str]) -> int:
    """How many of the pool's devices a trial's ``train`` takes on this machine: 0 on the CPU (or without a
    pool), else ``train.devices`` (a count, a list of ids: its length, ``auto``: the whole pool)."""
    t = cfg.train
    if not pool or str(t.accelerator).lower() == "cpu":
        return 0
    return device_count(t.devices, len(pool))


@contextlib.contextmanager
def hold_devices(run_dir: Path, pool: list[str], n: int, on_wait=None) -> Iterator[list[str]]:
    """Hold ``n`` devices of the pool for the body (none: yields []). Waits, sleeping between looks, while
    other workers hold too many (``on_wait()`` is called once); a signal handler that raises (SIGTERM, Ctrl-C)
    ends the wait. The locks are released on exit, or by the kernel when this process dies."""
    if n <= 0 or not pool:
        yield []
        return
    folder = SweepDir(run_dir).devices(socket.gethostname())
    folder.mkdir(parents=True, exist_ok=True)
    announced = False
    while True:
        held: list[tuple[str, Any]] = []
        for d in pool:
            f = open(folder / f"{d}.lock", "a")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                continue
            held.append((d, f))
            if len(held) == n:
                break
        if len(held) == n:
            break
        for _, f in held:  # not enough free: give back what we took, so two waiting workers cannot deadlock
            f.close()
        if not announced and on_wait is not None:
            on_wait()
            announced = True
        time.sleep(0.5)
    try:
        yield [d for d, _ in held]
    finally:
        for _, f in held:
            f.close()


def check_devices(spec: SweepSpec, pool: list[str]) -> None:
    """Refuse, before any training, a grid point that asks for more devices than this machine's pool has."""
    if not pool:
        return
    for point in spec.checked_points():
        need = devices_needed(spec.trial_config(point), pool)
        if need > len(pool):
            raise ConfigError(
                f"{spec.at(point)}: train.devices asks for {need} "
                f"devices but this machine's device pool ({','.join(pool)}, from CUDA_VISIBLE_DEVICES or the "
                f"GPUs torch sees) has {len(pool)}; lower train.devices or run it where more GPUs are visible."
            )


def check_machine(spec: SweepSpec) -> None:
    """Refuse, before any training, a grid point this machine's kind cannot train (``parallel.check_supported``:
    e.g. ``train.cuda_graphs`` without CUDA), naming the point, instead of failing every trial of it."""
    from recursive_lightning.training.parallel import check_supported  # heavy

    for point in spec.checked_points():
        try:
            check_supported(spec.trial_config(point).train)
        except ConfigError as e:
            raise ConfigError(f"{spec.at(point)}: {e}") from None
