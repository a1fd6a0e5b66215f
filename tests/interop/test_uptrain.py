"""Uptraining (interop/init.py and training/uptrain.py): layer maps by strategy, identity starts,
HF sources offline, one-sentence errors, the record in checkpoints and MLflow, train_only, exact resume
without the source."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from recursive_lightning.config import RunConfig  # noqa: E402
from recursive_lightning.errors import ConfigError  # noqa: E402
from recursive_lightning.interop.init import layer_map  # noqa: E402
from recursive_lightning.model.config import ModelConfig  # noqa: E402
from recursive_lightning.model.layout import parse_layout  # noqa: E402
from recursive_lightning.model.recursive.model import RecursiveLM  # noqa: E402
from recursive_lightning.training import uptrain  # noqa: E402
from recursive_lightning.training.uptrain import Source, initialise_from  # noqa: E402

SMALL = {"preset": "cpu-tiny", "max_seq_len": 64, "vocab_size": 512}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one thread is several times faster than two on a shared, busy CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _one_sentence(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and text.endswith("."), text
    return text


# ------------------------------------------------------------------------------------------ layer maps
# Bae et al. 2024 for a middle of M = K m layers (K loops of an m-layer core, prelude P):
#   stepwise: core layer j = P + K j; average: mean of P + j + k m (k < K); lower: P + j.
@pytest.mark.parametrize(
    "layout, pre, core, loops",
    [
        ("2+4R2+2", 2, 4, 2),
        ("0+6R2+0", 0, 6, 2),
        ("3+3R2+3", 3, 3, 2),
        ("2+4x{1/2,1}+2", 2, 4, 2),
        ("1+2R5+1", 1, 2, 5),
    ],
)
def test_layer_map_is_what_each_strategy_defines(layout, pre, core, loops):
    lay = parse_layout(layout)
    coda = list(range(12 - lay.coda, 12))
    expected = {
        "stepwise": [(pre + loops * j,) for j in range(core)],
        "average": [tuple(pre + j + k * core for k in range(loops)) for j in range(core)],
        "lower": [(pre + j,) for j in range(core)],
    }
    for strategy, cores in expected.items():
        got = layer_map(12, lay, strategy)
        assert got == {"prelude": [(i,) for i in range(pre)], "cores.0": cores, "coda": [(i,) for i in coda]}


def test_distinct_cores_take_consecutive_layers_by_every_strategy():
    lay = parse_layout("2+3+3+2+2")  # three distinct cores, each applied once: nothing is shared
    for strategy in ("stepwise", "average", "lower"):
        got = layer_map(12, lay, strategy)
        flat = [i for name in ("prelude", "cores.0", "cores.1", "cores.2", "coda") for (i,) in got[name]]
        assert flat == list(range(12)), strategy


def test_select_maps_explicit_layers_and_refuses_bad_maps():
    lay = parse_layout("4+4R2+4")
    got = layer_map(12, lay, "select:0-3/5,7,9,11/8-11")
    assert got["cores.0"] == [(5,), (7,), (9,), (11,)] and got["coda"] == [(8,), (9,), (10,), (11,)]
    for bad, says in (
        ("select:0-3/4-7", "groups"),
        ("select:0-3/4-6/8-11", "cores.0 3 layers"),
        ("select:0-3/4-7/9-12", "layer 12"),
        ("select:0-3/7-4/8-11", "increasing range"),
        ("spiral", "unknown"),
    ):
        with pytest.raises(ConfigError) as err:
            layer_map(12, lay, bad)
        assert says in _one_sentence(err)
    with pytest.raises(ConfigError) as err:  # stepwise / lower need as many middle layers as the core has
        layer_map(12, parse_layout("4+8R2+4"), "lower")
    assert "use average or select" in _one_sentence(err)


# ------------------------------------------------------------------------------------------ identity starts
@pytest.fixture(scope="module")
def vanilla() -> Source:
    torch.manual_seed(0)
    model = RecursiveLM(ModelConfig.from_dict({**SMALL, "layout": "12"})).double().eval()
    with torch.no_grad():  # well away from the init, so that every weight visibly matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return Source("in-memory", "checkpoint", model, None)


def _target(layout: str, topology: str, **kw) -> RecursiveLM:
    return (
        RecursiveLM(ModelConfig.from_dict({**SMALL, "layout": layout, "topology": topology, **kw}))
        .double()
        .eval()
    )


def _stacked(source: Source, layers: list[int]) -> RecursiveLM:
    """A vanilla model running ``layers`` of the source in this order (the computation a start should equal)."""
    model = _target(str(len(layers)), "base")
    model.load_state_dict(
        {k: v for k, v in source.model.state_dict().items() if ".layers." not in k}, strict=False
    )
    for j, i in enumerate(layers):
        model.prelude.layers[j].load_state_dict(source.model.prelude.layers[i].state_dict())
    return model


IDX = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("topology", ["base", "static", "dynamic"])
@pytest.mark.parametrize(
    "layout, select", [("4+4R1+4", "select:0-3/4-7/8-11"), ("3+2+4+3", "select:0-2/3-4/5-8/9-11")]
)
def test_prelude_core_coda_covering_every_layer_once_gives_the_vanilla_logits(
    vanilla, topology, layout, select
):
    model = _target(layout, topology)
    record = initialise_from(model, vanilla, select)
    assert record["start"].startswith("exact")
    with torch.no_grad():
        torch.testing.assert_close(model(IDX), vanilla.model(IDX), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "layout, topology, layers",
    [
        # looped twice: prelude, the stepwise core twice, coda (every step applied)
        ("2+4R2+2", "base", [0, 1, 2, 4, 6, 8, 2, 4, 6, 8, 10, 11]),
        ("2+4R2+2", "static", [0, 1, 2, 4, 6, 8, 2, 4, 6, 8, 10, 11]),
        ("2+4R2+2", "dynamic", [0, 1, 2, 4, 6, 8, 2, 4, 6, 8, 10, 11]),
        # SpiralFormer with a coefficient topology: coarse steps start as skips, the full-resolution step applies
        ("2+4x{1/4,1/2,1}+2", "static", [0, 1, 2, 4, 6, 8, 10, 11]),
        ("2+4x{1/2,1}+2", "dynamic", [0, 1, 2, 4, 6, 8, 10, 11]),
    ],
)
def test_looped_and_spiral_starts_compute_the_selected_layers(vanilla, layout, topology, layers):
    model = _target(layout, topology)
    initialise_from(model, vanilla, "stepwise")
    with torch.no_grad():
        torch.testing.assert_close(model(IDX), _stacked(vanilla, layers)(IDX), atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["2+4R2+2", "2+4x{1/4,1/2,1}+2", "2+4+4+2"])
def test_every_topology_starts_as_the_uptraining_page_table_says(vanilla, layout):
    from recursive_lightning.model.config import TOPOLOGIES

    coarse = "x{" in layout
    for topology in TOPOLOGIES:
        model = _target(layout, topology)
        start = initialise_from(model, vanilla, "average")["start"]
        if topology in ("static", "dynamic") or (topology == "base" and not coarse):
            assert start.startswith("exact"), (topology, start)
        elif topology == "mesh":
            assert start.startswith("near"), start
        else:
            assert start.startswith("not an identity"), (topology, start)
        with torch.no_grad():
            assert torch.isfinite(model(IDX)).all()


def test_mesh_starts_near_the_selected_layers_and_closer_with_a_larger_margin(vanilla):
    want = _stacked(vanilla, [0, 1, 2, 4, 6, 8, 10, 11])
    gaps = []
    for margin in (4.0, 8.0, 16.0, 40.0):
        model = _target("2+4x{1/4,1/2,1}+2", "mesh")  # SpiralFormer-B: coarse writes are never read
        record = initialise_from(model, vanilla, "stepwise", margin=margin)
        assert record["start"].startswith("near")
        with torch.no_grad():
            gaps.append((model(IDX) - want(IDX)).abs().max().item())
    assert gaps[0] > gaps[1] > gaps[2] and gaps[3] < 1e-5, gaps
    model = _target("2+4R2+2", "mesh", buffer=3)  # too few slots to keep each update apart: paper init kept
    assert initialise_from(model, vanilla, "stepwise")["start"].startswith("paper init")


def test_average_is_the_mean_of_the_tied_layers(vanilla):
    model = _target("2+4R2+2", "base")
    initialise_from(model, vanilla, "average")
    src = vanilla.model.prelude.layers
    for j in range(4):
        for name, p in model.cores[0].layers[j].named_parameters():
            want = (src[2 + j].get_parameter(name) + src[6 + j].get_parameter(name)) / 2
            torch.testing.assert_close(p, want, atol=1e-12, rtol=0)


def test_mismatched_target_is_one_sentence_and_leaves_the_model_untouched(vanilla):
    model = _target("4+4R1+4", "base", norm="rmsnorm", bias=False)
    with pytest.raises(ConfigError) as err:
        initialise_from(model, vanilla, "stepwise")
    assert "model.norm" in _one_sentence(err)
    model = _target("4+4R1+4", "base", n_heads=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as err:
        initialise_from(model, vanilla, "stepwise")
    assert "model.n_heads" in _one_sentence(err)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------------------------ Hugging Face sources
transformers = pytest.importorskip("transformers")


def _bpe(vocab: int):
    from recursive_lightning.data.tokenizer import train_bpe

    docs = [f"uptraining document {i}: the shared core loops over the middle layers. " * 4 for i in range(40)]
    return train_bpe(docs, vocab)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A tiny random GPT-NeoX and LLaMA written with save_pretrained (and a tokenizer.json beside each)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("hf")
    common = dict(
        vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128
    )
    made = {}
    for name, cfg_cls, model_cls, extra in (
        ("neox", GPTNeoXConfig, GPTNeoXForCausalLM, {"rotary_pct": 0.25}),
        ("llama", LlamaConfig, LlamaForCausalLM, {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    ):
        torch.manual_seed(0)
        hf = model_cls(cfg_cls(**common, max_position_embeddings=128, **extra)).float().eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_(0.0, 0.1)
        hf.save_pretrained(root / name)
        _bpe(300).save(str(root / name / "tokenizer.json"))
        made[name] = (root / name, hf)
    return made


@pytest.mark.parametrize("family", ["neox", "llama"])
def test_local_hf_directory_offline_gives_the_hf_logits(hf_dirs, family):
    from recursive_lightning.interop import hf as convert

    path, hf = hf_dirs[family]
    source = uptrain.load_source(str(path))  # HF_HUB_OFFLINE=1: local files only
    assert source.kind == {"neox": "gpt_neox", "llama": "llama"}[family] and source.tokenizer is not None
    to_config = convert.config_from_gpt_neox if family == "neox" else convert.config_from_llama
    cfg = to_config(hf.config).to_dict()
    model = RecursiveLM(ModelConfig.from_dict({**cfg, "layout": "1+2R1+1", "n_layers_hint": None})).eval()
    record = initialise_from(model, source, "select:0/1-2/3")
    assert record["fingerprint"] == uptrain.weights_fingerprint(source.model)
    idx = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, atol=1e-5, rtol=0)
    for field, value in (("d_model", 32), ("vocab_size", 512)):  # width, vocabulary: the tensor is named
        bad = RecursiveLM(
            ModelConfig.from_dict({**cfg, "layout": "1+2R1+1", field: value, "n_layers_hint": None})
        )
        with pytest.raises(ConfigError) as err:
            initialise_from(bad, source, "stepwise")
        assert "tensor 'embed.weight'" in _one_sentence(err)


def test_a_hub_name_offline_is_one_sentence():
    with pytest.raises(ConfigError) as err:
        uptrain.load_source("EleutherAI/no-such-model-for-tests")
    assert "Hugging Face Hub" in _one_sentence(err)
    with pytest.raises(ConfigError) as err:
        uptrain.load_source("/no/such/dir")
    assert "does not exist" in _one_sentence(err)


# ------------------------------------------------------------------------------------------ train --init-from
@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """A small text folder (fast to tokenise; the embedded corpus would cost a BPE training here)."""
    import random

    rng = random.Random(0)
    words = (
        "the shared core loops over middle layers while prelude and coda keep their first and last".split()
    )
    root = tmp_path_factory.mktemp("docs")
    for i in range(80):
        (root / f"{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(400)) + f" {i}.")
    return root


def _small_data(cfg: dict, docs, tokenizer: str = "bpe:300") -> dict:
    cfg["data"].update(path=str(docs), tokenizer=tokenizer, val_batches=2)
    return cfg


def _state(ckpt) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}


def test_train_init_from_a_checkpoint_records_freezes_and_resumes_exactly(tmp_path, tiny_run, docs):
    from mlflow.tracking import MlflowClient

    from recursive_lightning.training.checkpoint import read_checkpoint, save_model_checkpoint
    from recursive_lightning.training.run import train

    vanilla_run = RunConfig.from_dict(_small_data(tiny_run(layout="4", topology="base"), docs))
    torch.manual_seed(0)  # a vanilla checkpoint of ours (as train writes it), with its tokenizer
    save_model_checkpoint(
        tmp_path / "vanilla" / "checkpoints" / "last.ckpt",
        RecursiveLM(vanilla_run.model),
        vanilla_run,
        _bpe(300),
    )
    source_ckpt = read_checkpoint(tmp_path / "vanilla" / "checkpoints" / "last.ckpt")

    cfg = _small_data(tiny_run(layout="1+2R2+1", topology="mesh"), docs, tokenizer="init")
    cfg["train"].update(
        max_steps=4,
        checkpoint_every=2,
        val_every=4,
        init_from=str(tmp_path / "vanilla"),
        init_strategy="lower",
    )
    cfg["train"].update(train_only=["topology", "core"], train_only_steps=2)
    run = RunConfig.from_dict(cfg)
    straight = tmp_path / "straight"
    train(run, straight)

    step2 = read_checkpoint(straight / "checkpoints" / "step=000002.ckpt")
    record = step2["uptrain"]
    src = uptrain.load_source(str(tmp_path / "vanilla"))
    assert record["fingerprint"] == uptrain.weights_fingerprint(src.model)
    assert record["layer_map"] == {"prelude": [[0]], "cores.0": [[1], [2]], "coda": [[3]]}
    assert record["strategy"] == "lower" and record["kind"] == "checkpoint"
    theirs, ours = _state(source_ckpt), _state(step2)
    for k in ("embed.weight", "head.weight", "norm.weight", "prelude.layers.0.attn.qkv.weight"):
        assert torch.equal(ours[k], theirs[k]), k  # not in train_only: untouched for two steps
    assert torch.equal(ours["coda.layers.0.mlp.up.weight"], theirs["prelude.layers.3.mlp.up.weight"])
    assert not torch.equal(ours["cores.0.layers.0.mlp.up.weight"], theirs["prelude.layers.1.mlp.up.weight"])
    assert not torch.equal(ours["topology.write.0.weight"], torch.zeros_like(ours["topology.write.0.weight"]))
    final = _state(read_checkpoint(straight / "checkpoints" / "last.ckpt"))
    assert not torch.equal(final["embed.weight"], theirs["embed.weight"])  # everything trains after step 2

    run_id = (straight / "mlflow_run_id").read_text().strip()
    mlrun = MlflowClient(f"sqlite:///{straight / 'mlflow.db'}").get_run(run_id)
    assert mlrun.data.params["init.fingerprint"] == record["fingerprint"]
    assert mlrun.data.params["init.strategy"] == "lower"
    assert json.loads(mlrun.data.tags["init.layer_map"]) == record["layer_map"]

    # resume from the step-2 checkpoint with the source gone: the init is never applied again
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    for name in ("last.ckpt", "step=000004.ckpt", "best.ckpt"):
        (resumed / "checkpoints" / name).unlink(missing_ok=True)
    (resumed / "result.json").unlink()
    shutil.move(tmp_path / "vanilla", tmp_path / "gone")
    train(run, resumed, resume=True)
    last = read_checkpoint(resumed / "checkpoints" / "last.ckpt")
    assert last["uptrain"] == record
    again = _state(last)
    assert all(torch.equal(final[k], again[k]) for k in final), [
        k for k in final if not torch.equal(final[k], again[k])
    ]


def test_train_takes_the_source_tokenizer_and_refuses_another(tmp_path, tiny_run, hf_dirs, docs):
    from recursive_lightning.interop import hf as convert
    from recursive_lightning.training.run import train

    path, hf = hf_dirs["neox"]
    cfg = tiny_run()
    model = {**convert.config_from_gpt_neox(hf.config).to_dict(), "layout": "1+2R2+1", "topology": "static"}
    model.pop("n_layers_hint")
    cfg.update(model=model)
    cfg["data"].update(path=str(docs), tokenizer="bpe:300", batch_size=2, val_batches=1)
    cfg["train"].update(max_steps=1, val_every=1, init_from=str(path))
    with pytest.raises(ConfigError) as err:
        train(RunConfig.from_dict(cfg), tmp_path / "refused")
    text = _one_sentence(err)
    assert "'bpe:300'" in text and str(path) in text  # names both tokenizers
    cfg["data"]["tokenizer"] = "init"
    result = train(RunConfig.from_dict(cfg), tmp_path / "run")
    assert result.steps == 1
    kept = (tmp_path / "run" / uptrain.TOKENIZER_FILE).read_text()
    assert kept == uptrain.load_source(str(path)).tokenizer.to_str()


def test_cli_init_from_defaults_to_the_source_tokenizer(tmp_path):
    args = ["--train.init_from", "rel-source"]
    (tmp_path / "c.yaml").write_text("name: x\n")
    assert uptrain.cli_overrides("rel-source", str(tmp_path / "c.yaml"), args)[-2:] == [
        "--data.tokenizer",
        "init",
    ]
    # a recipe's tokenizer (for training from scratch) gives way to the source's ...
    (tmp_path / "d.yaml").write_text("data:\n  tokenizer: bpe:4096\n")
    assert uptrain.cli_overrides("rel-source", str(tmp_path / "d.yaml"), args)[-2:] == [
        "--data.tokenizer",
        "init",
    ]
    # ... one named beside the file's own init_from, or on the command line, is kept (and checked later)
    (tmp_path / "e.yaml").write_text("data:\n  tokenizer: bpe:4096\ntrain:\n  init_from: rel-source\n")
    assert uptrain.cli_overrides("rel-source", str(tmp_path / "e.yaml"), args) == args
    named = [*args, "--data.tokenizer", "bpe:4096"]
    assert uptrain.cli_overrides("rel-source", str(tmp_path / "d.yaml"), named) == named


def test_train_only_config_errors_are_one_sentence():
    for train_cfg, says in (
        ({"train_only": ["topology", "routers"], "train_only_steps": 5}, "'routers'"),
        ({"train_only_steps": 5}, "names no parts"),
        ({"train_only": ["core"]}, "train_only_steps is 0"),
        ({"train_only": ["core"], "train_only_steps": 500}, "exceeds train.max_steps"),
        ({"init_from": "x", "init_strategy": "every-other"}, "train.init_strategy"),
    ):
        with pytest.raises(ConfigError) as err:
            RunConfig.from_dict({"train": train_cfg})
        assert says in _one_sentence(err)


@pytest.mark.slow
def test_init_from_on_two_fsdp2_processes_starts_from_the_source(tmp_path, tiny_run, docs):
    """`train --init-from` as a 2-process FSDP2 job (gloo on the CPU): every rank starts from the source's
    layers before sharding, and train_only holds under FSDP2 (the parts outside it equal the source's after
    the frozen steps, read back from the sharded checkpoint; the core moved)."""
    import subprocess
    import sys

    import yaml

    from recursive_lightning.training.checkpoint import load_checkpoint, save_model_checkpoint

    vanilla_run = RunConfig.from_dict(_small_data(tiny_run(layout="4", topology="base"), docs))
    torch.manual_seed(0)
    source = RecursiveLM(vanilla_run.model)
    save_model_checkpoint(tmp_path / "vanilla" / "checkpoints" / "last.ckpt", source, vanilla_run, _bpe(300))
    cfg = _small_data(tiny_run(layout="1+2R2+1", topology="mesh"), docs, tokenizer="init")
    cfg["train"].update(max_steps=2, checkpoint_every=2, val_every=2, init_from=str(tmp_path / "vanilla"))
    cfg["train"].update(init_strategy="lower", train_only=["topology", "core"], train_only_steps=2)
    cfg["train"].update(strategy="fsdp", devices=2, accelerator="cpu")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "recursive_lightning", "train", "--config", str(tmp_path / "cfg.yaml")]
    p = subprocess.run([*cmd, "--run-dir", str(tmp_path / "run")], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir()  # a sharded (distributed) checkpoint
    ours = load_checkpoint(ckpt).model.state_dict()
    theirs = source.state_dict()
    for k in ("embed.weight", "head.weight", "norm.weight", "prelude.layers.0.attn.qkv.weight"):
        assert torch.equal(ours[k], theirs[k]), k  # copied on both ranks, frozen for two steps
    assert torch.equal(ours["coda.layers.0.mlp.up.weight"], theirs["prelude.layers.3.mlp.up.weight"])
    assert not torch.equal(ours["cores.0.layers.0.mlp.up.weight"], theirs["prelude.layers.1.mlp.up.weight"])
