"""How a model is parallelised, compiled and checkpointed: kept apart from the model code.

FSDP2 (``fully_shard``) wraps every transformer layer; the shared core's layers are sharded once
and reused by every loop iteration. Activation checkpointing wraps the same layers. A compiled run keeps
inductor's cache where the next run finds it (:func:`persistent_compile_cache`) and says what its first step
cost (:func:`first_step_line`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from recursive_lightning import files
from recursive_lightning.config import COMPILE_SCOPES, RunConfig, TrainConfig, device_count
from recursive_lightning.errors import ConfigError
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.threads import model_width


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper  # heavy

    model.shared_grads_in_place = False  # recomputation replays forward uses (model/shared_grad.py)
    for layers in model.layer_lists():
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)


def apply_fsdp(model: torch.nn.Module, device_mesh, mixed_precision: str | None = None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # heavy

    mp = None
    if mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.shared_grads_in_place = False  # FSDP2 hooks every use of a layer itself (model/shared_grad.py)
    kwargs = {"mesh": device_mesh}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for layers in model.layer_lists():
        for layer in layers:
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def compile_model(model: torch.nn.Module, scope: bool | str = "layers") -> None:
    """``torch.compile`` the model in place (``scope``: a ``train.compile`` value; ``True`` means ``layers``).

    ``layers``: every transformer layer on its own (the shared core's layers once, reused by every loop step
    and resolution; composes with FSDP2's per-layer wrapping); a model's ``compile_units`` where it names
    other units (Mela: the decoder layers and each memory block's attention, not the block's chunk loop). ``glue``: the layers as with ``layers``, and the
    work between them as regions of their own (each step's S_down, S_up with the shift, and MeSH's routers,
    write and read: ``RecursiveLM.compile_glue``; Mela: each memory block's norms and its neural memory's
    projections and chunk update, ``MelaLM.compile_glue``), so the glue is fused without compiling the unrolled
    loop as one graph.
    ``model``: the whole forward, so that the work between the layers (MeSH routers and buffer reads, S_down /
    S_up, the shift, embeddings and head) is fused too; the loop over steps is unrolled into one graph (on an
    H100, 160M SpiralFormer-B: 1.38x eager's tokens/s, layers 1.01x; see benchmarks/bench_gpu.py)."""
    scope = "layers" if scope is True else scope
    if scope not in COMPILE_SCOPES:
        raise ValueError(
            f"train.compile must be one of false, true, {', '.join(COMPILE_SCOPES)}; got {scope!r}"
        )
    model.shared_grads_in_place = (
        False  # compiled graphs keep no Python state across uses (model/shared_grad.py)
    )
    if scope == "model":
        model.compile()
        return
    units = (
        model.compile_units()
        if hasattr(model, "compile_units")
        else [u for ls in model.layer_lists() for u in ls]
    )
    for unit in units:
        unit.compile()
    if scope == "glue" and hasattr(model, "compile_glue"):
        model.compile_glue()


def fused_memory_runs_on(device: str | torch.device) -> bool:
    """Whether ``train.memory_kernel: triton``'s kernels run on ``device``: a CUDA GPU, or the CPU under Triton's
    interpreter (``TRITON_INTERPRET=1``, the tests' path); with the triton package installed."""
    kind = torch.device(device).type
    here = kind == "cuda" or (kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    return here and importlib.util.find_spec("triton") is not None


def check_supported(cfg: TrainConfig) -> None:
    """Refuse, before any work, combinations that are known to fail (or hang) on this machine's kind."""
    if cfg.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.accelerator {cfg.accelerator} needs a CUDA GPU; set it cpu or auto.")
    on_cpu = cfg.accelerator == "cpu" or (cfg.accelerator == "auto" and not torch.cuda.is_available())
    if on_cpu and not _process_count(cfg.devices):
        raise ConfigError(
            f"train.devices {cfg.devices!r} selects GPUs (by id, or -1 for every one) and this run is on the "
            "CPU; set it a count of processes there (1, 2, ...)."
        )
    if cfg.num_nodes > 1 and not launched_per_node():
        raise ConfigError(
            f"train.num_nodes {cfg.num_nodes} needs this command started on every node by a launcher (srun "
            "under SLURM, torchrun, mpirun) and none started it, so it would wait for the other nodes forever; "
            "launch it that way on each node, or set train.num_nodes 1."
        )
    if cfg.cuda_graphs and on_cpu:
        raise ConfigError("train.cuda_graphs needs a CUDA GPU; set it false on the CPU.")
    if cfg.memory_kernel == "triton":
        if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":  # Triton's interpreter: the tests' CPU path
            raise ConfigError("train.memory_kernel triton needs a CUDA GPU; set it torch on the CPU.")
        if importlib.util.find_spec("triton") is None:
            raise ConfigError(
                "train.memory_kernel triton needs the triton package (pip install triton); set it torch without it."
            )
    if cfg.compile and cfg.strategy == "fsdp" and on_cpu:
        # torch 2.13's C++ code generator emits a duplicate declaration for FSDP2-wrapped compiled layers
        raise ConfigError(
            "train.compile with train.strategy fsdp fails on the CPU (torch.compile's C++ code generator "
            "rejects the FSDP2-wrapped layers); set train.compile false there, or train on GPUs."
        )


def _process_count(devices: Any) -> bool:
    """Whether ``devices`` is a count Lightning's CPU accelerator takes (an int > 0, its string, or ``auto``):
    ids and -1 (every device) name GPUs."""
    if isinstance(devices, str):
        devices = devices.strip()
        return devices == "auto" or (devices.isdigit() and int(devices) > 0)
    return isinstance(devices, int) and not isinstance(devices, bool) and devices > 0


def launched_per_node() -> bool:
    """Whether a launcher started this process as one rank of a multi-node job, as Lightning's cluster
    environments detect one (SLURM's ``srun``, torchrun, LSF's ``jsrun``, MPI); or the user did, setting
    ``NODE_RANK`` on each node for Lightning's own environment; or this process runs inside a SLURM allocation
    with ``srun`` at hand, where a sweep starts each multi-node trial as an ``srun`` step
    (``sweep/launch.slurm_launcher``). Without one, rank 0 waits for the other nodes' ranks forever."""
    from lightning.fabric.plugins.environments import (  # heavy
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    with warnings.catch_warnings():  # SLURM's hint that srun is installed but not used: the refusal says it
        warnings.simplefilter("ignore")
        envs = (SLURMEnvironment, TorchElasticEnvironment, LSFEnvironment, MPIEnvironment)
        if any(env.detect() for env in envs):
            return True
    if "NODE_RANK" in os.environ:
        return True
    return "SLURM_JOB_ID" in os.environ and shutil.which("srun") is not None


def resolve_strategy(run: RunConfig) -> Any:
    """Lightning strategy for ``train.strategy``: auto / ddp / fsdp (FSDP2 via ModelParallelStrategy). DDP runs
    with ``find_unused_parameters`` where the loss does not reach every parameter (a Mela model's memory
    parameters at a short ``data.seq_len``, ``model/mela/model.memory_without_gradient``): its reducer would
    otherwise fail the second step waiting for their gradients."""
    cfg = run.train
    if cfg.strategy == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy  # heavy

        devices = cfg.devices if isinstance(cfg.devices, int) else None
        world = (devices or 1) * cfg.num_nodes
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    if cfg.strategy == "ddp" or _several_processes(cfg):
        from recursive_lightning.model.mela.model import memory_without_gradient  # heavy

        if memory_without_gradient(run.model, run.data.seq_len):
            from lightning.pytorch.strategies import DDPStrategy  # heavy

            return DDPStrategy(find_unused_parameters=True)
    return cfg.strategy


def _several_processes(cfg: TrainConfig) -> bool:
    """Whether ``train.strategy auto`` runs several processes, so that Lightning picks DDP: several nodes, or
    several devices (a count, ids, or ``auto`` / -1 on a machine with several GPUs; one process on the CPU)."""
    on_cpu = cfg.accelerator == "cpu" or not torch.cuda.is_available()
    every = 1 if on_cpu else torch.cuda.device_count()
    return device_count(cfg.devices, every) * cfg.num_nodes > 1


# the model width (per ``model.arch``) from which a CPU with native bf16 trains faster in bf16-mixed than in
# float32: below it autocast's casts around every small matmul cost more than bf16 saves. A training step's
# bf16-mixed / fp32 time on an AMX Xeon (benchmarks/bench_precision.py): looped 2+4R2+2 MeSH 2.08 at d_model
# 64, 0.82-0.87 at 128, 0.67-0.73 at 256, 0.52 at 768; Mela 1.14 at 128 (cpu-mela: its memory loop runs in
# float32 anyway), 0.50 at 768 (mela-400m)
BF16_MIN_WIDTH = {"recursive": 128, "mela": 256}


def resolve_precision(cfg: TrainConfig, accelerator: str, model: ModelConfig | None = None) -> str:
    """``auto``: bf16-mixed on CUDA with bf16 support; on a CPU with native bf16 matmul (AMX / AVX512-BF16)
    for a ``model`` at least ``BF16_MIN_WIDTH`` wide (None: any model); 32-true otherwise (on a CPU without
    native bf16, bf16 matmuls are ~4x slower than fp32)."""
    if cfg.precision != "auto":
        return cfg.precision
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "16-mixed"
    wide = model is None or model_width(model) >= BF16_MIN_WIDTH.get(model.arch, 128)
    return "bf16-mixed" if wide and native_bf16() else "32-true"


@contextlib.contextmanager
def tf32_under_mixed_precision(precision: str, device_type: str) -> Iterator[bool]:
    """Under half-precision autocast on CUDA, the GEMMs left in float32 (Mela's neural memory: its chunk loop
    runs outside autocast, ``model/mela/neural_memory.py``) run on TF32 tensor cores while the block runs:
    torch's float32 matmul precision ``high`` instead of its default ``highest``, unless the user chose one,
    and back at the end. Measured against float64 (``benchmarks/bench_mela_numerics.py --memory-gemms``,
    docs/models.md: Mela): under bf16 autocast the logits' error is the decoder's own with TF32 memory GEMMs as
    with float32 ones (3.5e-3 at mela-400m's structure); ``32-true`` keeps full float32. Yields whether it
    switched."""
    before = torch.get_float32_matmul_precision()
    switch = device_type == "cuda" and precision in ("bf16-mixed", "16-mixed") and before == "highest"
    if switch:
        torch.set_float32_matmul_precision("high")
    try:
        yield switch
    finally:
        if switch:
            torch.set_float32_matmul_precision(before)


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AMX or AVX512-BF16; Linux's /proc/cpuinfo)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def persistent_compile_cache() -> str:
    """Keep inductor's cache (its compiled graphs and kernels, keyed by the graph, the torch version and the
    device, so runs of any config share it safely) in the package's cache folder, ``inductor/`` of
    ``files.default_cache_dir()`` (``~/.cache/recursive_lightning`` by default), rather than torch's default under
    the temporary directory, which a cluster often gives each job empty: a run that compiles what an earlier
    run compiled then loads the graphs instead of building them again. A ``TORCHINDUCTOR_CACHE_DIR`` the user
    set wins (torch itself sets the variable to its default when ``torch._dynamo`` is imported, so that value
    counts as unset), and so does torch's default where the folder cannot be written (a read-only home on a
    compute node). Returns the directory in use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # heavy

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.abspath(given) != os.path.abspath(default_cache_dir()):
        return given
    ours = files.default_cache_dir() / "inductor"
    writable = files.writable_dir_problem(ours) is None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(ours) if writable else os.path.abspath(default_cache_dir())
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compiled_graphs() -> tuple[int, int]:
    """(graphs inductor has compiled in this process so far, how many of them it loaded from its cache)."""
    from torch._dynamo.utils import counters  # heavy

    c = counters["inductor"]
    hits = c["fxgraph_cache_hit"]
    return hits + c["fxgraph_cache_miss"] + c["fxgraph_cache_bypass"], hits


def first_step_line(seconds: float, cfg: TrainConfig, graphs: tuple[int, int], cache: str | None) -> str:
    """What a compiled or graph-captured run's first optimizer step cost (``graphs``: :func:`compiled_graphs`
    made during it): the time a researcher waits before training runs at speed."""
    how = []
    if cfg.compile:
        scope = "layers" if cfg.compile is True else cfg.compile
        made, loaded = graphs
        where = f" ({cache})" if cache else ""
        how.append(
            f"train.compile {scope}: {made} graph(s) compiled, {loaded} of them from inductor's cache{where}"
        )
    if cfg.cuda_graphs:
        how.append("train.cuda_graphs: the step captured")
    if cfg.memory_kernel == "triton":
        how.append(
            "train.memory_kernel triton: its four kernels compiled and tuned (Triton's cache keeps them)"
        )
    return f"[train] first step ready in {seconds:.1f} s; " + "; ".join(how)
