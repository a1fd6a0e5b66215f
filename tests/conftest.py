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
