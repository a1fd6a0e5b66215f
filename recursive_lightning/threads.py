"""How many CPU threads torch's intra-op parallelism uses, per model.

On a 2-core machine with another job beside it, splitting the small matrix products of the CPU presets
(d_model <= 256) over 2 OpenMP threads makes every op wait for a thread the kernel has given to the other
job: decoding ran 3.6-5x slower than with one thread. Wide models still gain from the cores. So:

- ``--threads N`` (a global option of ``python -m recursive_lightning``) or ``OMP_NUM_THREADS`` set by the
  user: that count, always (a sweep's spawned workers get ``cores // workers`` this way);
- otherwise one thread below ``WIDE`` (the model's widest matrix, d_model or Mela's HMM width); from it, the
  cores that are idle when the model is set up (sampled from /proc/stat over ``SAMPLE_S``; a core counts
  when at least ``1 - SLACK`` of it is free), at least 1. Even d_model 768 training ran at 0.42x of one
  thread with 2 threads and a busy process beside it, so a wide model takes only the cores nobody uses.
  The count is chosen once per command; see benchmarks/bench_threads.py and docs/benchmarks.md
  (CPU threads) for the figures.

torch's CPU build uses GNU OpenMP (libgomp): threads that wait at the end of a parallel region spin for
``GOMP_SPINCOUNT`` iterations before sleeping, which burns the busy core the other job needs.
:func:`set_wait_policy` asks libgomp to sleep at once (``OMP_WAIT_POLICY=PASSIVE``) unless the user chose a
policy; it must run before torch is imported, as the CLI does.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ENV = "RECURSIVE_LIGHTNING_THREADS"  # set by the CLI's --threads; read by every command in this process
WIDE = 512  # d_model from which a model gets the idle cores by default (benchmarks/bench_threads.py)
SAMPLE_S = 0.2  # seconds of /proc/stat the idle cores are measured over
SLACK = 0.3  # a core 70 % idle counts as free


def cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a SLURM allocation's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def requested() -> int | None:
    """The count the user asked for: ``--threads`` first, then ``OMP_NUM_THREADS``; None if neither."""
    for name in (ENV, "OMP_NUM_THREADS"):
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) >= 1:
            return int(value)
    return None


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])  # idle + iowait; no guest


def idle_cores(seconds: float = SAMPLE_S, sleep: Callable[[float], None] | None = None) -> float | None:
    """Cores idle over the next ``seconds`` (all of the machine's CPUs), or None where unknown."""
    first = _cpu_times()
    (sleep or time.sleep)(seconds)
    second = _cpu_times()
    if first is None or second is None or second[1] <= first[1]:
        return None
    return (os.cpu_count() or 1) * (second[0] - first[0]) / (second[1] - first[1])


def default_threads(width: int, idle: float | None = None) -> int:
    """The default count for a model whose widest matrix is ``width`` wide: 1 below ``WIDE``, else the idle
    cores (``idle``, measured when not given), at least 1 and at most :func:`cores`."""
    if width < WIDE:
        return 1
    if idle is None:
        idle = idle_cores()
    free = cores() if idle is None else int(idle + SLACK)
    return max(1, min(cores(), free))


def threads_for(width: int) -> int:
    """The user's count if given, else :func:`default_threads`."""
    return requested() or default_threads(width)


def model_width(model_or_cfg: object) -> int:
    """The widest hidden size of a model or ModelConfig (d_model, or Mela's HMM width if wider)."""
    cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
    return max(int(getattr(cfg, "d_model", 0) or 0), int(getattr(cfg, "hmm_width", 0) or 0))


_active = False  # inside a CLI command (:func:`for_command`); library calls (tests, notebooks) keep theirs


def apply_for(model_or_cfg: object) -> int:
    """Inside a CLI command, set torch's intra-op threads for this model (see the module docstring);
    elsewhere leave them. Returns the count in use."""
    import torch  # heavy

    if not _active:
        return torch.get_num_threads()
    n = threads_for(model_width(model_or_cfg))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def set_wait_policy() -> None:
    """libgomp's waiting threads sleep instead of spinning, unless the user set a policy (before torch loads)."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


@contextmanager
def for_command(threads: int | None) -> Iterator[None]:
    """The policy for one CLI command: ``threads`` (``--threads``) for this process and the processes it
    starts (sweep workers, DDP ranks), libgomp's passive wait when torch is not loaded yet, and torch's
    previous count back afterwards (a command run in-process by a test leaves no trace)."""
    global _active
    saved_env = os.environ.get(ENV)
    before = None
    if "torch" in sys.modules:
        before = sys.modules["torch"].get_num_threads()
    else:
        set_wait_policy()
    if threads is not None:
        os.environ[ENV] = str(threads)
    _active = True
    try:
        yield
    finally:
        _active = False
        if saved_env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved_env
        if before is not None and sys.modules["torch"].get_num_threads() != before:
            sys.modules["torch"].set_num_threads(before)
