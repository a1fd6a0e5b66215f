"""The blockwise cross-entropy (model/loss.py) gives F.cross_entropy's loss and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.loss import _CrossEntropy, cross_entropy
from recursive_lightning.model.recursive.model import RecursiveLM


def _reference(logits: torch.Tensor, targets: torch.Tensor, upstream: float):
    x = logits.detach().requires_grad_()
    loss = F.cross_entropy(
        x.flatten(0, -2).to(torch.promote_types(x.dtype, torch.float32)), targets.flatten()
    )
    (grad,) = torch.autograd.grad(loss * upstream, x)
    return loss, grad


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    vocab=st.integers(2, 300),
    rows=st.integers(1, 45),
    scale=st.floats(0.1, 30.0),
    upstream=st.floats(-3.0, 3.0),
    seed=st.integers(0, 2**16),
    overwrite=st.booleans(),
)
def test_blocks_equal_reference_float64(n, vocab, rows, scale, upstream, seed, overwrite):
    """Any block size, any logit scale (peaked or flat softmax), any upstream gradient, the gradient in fresh
    memory or written over the logits: equal to 1e-12."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=g, dtype=torch.float64) * scale).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    ref_loss, ref_grad = _reference(logits.detach().clone(), targets, upstream)
    loss = _CrossEntropy.apply(logits, targets, rows, overwrite)
    (grad,) = torch.autograd.grad(loss * upstream, logits)
    assert (grad.data_ptr() == logits.data_ptr()) == overwrite  # no (N, V) allocation when overwriting
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_logits(dtype):
    """(b, l, V) logits as a model gives them: float32 loss, gradient in the logits' dtype."""
    torch.manual_seed(0)
    logits = (torch.randn(3, 50, 1000) * 4).to(dtype).requires_grad_()
    targets = torch.randint(0, 1000, (3, 50))
    loss = cross_entropy(logits, targets)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_loss, ref_grad = _reference(logits, targets, 1.0)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-5}
    torch.testing.assert_close(loss, ref_loss.float(), **tol)
    torch.testing.assert_close(grad.float(), ref_grad.float(), **tol)


def test_model_loss_and_its_gradients_match_f_cross_entropy():
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=97, d_model=32, n_heads=4, max_seq_len=32, layout="1+2x{1/2,1}+1", topology="mesh"
    )
    model = RecursiveLM(cfg).double()
    idx, tgt = torch.randint(0, 97, (2, 20)), torch.randint(0, 97, (2, 20))
    loss = model.loss(idx, tgt)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_bad_targets_get_one_sentence():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 10\)"):
        cross_entropy(logits, torch.tensor([0, 3, 10, 1]))
    with pytest.raises(ValueError, match="do not match logits"):
        cross_entropy(logits, torch.tensor([0, 3]))
