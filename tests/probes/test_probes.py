"""The `probe` command: probing leaves the model untouched, batched capture equals the reference
metrics, MeSH composition from hand-set routers, the CLI end to end (PNGs, JSON, MLflow), --compare,
and one-sentence user errors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from recursive_lightning.errors import UserError
from recursive_lightning.model.config import TOPOLOGIES, ModelConfig
from recursive_lightning.model.recursive.model import RecursiveLM
from recursive_lightning.probes.attention import key_marginal_entropy, lam_window, local_attention_mass
from recursive_lightning.probes.capture import ProbeSettings, capture
from recursive_lightning.probes.cka import cka_matrix
from recursive_lightning.probes.mesh import mesh_state_composition
from recursive_lightning.probes.skew import computation_skew
from recursive_lightning.probes.subspace import shared_subspace_variance

TINY = dict(vocab_size=61, d_model=32, n_heads=4, max_seq_len=64)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: one intra-op thread is faster than two and immune to a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(layout: str, topology: str = "base", seed: int = 0, **kw) -> RecursiveLM:
    torch.manual_seed(seed)
    model = RecursiveLM(
        ModelConfig.from_dict({**TINY, "layout": layout, "topology": topology, **kw})
    ).double()
    if topology in ("static", "dynamic"):  # move off the initial point so every coefficient matters
        with torch.no_grad():
            for p in model.topology.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def tokens(n: int = 5, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (n, length), generator=torch.Generator().manual_seed(seed))


CASES = (
    [("6", "base")]
    + [("1+2R3+1", t) for t in TOPOLOGIES]
    + [
        ("1+2x{1/4,1/2,1}+1", "mesh"),
        ("1+2x{1/4,1/2,1}+1", "base"),
        ("1+1+1+1", "mesh"),
    ]
)


# ---------------------------------------------------------------------------
# probing does not change the model
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "topology"), CASES)
def test_probing_leaves_outputs_unchanged(layout, topology):
    model = tiny(layout, topology)
    x = tokens()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plain = model(x)
    logits, trace = model.traced(x)
    assert torch.equal(logits, plain)  # same code path without attention maps
    logits_att, trace_att = model.traced(x, attention=True)
    # explicit softmax(QK^T) (the path that records maps) vs SDPA: Attention._explicit takes the softmax in
    # float32 (`scores.float()`), even for a float64 model, hence float32-level agreement only
    torch.testing.assert_close(logits_att, plain, atol=1e-6, rtol=1e-4)
    assert len(trace.states) == model.layout.n_loop + 3
    cap = capture(model, x, ProbeSettings(batch_size=2, token_index=5), progress=False)
    assert torch.equal(model(x), plain)  # no hook left behind
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    S = model.layout.n_loop + 3
    assert cap.cka.shape == (5, S, S) and cap.spectra.shape == (5, S, 50)
    assert (cap.subspace is None) == (model.layout.n_loop == 0)
    assert (cap.routing is not None) == (topology == "mesh")
    assert (cap.coefficients is not None) == (topology in ("static", "dynamic"))
    assert (cap.attention is not None) == (model.layout.kind in ("looped", "multires"))
    assert torch.isfinite(cap.skew).all() and torch.isfinite(cap.cka).all()


def test_capture_equals_reference_metrics():
    """Batches of 2 over 5 samples == one traced call + the metrics on all samples at once (spectra and
    effective rank from an SVD; each metric is checked against its reference formula in
    test_probe_metrics.py)."""
    model = tiny("1+2x{1/4,1/2,1}+1", "mesh", seed=3)
    x = tokens(5, 24)
    cap = capture(model, x, ProbeSettings(batch_size=2, token_index=-3), progress=False)
    _, tr = model.traced(x, attention=True)
    states = torch.stack([h for _, h in tr.states], dim=1)
    skew = torch.stack([computation_skew(i, o) for _, i, o in tr.blocks], dim=-1)
    torch.testing.assert_close(cap.skew, skew)
    torch.testing.assert_close(cap.cka, cka_matrix(states))
    sv = torch.linalg.svdvals(states)
    spectra = torch.nn.functional.pad(sv / sv[..., :1], (0, 50 - sv.shape[-1]))
    torch.testing.assert_close(cap.spectra, spectra, atol=1e-7, rtol=0)
    p = sv / sv.sum(-1, keepdim=True)
    erank = torch.exp(-torch.special.xlogy(p, p).sum(-1))
    torch.testing.assert_close(cap.effective_rank, erank, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        cap.subspace, shared_subspace_variance(states[:, 1:5], k_max=32), atol=1e-9, rtol=0
    )
    lin = capture(model, x, ProbeSettings(kernel="linear", cka_tokens=8, attention=False), progress=False)
    pos = (
        torch.linspace(0, 23, 8).round().long()
    )  # --cka-tokens: evenly spaced positions, same for all states
    assert lin.cka_positions == 8
    torch.testing.assert_close(lin.cka, cka_matrix(states[:, :, pos], kernel="linear"))
    comp = mesh_state_composition(torch.stack(tr.routing["write"]), torch.stack(tr.routing["read"]))
    assert cap.token_index == 21
    torch.testing.assert_close(cap.routing["comp_seq"], comp.mean(1))
    torch.testing.assert_close(cap.routing["comp_tok"], comp[:, 21])
    # attention: loop t of the shared core at its native length L_t = 24 / g_t, LAM window ceil(32 / g_t)
    assert cap.attention_chunk == [4, 2, 1] and cap.attention_window == [8, 16, 32]
    maps = tr.attention["core0"]
    assert [m.shape[-1] for m in maps[0]] == [6, 12, 24]
    for layer in range(2):
        for t, g in enumerate((4, 2, 1)):
            a = maps[layer][t]
            torch.testing.assert_close(cap.attention["entropy"][:, t, layer], key_marginal_entropy(a))
            torch.testing.assert_close(
                cap.attention["lam"][:, t, layer], local_attention_mass(a, lam_window(1 / g))
            )


def test_mesh_composition_with_hand_set_routers():
    """Zero router weights + a large bias margin make the routers one-hot (or 50/50) by hand."""
    # K = 2 loop steps, B = K + 3 = 5 slots; router j writes h_m^(j-1) and reads h^(j)
    model = tiny("1+1R2+1", "mesh")
    write_slots = [[1], [2], [1]]
    read_slots = [[1], [0, 2], [1]]  # h^(1) reads h_emb and slot 2 at 0.5 each
    with torch.no_grad():
        for routers, slots in ((model.topology.write, write_slots), (model.topology.read, read_slots)):
            for lin, chosen in zip(routers, slots):
                lin.weight.zero_()
                lin.bias.fill_(-60.0)
                lin.bias[chosen] = 0.0
    cap = capture(model, tokens(3, 16), ProbeSettings(token_index=4, attention=False), progress=False)
    # columns [h_emb, h_m^(-1), h_m^(0), h_m^(1)], rows h^(0..2):
    #   h^(0) = slot1 = h_m^(-1);  h^(1) = .5 slot0 + .5 slot2 = .5 h_emb + .5 h_m^(0);
    #   h^(2) = slot1 = h_m^(-1) + h_m^(1)
    expected = torch.tensor(
        [[0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0], [0.0, 1.0, 0.0, 1.0]], dtype=torch.float64
    )
    for key in ("comp_seq", "comp_tok"):
        for sample in cap.routing[key]:
            torch.testing.assert_close(sample, expected, atol=1e-12, rtol=0)
    write = torch.zeros(3, 5, dtype=torch.float64)
    for j, s in enumerate(write_slots):
        write[j, s] = 1.0 / len(s)
    torch.testing.assert_close(cap.routing["write_seq"][0], write, atol=1e-12, rtol=0)
    from recursive_lightning.probes.registry import summarize

    summary = summarize(cap, {"model": {"kind": "looped", "chunk": [1, 1]}})
    assert summary["mesh"]["composition"]["gating_factor"].tolist() == pytest.approx([1.0, 0.5, 1.0])
    # the coefficients reconstruct the states token-wise (Eq. 7) for arbitrary routers too
    model = tiny("1+1R2+1", "mesh", seed=5)
    _, tr = model.traced(tokens(2, 16))
    coef = mesh_state_composition(torch.stack(tr.routing["write"]), torch.stack(tr.routing["read"]))
    sources = torch.stack([tr.states[0][1], tr.blocks[0][2], tr.blocks[1][2], tr.blocks[2][2]], dim=-2)
    for t in range(3):
        torch.testing.assert_close((coef[..., t, :, None] * sources).sum(-2), tr.states[t + 1][1])


# ---------------------------------------------------------------------------
# text -> samples
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_and_text(tmp_path_factory):
    from pydoc_data.topics import topics

    from recursive_lightning.data.tokenizer import train_bpe

    docs = [topics[k] for k in sorted(topics)]
    root = tmp_path_factory.mktemp("text")
    text = root / "text.txt"
    text.write_text("\n\f\n".join(docs))
    return train_bpe(docs, 300), text, docs


def test_samples_deterministic_heldout_first(tokenizer_and_text, monkeypatch):
    from recursive_lightning.data import corpus
    from recursive_lightning.data.shards import is_validation_document
    from recursive_lightning.probes.samples import load_samples

    tok, _, docs = tokenizer_and_text
    monkeypatch.setattr(corpus, "embedded_corpus_documents", lambda: list(docs))  # the default source
    a = load_samples(tok, None, 7, 40)
    b = load_samples(tok, None, 7, 40)
    assert torch.equal(a.tokens, b.tokens) and a.tokens.shape == (7, 40) and a.info["source"] == "<embedded>"
    first_heldout = next(d for d in docs if is_validation_document(d))
    assert a.tokens[0, :10].tolist() == tok.encode(first_heldout, add_special_tokens=False).ids[:10]
    with pytest.raises(UserError, match="fewer than one"):
        load_samples(tok, None, 1, 10**7)


# ---------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep(tokenizer_and_text, tmp_path_factory):
    """A sweep dir with three tiny run dirs; `spiral` has an MLflow run whose id the checkpoint carries."""
    from recursive_lightning.config import RunConfig
    from recursive_lightning.tracking.runs import (
        RUN_ID_FILE,
        create_run,
        default_tracking_uri,
        ensure_experiment,
    )
    from recursive_lightning.training.checkpoint import save_model_checkpoint

    tok, text, _ = tokenizer_and_text
    root = tmp_path_factory.mktemp("sweep")
    runs = {"base": ("1+2R3+1", "base"), "mesh": ("1+2R3+1", "mesh"), "spiral": ("1+2x{1/4,1/2,1}+1", "mesh")}
    ids = {}
    for name, (layout, topology) in runs.items():
        cfg = RunConfig.from_dict(
            {
                "name": name,
                "model": {**TINY, "vocab_size": 320, "layout": layout, "topology": topology},
                "data": {"seq_len": 32},
            }
        )
        torch.manual_seed(0)
        run_id = None
        if name == "spiral":
            uri = default_tracking_uri(root / name)
            run_id = create_run(uri, ensure_experiment(uri, name, root / name / "mlartifacts"), name)
            (root / name / RUN_ID_FILE).write_text(run_id)
        ids[name] = run_id
        save_model_checkpoint(
            root / name / "checkpoints" / "last.ckpt", RecursiveLM(cfg.model), cfg, tok, mlflow_run_id=run_id
        )
    return SimpleNamespace(root=root, text=text, run_id=ids["spiral"])


def test_probe_end_to_end_with_mlflow(sweep):
    from mlflow.tracking import MlflowClient

    from recursive_lightning.commands.probe import main
    from recursive_lightning.tracking.runs import default_tracking_uri

    run_dir = sweep.root / "spiral"
    assert (
        main(
            [str(run_dir), "--data", str(sweep.text), "--samples", "6", "--batch-size", "4", "--no-progress"]
        )
        == 0
    )
    out = run_dir / "probes"
    summary = json.loads((out / "probes.json").read_text())
    assert summary["data"]["samples"] == 6 and summary["data"]["seq_len"] == 32  # the run's data.seq_len
    assert summary["skew"]["blocks"] == ["prelude", "core 1", "core 2", "core 3", "coda"]
    assert summary["cka"]["states"] == ["h_emb", "h(0)", "h(1)", "h(2)", "h(3)", "h_out"]
    assert len(summary["spectra"]["mean"][0]) == 50
    assert summary["mesh"]["composition"]["cols"] == ["h_emb", "h_m(-1)", "h_m(0)", "h_m(1)", "h_m(2)"]
    assert summary["attention"]["chunk"] == [4, 2, 1] and summary["attention"]["lam_window"] == [8, 16, 32]
    assert len(summary["attention"]["entropy"]["dynamic_heads"]) == 4  # ceil(0.4 * 2 layers * 4 heads)
    expected = {
        "skew.png",
        "cka.png",
        "spectra.png",
        "shared_subspace.png",
        "mesh_routers.png",
        "state_composition.png",
        "attention_entropy_dynamic.png",
        "attention_lam_range.png",
    }
    assert expected <= set(summary["figures"])
    for name in summary["figures"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    client = MlflowClient(default_tracking_uri(run_dir))
    logged = {Path(f.path).name for f in client.list_artifacts(sweep.run_id, "probes")}
    assert {"probes.json", *summary["figures"]} <= logged
    assert "probe/skew/core_1" in client.get_run(sweep.run_id).data.metrics
    # a checkpoint whose MLflow run is unknown gets one linked run, reused on the next call
    from recursive_lightning.probes.outputs import mlflow_run

    stub = SimpleNamespace(
        mlflow_run_id="0" * 32,
        path=run_dir / "checkpoints" / "other.ckpt",
        run=SimpleNamespace(name="spiral"),
    )
    uri = default_tracking_uri(run_dir)
    rid, created = mlflow_run(uri, sweep.root / "base", stub)  # base has no run id file
    assert created and rid != sweep.run_id
    assert mlflow_run(uri, sweep.root / "base", stub) == (rid, True)
    assert client.get_run(rid).data.tags["probe.checkpoint"].endswith("other.ckpt")


def test_probe_compare_sweep_dir(sweep):
    from recursive_lightning.commands.probe import main

    out = sweep.root / "cmp"
    argv = [
        "--compare",
        str(sweep.root),
        "--data",
        str(sweep.text),
        "--samples",
        "3",
        "--seq-len",
        "16",
        "--no-mlflow",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    summary = json.loads((out / "probes.json").read_text())
    assert summary["compare"] == ["base", "mesh", "spiral"]  # topologies repeat, so run-dir names
    for name in (
        "compare_skew.png",
        "compare_cka.png",
        "compare_spectra.png",
        "compare_shared_subspace.png",
        "compare_mesh_routers.png",
        "compare_state_composition.png",
        "compare_attention_entropy_dynamic.png",
        "compare_attention_lam_range.png",
    ):
        assert name in summary["figures"] and (out / name).stat().st_size > 0
    hashes = {m["data"]["tokens_sha256"] for m in summary["models"].values()}
    assert len(hashes) == 1  # every model saw the same token windows


def test_user_errors_are_one_sentence(tmp_path, capsys, sweep):
    from recursive_lightning import cli
    from recursive_lightning.commands.probe import main

    for argv in (
        [str(tmp_path / "missing.ckpt")],
        [str(tmp_path)],
        ["--compare", str(tmp_path / "nope")],
        [],
    ):
        with pytest.raises(UserError) as err:
            main(argv)
        msg = str(err.value)
        assert "\n" not in msg and msg.endswith(".") and msg.count(". ") == 0, msg
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"not a checkpoint")
    assert cli.main(["probe", str(bad)]) == 2
    assert capsys.readouterr().err.startswith("error: checkpoint")
    with pytest.raises(UserError, match="--token-index 99"):
        main(
            [
                str(sweep.root / "base"),
                "--data",
                str(sweep.text),
                "--samples",
                "1",
                "--token-index",
                "99",
                "--no-mlflow",
            ]
        )


def test_compare_finds_the_trials_of_a_sweep_directory(tmp_path):
    """`probe --compare <sweep dir>`: a sweep keeps its trials in trials/<point>/ (the help says "or one sweep
    dir", which was refused); the trials' directories are what is compared, sorted by name."""
    from recursive_lightning.probes.run import expand_compare

    sweep = tmp_path / "sweep"
    for point in ("variant=mesh_seed=0", "variant=base_seed=0"):
        (sweep / "trials" / point / "checkpoints").mkdir(parents=True)
        (sweep / "trials" / point / "checkpoints" / "last.ckpt").write_bytes(b"PK")
    (sweep / "report").mkdir()
    assert expand_compare([str(sweep)]) == sorted((sweep / "trials").iterdir())
    assert expand_compare([str(sweep / "trials")]) == sorted((sweep / "trials").iterdir())
