import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    """One tokenizer + shard cache for the whole session (tokenising the embedded corpus once)."""
    return str(tmp_path_factory.mktemp("rl-cache"))


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
