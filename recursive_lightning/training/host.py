"""Host memory for CPU training: keep freed memory in the process instead of returning it every step.

A training step allocates and frees the same large tensors every time: the (tokens x vocab) logits and their
gradient, the (vocab x d) embedding and head gradients (each ~150-200 MB at Pythia-160M, 1024 tokens).
glibc's malloc serves anything above 32 MB with a fresh ``mmap`` and returns it with ``munmap`` on free, so
every step page-faults those tensors in again, and on a virtual machine a fault is expensive (on this
project's Firecracker VMs `aten::fill_` of the fresh gradients took 160-270 ms of a 4.0 s Pythia-160M step).

``keep_freed_memory`` tells glibc (``mallopt``) to serve every allocation from its heap and never trim it, so
the later steps reuse the first steps' pages: the 160M SpiralFormer-B AdamW step fell from 4.18 to 3.23 s
(``benchmarks/bench_host_memory.py``), and its time stopped depending on the machine's memory state. The
process keeps its peak footprint until it exits (what jemalloc/tcmalloc, which the PyTorch CPU tuning guide
recommends, do too). Only glibc on Linux has these
knobs; elsewhere nothing changes. ``train.keep_host_memory: false`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

from recursive_lightning import formatting as fmt
from recursive_lightning.errors import ConfigError

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
M_MMAP_MAX = -4
_NEVER_TRIM = 2**31 - 1  # mallopt takes an int: trim only above 2 GiB of free heap top


@functools.cache
def keep_freed_memory() -> bool:
    """Serve every allocation from glibc's heap and keep freed memory for reuse; True where that was set.

    Idempotent; call it before the first training step (allocations already made keep their mapping)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it (and these mallopt parameters)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl): no mallopt knobs to set
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; both must hold, else large blocks would still be unmapped
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, _NEVER_TRIM))


# float32 weights, their gradients and AdamW's two moments: what a training step holds per parameter at least
# (activations and the data come on top)
TRAIN_BYTES_PER_PARAM = 16


def available_memory() -> int | None:
    """Bytes this process can still allocate: ``MemAvailable`` of /proc/meminfo, lowered to what a cgroup v2
    memory limit leaves; None where neither is known."""
    out: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    out.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit.isdigit():
            out.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(out) if out else None


def check_fits_in_memory(params: int, bytes_per_param: int = TRAIN_BYTES_PER_PARAM) -> None:
    """Refuse in one sentence, before the run starts, a model whose ``params`` cannot be trained in the memory
    this machine has available (``bytes_per_param`` each: float32 weights, gradients and AdamW's moments),
    rather than fail in an allocation (or the kernel's OOM killer) once its run is RUNNING."""
    free = available_memory()
    need = params * bytes_per_param
    if free is None or need <= free:
        return
    raise ConfigError(
        f"the model has {fmt.params(params)} parameters, which need at least {need / 2**30:,.1f} GiB to train "
        f"({bytes_per_param} bytes each: float32 weights, gradients and AdamW's moments), but this machine has "
        f"{free / 2**30:,.1f} GiB available; choose a smaller model (model.d_model, model.layout, "
        "model.preset) or a machine with more memory."
    )
