"""The GPU path: CUDA kernels, bf16 autocast, torch.compile (inductor/Triton), Lightning on a GPU, FSDP2 on one
GPU. Skipped without CUDA (CI has none); run on a lent GPU with ``python -m pytest tests/test_cuda.py``.

References are the same models in float64 on the CPU; tolerances follow the arithmetic (float32 with TF32
off: 1e-4 relative; bf16 operands: a few 1e-3).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from recursive_lightning.model.config import preset
from recursive_lightning.model.recursive.model import RecursiveLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# one of each family: vanilla, looped MeSH, SpiralFormer-B with learned S_down/S_up and MeSH, learnable
# dynamic combination with GQA and SwiGLU, distinct cores (MeSH Table 8)
FAMILIES = {
    "vanilla": dict(layout="4", topology="base"),
    "looped-mesh": dict(layout="1+2R3+1", topology="mesh"),
    "spiral-mesh": dict(
        layout="1+2x{1/8,1/4,1/2,1}+1",
        topology="mesh",
        downscale="self_aggregation",
        upscale="allocation",
    ),
    "spiral-anchor-mean": dict(
        layout="1+2x{1/4,1/2,1}+1", topology="anchor", downscale="mean", upscale="broadcast", shift="parallel"
    ),
    "dynamic-gqa": dict(layout="1+2R2+1", topology="dynamic", n_kv_heads=2, mlp="swiglu", norm="rmsnorm"),
    "distinct-cores": dict(layout="1+2+2+1", topology="anchor+residual"),
}


@pytest.fixture(autouse=True)
def _exact_float32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _model(name: str, seed: int = 0) -> RecursiveLM:
    torch.manual_seed(seed)
    return RecursiveLM(preset("cpu-tiny", max_seq_len=256, **FAMILIES[name]))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def _loss_and_grads(model: RecursiveLM, idx: torch.Tensor, tgt: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits = model(idx)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


def _assert_grads_close(got: dict, ref: dict, tol: float = 1e-3) -> None:
    """Relative error per parameter; a gradient that is zero in exact arithmetic (the scorer bias: softmax
    within a chunk ignores a constant) is checked against zero instead."""
    got = {n.replace("_orig_mod.", ""): g for n, g in got.items()}
    assert got.keys() == ref.keys()
    worst = max((_rel(got[n], ref[n]), n) for n in ref if ref[n].norm() > 1e-9)
    assert worst[0] < tol, worst
    assert all(got[n].norm() < 1e-5 for n in ref if ref[n].norm() <= 1e-9)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_float32_on_cuda_matches_float64_on_cpu(name):
    ref = _model(name).double()
    gpu = _model(name).cuda()
    idx = torch.randint(0, ref.cfg.vocab_size, (2, 200))
    tgt = torch.randint(0, ref.cfg.vocab_size, (2, 200))
    l_ref, loss_ref, g_ref = _loss_and_grads(ref, idx, tgt)
    l_gpu, loss_gpu, g_gpu = _loss_and_grads(gpu, idx.cuda(), tgt.cuda())
    assert _rel(l_gpu, l_ref) < 1e-4
    assert abs(float(loss_gpu) - float(loss_ref)) < 1e-4
    _assert_grads_close(g_gpu, g_ref)


@pytest.mark.parametrize("name", ["vanilla", "looped-mesh", "spiral-mesh", "dynamic-gqa"])
def test_bf16_autocast_stays_close_to_float64(name):
    ref = _model(name).double()
    gpu = _model(name).cuda()
    idx = torch.randint(0, ref.cfg.vocab_size, (2, 256))
    with torch.no_grad():
        expected = ref(idx)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = gpu(idx.cuda())
    assert got.dtype == torch.bfloat16  # the head ran in bf16: autocast reached the whole model
    assert _rel(got, expected) < 3e-2
    # the training loss (model/loss.py) in bf16 autocast: float32 accumulation, close to the reference
    tgt = torch.randint(0, ref.cfg.vocab_size, (2, 256))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        loss = gpu.loss(idx.cuda(), tgt.cuda())
    assert loss.dtype == torch.float32
    assert abs(float(loss) - float(ref.loss(idx, tgt))) < 2e-2


def test_flash_attn_matches_sdpa():
    """flash-attn (when installed) is taken for CUDA half-precision inputs; it must agree with SDPA."""
    from recursive_lightning.model import block

    if block.flash_attn_func is None:
        pytest.skip("flash-attn is not installed")
    model = _model("spiral-mesh").cuda()
    idx = torch.randint(0, model.cfg.vocab_size, (2, 256), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        flash = model(idx).float()
        saved, block.flash_attn_func = block.flash_attn_func, None
        try:
            sdpa = model(idx).float()
        finally:
            block.flash_attn_func = saved
    assert _rel(flash, sdpa) < 1e-2


@pytest.mark.parametrize("name", ["spiral-mesh", "spiral-anchor-mean", "looped-mesh"])
def test_causal_on_cuda(name):
    """Perturbing token j changes no logit before j (the CUDA attention kernels and S_down/S_up)."""
    model = _model(name).cuda().eval()
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, model.cfg.vocab_size, (1, 203), generator=g)
    with torch.no_grad():
        base = model(idx.cuda())
        for j in (5, 64, 131, 202):
            other = idx.clone()
            other[0, j] = (other[0, j] + 1) % model.cfg.vocab_size
            changed = model(other.cuda())
            assert torch.allclose(changed[:, :j], base[:, :j], atol=1e-5, rtol=0), j
            assert not torch.allclose(changed[:, j:], base[:, j:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["vanilla", "looped-mesh", "spiral-mesh"])
def test_cached_decoding_on_cuda_equals_recomputation(name):
    model = _model(name).cuda().eval()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 37), device="cuda")
    cached = model.generate(prompt, 40, use_cache=True)
    full = model.generate(prompt, 40, use_cache=False)
    assert torch.equal(cached, full)


@pytest.mark.parametrize("scope", ["layers", "glue", "model"])
def test_compile_on_cuda_matches_eager(scope):
    """train.compile (inductor, Triton kernels on CUDA) keeps the loss and gradients of eager mode, over
    several steps and a second sequence length."""
    from recursive_lightning.training.parallel import compile_model

    eager, compiled = _model("spiral-mesh").cuda(), _model("spiral-mesh").cuda()
    compile_model(compiled, scope)
    for length in (192, 192, 131):
        idx = torch.randint(0, eager.cfg.vocab_size, (2, length), device="cuda")
        tgt = torch.randint(0, eager.cfg.vocab_size, (2, length), device="cuda")
        _, loss_e, g_e = _loss_and_grads(eager, idx, tgt)
        _, loss_c, g_c = _loss_and_grads(compiled, idx, tgt)
        assert abs(float(loss_e) - float(loss_c)) < 1e-4
        _assert_grads_close(g_c, g_e)


def _gpu_run(tiny_run, **train):
    from recursive_lightning.config import RunConfig

    cfg = tiny_run()
    cfg["train"].update(accelerator="gpu", devices=1, max_steps=12, checkpoint_every=4, val_every=6, **train)
    return RunConfig.from_dict(cfg)


def _losses(run_dir) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    c = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    hist = sorted(c.get_metric_history(run_id, "train/loss"), key=lambda m: m.timestamp)
    return {m.step: m.value for m in hist}


def _stop_after(monkeypatch, step: int):
    from recursive_lightning.training.module import RecursiveLMModule

    def die(self, outputs, batch, batch_idx) -> None:
        if self.trainer.global_step == step:
            raise RuntimeError(f"stopped after step {step}")

    monkeypatch.setattr(RecursiveLMModule, "on_train_batch_end", die, raising=False)


@pytest.mark.parametrize(
    "strategy,compile,graphs",
    [("auto", False, False), ("fsdp", False, False), ("auto", "model", False), ("auto", "glue", False)]
    + [("auto", False, True)],
    ids=["single", "fsdp", "compiled", "compiled-glue", "cuda-graphs"],
)
def test_train_on_gpu_in_bf16_and_resume(tmp_path, tiny_run, monkeypatch, strategy, compile, graphs):
    """`train` on one GPU: precision auto -> bf16-mixed, loss falls, validation perplexity is logged, and a run
    stopped after its step-8 checkpoint resumes to the same losses (FSDP2: a sharded checkpoint; compiled: the
    whole model under torch.compile, train.compile: model; compiled-glue: train.compile: glue; cuda-graphs:
    train.cuda_graphs, each step replayed, captured again after the resume)."""
    from recursive_lightning.training.parallel import resolve_precision
    from recursive_lightning.training.run import train

    cfg = _gpu_run(tiny_run, strategy=strategy, compile=compile, cuda_graphs=graphs)
    assert resolve_precision(cfg.train, "gpu") == "bf16-mixed"
    straight = tmp_path / "straight"
    result = train(cfg, straight)
    a = _losses(straight)
    assert sorted(a) == list(range(12))
    assert a[11] < a[0] - 0.5, a  # it learns
    assert 1 < result.metrics["val/heldout/ppl"] < 4096  # below the uniform model's perplexity
    ckpt = straight / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() if strategy == "fsdp" else ckpt.is_file()

    stopped = tmp_path / "stopped"
    with monkeypatch.context() as m:
        _stop_after(m, 8)
        with pytest.raises(RuntimeError, match="stopped after step 8"):
            train(cfg, stopped)
    train(cfg, stopped, resume=True)
    b = _losses(stopped)
    assert sorted(b) == list(range(12))
    # the same kernels on the same data: equal up to the nondeterministic atomics of attention's backward
    worst = max(abs(a[s] - b[s]) for s in a)
    print(f"{strategy}: max |straight - resumed| train/loss over 12 steps = {worst:.2e}")
    assert worst < 1e-3, (a, b)


# ---------------------------------------------------------------------------------------------- Mela
def _mela(seed: int = 0):
    from recursive_lightning.model.build import build_model

    torch.manual_seed(seed)
    cfg = preset(
        "cpu-mela",
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        layout="3",
        patch_size=4,
        chunk_size=4,
        h_cycles=3,
        l_cycles=2,
        h_layers=2,
        l_layers=1,
        memory_heads=2,
        vocab_size=512,
    )
    return build_model(cfg)


def _assert_same_loss_and_grads(
    reference, other, idx: torch.Tensor, loss_tol: float, grad_tol: float
) -> None:
    """Mela's training loss on ``idx`` of ``other`` within ``loss_tol`` (relative) of ``reference``'s, and every
    parameter's gradient within ``grad_tol``."""
    losses = []
    for model in (reference, other):
        loss = model.loss(idx[:, :-1], idx[:, 1:])
        loss.backward()
        losses.append(float(loss))
    assert abs(losses[0] - losses[1]) < loss_tol * abs(losses[0])
    want = dict(reference.named_parameters())
    for name, p in other.named_parameters():
        assert _rel(p.grad, want[name].grad) < grad_tol, name


def test_mela_float32_and_bf16_against_float64_cpu():
    """``cpu-mela`` at its defaults over 64 chunks (the step floor keeps the memory's dynamics contractive,
    docs/models.md: Numerics): float32 on the GPU within 1e-3 of the CPU's float64, relative to the largest
    logit, and bf16 autocast within 2x the error of the same model whose memory has no Newton-Schulz
    (Eqs. 4-5)."""
    from conftest import chunk_errors, mela_against_float64

    errors = {}
    for update in ("newton_schulz", "forgetting"):
        model, high, idx = mela_against_float64(1, memory_update=update)
        per_chunk = model.cfg.tokens_per_chunk
        with torch.no_grad():
            want = high(idx).cuda()
            gpu = model.cuda()
            errors[update, "float32"] = float(chunk_errors(gpu(idx.cuda()), want, per_chunk).max())
            with torch.autocast("cuda", dtype=torch.bfloat16):
                errors[update, "bf16"] = float(chunk_errors(gpu(idx.cuda()), want, per_chunk).max())
    print(errors)
    assert errors["newton_schulz", "float32"] < 1e-3, errors
    assert errors["newton_schulz", "bf16"] < 2 * errors["forgetting", "bf16"], errors


@pytest.mark.parametrize("memory_kernel", ["torch", "triton"])
def test_mela_bf16_training_step_and_causality_on_gpu(memory_kernel):
    """A bf16 step's loss and gradients finite; perturbing a token changes no logit before it (with
    ``triton``: every memory update on the fused kernels of train.memory_kernel)."""
    model = _mela().cuda()
    if memory_kernel == "triton":
        model.use_memory_kernel()
    PC = model.cfg.tokens_per_chunk
    idx = torch.randint(0, 512, (2, 4 * PC + 1), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model.loss(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        base = model(idx[:, :-1])
        other = idx[:, :-1].clone()
        other[:, PC + 2] += 1
        assert torch.equal(model(other)[:, : PC + 2], base[:, : PC + 2])


def test_mela_compiled_memory_update_on_gpu_equals_eager():
    """train.compile: glue's memory regions (each neural memory's projections and chunk update, Triton kernels on
    CUDA) keep eager mode's loss and gradients, in float64 as on the CPU (tests/model/test_mela.py)."""
    eager = _mela().cuda().double()
    compiled = _mela().cuda().double()
    compiled.compile_glue()
    idx = torch.randint(0, 512, (2, 3 * eager.cfg.tokens_per_chunk + 1), device="cuda")
    _assert_same_loss_and_grads(eager, compiled, idx, loss_tol=1e-9, grad_tol=1e-6)


def test_mela_cached_decoding_on_gpu():
    model = _mela().cuda().eval()
    idx = torch.randint(0, 512, (1, 3 * model.cfg.tokens_per_chunk + 2), device="cuda")
    with torch.no_grad():
        full = model.hidden(idx)
        cache = model.new_cache()
        steps = [model.hidden(idx[:, :3], cache=cache)]
        steps += [model.hidden(idx[:, i : i + 1], cache=cache) for i in range(3, idx.shape[1])]
    assert _rel(torch.cat(steps, 1), full) < 1e-4


def test_mela_fused_memory_updates_on_gpu_equal_the_pytorch_updates():
    """train.memory_kernel: triton (model/mela/memory_kernel.py) compiled for this GPU: in float64 the loss and
    every gradient of the PyTorch path (every update fused, and the backward of those with gradients), a no-grad
    forward's logits
    likewise; in float32 (TF32 off) the logits within the PyTorch path's own distance from float64, and under
    bf16 autocast with TF32 (what train runs) within the PyTorch path's bf16 error of it."""
    plain = _mela().cuda().double()
    fused = _mela().cuda().double()
    fused.use_memory_kernel()
    idx = torch.randint(0, 512, (2, 3 * plain.cfg.tokens_per_chunk + 1), device="cuda")
    _assert_same_loss_and_grads(plain, fused, idx, loss_tol=1e-10, grad_tol=1e-8)
    with torch.no_grad():
        exact = plain(idx[:, :-1])
        assert _rel(fused(idx[:, :-1]), exact) < 1e-10
        low, low_fused = plain.float(), fused.float()
        errors = {"torch": _rel(low(idx[:, :-1]), exact), "fused": _rel(low_fused(idx[:, :-1]), exact)}
        torch.backends.cuda.matmul.allow_tf32 = True
        with torch.autocast("cuda", dtype=torch.bfloat16):
            errors["torch bf16"] = _rel(low(idx[:, :-1]), exact)
            errors["fused bf16+tf32"] = _rel(low_fused(idx[:, :-1]), exact)
    print(errors)
    assert errors["fused"] < 4 * errors["torch"] + 1e-6, errors
    assert errors["fused bf16+tf32"] < 2 * errors["torch bf16"], errors


@pytest.mark.parametrize(
    "d,C,floor",
    [(768, 64, 0.0), (768, 64, 12.0), (800, 72, 0.1)],
    ids=["no-floor", "floor", "ragged-floor-in-some-heads"],
)
def test_mela_fused_update_with_gradients_on_gpu_equals_autograd(d, C, floor):
    """One chunk's update on the fused kernels forward and backward (model/mela/memory_kernel_backward.py),
    compiled for this GPU from a carried state at mela-400m's head shape (4 heads of 192 x 384, C = 64) and at
    one no tile divides (200 x 400, C = 72, the floor binding in 8 of 16 heads): in float64 every output and every
    input's gradient equal to the PyTorch update's under autograd; in float32 each gradient's error against
    float64 within 4x the PyTorch path's, in float32 and in TF32."""
    from conftest import floor_binds, memory_chunk, update_outputs_and_gradients

    from recursive_lightning.model.mela import memory_kernel_backward
    from recursive_lightning.model.mela.neural_memory import NS_COEFFICIENTS

    fused = functools.partial(
        memory_kernel_backward.fused_update, ns_steps=5, coefficients=NS_COEFFICIENTS, step_floor=floor
    )
    mem, args = memory_chunk(d, 4, C, floor, torch.float64, carried=True, device="cuda")
    if floor == 0.1:  # both branches of the bounded step
        binds = floor_binds(mem, args, floor)
        assert binds.any() and not binds.all()
    want_out, want = update_outputs_and_gradients(mem.update_memory, args)
    got_out, got = update_outputs_and_gradients(fused, args)
    for w, g in zip(want_out + list(want), got_out + list(got)):
        assert _rel(g, w) < 1e-10
    low = copy.deepcopy(mem).float()
    args32 = tuple([t.float() for t in a] if isinstance(a, list) else a.float() for a in args)
    old = torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "high"):  # float32, then TF32 (the kernels read it, memory_kernel.py)
            torch.set_float32_matmul_precision(precision)
            errors = [
                (_rel(t, e), _rel(f, e))
                for e, t, f in zip(
                    want, update_outputs_and_gradients(low.update_memory, args32)[1],
                    update_outputs_and_gradients(fused, args32)[1],
                )
            ]  # fmt: skip
            print(f"{precision}: (torch, fused) float32 gradient errors against float64: {errors}")
            assert all(f <= 4 * t + 1e-6 for t, f in errors), errors
    finally:
        torch.set_float32_matmul_precision(old)


def test_mela_train_with_fused_memory_updates_on_gpu_and_resume(tmp_path, tiny_run, monkeypatch):
    """`train` with train.memory_kernel: triton on one GPU (bf16-mixed): the loss falls, the first step's line
    names the kernels, a run stopped after its step-8 checkpoint resumes to the same losses, and the checkpoint
    loaded on the GPU keeps the fused updates."""
    from recursive_lightning.config import RunConfig
    from recursive_lightning.training.run import train

    cfg = tiny_run()
    cfg["model"] = {"preset": "cpu-mela"}
    cfg["data"]["seq_len"] = 3 * 64  # three chunks of P * C tokens: the HMM runs over two
    cfg["train"].update(accelerator="gpu", devices=1, checkpoint_every=4, val_every=6, memory_kernel="triton")
    run_cfg = RunConfig.from_dict(cfg)
    straight = tmp_path / "straight"
    train(run_cfg, straight)
    a = _losses(straight)
    assert sorted(a) == list(range(12)) and a[11] < a[0], a
    stopped = tmp_path / "stopped"
    with monkeypatch.context() as m:
        _stop_after(m, 8)
        with pytest.raises(RuntimeError, match="stopped after step 8"):
            train(run_cfg, stopped)
    train(run_cfg, stopped, resume=True)
    b = _losses(stopped)
    worst = max(abs(a[s] - b[s]) for s in a)
    print(f"memory_kernel triton: max |straight - resumed| train/loss over 12 steps = {worst:.2e}")
    assert worst < 1e-3, (a, b)
    from conftest import memory_kernels_set

    from recursive_lightning.training.checkpoint import load_checkpoint

    kept = memory_kernels_set(load_checkpoint(straight, device="cuda").model)  # generate's and eval's model
    assert kept and all(kept)


@pytest.mark.parametrize("name", ["looped-mesh", "spiral-mesh", "mela", "mela-fused"])
def test_cuda_graph_step_replays_eager_loss_and_gradients(name):
    """train.cuda_graphs' GraphedStep (training/cuda_graphs.py): the captured forward + backward, replayed on new
    inputs, gives eager's loss and gradients for those inputs (float32, TF32 off); the gradients stay reachable
    through ``.grad`` after a ``zero_grad`` (Lightning's closure runs one between the step and the backward).
    ``mela-fused``: with train.memory_kernel triton, its kernels (tuned in the capture's warm-up steps) captured
    beside the ATen ones."""
    from recursive_lightning.training.cuda_graphs import GraphedStep

    mela = name.startswith("mela")
    model = (_mela() if mela else _model(name)).cuda()
    if name == "mela-fused":
        model.use_memory_kernel()
    n = 2 * model.cfg.tokens_per_chunk if mela else 64
    gen = torch.Generator(device="cuda").manual_seed(3)
    batches = [torch.randint(0, 512, (2, n + 1), device="cuda", generator=gen) for _ in range(3)]
    model.shared_grads_in_place = False
    step = GraphedStep(model.loss, list(model.parameters()))
    step(batches[0][:, :-1], batches[0][:, 1:])  # captures, then replays
    static = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}  # the graph's gradients
    assert static, "the captured backward wrote no gradient"
    params = dict(model.named_parameters())
    for b in batches[1:]:
        got = float(step(b[:, :-1], b[:, 1:]))
        model.zero_grad(set_to_none=True)
        step.restore_grads()
        assert all(params[k].grad is g for k, g in static.items())
        want = model.loss(b[:, :-1], b[:, 1:])
        ref = torch.autograd.grad(want, [params[k] for k in static])
        assert abs(got - float(want)) <= 1e-5 * abs(float(want))
        for (k, g), r in zip(static.items(), ref):
            assert _rel(g, r) < 1e-4, k
