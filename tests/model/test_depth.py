"""Test-time depth (model/depth.py, model/recursive/depth.py): a model run at K' loop steps (Mela: H' cycles)
equals a model *built* at that depth whose per-step parameters follow each topology's extrapolation rule; the
trained depth reproduces the ordinary forward bit for bit; causality and cached decoding hold at every depth;
truncated backpropagation gives the gradients of a reference loop that detaches the early steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from recursive_lightning.errors import UserError
from recursive_lightning.model.build import build_model
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.depth import at_depth, check_depth, trained_depth
from recursive_lightning.model.recursive.depth import loop_plan
from recursive_lightning.model.recursive.model import RecursiveLM
from tests.model.test_mela import tiny as tiny_mela
from tests.model.test_model import assert_causal

TINY = dict(vocab_size=61, d_model=32, n_heads=4, max_seq_len=64)
TOPOLOGIES = ["base", "residual", "anchor", "anchor_emb", "residual+anchor", "static", "dynamic", "mesh"]


def rule(K: int, k: int) -> list[int]:
    """The extrapolation rule, written out: loop step t uses trained step t up to K - 1, then K - 1 again."""
    return [min(t, K - 1) for t in range(k)]


LAYOUTS = {"looped": (1, 2, 3, 1), "multires": (1, 2, (4, 2, 1), 1)}  # prelude, core, K or schedule, coda


def _cfg(kind: str, topology: str, **kw) -> ModelConfig:
    pre, core, k, coda = LAYOUTS[kind]
    layout = (
        f"{pre}+{core}R{k}+{coda}"
        if kind == "looped"
        else f"{pre}+{core}x{{{','.join(f'1/{g}' for g in k)}}}+{coda}"
    )
    return ModelConfig.from_dict({**TINY, "layout": layout, "topology": topology, **kw})


def _model(kind: str, topology: str, **kw) -> RecursiveLM:
    torch.manual_seed(0)
    model = RecursiveLM(_cfg(kind, topology, **kw)).double().eval()
    with torch.no_grad():  # away from the initial point, so that every per-step parameter matters
        for name, p in model.named_parameters():
            if name.startswith(("topology.", "steps.")):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _built_at(model: RecursiveLM, k: int) -> RecursiveLM:
    """The reference: a model *built* with k loop steps, each step's own parameters copied from the trained
    step the extrapolation rule names (loop_plan), MeSH's buffer at the trained B slots."""
    cfg, lay, plan = model.cfg, model.layout, rule(model.layout.n_loop, k)
    assert loop_plan(lay, k) == plan
    if lay.kind == "looped":
        layout = f"{lay.prelude}+{lay.cores[0]}R{k}+{lay.coda}"
    else:
        layout = f"{lay.prelude}+{lay.cores[0]}x{{{','.join(f'1/{lay.chunk[s]}' for s in plan)}}}+{lay.coda}"
    ref_cfg = dataclasses.replace(
        cfg,
        layout=layout,
        buffer=cfg.buffer_slots if cfg.topology == "mesh" else None,
        offset=[model.steps[s].offset for s in plan],
        shift=[model.steps[s].shift for s in plan],
    )
    ref = RecursiveLM(ref_cfg).double().eval()
    state = {}
    for name, value in model.state_dict().items():
        parts = name.split(".")
        if parts[0] == "steps":
            for t, s in enumerate(plan):
                if s == int(parts[1]):
                    state[".".join(["steps", str(t), *parts[2:]])] = value
        elif parts[:2] in (
            ["topology", "write"],
            ["topology", "read"],
        ):  # index 0: transitional, t + 1: step t
            for i, s in enumerate([-1, *plan]):
                if s + 1 == int(parts[2]):
                    state[".".join([*parts[:2], str(i), *parts[3:]])] = value
        elif parts[:2] == ["topology", "coef"]:
            for t, s in enumerate(plan):
                if s == int(parts[2]):
                    state[".".join([*parts[:2], str(t), *parts[3:]])] = value
        elif name == "topology.alpha":
            state[name] = value[plan]
        else:
            state[name] = value
    ref.load_state_dict(state, strict=True)
    return ref


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_depth_equals_a_model_built_at_that_depth(kind, topology):
    model = _model(kind, topology)
    x = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(0))
    trained = model(x)
    K = model.layout.n_loop
    with at_depth(model, K):
        assert torch.equal(model(x), trained)  # the trained depth is the ordinary forward, bit for bit
    for k in (1, K - 1, K + 1, 2 * K + 1):
        with at_depth(model, k):
            out = model(x)
        torch.testing.assert_close(out, _built_at(model, k)(x), atol=1e-12, rtol=0)
        assert not torch.allclose(out, trained)
    assert model.loops is None and torch.equal(model(x), trained)  # the depth is restored on leaving


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("topology", ["base", "mesh", "dynamic"])
@pytest.mark.parametrize("k", [1, 5])
def test_causal_and_cached_at_every_depth(kind, topology, k):
    model = _model(kind, topology)
    with at_depth(model, k):
        assert_causal(model)
        x = torch.randint(0, 61, (2, 21), generator=torch.Generator().manual_seed(1))
        full = model.hidden(x)
        cache = model.new_cache()
        assert len(cache.steps) == k and f"step{k - 1}" in cache.kv
        parts = [model.hidden(x[:, :9], cache=cache)] + [
            model.hidden(x[:, i : i + 1], cache=cache) for i in range(9, 21)
        ]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-10, rtol=0)


@pytest.mark.parametrize("topology", ["anchor", "mesh", "dynamic"])
@pytest.mark.parametrize("backprop", [1, 2])
def test_truncated_backprop_equals_a_reference_that_detaches_the_early_steps(topology, backprop):
    """Gradients through the last ``backprop`` loop steps only (Huginn's truncation): the same loss, and the
    gradients of a hand-written loop whose early steps run without gradients."""
    model = _model("looped", topology).train()
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(2))
    y = torch.roll(x, -1, 1)
    model.backprop_loops = backprop
    with at_depth(model, 4):
        loss = model.loss(x, y)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        model.backprop_loops = None

        h_emb = model.embed(x) * model.emb_scale
        h, carry = model.topology.start(h_emb, model.prelude(h_emb))
        for t, s in enumerate(model.loop_plan()):
            with torch.set_grad_enabled(t >= 4 - backprop):
                h, carry = model.topology.step(s, h, model.steps[s](h, model.cores[0]), carry)
        ref = torch.nn.functional.cross_entropy(
            model.head(model.norm(model.coda(h))).flatten(0, 1), y.flatten()
        )
        ref.backward()
    assert torch.equal(loss.detach(), ref.detach()) or torch.allclose(loss, ref, atol=1e-12, rtol=0)
    ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-10, rtol=1e-8, msg=n)
    # the early steps' own parameters get no gradient; the shared core and the prelude (through h^(0)) do
    assert "cores.0.layers.0.attn.qkv.weight" in grads or any(n.startswith("cores.0.") for n in grads)
    assert any(n.startswith("prelude.") for n in grads)


@pytest.mark.parametrize(
    "layout, k, words",
    [
        ("4", 2, "no loop"),
        ("1+1+1+1", 2, "distinct cores"),
        ("1+1R2+1", 0, ">= 1"),
        ("1+1R2+1", "4", ">= 1"),
        ("1+1R2+1", True, ">= 1"),
    ],
)
def test_a_bad_depth_gets_one_sentence(layout, k, words):
    model = RecursiveLM(ModelConfig.from_dict({**TINY, "layout": layout}))
    with pytest.raises(UserError, match=words) as err:
        with at_depth(model, k):
            pass
    assert "--loops" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("memstack", [False, True])
def test_mela_h_cycles(memstack):
    torch.manual_seed(0)
    model = build_model(tiny_mela(memstack=memstack)).double().eval()
    H = trained_depth(model)
    x = torch.randint(0, 97, (2, 26), generator=torch.Generator().manual_seed(0))
    trained = model(x)
    with at_depth(model, H):
        assert torch.equal(model(x), trained)
    for k in (1, H + 2):
        with at_depth(model, k):
            out = model(x)
            assert len(model.hmm.applications) == k * (
                model.cfg.l_cycles * model.cfg.l_layers + model.cfg.h_layers
            )
            if not memstack:  # the same parameters as a model built with H' cycles: equal to it
                torch.manual_seed(0)
                ref = build_model(tiny_mela(memstack=memstack, h_cycles=k)).double().eval()
                ref.load_state_dict(model.state_dict())
                torch.testing.assert_close(out, ref(x), atol=1e-12, rtol=0)
            cache = model.new_cache()
            steps = [model.hidden(x[:, :5], cache=cache)] + [
                model.hidden(x[:, i : i + 1], cache=cache) for i in range(5, 26)
            ]
            torch.testing.assert_close(torch.cat(steps, 1), model.hidden(x), atol=1e-9, rtol=0)
            for j in (4, 17):  # causal: a change at j leaves every earlier position as it was
                y = x.clone()
                y[:, j] = (y[:, j] + 1) % 97
                torch.testing.assert_close(model(y)[:, :j], out[:, :j], atol=1e-12, rtol=0)
        assert not torch.allclose(out, trained)
    # ends aligned (model/depth.py): the last cycle fuses through the last trained fusion, whatever H'; with
    # MemStack the fusions no cycle reaches give zeros. Reference: a model without MemStack built at H' whose
    # one fusion is the trained last one.
    emb = model.embed(x[:, :24])
    for k in (1, H + 2):
        with at_depth(model, k):
            zs, _ = model.hmm(emb)
        assert len(zs) == (H if memstack else 1)
        if memstack and k < H:
            assert all(not z.any() for z in zs[: H - k]) and zs[-1].any()
        ref = build_model(tiny_mela(memstack=False, h_cycles=k)).double().eval()
        last = len(model.hmm.fusions) - 1
        ref.load_state_dict(
            {
                n.replace(f"hmm.fusions.{last}.", "hmm.fusions.0."): v
                for n, v in model.state_dict().items()
                if not n.startswith("hmm.fusions.") or n.startswith(f"hmm.fusions.{last}.")
            }
        )
        torch.testing.assert_close(zs[-1], ref.hmm(emb)[0][-1], atol=1e-12, rtol=0)
    with pytest.raises(UserError, match="--h-cycles"):
        check_depth(model, 2, dial="loops")
    with pytest.raises(UserError, match=">= 1"):
        check_depth(model, 0)


@pytest.mark.parametrize("topology", ["anchor", "mesh"])
def test_describe_counts_the_flops_of_a_depth(topology):
    """describe(loops=k) counts the FLOPs of a model built with k loop steps (MeSH at the trained B slots)."""
    from recursive_lightning.model.describe import describe

    cfg = ModelConfig.from_dict({**TINY, "layout": "1+2R3+1", "topology": topology})
    assert describe(cfg, seq_len=32, loops=3) == describe(cfg, seq_len=32)
    for k in (1, 6):
        built = dataclasses.replace(
            cfg, layout=f"1+2R{k}+1", buffer=cfg.buffer_slots if topology == "mesh" else None
        )
        at, ref = describe(cfg, seq_len=32, loops=k), describe(built, seq_len=32)
        for key in ("flops_forward", "flops_attention", "n_loop", "n_compute_layers"):
            assert at[key] == ref[key], key
    mela = tiny_mela()
    assert describe(mela, seq_len=24, loops=mela.h_cycles) == describe(mela, seq_len=24)
    two, six = describe(mela, seq_len=24, loops=2), describe(mela, seq_len=24, loops=6)
    assert (
        six["block_applications"] == 3 * two["block_applications"]
        and six["flops_forward"] > two["flops_forward"]
    )


def test_mesh_far_past_the_trained_depth_reads_a_bounded_buffer(monkeypatch):
    """At K' far above K the factored buffer is collapsed to B writes whenever it reaches 2B
    (MeSH.collapse_writes): the same logits and gradients as reading every write, in float64, and no read of
    more than 2B writes."""
    from recursive_lightning.model.recursive.mesh import MeSH

    model = _model("looped", "mesh")
    slots, k = model.cfg.buffer_slots, 8 * model.cfg.buffer_slots
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(2))
    longest = []
    write_read = MeSH.write_read

    def spy(self, idx, router_in, u, carry, writes):
        longest.append(len(writes) + 1)
        return write_read(self, idx, router_in, u, carry, writes)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        with at_depth(model, k):
            out = model(x)
        out.pow(2).mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    monkeypatch.setattr(MeSH, "write_read", spy)
    out, grads = run()
    assert max(longest) <= 2 * slots
    monkeypatch.setattr(MeSH, "collapse_writes", staticmethod(lambda writes: writes))
    longest.clear()
    ref, ref_grads = run()
    assert max(longest) == k + 1  # the reference reads every write
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)
