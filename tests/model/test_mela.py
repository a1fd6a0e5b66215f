"""Mela (arch: mela): the neural memory against a per-position loop of Eqs. 1-11, Newton-Schulz, HLR,
MemStack, causality, cached decoding, parameter formulas and describe."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import chunk_errors, mela_against_float64

from recursive_lightning.config import RunConfig
from recursive_lightning.errors import ConfigError
from recursive_lightning.model.build import build_model
from recursive_lightning.model.config import ModelConfig, preset
from recursive_lightning.model.describe import describe
from recursive_lightning.model.mela.neural_memory import NeuralMemory, mlp_forward, newton_schulz

UPDATES = ("plain", "momentum", "forgetting", "newton_schulz")


def tiny(**kw) -> ModelConfig:
    base = dict(
        preset="cpu-mela",
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        hmm_heads=2,
        vocab_size=97,
        layout="3",
        patch_size=2,
        chunk_size=3,
        h_cycles=3,
        l_cycles=2,
        h_layers=2,
        l_layers=1,
        memory_heads=2,
    )
    return ModelConfig.from_dict({**base, **kw})


# ---------------------------------------------------------------- neural memory (Eqs. 1-11)
def reference_step(S: torch.Tensor, M: torch.Tensor, theta_sum: torch.Tensor, floor: float) -> torch.Tensor:
    """Eq. 10's step for one (sequence, head): NewtonSchulz(S), times min(1, ||S|| / (floor sum theta ||M||))
    with the floor (``memory_step_floor``)."""
    step = newton_schulz(S)
    return step * min(1.0, float(S.norm() / (floor * theta_sum * M.norm()))) if floor else step


def reference_memory(mem: NeuralMemory, x: torch.Tensor) -> torch.Tensor:
    """Per-position loop: every position's gradient by autograd against M_{t-1}, summed over the chunk."""
    b, n, d = x.shape
    C, H, hd = mem.chunk_size, mem.heads, mem.head_dim
    q, k, v = mem.qkv(x).split(d, dim=-1)
    q = torch.nn.functional.normalize(q.view(b, n, H, hd), dim=-1)
    k = torch.nn.functional.normalize(k.view(b, n, H, hd), dim=-1)
    v = v.view(b, n, H, hd)
    theta = mem.max_lr * torch.sigmoid(mem.theta(x))
    out = torch.zeros(b, n, H, hd, dtype=x.dtype)
    for bi in range(b):
        for h in range(H):
            M = [w[h].detach().clone() for w in mem.init_weights]
            S = [torch.zeros_like(w) for w in M]
            for t in range(n // C):
                chunk = x[bi, t * C : (t + 1) * C].mean(0)
                eta = torch.sigmoid(mem.eta(chunk))[h] if mem.eta is not None else 0.0
                alpha = torch.sigmoid(mem.alpha(chunk))[h] if mem.alpha is not None else 1.0
                grads = [torch.zeros_like(w) for w in M]
                for i in range(t * C, (t + 1) * C):
                    if mem.read == "before":
                        out[bi, i, h] = mlp_forward(q[bi, i, h][None], M)[0][0]  # Eq. 9, M_{t-1}
                    with torch.enable_grad():
                        Ms = [w.clone().requires_grad_(True) for w in M]
                        loss = ((mlp_forward(k[bi, i, h][None], Ms)[0][0] - v[bi, i, h]) ** 2).sum()  # Eq. 8
                        per_position = torch.autograd.grad(loss, Ms)
                    for g, gi in zip(grads, per_position):
                        g += theta[bi, i, h] * gi
                for j in range(len(M)):
                    S[j] = (eta * S[j] if mem.eta is not None else 0) - grads[j]  # Eq. 11
                    step = S[j]
                    if mem.update == "newton_schulz":
                        theta_sum = theta[bi, t * C : (t + 1) * C, h].sum()
                        step = reference_step(S[j], M[j], theta_sum, mem.step_floor)
                    M[j] = alpha * M[j] + step  # Eq. 10
                if mem.read == "after":
                    for i in range(t * C, (t + 1) * C):
                        out[bi, i, h] = mlp_forward(q[bi, i, h][None], M)[0][0]  # M_t
    return mem.out(out.reshape(b, n, d))


@pytest.mark.parametrize("read", ["after", "before"])
@pytest.mark.parametrize(
    "update,floor", [(u, 0.0) for u in UPDATES] + [("newton_schulz", 6.0), ("newton_schulz", 40)]
)
@pytest.mark.parametrize("chunk,depth", [(1, 2), (3, 2), (4, 1)])
def test_memory_matches_per_position_loop(update, floor, chunk, depth, read):
    torch.manual_seed(0)
    mem = NeuralMemory(8, 2, depth, 2, chunk, update=update, read=read, step_floor=floor).double()
    for p in mem.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 3 * chunk if chunk > 1 else 4, 8, dtype=torch.float64)
    with torch.no_grad():
        got, _ = mem(x)
        want = reference_memory(mem, x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_simpler_forms_reduce():
    """Eqs. 2-3 with eta = 0 are Eq. 1; Eqs. 4-5 with alpha = 1 are Eqs. 2-3."""
    torch.manual_seed(1)
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    plain = NeuralMemory(8, 2, 2, 2, 3, update="plain").double()
    momentum = NeuralMemory(8, 2, 2, 2, 3, update="momentum").double()
    forgetting = NeuralMemory(8, 2, 2, 2, 3, update="forgetting").double()
    momentum.load_state_dict(plain.state_dict(), strict=False)  # keeps its own eta head
    forgetting.load_state_dict(momentum.state_dict(), strict=False)  # keeps its own alpha head
    with torch.no_grad():
        assert not torch.allclose(momentum(x)[0], plain(x)[0])  # a real eta matters
        forgetting.alpha.bias.fill_(60.0)
        forgetting.alpha.weight.zero_()  # alpha = sigmoid(60) = 1 in float64
        torch.testing.assert_close(forgetting(x)[0], momentum(x)[0], rtol=1e-12, atol=1e-12)
        momentum.eta.weight.zero_()
        momentum.eta.bias.fill_(-800.0)  # eta = 0
        torch.testing.assert_close(momentum(x)[0], plain(x)[0], rtol=1e-12, atol=1e-12)


def test_newton_schulz_properties():
    torch.manual_seed(2)
    g = torch.randn(6, 16, 48, dtype=torch.float64)
    o = newton_schulz(g, 5)
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.6 and s.max() < 1.25  # Muon's quintic: near 1, not exactly
    torch.testing.assert_close(newton_schulz(g.transpose(-2, -1), 5), o.transpose(-2, -1))
    torch.testing.assert_close(newton_schulz(3.7 * g, 5), o)  # scale-free (Frobenius normalisation)


def test_outer_parameters_learn_through_inner_updates():
    cfg = tiny()
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 4 * cfg.tokens_per_chunk + 1))  # eta_t first matters at t = 2
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum()]
    assert missing == []


# ---------------------------------------------------------------- the model
SWITCHES = [
    {},
    {"memory_read": "before"},
    {"fusion": "weighted_sum", "memory_update": "forgetting", "hmm_d_model": 16},
    {"fusion": "none", "memstack": False, "hmm_gate": False, "memory_carry": "none"},
    {"hmm_attention": False, "memory_update": "plain"},
    {"neural_memory": False},
]


@pytest.mark.parametrize("switches", SWITCHES)
def test_causal_inside_and_across_chunks(switches):
    torch.manual_seed(4)
    cfg = tiny(**switches)
    model = build_model(cfg).double().eval()
    PC = cfg.tokens_per_chunk
    idx = torch.randint(0, cfg.vocab_size, (1, 4 * PC))
    with torch.no_grad():
        base = model(idx)
        for p in (0, 2, PC - 1, PC, PC + 3, 2 * PC + 1, 3 * PC):
            other = idx.clone()
            other[0, p] = (other[0, p] + 1) % cfg.vocab_size
            out = model(other)
            assert torch.equal(out[:, :p], base[:, :p]), f"token {p} changed an earlier logit"
            assert not torch.allclose(out[:, p:], base[:, p:])
    # the memory is the only channel between chunks: chunk 2 hears of chunk 0 through the neural memory
    # only (the HMM's attention is local to a chunk, so without a neural memory it looks one chunk back)
    with torch.no_grad():
        other = idx.clone()
        other[0, 0] += 1
        assert torch.allclose(model(other)[:, 2 * PC :], base[:, 2 * PC :]) != cfg.neural_memory


def test_hlr_only_last_cycle_has_gradients():
    cfg = tiny()
    model = build_model(cfg)
    model.hmm.record = []
    idx = torch.randint(0, cfg.vocab_size, (1, 2 * cfg.tokens_per_chunk))
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    steps = cfg.l_cycles + 1  # module outputs per cycle
    assert model.hmm.record == [False] * steps * (cfg.h_cycles - 1) + [True] * steps
    assert model.hmm.patchify.weight.grad.abs().sum() > 0
    model.hmm.record = []
    with torch.no_grad():
        model(idx)
    assert model.hmm.record == [False] * steps * cfg.h_cycles


def test_memstack_adds_z_at_memory_rows_only():
    torch.manual_seed(5)
    cfg = tiny()
    model = build_model(cfg).double().eval()
    C, PC, d = cfg.chunk_size, cfg.tokens_per_chunk, cfg.d_model
    idx = torch.randint(0, cfg.vocab_size, (2, 3 * PC))
    seen: dict[str, list] = {"out": [], "in": []}
    hooks = [layer.register_forward_hook(lambda m, a, o: seen["out"].append(o)) for layer in model.layers]
    hooks += [layer.register_forward_pre_hook(lambda m, a: seen["in"].append(a[0])) for layer in model.layers]
    with torch.no_grad():
        model(idx)
        x = model.embed(idx)
        memory, *stack = model.memory_rows(x, 3)
    for h in hooks:
        h.remove()
    assert len(stack) == cfg.h_cycles - 1
    for a in range(len(model.layers) - 1):
        added = (seen["in"][a + 1] - seen["out"][a]).view(2, 3, C + PC, d)
        want = stack[a] if a < len(stack) else torch.zeros_like(memory)
        torch.testing.assert_close(added[:, :, :C], want, rtol=0, atol=1e-12)
        assert torch.equal(added[:, :, C:], torch.zeros_like(added[:, :, C:]))
    torch.testing.assert_close(seen["in"][0].view(2, 3, C + PC, d)[:, :, :C], memory)
    assert torch.equal(stack[0][:, 0], torch.zeros_like(stack[0][:, 0]))  # nothing at chunk 0


@pytest.mark.parametrize("memstack", [True, False])
def test_describe_bounds_the_decoding_state(memstack):
    """describe's decoding state is what the cache holds at its largest (within one token's keys, values and
    text row): decoding three chunks token by token never exceeds it."""
    cfg = preset("cpu-mela")
    cfg.memstack = memstack
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    cache, largest = model.new_cache(), 0
    with torch.no_grad():
        model.hidden(torch.randint(0, cfg.vocab_size, (1, 5)), cache=cache)
        for _ in range(3 * cfg.tokens_per_chunk):
            model.hidden(torch.randint(0, cfg.vocab_size, (1, 1)), cache=cache)
            largest = max(largest, cache.numel())
    bound = describe(cfg, seq_len=256)["decode_state_elements"]
    one_token = 2 * len(model.layers) * cfg.kv_heads * cfg.head_dim + cfg.d_model
    assert largest <= bound <= largest + one_token


def test_cached_decoding_equals_full_forward_with_constant_state():
    torch.manual_seed(6)
    cfg = tiny()
    model = build_model(cfg).double().eval()
    PC = cfg.tokens_per_chunk
    idx = torch.randint(0, cfg.vocab_size, (2, 16 * PC + 3))
    with torch.no_grad():
        full = model.hidden(idx)
        cache = model.new_cache()
        outs = [model.hidden(idx[:, :5], cache=cache)]
        sizes = {}
        for i in range(5, idx.shape[1]):
            outs.append(model.hidden(idx[:, i : i + 1], cache=cache))
            if cache.text_len == 0:
                sizes[cache.chunks] = cache.numel()
        cached = torch.cat(outs, 1)
        # Newton-Schulz amplifies rounding in an update's near-null directions, and the memory carries it
        # from chunk to chunk (about 3x per chunk here): exact at first, 1e-7 after 16 chunks in float64
        torch.testing.assert_close(cached[:, : 4 * PC], full[:, : 4 * PC], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(cached, full, rtol=1e-6, atol=1e-6)
    assert sizes[1] == sizes[4] == sizes[16]
    out = model.generate(idx[:, :7], 2 * PC)
    assert out.shape == (2, 7 + 2 * PC)
    assert torch.equal(out, model.generate(idx[:, :7], 2 * PC, use_cache=False))


# ---------------------------------------------------------------- parameters, describe, configs
def n_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg).parameters())


def test_switches_change_parameters_by_their_formula():
    cfg = tiny()
    d, blocks, nh, H = cfg.hmm_width, cfg.h_layers + cfg.l_layers, cfg.memory_heads, cfg.h_cycles
    hd = d // nh
    memory_init = nh * 2 * (2 * hd * hd)  # depth 2, expansion 2: (hd x 2hd) + (2hd x hd) per head
    fusion_mlp = 2 * d * d + d * cfg.d_model
    full = n_params(cfg)
    assert full - n_params(tiny(hmm_gate=False)) == blocks * d * d
    assert full - n_params(tiny(hmm_attention=False)) == blocks * (5 * d * d + d)
    assert full - n_params(tiny(neural_memory=False)) == blocks * (
        4 * d * d + 3 * (d * nh + nh) + memory_init + d
    )
    assert full - n_params(tiny(memory_update="forgetting")) == 0
    assert full - n_params(tiny(memory_update="momentum")) == blocks * (d * nh + nh)
    assert full - n_params(tiny(memory_update="plain")) == 2 * blocks * (d * nh + nh)
    assert full - n_params(tiny(memstack=False)) == (H - 1) * fusion_mlp
    assert full - n_params(tiny(fusion="none")) == H * fusion_mlp  # d_hmm == d_model: no projection
    assert full - n_params(tiny(fusion="weighted_sum")) == H * (fusion_mlp - 2 * d)
    # "none" is h only, parameter-free: with hmm_d_model != d_model it is refused, not given a projection
    with pytest.raises(
        ConfigError, match=r"model.fusion 'none' .* model.hmm_d_model 16 must equal model.d_model 32"
    ):
        tiny(hmm_d_model=16, fusion="none")


@pytest.mark.parametrize("name", ["cpu-mela", "mela-400m"])
def test_describe_sums_the_built_model(name):
    cfg = preset(name)
    d = describe(cfg, seq_len=cfg.tokens_per_chunk * 2)
    assert d["params_total"] == n_params(cfg)
    parts = (
        "patchify",
        "hmm_attention",
        "hmm_gates",
        "hmm_norms",
        "memory_projections",
        "initial_memories",
        "fusions",
        "memory_tokens",
    )
    assert sum(d[f"params_{p}"] for p in parts) == d["params_memory"]
    assert d["params_memory"] + d["params_language"] + d["params_embedding"] == d["params_total"]
    flops = (
        "decoder",
        "hmm_attention",
        "memory_projections",
        "newton_schulz",
        "memory_inner_loop",
        "hmm_other",
    )
    assert sum(d[f"flops_{p}"] for p in flops) == d["flops_forward"]
    assert min(d[f"flops_{p}"] for p in flops) >= 0


@pytest.mark.parametrize("extra", [{}, {"memstack": False}, {"memory_update": "momentum"}])
def test_describe_counts_equal_a_full_meta_forward(extra):
    """describe counts Mela's FLOPs from 2 and 3 chunks (extended linearly) and replays HLR's repeated L/H
    module calls: every module's count equals one full, unreplayed meta forward's, a partial last chunk
    included (fails with the chunk extension off by one, or a replay that drops a module path)."""
    from recursive_lightning.model.describe import _count_forward, _mela_flop_counts
    from recursive_lightning.model.mela.model import MelaLM

    cfg = preset("cpu-mela", **extra)
    with torch.device("meta"):
        model = MelaLM(cfg)
    for seq_len in (5 * cfg.tokens_per_chunk + 7, 4 * cfg.tokens_per_chunk, 2 * cfg.tokens_per_chunk + 1):
        full = _count_forward(model, seq_len, 2).get_flop_counts()
        fast = _mela_flop_counts(model, cfg, seq_len, 2)
        assert {k: sum(v.values()) for k, v in fast.items() if any(v.values())} == {
            k: sum(v.values()) for k, v in full.items() if any(v.values())
        }, seq_len
        assert describe(cfg, seq_len=seq_len, batch_size=2)["flops_forward"] == sum(full["Global"].values())


def test_mela_400m_geometry_and_table1_shares():
    d = describe(preset("mela-400m"), seq_len=4096)
    assert (d["n_patches"], d["n_chunks"], d["decoder_length"]) == (128, 2, 4224)  # Sec. 4.1
    assert d["block_applications"] == 4 * (4 * 4 + 8) and d["block_applications_with_grad"] == 24
    for name, (mem, lang) in {
        "mela-400m": (27.45, 65.75),
        "mela-800m": (28.78, 66.35),
        "mela-1.2b": (18.19, 76.97),
    }.items():
        d = describe(preset(name), seq_len=4096)
        assert abs(100 * d["params_memory"] / d["params_total"] - mem) < 1.5, name
        assert abs(100 * d["params_language"] / d["params_total"] - lang) < 1.5, name
        tpp = n_params(preset(name.replace("mela", "transformerpp")))
        assert abs(tpp / d["params_total"] - 1) < 0.02, name  # Transformer++ matched in size


def test_bad_mela_configs_get_one_sentence():
    with pytest.raises(ConfigError, match=r"data.seq_len 100 .* multiple of P\*C"):
        RunConfig.from_dict({"model": {"preset": "cpu-mela"}, "data": {"seq_len": 100}})
    with pytest.raises(ConfigError, match="first H-1 = 3"):
        tiny(layout="2", h_cycles=4)
    with pytest.raises(ConfigError, match="model.fusion 'concat' is unknown"):
        tiny(fusion="concat")
    with pytest.raises(ConfigError, match="model.memory_update"):
        tiny(memory_update="adam")
    with pytest.raises(ConfigError, match="decoder is a plain stack"):
        tiny(layout="1+2R2+1")
    with pytest.raises(ConfigError, match="both false"):
        tiny(hmm_attention=False, neural_memory=False)
    with pytest.raises(ConfigError, match="heads of 25 dims, whose rotary part"):
        tiny(hmm_d_model=50)  # 2 HMM heads of 25 dims
    with pytest.raises(ConfigError, match=r"lower it \(--train.warmup_steps N\)"):
        RunConfig.from_dict({"model": {"preset": "cpu-mela"}, "train": {"max_steps": 20, "warmup_steps": 30}})
    from recursive_lightning.errors import UserError

    with pytest.raises(UserError, match="describe needs a positive --seq-len, not 0"):
        describe(tiny(), seq_len=0)


@pytest.mark.parametrize("carry", ["cycles", "none"])
def test_float32_matches_float64_over_64_chunks(carry):
    """``cpu-mela`` at its defaults, untrained, one sequence of 64 chunks: float32 stays within 1e-3 of float64,
    relative to the largest logit (under 1e-6 measured, at one and two threads alike). With Eq. 10's unbounded step
    (``memory_step_floor: 0``) the gap grows ~5x a chunk to the logits' own scale (0.5) after ~10 chunks."""
    model, high, idx = mela_against_float64(7, memory_carry=carry)
    with torch.no_grad():
        err = chunk_errors(model(idx), high(idx), model.cfg.tokens_per_chunk)
    assert float(err.max()) < 1e-3, (
        f"float32 is {float(err.max()):.1e} off float64 at chunk {int(err.argmax())}"
    )


@pytest.mark.parametrize("carry", ["cycles", "none"])
def test_unbounded_newton_schulz_step_amplifies_a_perturbation(carry):
    """The mechanism, in float64 alone: a 1e-10 perturbation of every M_0 grows through Eq. 10's unbounded step
    (Newton-Schulz gives a vanishing surprise unit singular values): ~5x a chunk with ``cycles``, 1.7e-7 after 16
    chunks with ``none``; with the step floor it stays at its direct effect, ~1.5e-10
    (``neural_memory.step_floors``)."""
    torch.manual_seed(3)
    idx = None
    moved = {}
    for floor in (0.0, ModelConfig.memory_step_floor):
        torch.manual_seed(3)
        cfg = preset("cpu-mela", memory_carry=carry, memory_step_floor=floor)
        model = build_model(cfg).double().eval()
        nudged = copy.deepcopy(model)
        with torch.no_grad():
            for mem in nudged.modules():
                if isinstance(mem, NeuralMemory):
                    for w in mem.init_weights:
                        w.add_(1e-10 * torch.randn_like(w))
            idx = torch.randint(0, cfg.vocab_size, (1, 16 * cfg.tokens_per_chunk)) if idx is None else idx
            moved[floor] = float(chunk_errors(nudged(idx), model(idx), cfg.tokens_per_chunk)[-4:].max())
    bounded = moved[ModelConfig.memory_step_floor]
    assert bounded < 1e-9 and moved[0.0] > 100 * bounded, moved


def test_a_mela_config_written_before_the_step_floor_keeps_eq10():
    """A complete stored Mela dict (a checkpoint's or config.yaml's ``to_dict``) without ``memory_step_floor`` was
    trained with Eq. 10's unbounded step and loads as that function; a user's file without it gets the default."""
    stored = preset("cpu-mela").to_dict()
    assert ModelConfig.from_dict(stored).memory_step_floor == ModelConfig.memory_step_floor > 0
    del stored["memory_step_floor"]
    assert ModelConfig.from_dict(stored).memory_step_floor == 0.0
    user = {"preset": "cpu-mela", "memory_carry": "none"}
    assert ModelConfig.from_dict(user).memory_step_floor == ModelConfig.memory_step_floor
    with pytest.raises(ConfigError, match="memory_step_floor must be a number >= 0"):
        tiny(memory_step_floor=-1)


def test_bf16_autocast_error_is_the_decoders_own_over_64_chunks():
    """Under bf16 autocast ``cpu-mela`` (memory loop in float32) stays as close to float64 over 64 chunks as the
    same model with a memory that has no Newton-Schulz (Eqs. 4-5, which cannot amplify): 7.3-8.2e-3 against
    5.9-7.4e-3 measured at the largest chunk; with the unbounded step it saturates near 0.5."""
    errors = {}
    for update in ("newton_schulz", "forgetting"):
        model, high, idx = mela_against_float64(1, memory_update=update)
        with torch.no_grad():
            want = high(idx)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                errors[update] = float(chunk_errors(model(idx), want, model.cfg.tokens_per_chunk).max())
    assert errors["newton_schulz"] < 2 * errors["forgetting"], errors


# ---------------------------------------------------------------- training: kill and resume
KILL_AT = """
import os, signal, sys
import lightning as L, yaml
from recursive_lightning.config import RunConfig
from recursive_lightning.training.run import train

class Kill(L.Callback):  # SIGKILL itself right after step 6 (its checkpoint, at 4, is on disk)
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 6:
            os.kill(os.getpid(), signal.SIGKILL)

train(RunConfig.from_dict(yaml.safe_load(open(sys.argv[1]))), sys.argv[2], callbacks=[Kill()])
"""


def test_mela_kill_and_resume_gives_identical_losses(tmp_path, tiny_run):
    import subprocess
    import sys
    from pathlib import Path

    import yaml
    from mlflow.tracking import MlflowClient

    cfg = tiny_run(
        preset="cpu-mela",
        layout="2",
        topology="base",
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        hmm_heads=2,
        patch_size=2,
        chunk_size=4,
        h_cycles=2,
        l_cycles=2,
        h_layers=1,
        l_layers=1,
    )
    cfg["train"]["max_steps"] = 10
    (tmp_path / "mela.yaml").write_text(yaml.safe_dump(cfg))
    from conftest import ENV as env  # one thread in all three processes: equal float32 sums

    def cli(*args):
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)

    def losses(run_dir: Path) -> dict[int, float]:
        run_id = (run_dir / "mlflow_run_id").read_text().strip()
        client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
        history = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.timestamp)
        return {m.step: m.value for m in history}

    straight = cli(
        "-m",
        "recursive_lightning",
        "train",
        "--config",
        str(tmp_path / "mela.yaml"),
        "--run-dir",
        str(tmp_path / "straight"),
    )
    assert straight.returncode == 0, straight.stdout + straight.stderr
    killed = cli("-c", KILL_AT, str(tmp_path / "mela.yaml"), str(tmp_path / "killed"))
    assert killed.returncode == -9, killed.stdout + killed.stderr
    resumed = cli("-m", "recursive_lightning", "train", "--run-dir", str(tmp_path / "killed"), "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert sorted(a) == sorted(b) and len(a) == 10
    assert a == b


def test_describe_json_cli_has_todays_keys_plus_memory_and_language():
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "recursive_lightning", "describe", "--preset", "mela-400m", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    mela = json.loads(out.stdout)
    today = describe(preset("pythia-160m"), seq_len=4096)
    assert set(today) | {"params_memory", "params_language"} <= set(mela)
    assert mela["params_total"] == 364_749_456 and mela["decoder_length"] == 4224


@pytest.mark.parametrize("read", ["after", "before"])
def test_two_chunks_train_the_memory_update_only_when_read_after(read):
    """At the paper's training length (4K = 2 chunks) decoder chunk 1 reads the HMM at chunk 0: reading the
    memory after chunk 0's update trains theta; Eq. 9 literally (before) never reads an update there."""
    cfg = tiny(memory_read=read)
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 2 * cfg.tokens_per_chunk + 1))
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    theta = model.hmm.h_module.blocks[0].memory.theta.weight.grad
    assert (theta is not None and theta.abs().sum() > 0) == (read == "after")


def test_newton_schulz_backward_equals_autograd():
    """The hand-written backward of _NewtonSchulz against autograd through the plain iteration (float64)."""
    from recursive_lightning.model.mela.neural_memory import NS_COEFFICIENTS

    def plain(g, steps=5, eps=1e-7):
        a, b, c = NS_COEFFICIENTS
        x = g / (g.norm(dim=(-2, -1), keepdim=True) + eps)
        for _ in range(steps):
            A = x @ x.transpose(-2, -1)
            x = a * x + (b * A + c * A @ A) @ x
        return x

    torch.manual_seed(8)
    for shape in [(3, 4, 6), (2, 5, 5), (2, 3, 7, 4)]:  # wide, square, tall with two leading dims
        g = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        w = torch.randn(*shape, dtype=torch.float64)
        got = torch.autograd.grad((newton_schulz(g, 5) * w).sum(), g)[0]
        tall = shape[-2] > shape[-1]
        ref_in = g.transpose(-2, -1) if tall else g
        ref_out = plain(ref_in)
        ref = torch.autograd.grad(((ref_out.transpose(-2, -1) if tall else ref_out) * w).sum(), g)[0]
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(newton_schulz(g, 5), ref_out.transpose(-2, -1) if tall else ref_out)
        # with a floor: the output times min(1, |g| / tau), gradients to g and tau (half the floors active)
        tau = (g.detach().norm(dim=(-2, -1), keepdim=True) * torch.tensor([0.5, 2.0] * 4)[: g[..., 0, 0].numel()]
               .view(g.shape[:-2] + (1, 1))).requires_grad_(True)  # fmt: skip
        got = torch.autograd.grad((newton_schulz(g, 5, floor=tau) * w).sum(), (g, tau))
        scale = (g.norm(dim=(-2, -1), keepdim=True) / tau).clamp(max=1.0)
        ref_out = plain(ref_in)
        ref = torch.autograd.grad(
            ((ref_out.transpose(-2, -1) if tall else ref_out) * scale * w).sum(), (g, tau)
        )
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("floor", [0.0, 6.0, 40.0])
def test_gradcheck_through_two_chunks_with_the_step_floor(floor):
    """Every outer parameter's gradient through two bounded updates (the floor active at 40)."""
    torch.manual_seed(3)
    mem = NeuralMemory(4, 1, 2, 2, 2, update="newton_schulz", step_floor=floor).double()
    x = torch.randn(1, 4, 4, dtype=torch.float64, requires_grad=True)
    names = [n for n, _ in mem.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for p in mem.parameters())

    def f(x, *ps):
        return torch.func.functional_call(mem, dict(zip(names, ps)), (x,))[0]

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-5)


def test_bf16_autocast_trains():
    """Under bf16 autocast (train.precision auto picks it on CPUs with bf16 matmuls, and on GPUs) the custom
    Newton-Schulz backward gets gradients of another dtype than its saved tensors."""
    cfg = tiny()
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 3 * cfg.tokens_per_chunk + 1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model.loss(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and all(
        torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None
    )


@pytest.mark.parametrize("carry,tol", [("none", 0.08), ("cycles", 0.25)])
def test_memory_loop_runs_in_float32_under_bf16_autocast(carry, tol):
    """Newton-Schulz would write bf16 rounding in an update's near-null directions into the memory as O(1)
    updates: the chunk loop runs in float32 (bf16 logits 14 % off float64 after three chunks without it, 3 %
    with it and ``memory_carry: none``; 17.5 % with ``cycles``, whose chained updates amplify the bf16
    projections' rounding)."""
    torch.manual_seed(9)
    cfg = tiny(
        d_model=64,
        hmm_heads=4,
        layout="3",
        patch_size=4,
        chunk_size=4,
        memory_heads=2,
        vocab_size=512,
        memory_carry=carry,
    )
    model = build_model(cfg).eval()
    ref = copy.deepcopy(model).double()
    idx = torch.randint(0, cfg.vocab_size, (2, 3 * cfg.tokens_per_chunk))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(idx)
    with torch.no_grad():
        want = ref(idx)
    assert float((low.double() - want).norm() / want.norm()) < tol


@pytest.mark.parametrize("update", ["plain", "momentum", "forgetting"])
def test_unnormalised_updates_stay_finite_with_the_lr_bound(update):
    """Eqs. 1-5 have no Newton-Schulz to normalise the update: theta = sigmoid(.) (up to 1) blows the memory up
    within 64 chunks at initialisation (the CPU Table 4 sweep's w/o-NS row went to nan), theta <= max_lr not."""
    torch.manual_seed(0)
    x = torch.randn(2, 8 * 64, 128)
    with torch.no_grad():
        bounded = NeuralMemory(128, 4, 2, 2, 8, update=update)(x)[0]
        unbounded = NeuralMemory(128, 4, 2, 2, 8, update=update, max_lr=1.0)(x)[0]
    assert torch.isfinite(bounded).all() and not torch.isfinite(unbounded).all()


def test_activation_checkpointing_keeps_loss_and_gradients():
    """train.activation_checkpointing wraps the decoder layers and the memory blocks (layer_lists); the
    Newton-Schulz backward unpacks its saved tensors once, as checkpointing requires."""
    from recursive_lightning.training.parallel import apply_activation_checkpointing

    torch.manual_seed(10)
    cfg = tiny()
    plain = build_model(cfg)
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped)
    idx = torch.randint(0, cfg.vocab_size, (2, 3 * cfg.tokens_per_chunk + 1))
    losses = []
    for model in (plain, wrapped):
        loss = model.loss(idx[:, :-1], idx[:, 1:])
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1])
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in wrapped.named_parameters()}
    for n, p in plain.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- the paper's settings (Table 1: P = 32, C = 64, 4K)
def mela_400m_narrow(**kw) -> ModelConfig:
    """mela-400m's depth, cycles, P = 32 and C = 64 at width 32."""
    return preset(
        "mela-400m", d_model=32, n_heads=4, n_kv_heads=2, hmm_d_model=32, hmm_heads=4, vocab_size=97, **kw
    )


@pytest.mark.parametrize("carry", ["cycles", "none"])
def test_memory_learns_at_4k_patch32_chunk64(carry):
    """At 4,096 tokens (2 chunks of P*C = 2,048) decoder chunk 1 reads the HMM at chunk 0 only. With each block's
    memory carried through the cycles (default) the loss reaches eta, M_0 and every other HMM parameter; with
    every application from its own M_0 (``none``) each memory updates once from S_0 = 0,
    so eta gets nothing. ``memory_without_gradient`` (train's warning) names exactly the parameters left out."""
    from recursive_lightning.model.mela.model import memory_gradient_warning, memory_without_gradient

    torch.manual_seed(0)
    cfg = mela_400m_narrow(memory_carry=carry)
    model = build_model(cfg)
    idx = torch.randint(0, cfg.vocab_size, (1, 4096 + 1))
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    dead = sorted(
        {
            "hmm." + n.rsplit(".", 1)[0]
            for n, p in model.hmm.named_parameters()
            if p.grad is None or not p.grad.abs().sum()
        }
    )
    etas = [f"hmm.{m}_module.blocks.{j}.memory.eta" for m, n in (("l", 4), ("h", 8)) for j in range(n)]
    assert dead == ([] if carry == "cycles" else sorted(etas))
    assert sorted(memory_without_gradient(cfg, 4096)) == dead
    warning = memory_gradient_warning(cfg, 4096)
    assert (warning is None) == (carry == "cycles")
    if warning:
        assert "hmm.l_module.blocks.0.memory.eta" in warning and "memory_carry cycles" in warning


def reference_hmm(hmm, x: torch.Tensor) -> list[torch.Tensor]:
    """memory_carry cycles written plainly (float64): chunk by chunk, every cycle, every block; each block's
    memory (M, S per batch and head) continues from its previous application, across cycles and chunks;
    each chunk's update by autograd of Eq. 8 against the memory before it, then Eqs. 11, 10, read after."""
    cfg = hmm.cfg
    P, C, b = cfg.patch_size, cfg.chunk_size, x.shape[0]
    memories: dict = {}  # (module, block) -> [M, S], each a list over memory tensors of (b, heads, i, o)

    def memory(mem: NeuralMemory, key, u: torch.Tensor) -> torch.Tensor:
        d, H, hd = u.shape[-1], mem.heads, mem.head_dim
        if key not in memories:
            M = [w.unsqueeze(0).repeat(b, 1, 1, 1) for w in mem.init_weights]
            memories[key] = [M, [torch.zeros_like(w) for w in M]]
        M, S = memories[key]
        q, k, v = mem.qkv(u).split(d, dim=-1)
        q = torch.nn.functional.normalize(q.view(b, C, H, hd), dim=-1)
        k = torch.nn.functional.normalize(k.view(b, C, H, hd), dim=-1)
        v = v.view(b, C, H, hd)
        theta = mem.max_lr * torch.sigmoid(mem.theta(u))  # (b, C, H)
        eta, alpha = torch.sigmoid(mem.eta(u.mean(1))), torch.sigmoid(mem.alpha(u.mean(1)))  # (b, H)
        out = torch.zeros(b, C, H, hd, dtype=u.dtype)
        for bi in range(b):
            for h in range(H):
                with torch.enable_grad():
                    Ms = [w[bi, h].clone().requires_grad_(True) for w in M]
                    loss = (
                        theta[bi, :, h, None] * (mlp_forward(k[bi, :, h], Ms)[0] - v[bi, :, h]) ** 2
                    ).sum()
                    grads = torch.autograd.grad(loss, Ms)
                for i, g in enumerate(grads):
                    S[i][bi, h] = eta[bi, h] * S[i][bi, h] - g  # Eq. 11
                    step = reference_step(S[i][bi, h], M[i][bi, h], theta[bi, :, h].sum(), mem.step_floor)
                    M[i][bi, h] = alpha[bi, h] * M[i][bi, h] + step  # Eq. 10
                out[bi, :, h] = mlp_forward(q[bi, :, h], [w[bi, h] for w in M])[0]  # read after the update
        return mem.out(out.reshape(b, C, d))

    def module(mod, name: str, inputs: list[torch.Tensor]) -> torch.Tensor:
        u = mod.fuse(torch.cat(inputs, dim=-1))
        for j, block in enumerate(mod.blocks):
            u = u + block.attn(block.norm1(u))
            u = u + memory(block.memory, (name, j), block.norm2(u))
        return u

    outs = []
    for t in range(x.shape[1] // (P * C)):
        x_p = hmm.patchify(x[:, t * P * C : (t + 1) * P * C].transpose(1, 2)).transpose(1, 2)
        l_state = h_state = x_p
        zs = []
        for i in range(cfg.h_cycles):
            for _ in range(cfg.l_cycles):
                l_state = module(hmm.l_module, "l", [l_state, h_state, x_p])
            h_state = module(hmm.h_module, "h", [h_state, l_state])
            zs.append(hmm.fusions[i](l_state, h_state))
        outs.append(zs)
    return [torch.cat(z, dim=1) for z in zip(*outs)]


def test_memory_carries_across_cycles_as_the_reference_loop():
    torch.manual_seed(8)
    cfg = tiny()
    model = build_model(cfg).double().eval()
    x = model.embed(torch.randint(0, cfg.vocab_size, (2, 3 * cfg.tokens_per_chunk)))
    with torch.no_grad():
        got, states = model.hmm(x)
        want = reference_hmm(model.hmm, x)
        assert len(states) == cfg.l_layers + cfg.h_layers  # one memory per block
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
        # each application from its own M_0 is another function (the reference would not pass it)
        model.hmm.cfg = dataclasses.replace(cfg, memory_carry="none")
        other, states = model.hmm(x)
        assert len(states) == len(model.hmm.applications)
        assert (other[-1] - want[-1]).abs().amax() > 0.1 * want[-1].abs().amax()


@pytest.mark.parametrize("carry", ["cycles", "none"])
def test_float32_cached_decoding_within_1e4_over_64_chunks(carry):
    """cpu-mela at random init in float32, decoded a few tokens at a time over 64 chunks: the memory rows are
    computed by the same operations as the full forward (chunk by chunk from the patchify on), so only the
    decoder's own rounding differs. With the patchify and the HMM over all chunks at once (the previous
    code) Newton-Schulz amplified the differences to 2e-2 after 20 chunks."""
    torch.manual_seed(6)
    cfg = preset("cpu-mela", memory_carry=carry)
    model = build_model(cfg).eval()
    PC = cfg.tokens_per_chunk
    idx = torch.randint(0, cfg.vocab_size, (1, 64 * PC))
    with torch.no_grad():
        full = model(idx)
        cache = model.new_cache()
        cached = torch.cat(
            [model.head(model.hidden(idx[:, i : i + 13], cache=cache)) for i in range(0, idx.shape[1], 13)], 1
        )
    assert cache.chunks == 64
    err = (cached - full).abs().amax()
    assert err < 1e-4, f"float32 cached decoding is {err:.1e} off the full forward after 64 chunks"


def test_compile_glue_stays_within_five_graphs_of_the_memory_update():
    """``train.compile: glue`` on Mela compiles the decoder layers, each memory block's attention and the chunk
    update (``MelaLM.compile_units``): training steps under bf16 autocast and an evaluation forward need at most
    five graphs of each compiled function (the update: no gradients; with gradients, M and S each with or without
    one), whatever the number of blocks, cycles and chunks; dynamo falls back to eager past its limit."""
    from recursive_lightning.training.parallel import compile_model

    torch.manual_seed(2)
    model = build_model(tiny(h_layers=2, l_layers=2))
    compile_model(model, "glue")
    idx = torch.randint(0, 97, (2, 4 * model.cfg.tokens_per_chunk + 1))
    limits = torch._dynamo.config.patch(recompile_limit=5, fail_on_recompile_limit_hit=True)
    with limits, torch.autocast("cpu", dtype=torch.bfloat16):  # as train.precision bf16-mixed
        for _ in range(3):
            model.loss(idx[:, :-1], idx[:, 1:]).backward()
        with torch.no_grad():
            model(idx)


def test_compiled_memory_update_equals_eager_in_float64():
    """``train.compile: glue`` compiles each neural memory's projections (``project``) and chunk update
    (``update_memory``, one graph for every chunk): the loss and every gradient equal eager mode's in float64,
    over two batches; W_1 and W_2 are orthogonalised in one batched Newton-Schulz loop in both."""
    torch.manual_seed(5)
    eager = build_model(tiny()).double()
    compiled = copy.deepcopy(eager)
    compiled.compile_glue()
    memories = [m for m in compiled.modules() if isinstance(m, NeuralMemory)]
    assert memories and all(m.glue is not None for m in memories)
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, 97, (2, 3 * eager.cfg.tokens_per_chunk + 1), generator=g)
        losses = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            loss = model.loss(idx[:, :-1], idx[:, 1:])
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-10, atol=0)
        want = dict(eager.named_parameters())
        for name, p in compiled.named_parameters():  # the fused kernels round differently; the memory
            # amplifies that (docs/models.md: Numerics) to ~3e-9 of a gradient's norm
            err = float((p.grad - want[name].grad).norm() / want[name].grad.norm())
            assert err < 1e-6, (name, err)
