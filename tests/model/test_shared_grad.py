"""model/shared_grad.py: the looped core's weight gradients summed in one buffer equal autograd's own sum."""

from __future__ import annotations

import pytest
import torch

from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.loss import cross_entropy
from recursive_lightning.model.recursive.model import RecursiveLM
from recursive_lightning.model.shared_grad import SHARED_MIN_NUMEL, Linear, accumulate_weight_grads
from recursive_lightning.training import parallel

TINY = dict(vocab_size=61, d_model=32, n_heads=4, max_seq_len=64)


def pair(layout: str, topology: str) -> tuple[RecursiveLM, RecursiveLM]:
    """The same float64 model twice: autograd's own gradient sum, and the in-place one."""
    models = []
    for in_place in (False, True):
        torch.manual_seed(0)
        model = RecursiveLM(ModelConfig.from_dict({**TINY, "layout": layout, "topology": topology})).double()
        model.shared_grads_in_place = in_place
        model.shared_grads_min_numel = 0  # every Linear of this tiny model takes the in-place path
        models.append(model)
    return models[0], models[1]


def batch(n: int = 2, length: int = 24, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY["vocab_size"], (n, length + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def assert_same_grads(a: RecursiveLM, b: RecursiveLM) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-13, msg=name)


@pytest.mark.parametrize(
    "layout, topology",
    [
        ("2+2x{1/4,1/2,1}+2", "mesh"),  # SpiralFormer: one core at three resolutions
        ("1+2R3+1", "anchor"),
        ("1+2R2+1", "residual"),
        ("1+2+2+1", "mesh"),  # distinct cores, each used once: nothing to share
    ],
)
def test_gradients_equal_autograds_sum(layout, topology):
    a, b = pair(layout, topology)
    x, y = batch()
    a.loss(x, y).backward()
    b.loss(x, y).backward()
    assert_same_grads(a, b)


def test_two_forwards_one_backward_and_a_retained_graph():
    a, b = pair("1+2x{1/2,1}+1", "mesh")
    for model in (a, b):
        (x1, y1), (x2, y2) = batch(seed=1), batch(seed=2)
        # two graphs, each with its own sums (cross_entropy keeps the logits: the graph is backpropagated twice)
        loss = cross_entropy(model(x1), y1) + 0.5 * cross_entropy(model(x2), y2)
        loss.backward(retain_graph=True)
        loss.backward()  # the same graph again: its sums start afresh
    assert_same_grads(a, b)


def test_buffers_exist_only_during_a_grad_forward():
    _, b = pair("1+2R2+1", "anchor")
    linears = [m for m in b.modules() if isinstance(m, Linear)]
    x, y = batch()
    b.loss(x, y)
    with torch.no_grad():
        b(x)
    assert all(m.grad_buffer is None for m in linears)


def test_autocast_and_activation_checkpointing_take_autograds_path():
    a, b = pair("1+2x{1/2,1}+1", "mesh")
    a, b = a.float(), b.float()
    x, y = batch()
    for model in (a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.loss(x, y).backward()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)  # the very same operations

    a, b = pair("1+2x{1/2,1}+1", "mesh")
    parallel.apply_activation_checkpointing(b)  # recomputation would replay forward uses: turned off
    assert not b.shared_grads_in_place
    for model in (a, b):
        model.loss(x, y).backward()
    assert_same_grads(a, b)


def test_only_large_weights_take_the_buffer():
    """By default only weights of SHARED_MIN_NUMEL elements or more sum in a buffer (below it autograd's own sum
    is faster); ``min_numel=0`` puts every Linear on that path."""
    small, large = Linear(8, 8), Linear(1024, SHARED_MIN_NUMEL // 1024)
    with accumulate_weight_grads([small, large]):
        assert small.grad_buffer is None and large.grad_buffer is not None
    with accumulate_weight_grads([small, large], min_numel=0):
        assert small.grad_buffer is not None and large.grad_buffer is not None
    assert small.grad_buffer is None and large.grad_buffer is None
