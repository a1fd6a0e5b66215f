import copy
import os
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# the README's test command runs two pytest-xdist workers on the two cores: one intra-op thread each (two
# workers with two threads each run tiny matrices several times slower: 129 s against 23 s for one test)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // _WORKERS))

import pytest  # noqa: E402

# The slowest test files, longest first (seconds of one quiet serial run), collected first: with
# `-n 2 --dist loadfile --no-loadscope-reorder` each worker starts on one of the longest and the short files
# fill in after, so that both finish together (longest processing time first). The rest keep their order.
SLOW_FILES = (
    "sweep/test_sweep_faults.py",  # 337
    "sweep/test_sweep.py",  # 334
    "model/test_mela.py",  # 147
    "training/test_training.py",  # 144
    "sweep/test_sweep_grow.py",  # 136
    "test_configs.py",  # 119
    "sweep/test_sweep_secrets.py",  # 150
    "sweep/test_sweep_postgres.py",  # 95
    "sweep/test_slurm.py",  # 95
    "sweep/test_sweep_devices.py",  # 85
    "model/test_model.py",  # 71
    "tracking/test_mlflow_view.py",  # 60
    "training/test_compile_cache.py",  # 54
    "training/test_run_dir_lock.py",  # 45
    "test_docs.py",  # 40
)


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    missing = [f for f in SLOW_FILES if not (here / f).exists()]
    if missing:  # a moved or renamed file: keep the list true
        raise pytest.UsageError(f"tests/conftest.py SLOW_FILES names files that do not exist: {missing}")

    def rank(item) -> int:
        rel = item.path.relative_to(here).as_posix() if item.path.is_relative_to(here) else ""
        return SLOW_FILES.index(rel) if rel in SLOW_FILES else len(SLOW_FILES)

    items.sort(key=rank)  # stable: each file's own order, and the other files', unchanged


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One tokenizer + shard cache for the whole session (tokenising the embedded corpus once)."""
    return str(tmp_path_factory.mktemp("rl-cache"))


def mela_against_float64(seed: int, chunks: int = 64, **model) -> tuple:
    """``cpu-mela`` with the ``model`` fields (random init from ``seed``), its float64 copy and one sequence of
    ``chunks`` decoder chunks: the numerics tests' setting."""
    from recursive_lightning.model.build import build_model
    from recursive_lightning.model.config import preset

    torch.manual_seed(seed)
    cfg = preset("cpu-mela", **model)
    low = build_model(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (1, chunks * cfg.tokens_per_chunk))
    return low, copy.deepcopy(low).double(), idx


# setup.sh installs Triton here on a machine without CUDA (outside site-packages: lightning imports triton where
# it finds it, which every process would then pay), for the fused kernels' tests under Triton's interpreter
TRITON_INTERPRETER = Path(__file__).resolve().parents[1] / ".venv" / "triton-interpreter"


@pytest.fixture
def memory_kernel(monkeypatch):
    """``model/mela/memory_kernel.py`` imported afresh (and ``memory_kernel_backward.py``, which imports it), its
    kernels run by Triton's interpreter on the CPU (``TRITON_INTERPRET=1``, read when ``triton.jit`` decorates
    them); skipped without Triton."""
    import importlib
    import sys

    import recursive_lightning.model.mela as package

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if TRITON_INTERPRETER.is_dir():
        monkeypatch.syspath_prepend(str(TRITON_INTERPRETER))
    pytest.importorskip("triton", reason="setup.sh installs triton for the fused kernels' tests")
    import dataclasses

    from triton.runtime import interpreter

    # the interpreter's int32 overflow check of every index addition and product: half the tests' time, and the
    # test shapes' offsets are far below 2^31
    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=False))
    names = ("memory_kernel", "memory_kernel_backward")
    for name in names:
        sys.modules.pop(f"{package.__name__}.{name}", None)
    yield importlib.import_module(f"{package.__name__}.memory_kernel")
    for name in names:  # the next import decorates the kernels for the device again
        sys.modules.pop(f"{package.__name__}.{name}", None)
        vars(package).pop(name, None)


@pytest.fixture
def memory_kernel_backward(memory_kernel):
    """``model/mela/memory_kernel_backward.py`` under Triton's interpreter, as :func:`memory_kernel`."""
    import importlib

    return importlib.import_module("recursive_lightning.model.mela.memory_kernel_backward")


def memory_chunk(
    d: int,
    heads: int,
    C: int,
    floor: float,
    dtype: torch.dtype,
    carried: bool,
    batch: int = 2,
    device: str = "cpu",
) -> tuple:
    """A neural memory (2-layer MLP, Newton-Schulz with ``floor``) and one chunk's update inputs (k, v, theta,
    eta_t, alpha_t, M_{t-1}, S_{t-1}), on ``device``: from M_0 (expanded, stride 0 over the batch) or from a
    state carried after one update (W_2 and S_2 then transposed views, as the fused kernel returns them)."""
    from recursive_lightning.model.mela.neural_memory import NeuralMemory

    torch.manual_seed(0)
    mem = NeuralMemory(d, heads, depth=2, expansion=2, chunk_size=C, step_floor=floor).to(device, dtype)
    with torch.no_grad():
        q, k, v, theta, eta, alpha = mem.project(torch.randn(batch, 2 * C, d, dtype=dtype).to(device))
        ks, vs, thetas = (t.split(C, dim=-2 if t.dim() == 4 else -1) for t in (k, v, theta))
        rates = [(eta[:, :, t, None, None], alpha[:, :, t, None, None]) for t in range(2)]
        state = mem.initial_state(batch)
        weights, momentum = state.weights, state.momentum
        if carried:
            weights, momentum = mem.update_memory(ks[0], vs[0], thetas[0], *rates[0], weights, momentum)
            weights = [weights[0], weights[1].mT.contiguous().mT]
    return mem, (ks[1], vs[1], thetas[1], *rates[1], weights, momentum)


def memory_kernels_set(model: torch.nn.Module) -> list[bool]:
    """Per neural memory of a Mela model, whether its updates run on the fused kernels (``use_memory_kernel``)."""
    from recursive_lightning.model.mela.neural_memory import NeuralMemory

    return [m.kernel is not None for m in model.modules() if isinstance(m, NeuralMemory)]


def floor_binds(mem, args: tuple, floor: float) -> torch.Tensor:
    """Per memory tensor, sequence and head, whether the bounded step's floor binds in the update of ``args``
    (:func:`memory_chunk`'s): ||S_t|| below tau (``neural_memory.step_floors``)."""
    from recursive_lightning.model.mela.neural_memory import step_floors

    with torch.no_grad():
        momentum = mem.update_memory(*args)[1]
        taus = step_floors(args[5], args[2], floor)
        return torch.stack(
            [torch.linalg.vector_norm(m, dim=(-2, -1)) < t[..., 0, 0] for m, t in zip(momentum, taus)]
        )


def update_outputs_and_gradients(update, args: tuple, cotangents: str = "random") -> tuple[list, tuple]:
    """M_t, S_t of ``update(*args)`` (args as :func:`memory_chunk` returns them) and the gradients of a loss
    in every input (k, v, theta, eta_t, alpha_t, M_{t-1}, S_{t-1}): <M_t, R> + <S_t, R'> for fixed random R, R'
    (``random``), the same with R, R' transposed views (``transposed``), or sum M_t with S_t unused (``sum``: the
    gradients reaching the update have stride 0, S_t's none)."""
    k, v, theta, eta, alpha, weights, momentum = args
    leaves = [t.detach().clone().requires_grad_() for t in (k, v, theta, eta, alpha, *weights, *momentum)]
    weights, momentum = update(*leaves[:5], leaves[5:7], leaves[7:9])
    outputs = weights + momentum
    if cotangents == "sum":
        return outputs, torch.autograd.grad(sum(w.sum() for w in weights), leaves)
    torch.manual_seed(1)
    # in index order whatever the strides, drawn in float64 on the CPU whatever the dtype and device
    draws = [torch.randn(o.shape, dtype=torch.float64) for o in outputs]
    if cotangents == "transposed":
        draws = [d.mT.contiguous().mT for d in draws]
    total = sum((o * d.to(o.device, o.dtype)).sum() for o, d in zip(outputs, draws))
    return outputs, torch.autograd.grad(total, leaves)


def chunk_errors(low: torch.Tensor, high: torch.Tensor, tokens_per_chunk: int) -> torch.Tensor:
    """Per decoder chunk of a Mela model, the largest |low - high| over the chunk's logits, relative to the
    largest |logit| of ``high`` (the float64 reference)."""
    err = (low.double().to(high.device) - high).abs().amax(dim=(0, 2)).view(-1, tokens_per_chunk).amax(1)
    return err / high.abs().amax()


def tiny_config(data_cache: str, **model) -> dict:
    """A run config that trains in seconds on the CPU: cpu-tiny, 64-token blocks of the embedded corpus."""
    return {
        "name": "tiny",
        "model": {"preset": "cpu-tiny", "layout": "1+2R2+1", "topology": "mesh", "max_seq_len": 128, **model},
        "data": {
            "tokenizer": "bpe:4096",
            "seq_len": 64,
            "batch_size": 8,
            "val_batches": 4,
            "cache_dir": data_cache,
        },
        "train": {
            "max_steps": 12,
            "lr": 3e-3,
            "val_every": 6,
            "checkpoint_every": 4,
            "progress": False,
            "seed": 0,
        },
    }


@pytest.fixture
def tiny_run(data_cache):
    """``tiny_run(**model_overrides)``: :func:`tiny_config` with this session's data cache."""
    return lambda **model: tiny_config(data_cache, **model)


@pytest.fixture(scope="module")
def slurm():
    """A real single-node SLURM cluster (munged, slurmctld, slurmd from slurm-wlm; tests/slurm_cluster.py),
    stopped with every daemon at the module's end; skipped in one line where it cannot start."""
    from slurm_cluster import SlurmCluster, unavailable

    why = unavailable()
    if why:
        pytest.skip(why)
    try:
        cluster = SlurmCluster(gpus=2).start()
    except RuntimeError as e:
        pytest.skip(f"SLURM did not start here: {str(e).splitlines()[0][:200]}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, data_cache):
    """One tiny run trained once for the session (12 steps of :func:`tiny_config`, checkpoints at 4, 8, 12):
    the artefact the edge-case tests hand to eval, probe, generate, ui, report. Tests must not change it
    (copy it first); the edge cases check that they do not."""
    from recursive_lightning.config import RunConfig
    from recursive_lightning.training.run import train

    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train(RunConfig.from_dict(tiny_config(data_cache)), run_dir)
    return run_dir


@pytest.fixture(scope="session")
def hf_model_dirs(tmp_path_factory):
    """A tiny random GPT-NeoX and LLaMA of 6 layers saved with ``save_pretrained``, each with a tokenizer.json
    (a 300-token BPE), as a downloaded Pythia / LLaMA directory looks: ``{"neox": path, "llama": path}``."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    from recursive_lightning.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("hf-models")
    docs = [f"uptraining document {i}: the shared core loops over the middle layers. " * 4 for i in range(40)]
    common = dict(
        vocab_size=320, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, intermediate_size=128
    )
    made = {}
    for name, cfg_cls, model_cls, extra in (
        ("neox", GPTNeoXConfig, GPTNeoXForCausalLM, {"rotary_pct": 0.25}),
        ("llama", LlamaConfig, LlamaForCausalLM, {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    ):
        torch.manual_seed(0)
        model_cls(cfg_cls(**common, max_position_embeddings=512, **extra)).save_pretrained(root / name)
        train_bpe(docs, 300).save(str(root / name / "tokenizer.json"))
        made[name] = root / name
    return made


# --- sweep test helpers (tests/test_sweep*.py, test_report.py, test_slurm.py): one definition each ----------
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# a `sweep` subprocess's environment: this tree importable, one thread, no fault point inherited from outside
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
ENV.pop("RECURSIVE_LIGHTNING_FAULT", None)
# a sweep whose trials train in seconds on the CPU (cpu-tiny, 32-token blocks, 6 steps)
TINY_SWEEP_OVERRIDES = {
    "model.preset": "cpu-tiny",
    "model.layout": "1+1R2+1",
    "data.seq_len": 32,
    "data.batch_size": 4,
    "data.val_batches": 2,
    "train.max_steps": 6,
    "train.val_every": 3,
    "train.checkpoint_every": 2,
    "train.progress": False,
}


def write_sweep(
    path: Path, cache: str, name: str, axes: dict, seeds=(0,), overrides: dict | None = None, **top
) -> Path:
    """A sweep file at ``path`` on experiments/cpu/looped-mesh.yaml: :data:`TINY_SWEEP_OVERRIDES` (then
    ``overrides``) with the data cache ``cache``, the given axes and seeds, and any other top-level field."""
    spec = {
        "name": name,
        "base": str(ROOT / "experiments/cpu/looped-mesh.yaml"),
        "overrides": {**TINY_SWEEP_OVERRIDES, "data.cache_dir": cache, **(overrides or {})},
        "axes": axes,
        "seeds": list(seeds),
        **top,
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def run_sweep(args, env=None, **kw) -> subprocess.Popen:
    """``python -m recursive_lightning sweep *args`` started, its output (stdout and stderr) piped as text."""
    return subprocess.Popen(
        [sys.executable, "-m", "recursive_lightning", "sweep", *map(str, args)],
        env=env or ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def live_children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` and that have not exited (a zombie, not yet waited for, is not
    counted): read from /proc, so a test waits for a process's end instead of guessing a time."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def command_output(command: str, *args, env=None, timeout=900) -> tuple[int, str]:
    """``python -m recursive_lightning COMMAND *args`` run to its end: (exit code, stdout and stderr). Past
    ``timeout`` (a command that hangs) its whole process group is killed, its ranks and workers too, and
    ``subprocess.TimeoutExpired`` raised."""
    p = subprocess.Popen(
        [sys.executable, "-m", "recursive_lightning", command, *map(str, args)],
        env=env or ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, out


def sweep_output(*args, env=None, timeout=900) -> tuple[int, str]:
    """``python -m recursive_lightning sweep *args`` run to its end: (exit code, output)."""
    return command_output("sweep", *args, env=env, timeout=timeout)


def run_of(run_dir: Path):
    """The MLflow run a run directory logs to (its recorded run id, in the store it records)."""
    from mlflow.tracking import MlflowClient

    from recursive_lightning.tracking.runs import default_tracking_uri

    run_id = (Path(run_dir) / "mlflow_run_id").read_text().strip()
    return MlflowClient(default_tracking_uri(run_dir)).get_run(run_id)


def sweep_runs(tracking: str, name: str):
    """(MLflow client, the sweep's parent runs, its child runs) in the tracking store."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(tracking)
    runs = c.search_runs([c.get_experiment_by_name(name).experiment_id])
    parents = [r for r in runs if r.data.tags.get("kind") == "sweep"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return c, parents, children


@pytest.fixture(scope="module")
def pg():
    """A throwaway PostgreSQL cluster for the module; skipped where its server binaries are not installed."""
    from recursive_lightning.sweep import servers

    if servers.postgres_bindir() is None:
        pytest.skip("PostgreSQL's server binaries (initdb, pg_ctl) are not installed")
    with servers.LocalPostgres(fast=True) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def mlflow_server(pg, tmp_path_factory):
    """An `mlflow server` whose backend store is a PostgreSQL database, artifacts served from a folder."""
    from recursive_lightning.sweep import servers

    backend = pg.create_database("mlflow")
    with servers.LocalMlflowServer(backend, tmp_path_factory.mktemp("mlflow") / "artifacts") as server:
        yield server.uri


def sweep_file(tmp_path: Path, cache: str, rows: dict, seeds=(0,), steps: int = 12) -> Path:
    overrides = {
        "model.layout": "1+2R2+1",
        "data.seq_len": 64,
        "data.batch_size": 8,
        "train.max_steps": steps,
        "train.val_every": 6,
        "train.checkpoint_every": 4,
    }
    return write_sweep(tmp_path / "sweep.yaml", cache, "tiny-sweep", {"variant": rows}, seeds, overrides)


def assert_eval_refused(
    ckpt: Path, text: Path, flags: list[str], message: str, out_root: Path, capsys
) -> None:
    """``eval ckpt --ppl doc=text ... flags`` exits 2 with one sentence holding ``message`` and leaves nothing
    on disk: neither its output folder nor its tracking database (tests/evaluation: --loops, --exit-kl)."""
    from recursive_lightning.cli import main

    out, db = out_root / "o", out_root / "m.db"
    args = ["eval", str(ckpt), "--ppl", f"doc={text}", "--tasks", "none", "--out", str(out)]
    assert main([*args, "--tracking-uri", f"sqlite:///{db}", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() and not db.exists()


def read_only(monkeypatch, *dirs: Path) -> None:
    """Make ``dirs`` read-only for the package's write check (chmod does not stop root, who runs CI here)."""
    from recursive_lightning import files

    real = files._can_write
    roots = [d.resolve() for d in dirs]

    def can_write(d: Path) -> bool:
        d = Path(d).resolve()
        return not any(d == r or r in d.parents for r in roots) and real(d)

    monkeypatch.setattr(files, "_can_write", can_write)
