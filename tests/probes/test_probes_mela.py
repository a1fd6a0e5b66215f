"""Mela probes (probes/mela.py): the recorded gates, the JSON layout, MemStack's change, the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recursive_lightning.errors import UserError
from recursive_lightning.model.build import build_model
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.probes.mela import applications, capture_mela, summarize

TINY = {
    "preset": "cpu-mela",
    "d_model": 32,
    "n_heads": 4,
    "n_kv_heads": 2,
    "hmm_heads": 2,
    "vocab_size": 97,
    "layout": "3",
    "patch_size": 2,
    "chunk_size": 3,
    "h_cycles": 3,
    "l_cycles": 2,
    "h_layers": 2,
    "l_layers": 1,
    "memory_heads": 2,
}
PC, C = 6, 3
N, L = 5, 4 * PC  # 4 text chunks, 3 memory chunks


def tiny(**over):
    torch.manual_seed(0)
    return build_model(ModelConfig.from_dict({**TINY, **over}))


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 97, (N, L), generator=torch.Generator().manual_seed(1))


def _inputs_of(model, memory, call, tokens, batch_size, per_chunk):
    """The input x of the ``call``-th application of one NeuralMemory during ``model.hidden``, over every
    chunk (the HMM runs chunk by chunk: the memory is called ``per_chunk`` times a chunk), run in the
    capture's batches (the same float paths: deep in the recursion, batch sizes differ in the last bits)."""
    seen, xs = [], []
    handle = memory.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    try:
        with torch.no_grad():
            for i in range(0, len(tokens), batch_size):
                seen.clear()
                model.hidden(tokens[i : i + batch_size])
                xs.append(torch.cat(seen[call::per_chunk], dim=1))
    finally:
        handle.remove()
    return torch.cat(xs)


@pytest.mark.parametrize("app", ["cycle 2 / L step 2 / L-block 0", "cycle 3 / H-block 1"])
def test_recorded_gates_are_the_sigmoid_of_the_heads(model, tokens, app):
    cap = capture_mela(model, tokens, batch_size=2, progress=False)  # batches of 2, 2, 1: weighted
    names = [a["name"] for a in cap.applications]
    a = names.index(app)
    module, block = cap.applications[a]["module"], cap.applications[a]["block"]
    memory = (model.hmm.l_module if module == "l" else model.hmm.h_module).blocks[block].memory
    call = sum(1 for b in cap.applications[:a] if (b["module"], b["block"]) == (module, block))
    per_chunk = sum(1 for b in cap.applications if (b["module"], b["block"]) == (module, block))
    x = _inputs_of(model, memory, call, tokens, 2, per_chunk)  # (N, patches, d)
    T = cap.memory_chunks
    assert x.shape[1] == T * C
    chunks = x.view(N, T, C, -1)
    with torch.no_grad():
        theta = memory.max_lr * torch.sigmoid(memory.theta(chunks)).mean(
            dim=(0, 2, 3)
        )  # samples, positions, heads
        pooled = chunks.mean(dim=2)
        eta = torch.sigmoid(memory.eta(pooled)).mean(dim=(0, 2))
        alpha = torch.sigmoid(memory.alpha(pooled)).mean(dim=(0, 2))
    for name, want in (("theta", theta), ("eta", eta), ("alpha", alpha)):
        got = torch.from_numpy(getattr(cap, name)[a]).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    # Newton-Schulz: the update's singular values at most ~1 (a unit step, scaled down by the step floor where
    # the surprise is small against the memory: model.memory_step_floor), none far above
    sv = cap.singular[a]
    assert sv.shape == (T, 2, 16) and 0 < sv[..., 0].min() and sv.max() < 1.3


def test_json_holds_every_application_and_chunk(model, tokens):
    from recursive_lightning.probes.outputs import clean

    cap = capture_mela(model, tokens[:2], batch_size=4, progress=False)
    mela = json.loads(json.dumps(clean(summarize(cap))))  # as probes.json holds it
    apps = applications(model.cfg)
    assert len(apps) == 3 * (2 * 1 + 2) == len(mela["applications"])
    assert apps[5]["name"] == "cycle 2 / L step 2 / L-block 0" and apps[-1]["name"] == "cycle 3 / H-block 1"
    records = mela["memory"]["records"]
    assert len(records) == 12 * 3
    assert [(r["application"], r["chunk"]) for r in records] == [
        (a["name"], t) for a in apps for t in range(3)
    ]
    for r in records:
        assert len(r["surprise_norm"]) == 2 and len(r["update_singular_values"]) == 2
        assert all(0 < r[k] < 1 for k in ("theta", "eta", "alpha"))
    assert [a["gradients"] for a in mela["applications"]] == [False] * 8 + [True] * 4


def test_memstack_change(model, tokens):
    cap = capture_mela(model, tokens, batch_size=N, progress=False)  # one batch, as the reference below
    r = cap.memstack_ratio  # [N, H-1, text chunks]
    assert r.shape == (N, 2, 4)
    assert (r[:, :, 0] == 0).all() and (r[:, :, 1:] > 0).all()  # chunk 0 reads the initial memory
    # independently: what layer a+1 receives minus what layer a returned, at the memory rows
    outs, ins = {}, {}
    hooks = [
        model.layers[a].register_forward_hook(lambda m, i, o, a=a: outs.__setitem__(a, o)) for a in (0, 1)
    ]
    hooks += [
        model.layers[a].register_forward_pre_hook(lambda m, i, a=a: ins.__setitem__(a, i[0])) for a in (1, 2)
    ]
    try:
        with torch.no_grad():
            model.hidden(tokens)
    finally:
        for h in hooks:
            h.remove()
    for a in (0, 1):
        y = outs[a][:, :C].reshape(N, 4, -1)
        change = (ins[a + 1][:, :C].reshape(N, 4, -1) - y).norm(dim=-1) / y.norm(dim=-1)
        torch.testing.assert_close(torch.from_numpy(r[:, a]).float(), change, rtol=1e-4, atol=1e-6)
    off = capture_mela(tiny(memstack=False), tokens, batch_size=3, progress=False)
    assert off.memstack_ratio.shape == (N, 2, 4) and (off.memstack_ratio == 0).all()
    assert (off.memstack_rows > 0).all()


def test_one_chunk_is_refused(model, tokens):
    with pytest.raises(UserError, match="only one Mela chunk"):
        capture_mela(model, tokens[:, :PC], progress=False)


# ---------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from pydoc_data.topics import topics

    from recursive_lightning.config import RunConfig
    from recursive_lightning.data.tokenizer import train_bpe
    from recursive_lightning.tracking.runs import (
        RUN_ID_FILE,
        create_run,
        default_tracking_uri,
        ensure_experiment,
    )
    from recursive_lightning.training.checkpoint import save_model_checkpoint

    docs = [topics[k] for k in sorted(topics)]
    root = tmp_path_factory.mktemp("mela")
    (root / "text.txt").write_text("\n\f\n".join(docs))
    cfg = RunConfig.from_dict(
        {"name": "mela-tiny", "model": {**TINY, "vocab_size": 320}, "data": {"seq_len": L}}
    )
    run = root / "run"
    uri = default_tracking_uri(run)
    run_id = create_run(uri, ensure_experiment(uri, "mela-tiny", run / "mlartifacts"), "mela-tiny")
    (run / RUN_ID_FILE).write_text(run_id)
    torch.manual_seed(0)
    save_model_checkpoint(
        run / "checkpoints" / "last.ckpt",
        build_model(cfg.model),
        cfg,
        train_bpe(docs, 300),
        mlflow_run_id=run_id,
    )
    return run


def test_probe_command_on_a_mela_checkpoint(run_dir, capsys):
    from mlflow.tracking import MlflowClient

    from recursive_lightning.commands.probe import main
    from recursive_lightning.tracking.runs import RUN_ID_FILE, default_tracking_uri

    text = run_dir.parent / "text.txt"
    argv = [str(run_dir), "--data", str(text), "--samples", "5", "--batch-size", "2", "--no-progress"]
    assert main(argv) == 0
    assert "Mela checkpoint" in capsys.readouterr().out
    out = run_dir / "probes"
    summary = json.loads((out / "probes.json").read_text())
    assert summary["probes"] == "mela" and summary["model"]["arch"] == "mela"
    assert summary["data"]["samples"] == 5 and summary["data"]["seq_len"] == L
    assert len(summary["mela"]["memory"]["records"]) == 12 * 3
    assert len(summary["mela"]["memstack"]["relative_change"]["per_chunk"]) == 2
    figures = {"mela_surprise.png", "mela_rates.png", "mela_update_spectrum.png", "mela_memstack.png"}
    assert set(summary["figures"]) == figures
    for name in figures:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run_id = (run_dir / RUN_ID_FILE).read_text()
    client = MlflowClient(default_tracking_uri(run_dir))
    logged = {Path(f.path).name for f in client.list_artifacts(run_id, "probes")}
    assert {"probes.json", *figures} <= logged
    metrics = client.get_run(run_id).data.metrics
    assert {"probe/mela/theta", "probe/mela/memstack/cycle1", "probe/mela/memstack/cycle2"} <= set(metrics)
    # --compare has no common axes for Mela runs: one sentence
    with pytest.raises(UserError, match="Mela checkpoint") as err:
        main(["--compare", str(run_dir), str(run_dir), "--data", str(text), "--no-mlflow", "--no-progress"])
    msg = str(err.value)
    assert "\n" not in msg and msg.endswith(".") and msg.count(". ") == 0
