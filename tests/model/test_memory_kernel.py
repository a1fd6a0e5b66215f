"""Mela's fused memory update (``model/mela/memory_kernel.py``) on the CPU under Triton's interpreter: equal to
the PyTorch update (``NeuralMemory.update_memory``) in float64 at shapes that are not multiples of its tiles,
within the PyTorch path's own error in float32; with gradients, every input's gradient equal to autograd's
through the PyTorch update in float64 and as close to it in float32; used by a model for every update (the loss
and every gradient those of the PyTorch path); the kernels compiled for an H100/H200 (sm_90) on this CPU;
``train.memory_kernel``'s refusals. The GPU runs the same checks in ``tests/test_cuda.py``."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys

import pytest
import torch
from conftest import (
    ROOT,
    TRITON_INTERPRETER,
    floor_binds,
    memory_chunk,
    memory_kernels_set,
    update_outputs_and_gradients,
)

from recursive_lightning.config import RunConfig
from recursive_lightning.errors import ConfigError
from recursive_lightning.model.build import build_model
from recursive_lightning.model.config import preset
from recursive_lightning.model.mela.neural_memory import NS_COEFFICIENTS, NeuralMemory
from recursive_lightning.training import parallel


@pytest.mark.parametrize(
    "d,heads,C,floor,carried",
    [(32, 2, 8, 12.0, False), (48, 1, 40, 0.0, True), (24, 2, 16, 3.0, True)],
    ids=["from-M0-floor", "ragged-tiles-no-floor", "carried-floor"],
)
def test_the_fused_update_equals_the_pytorch_update_in_float64(memory_kernel, d, heads, C, floor, carried):
    mem, args = memory_chunk(d, heads, C, floor, torch.float64, carried)
    with torch.no_grad():
        want = mem.update_memory(*args)
        got = memory_kernel.fused_update_memory(
            *args, ns_steps=5, coefficients=NS_COEFFICIENTS, step_floor=floor
        )
    for w, g in zip(want[0] + want[1], got[0] + got[1]):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)


@pytest.fixture
def compiled_scalars(memory_kernel, monkeypatch):
    """The interpreter given each Python float a kernel takes at run time as the compiled kernel gets it: a GPU
    launch passes it as an fp32 parameter (``triton.runtime.jit.mangle_type``), which the interpreter would
    otherwise keep a Python float, in float64."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.jit import mangle_type

    convert = interpreter._implicit_cvt

    def as_launched(arg):
        if not isinstance(arg, float):
            return convert(arg)
        ty = tl.str_to_ty(mangle_type(arg), None)
        return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), ty), ty)

    monkeypatch.setattr(interpreter, "_implicit_cvt", as_launched)
    return memory_kernel


@pytest.mark.parametrize("carried", [False, True], ids=["from-M0", "carried"])
def test_the_float64_update_keeps_its_floor_and_eps_in_float64_as_a_gpu_launch_passes_them(
    compiled_scalars, carried
):
    """A floor that float32 cannot hold (12.3) and Newton-Schulz's eps (1e-7) reach the float64 kernel at full
    precision: an fp32 kernel argument would move tau by 1.6e-8 relative, and the step with it."""
    mem, args = memory_chunk(32, 2, 8, 12.3, torch.float64, carried)
    with torch.no_grad():
        want = mem.update_memory(*args)
        got = compiled_scalars.fused_update_memory(
            *args, ns_steps=5, coefficients=NS_COEFFICIENTS, step_floor=12.3
        )
    for w, g in zip(want[0] + want[1], got[0] + got[1]):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)


def test_a_vanished_memory_takes_the_pytorch_updates_step_below_the_floor(memory_kernel):
    """M_{t-1} = 0 makes tau = 0, which both paths clamp to the dtype's smallest normal number (``tiny``): in
    float64 a surprise of norm 1.5e-38 (a decayed momentum; the memory's own surprise is 0) then takes the full
    step. (In float32 a norm that small sums squares that underflow to 0: both paths take no step.)"""
    mem, (k, v, theta, eta, alpha, weights, momentum) = memory_chunk(
        32, 2, 8, 6.0, torch.float64, carried=False
    )
    weights = [torch.zeros_like(w) for w in weights]
    momentum = [torch.full_like(w, 3e-38 / w[0, 0].numel() ** 0.5) for w in weights]
    args = (k, v, theta, eta, alpha, weights, momentum)
    with torch.no_grad():
        want = mem.update_memory(*args)
        got = memory_kernel.fused_update_memory(
            *args, ns_steps=5, coefficients=NS_COEFFICIENTS, step_floor=6.0
        )
    for w, g in zip(want[0], got[0]):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=0)


def test_the_fused_update_in_float32_is_as_close_to_float64_as_the_pytorch_update(memory_kernel):
    mem, args = memory_chunk(48, 2, 40, 12.0, torch.float64, carried=True)
    low = copy.deepcopy(mem).float()
    args32 = [[t.float() for t in a] if isinstance(a, list) else a.float() for a in args]
    with torch.no_grad():
        exact = mem.update_memory(*args)
        torch32 = low.update_memory(*args32)
        fused32 = memory_kernel.fused_update_memory(
            *args32, ns_steps=5, coefficients=NS_COEFFICIENTS, step_floor=12.0
        )
    for e, t, f in zip(exact[0] + exact[1], torch32[0] + torch32[1], fused32[0] + fused32[1]):
        scale = e.abs().max()
        torch_err, fused_err = ((x.double() - e).abs().max() / scale for x in (t, f))
        assert fused_err < 1e-5 and fused_err <= 4 * torch_err + 1e-6, (fused_err, torch_err)


@pytest.mark.parametrize(
    "d,heads,C,floor,carried",
    [(32, 2, 8, 12.0, False), (48, 1, 40, 0.0, True), (24, 2, 16, 0.25, True)],
    ids=["from-M0-floor", "ragged-tiles-no-floor", "carried-floor-binding-in-some-heads"],
)
def test_the_fused_update_with_gradients_gives_the_pytorch_updates_gradients_in_float64(
    memory_kernel_backward, d, heads, C, floor, carried
):
    """The update that carries gradients (the last HLR cycle in training) on the fused kernels, forward and
    backward: M_t, S_t and the gradient of every input equal to the PyTorch update's and autograd's, to 1e-10
    of each gradient's largest entry; with the floor binding in every head (from M_0) and in some heads only
    (0.25: the bounded step's two branches, d tau and d sum theta where it binds)."""
    mem, args = memory_chunk(d, heads, C, floor, torch.float64, carried)
    if floor == 0.25:
        binds = floor_binds(mem, args, floor)
        assert binds.any() and not binds.all()
    want = update_outputs_and_gradients(mem.update_memory, args)
    fused = functools.partial(
        memory_kernel_backward.fused_update, ns_steps=5, coefficients=NS_COEFFICIENTS, step_floor=floor
    )
    got = update_outputs_and_gradients(fused, args)
    for w, g in zip(want[0], got[0]):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)
    names = ("k", "v", "theta", "eta_t", "alpha_t", "W_1", "W_2", "S_1", "S_2")
    for name, w, g in zip(names, want[1], got[1]):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10 * w.abs().max().item() + 1e-15, msg=name)


@pytest.mark.parametrize("cotangents", ["sum", "transposed"])
def test_the_fused_backward_reads_output_gradients_of_any_strides(memory_kernel_backward, cotangents):
    """The gradients reaching the update as autograd hands them over: of stride 0 (a sum), with S_t unused (its
    gradient zeros), or transposed; every input's gradient that of the PyTorch update, in float64."""
    mem, args = memory_chunk(40, 1, 24, 12.0, torch.float64, carried=True)  # ragged tiles: 40 x 80, C = 24
    fused = functools.partial(
        memory_kernel_backward.fused_update, ns_steps=5, coefficients=NS_COEFFICIENTS, step_floor=12.0
    )
    want = update_outputs_and_gradients(mem.update_memory, args, cotangents)[1]
    got = update_outputs_and_gradients(fused, args, cotangents)[1]
    for name, w, g in zip(("k", "v", "theta", "eta_t", "alpha_t", "W_1", "W_2", "S_1", "S_2"), want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10 * w.abs().max().item() + 1e-15, msg=name)


def test_a_second_derivative_through_the_fused_update_is_refused(memory_kernel_backward):
    """The backward's kernels write gradients without a graph: differentiating them again raises rather than
    leaving the update's part out of the second derivative."""
    mem, (k, v, theta, eta, alpha, weights, momentum) = memory_chunk(
        16, 1, 8, 6.0, torch.float64, carried=True
    )
    k = k.clone().requires_grad_()
    new_weights, _ = memory_kernel_backward.fused_update(
        k, v, theta, eta, alpha, weights, momentum, ns_steps=5, coefficients=NS_COEFFICIENTS, step_floor=6.0
    )
    (dk,) = torch.autograd.grad(sum((w * w).sum() for w in new_weights), k, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dk.sum().backward()


def test_the_fused_gradients_in_float32_are_as_close_to_float64_as_the_pytorch_updates(
    memory_kernel_backward,
):
    """In float32 each gradient's error against float64 within 4x the PyTorch update's own (and below 1e-4 of
    its largest entry), at ragged tiles from a carried state with the floor."""
    mem, args = memory_chunk(48, 2, 40, 12.0, torch.float64, carried=True)
    low = copy.deepcopy(mem).float()
    args32 = tuple([t.float() for t in a] if isinstance(a, list) else a.float() for a in args)
    fused = functools.partial(
        memory_kernel_backward.fused_update, ns_steps=5, coefficients=NS_COEFFICIENTS, step_floor=12.0
    )
    exact = update_outputs_and_gradients(mem.update_memory, args)[1]
    torch32 = update_outputs_and_gradients(low.update_memory, args32)[1]
    fused32 = update_outputs_and_gradients(fused, args32)[1]
    for e, t, f in zip(exact, torch32, fused32):
        scale = e.abs().max()
        torch_err, fused_err = ((x.double() - e).abs().max() / scale for x in (t, f))
        assert fused_err < 1e-4 and fused_err <= 4 * torch_err + 1e-6, (fused_err, torch_err)


# cpu-mela narrowed: a model the interpreter runs in seconds
TINY_MELA = {
    "d_model": 64,
    "n_heads": 4,
    "hmm_d_model": 16,
    "hmm_heads": 4,
    "memory_heads": 1,
    "vocab_size": 97,
}


def _tiny_mela():
    torch.manual_seed(0)
    cfg = preset("cpu-mela", **TINY_MELA)
    model = build_model(cfg).double()
    idx = torch.randint(0, cfg.vocab_size, (1, 3 * cfg.tokens_per_chunk + 1))  # the HMM reads chunks 0, 1
    return model, idx


def test_a_model_runs_every_update_fused_and_learns_as_before(memory_kernel):
    """cpu-mela's training loss over 3 decoder chunks (the HMM over the first 2; H = 2: one HLR cycle without
    gradients and the last with them, every update fused, the memory carried across chunks) and a no-grad
    forward in float64: the loss, every parameter's gradient and the logits those of the PyTorch update."""
    plain, idx = _tiny_mela()
    fused = copy.deepcopy(plain)
    fused.use_memory_kernel()
    calls = []
    for m in fused.modules():
        if isinstance(m, NeuralMemory):
            kernel = m.kernel
            m.kernel = lambda *a, _k=kernel: calls.append(torch.is_grad_enabled()) or _k(*a)
    losses = [m.loss(idx[:, :-1], idx[:, 1:]) for m in (plain, fused)]
    for loss in losses:
        loss.backward()
    per_chunk = len(plain.hmm.applications)
    assert calls == 2 * (
        [False] * (per_chunk // 2) + [True] * (per_chunk // 2)
    )  # 2 chunks, H = 2 cycles each
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=0)
    grads = dict(fused.named_parameters())
    for name, p in plain.named_parameters():
        assert p.grad is not None and grads[name].grad is not None, name
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-9, atol=1e-12, msg=name)
    calls.clear()
    short = idx[:, : 2 * plain.cfg.tokens_per_chunk]  # the HMM over chunk 0
    with torch.no_grad():
        logits = [m(short) for m in (plain, fused)]
    assert len(calls) == per_chunk
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-10, atol=1e-12)


def test_a_run_trained_with_the_fused_updates_evaluates_and_generates_with_them(
    memory_kernel, tiny_run, tmp_path, monkeypatch
):
    """``load_checkpoint`` (generate, probe; eval's lm-eval adapter once on its device) of a Mela run trained with
    ``train.memory_kernel: triton`` puts every neural memory on the fused kernels where they run (here Triton's
    interpreter, a GPU for users); its cached decoding then gives the PyTorch path's hidden states in float64.
    Where they do not run (the CPU without the interpreter), and for a run trained without them, the PyTorch
    path."""
    from recursive_lightning.training.checkpoint import load_checkpoint, save_model_checkpoint

    cfg = tiny_run()
    cfg["model"] = {"preset": "cpu-mela", **TINY_MELA}
    cfg["train"]["memory_kernel"] = "triton"
    run = RunConfig.from_dict(cfg)
    torch.manual_seed(0)
    path = save_model_checkpoint(tmp_path / "fused.ckpt", build_model(run.model), run)

    fused = load_checkpoint(path, device="cpu").model.double()
    assert memory_kernels_set(fused) and all(memory_kernels_set(fused))
    monkeypatch.delenv("TRITON_INTERPRET")
    plain = load_checkpoint(path, device="cpu").model.double()
    assert not any(memory_kernels_set(plain))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read again at each launch
    idx = torch.randint(0, 97, (1, 3 * run.model.tokens_per_chunk + 2))
    with torch.no_grad():
        full = plain.hidden(idx)
        cache = fused.new_cache()
        steps = [fused.hidden(idx[:, :3], cache=cache)]
        steps += [fused.hidden(idx[:, i : i + 1], cache=cache) for i in range(3, idx.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-12)
    run.train.memory_kernel = "torch"
    path = save_model_checkpoint(tmp_path / "plain.ckpt", plain, run)
    assert not any(memory_kernels_set(load_checkpoint(path, device="cpu").model))


_COMPILE_FOR_SM90 = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from recursive_lightning.model.mela import memory_kernel as kernel, memory_kernel_backward as backward

ns = {"FLOOR": 6.0, "EPS": 1e-7, "TINY": 1.2e-38, "STEPS": 5, "NS_A": 3.4, "NS_B": -4.8, "NS_C": 2.0}
kernels = [(kernel.store_surprise_kernel, {"SAVE": True}, kernel.CONFIGS)]
kernels += [(kernel.orthogonal_step_kernel, {**ns, "SAVE": True}, kernel.CONFIGS)]
kernels += [(backward.orthogonal_step_backward_kernel, ns, backward.BACKWARD_CONFIGS)]
kernels += [(backward.store_surprise_backward_kernel, {}, backward.BACKWARD_CONFIGS)]
# the updates without gradients' orthogonal step, and the backward without a floor, in one tile configuration
kernels += [(kernel.orthogonal_step_kernel, {**ns, "SAVE": False}, kernel.CONFIGS[:1])]
kernels += [(backward.orthogonal_step_backward_kernel, {**ns, "FLOOR": 0.0}, backward.BACKWARD_CONFIGS[:1])]
print(sum(len(configs) for _, _, configs in kernels))
for fn, consts, configs in kernels:
    for config in configs:
        constexprs = {**config.kwargs, "PRECISION": "tf32", **consts}
        signature = {n: "constexpr" if n in constexprs else "*fp32" if n.endswith("_ptr") else "i32" for n in fn.arg_names}
        where = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        compiled = compile(ASTSource(fn, signature, constexprs=where), target=GPUTarget("cuda", 90, 32), options=options)
        print(fn.__name__, compiled.metadata.shared, "mma" in compiled.asm["ptx"])
"""


def test_the_kernels_compile_for_an_h100_h200_on_this_cpu(tmp_path):
    """Triton's compiler (front end to PTX and ptxas, no GPU needed) accepts the four kernels in every tile and
    warp configuration the autotuner may pick (the forward two keeping the backward's scratch; the orthogonal
    step without it and the backward without a floor in one configuration), for sm_90 in float32 with TF32 dots
    (the training setting; float64, the references' dtype, compiles on the GPU in ``tests/test_cuda.py``),
    within an SM's shared memory, their dots on tensor cores. The interpreter runs any Python, so only this
    catches what the compiler rejects (a global that is not constexpr, branches of two types). In a process of
    its own, with an empty cache: the interpreter leaves ``triton.language`` patched in the process that ran
    it."""
    if not TRITON_INTERPRETER.is_dir():
        pytest.importorskip("triton", reason="setup.sh installs triton for the fused kernels' tests")
    env = {
        **os.environ,
        "TRITON_CACHE_DIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(TRITON_INTERPRETER), str(ROOT)]),
    }
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    count, *lines = [line.split() for line in done.stdout.splitlines()]
    assert len(lines) == int(count[0]) >= 10
    for name, shared, mma in lines:
        assert int(shared) <= 227 * 1024 and mma == "True", (name, shared, mma)  # sm_90's per-block limit


def test_each_kernel_is_tuned_per_shape_and_the_forward_per_scratch_kept(
    memory_kernel, memory_kernel_backward
):
    """The autotuner picks a tile per (C, D, E) and, for the forward kernels, per SAVE: a forward that keeps the
    backward's scratch stores more, and does not reuse the tile timed without it."""
    tuned = {
        name: getattr(module, name).keys
        for module, names in ((memory_kernel, ("store_surprise", "orthogonal_step")),
                              (memory_kernel_backward, ("store_surprise_backward", "orthogonal_step_backward")))
        for name in names
    }  # fmt: skip
    assert tuned == {
        "store_surprise": ["C", "D", "E", "SAVE"],
        "orthogonal_step": ["C", "D", "E", "SAVE"],
        "store_surprise_backward": ["C", "D", "E"],
        "orthogonal_step_backward": ["C", "D", "E"],
    }


@pytest.mark.parametrize(
    "model,train_cfg,named",
    [
        ({}, {"memory_kernel": "cuda"}, "train.memory_kernel 'cuda' is unknown; choose torch or triton."),
        (
            {"preset": "cpu-tiny"},
            {"memory_kernel": "triton"},
            "fuses Mela's neural memory update; set it torch",
        ),
        (
            {"memory_depth": 3},
            {"memory_kernel": "triton"},
            "newton_schulz at model.memory_depth 2, not newton_schulz at depth 3",
        ),
        ({"memory_update": "momentum"}, {"memory_kernel": "triton"}, "not momentum at depth 2"),
        ({}, {"memory_kernel": "triton", "compile": "model"}, "cannot be combined with train.compile model"),
    ],
)
def test_a_memory_kernel_that_cannot_compute_the_update_is_refused(tiny_run, model, train_cfg, named):
    cfg = tiny_run()
    cfg["model"] = {"preset": "cpu-mela", **model}
    cfg["train"].update(train_cfg)
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        RunConfig.from_dict(cfg)


def test_the_triton_memory_kernel_on_the_cpu_is_refused_before_any_work(tiny_run, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = tiny_run()
    cfg["model"] = {"preset": "cpu-mela"}
    cfg["train"].update(memory_kernel="triton", accelerator="cpu")
    with pytest.raises(
        ConfigError, match="train.memory_kernel triton needs a CUDA GPU; set it torch on the CPU"
    ):
        parallel.check_supported(RunConfig.from_dict(cfg).train)
