"""The fused eager glue and the compiled glue regions against their reference forms, in float64.

Eager fast paths with written-out backwards: the attention input's head split + rotary (``block._QKVRotary``;
in the decoder's layers and Mela's HMM attention),
MeSH's factored read (``mesh._FactoredRead``), S_down / S_up as views (``resolution._SelfAggregation``,
``_ChunkMap``). References: the composed rotary, the term-by-term read, the padded S_down / S_up (the forms
``train.compile: glue`` hands to ``torch.compile``). Values and gradients, causality, and kill-and-resume with
the compiled glue on."""

import copy

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from hypothesis import given, settings
from hypothesis import strategies as st

from recursive_lightning.model.block import _rotate_half_reference, qkv_rotary
from recursive_lightning.model.config import ModelConfig, preset
from recursive_lightning.model.mela.hierarchical_memory import GatedAttention
from recursive_lightning.model.recursive.mesh import _FactoredRead, _inner_products, _read_buffer_reference
from recursive_lightning.model.recursive.model import RecursiveLM
from recursive_lightning.model.recursive.resolution import ResolutionStep


def _grads(out, inputs, seed: int = 0):
    """Gradients of <out, w> for a fixed random w (every output element weighted differently)."""
    outs = out if isinstance(out, tuple | list) else (out,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
    return torch.autograd.grad(loss, inputs, allow_unused=True)


@pytest.mark.parametrize(
    "heads,kv,head_dim,dim,per_row",
    [(4, 4, 16, 4, False), (4, 2, 8, 8, False), (4, 1, 16, 8, True), (2, 2, 12, 6, False)],
    ids=["pythia-quarter", "gqa-full", "mqa-per-row", "odd-half"],
)
def test_qkv_rotary_equals_the_composed_form(heads, kv, head_dim, dim, per_row):
    """q, k rotated (rotate-half, first ``dim`` dims) and v split off: values to one rounding (the fused form
    uses a multiply-add) and gradients to rounding, against ``Rotary.forward`` and slicing."""
    g = torch.Generator().manual_seed(0)
    b, length = 2, 7
    qkv = torch.randn(
        b, length, heads + 2 * kv, head_dim, generator=g, dtype=torch.double, requires_grad=True
    )
    angles = torch.rand(
        (b, length, dim // 2) if per_row else (length, dim // 2), generator=g, dtype=torch.double
    )
    angles = 10 * torch.cat([angles, angles], -1)
    cos, sin = angles.cos(), angles.sin()
    fused = qkv_rotary(qkv, cos, sin, (heads, kv), dim)
    qk = _rotate_half_reference(qkv[:, :, : heads + kv], cos, sin, dim)
    ref = (qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, heads + kv :])
    for a, r in zip(fused, ref):
        torch.testing.assert_close(a, r.transpose(1, 2), rtol=1e-15, atol=1e-15)
    (ga,), (gr,) = _grads(fused, [qkv]), _grads(tuple(r.transpose(1, 2) for r in ref), [qkv])
    torch.testing.assert_close(ga, gr, rtol=1e-14, atol=1e-14)


def _gated_attention_reference(attn, x):
    """Mela's HMM attention composed as written (the head split by rearrange, ``Rotary.forward`` on q and k)."""
    b = x.shape[0]
    xc = rearrange(x, "b (c n) d -> (b c) n d", n=attn.chunk)
    q, k, v = rearrange(attn.qkv(xc), "bc n (three h d) -> three bc n h d", three=3, h=attn.heads)
    cos, sin = attn.rotary.cos_sin_range(0, attn.chunk, x.device, x.dtype)
    q, k = (attn.rotary(t, cos, sin).transpose(1, 2) for t in (q, k))
    y = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
    y = rearrange(y, "bc h n d -> bc n (h d)") * torch.sigmoid(attn.gate(xc))
    return rearrange(attn.proj(y), "(b c) n d -> b (c n) d", b=b)


@pytest.mark.parametrize("rotary_pct", [1.0, 0.5])
def test_mela_gated_attention_equals_its_composed_form(rotary_pct):
    """The HMM's gated, causal, chunk-local attention with q and k rotated by ``qkv_rotary``: values to one
    rounding and every gradient (input, projections, gate) to rounding, against the composed form, in float64."""
    torch.manual_seed(0)
    cfg = preset("cpu-mela", hmm_d_model=24, hmm_heads=3, chunk_size=5, rotary_pct=rotary_pct)
    attn = GatedAttention(cfg).double()
    x = torch.randn(2, 3 * cfg.chunk_size, 24, dtype=torch.double, requires_grad=True)
    inputs = [x, *attn.parameters()]
    fused, ref = attn(x), _gated_attention_reference(attn, x)
    torch.testing.assert_close(fused, ref, rtol=1e-14, atol=1e-14)
    for a, r in zip(_grads(fused, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(a, r, rtol=1e-13, atol=1e-13)


@settings(max_examples=20, deadline=None)
@given(writes=st.integers(1, 6), slots=st.integers(2, 7), seed=st.integers(0, 2**16))
def test_factored_read_equals_the_term_by_term_read(writes, slots, seed):
    """MeSH Eq. 6 on the factored buffer: the batched gains and backward equal the term-by-term sum (values to
    one rounding: the gains sum the slots in another order; gradients to rounding) for every input."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, simplex=False):
        t = torch.randn(*shape, generator=g, dtype=torch.double)
        return (t.softmax(-1) if simplex else t).requires_grad_()

    h_emb, w_read = rand(2, 5, 8), rand(2, 5, slots, simplex=True)
    pairs = [(rand(2, 5, 8), rand(2, 5, slots, simplex=True)) for _ in range(writes)]
    flat = [t for pair in pairs for t in pair]
    fused, ref = _FactoredRead.apply(h_emb, w_read, *flat), _read_buffer_reference(h_emb, w_read, pairs)
    torch.testing.assert_close(fused, ref, rtol=1e-15, atol=1e-15)
    for a, r in zip(_grads(fused, [h_emb, w_read, *flat]), _grads(ref, [h_emb, w_read, *flat])):
        torch.testing.assert_close(a, r, rtol=1e-13, atol=1e-13)


def test_inner_products_per_write_equal_the_stacked_product():
    """The factored read's backward takes <g, u^(tau)> per write on the CPU and as one batched product over the
    stacked writes elsewhere (fewer kernel launches on a GPU): both equal the explicit sum."""
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(2, 5, 8, generator=g, dtype=torch.double)
    us = tuple(torch.randn(2, 5, 8, generator=g, dtype=torch.double) for _ in range(4))
    ref = torch.stack([(u * grad).sum(-1) for u in us])
    for stacked in (False, True):
        torch.testing.assert_close(_inner_products(grad, us, stacked), ref, rtol=1e-14, atol=1e-14)


@settings(max_examples=30, deadline=None)
@given(
    g=st.sampled_from([2, 4, 8, 16]),
    data=st.data(),
    length=st.integers(1, 40),
    batch=st.integers(1, 3),
    downscale=st.sampled_from(["self_aggregation", "mean"]),
    upscale=st.sampled_from(["allocation", "broadcast"]),
)
def test_chunk_maps_equal_the_padded_form(g, data, length, batch, downscale, upscale):
    """S_down (Eqs. 16-18) and S_up with the shift (Eqs. 19-22) as views with written-out backwards equal
    their padded forms (what ``train.compile: glue`` compiles): values and gradients for the states and the
    scorer / allocator, every offset ω < g and causal shift s in {g-1, g, g+1}, chunk 0 partial or not, the
    sequence ending mid-chunk or not, batch > 1; chunks of up to 8 positions summed by multiply-adds, 16 by a GEMM."""
    offset = data.draw(st.integers(0, g - 1), label="offset")
    shift = data.draw(st.sampled_from([g - 1, g, g + 1]), label="shift")
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=61, d_model=8, n_heads=2, max_seq_len=64, downscale=downscale, upscale=upscale
    )
    step = ResolutionStep(cfg, g, offset, shift, g**0.5).double()
    params = list(step.parameters())
    n = (length + offset) // g
    if n > 0:
        h = torch.randn(batch, length, 8, dtype=torch.double, requires_grad=True)
        z, z_ref = step.down(h), step.down_padded(h)
        torch.testing.assert_close(z, z_ref, rtol=1e-14, atol=1e-14)
        for a, r in zip(_grads(z, [h, *params]), _grads(z_ref, [h, *params])):
            torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-14)
    z = torch.randn(batch, max(n, 1), 8, dtype=torch.double, requires_grad=True)
    u, u_ref = step.up(z, length), step.up_padded(z, length)
    torch.testing.assert_close(u, u_ref, rtol=1e-14, atol=1e-14)
    if u.requires_grad:
        for a, r in zip(_grads(u, [z, *params]), _grads(u_ref, [z, *params])):
            torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-14)


def _model(layout: str = "1+1x{1/4,1/2,1}+1", topology: str = "mesh") -> RecursiveLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_heads=4, max_seq_len=64, layout=layout, topology=topology)
    return RecursiveLM(cfg).double()


def _loss_and_grads(model: RecursiveLM, idx: torch.Tensor, tgt: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = model.loss(idx, tgt)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_glue_equals_eager_and_stays_causal():
    """``RecursiveLM.compile_glue`` (each step's S_down / S_up, each MeSH step's routers + write + read as
    torch.compile regions, traced through dynamo and AOTAutograd; inductor's kernels are checked on a GPU in
    test_cuda.py) gives eager mode's loss and every gradient in float64, and a token changes no earlier
    position's logits."""
    eager = _model("1+1x{1/4,1}+1")  # one coarse step (g = 4, ω = 2, s = 3) and three MeSH steps: 5 regions
    compiled = copy.deepcopy(eager)
    compiled.compile_glue(backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    idx, tgt = torch.randint(0, 61, (2, 23), generator=g), torch.randint(0, 61, (2, 23), generator=g)
    loss_e, grads_e = _loss_and_grads(eager, idx, tgt)
    loss_c, grads_c = _loss_and_grads(compiled, idx, tgt)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-13, atol=0)
    assert grads_c.keys() == grads_e.keys()
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-10, atol=1e-13, msg=name)
    base = compiled(idx)  # grad mode on, as above: the same graphs, no recompilation
    for j in (3, 11, 20):
        y = idx.clone()
        y[:, j] = (y[:, j] + 1) % 61
        out = compiled(y)
        torch.testing.assert_close(out[:, :j], base[:, :j], atol=1e-12, rtol=0)
        assert not torch.allclose(out[:, j:], base[:, j:])


@pytest.mark.slow
def test_kill_and_resume_with_compiled_glue(tmp_path, tiny_run, monkeypatch):
    """``train.compile: glue`` on a SpiralFormer MeSH model: a run that dies right after its step-4 checkpoint
    resumes to the losses of an uninterrupted run (test_training's in-process kill pattern). The regions are
    traced by dynamo + AOTAutograd and run as ATen graphs: inductor's C++ build takes minutes on this CPU;
    its kernels are checked on a GPU (tests/test_cuda.py)."""
    from recursive_lightning.config import RunConfig
    from recursive_lightning.training.module import RecursiveLMModule
    from recursive_lightning.training.run import train
    from tests.training.test_training import losses

    compile_calls = []

    def aot_eager(*args, **kwargs):
        compile_calls.append(args)
        return compile_(*args, **{**kwargs, "backend": "aot_eager"})

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", aot_eager)
    cfg = tiny_run(layout="1+1x{1/4,1}+1")
    cfg["train"].update(max_steps=8, checkpoint_every=4, val_every=8, compile="glue")
    cfg["data"]["val_batches"] = 1
    run = RunConfig.from_dict(cfg)
    train(run, tmp_path / "straight")
    assert len(compile_calls) >= 2 + 3  # the layers' and the glue's regions went through torch.compile

    def die_after_checkpoint(self, outputs, batch, batch_idx) -> None:
        if self.trainer.global_step == 4:
            raise RuntimeError("killed right after the step-4 checkpoint")

    killed = tmp_path / "killed"
    with monkeypatch.context() as m:
        m.setattr(RecursiveLMModule, "on_train_batch_end", die_after_checkpoint, raising=False)
        with pytest.raises(RuntimeError, match="killed right after"):
            train(run, killed)
    assert (killed / "checkpoints" / "step=000004.ckpt").exists()
    train(run, killed, resume=True)
    want, got = losses(tmp_path / "straight"), losses(killed)
    assert sorted(want) == sorted(got) == list(range(8))
    assert all(want[s] == got[s] for s in want), [(s, want[s], got[s]) for s in want if want[s] != got[s]]
