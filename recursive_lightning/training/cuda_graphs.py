"""A training step's forward + backward captured once as a CUDA graph and replayed (``train.cuda_graphs``).

Where the host's kernel launches bound a step (SpiralFormer's coarse passes, Mela's chunk loop: thousands of
small kernels), a replay launches the whole step as one graph and the GPU no longer waits for Python. This is
PyTorch's whole-network capture recipe (``torch.cuda.graphs``): a few warm-up steps on a side stream, one
capture of ``loss_fn(*inputs)`` + ``backward`` under ``torch.cuda.graph``, then per step a copy of the new inputs
into the captured ones and ``graph.replay()``. The optimiser step stays outside the graph (Lightning's, with its
clipping and schedule), so what the graph holds is what eager mode computes, kernel for kernel.

Captured: gradients that are set, not accumulated (``.grad`` is None at capture), in the graph's memory pool;
after each replay, and again through :meth:`GraphedStep.restore_grads` (Lightning's closure calls ``zero_grad``
between the training step and the backward hook, setting ``.grad`` to None), the parameters' ``.grad`` point at
them. Autocast
runs with its weight cache off (a cached cast would be captured as stale). A new input shape or a change in
which parameters train (``train.train_only``) captures again. On the CPU the step runs eagerly (the tests'
path and ``--smoke``), with the same semantics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def _uncached_autocast(device_type: str) -> torch.autocast:
    """The autocast state in force, with its weight cache off (required under capture)."""
    enabled = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type)
    return torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False)


class GraphedStep:
    """``step(*inputs)`` runs ``loss_fn(*inputs).backward()`` by replaying a captured CUDA graph; returns the loss.

    ``params``: the module's parameters (those with ``requires_grad`` at capture get their gradient from the
    graph). ``warmup``: eager steps on a side stream before capture (cuDNN/cuBLAS workspaces, lazy init)."""

    def __init__(
        self,
        loss_fn: Callable[..., torch.Tensor],
        params: Sequence[torch.nn.Parameter],
        warmup: int = 3,
    ) -> None:
        self.loss_fn, self.params, self.warmup = loss_fn, list(params), warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key: tuple | None = None
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.loss: torch.Tensor | None = None
        self.grads: list[torch.Tensor | None] = []

    def _fwd_bwd(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        with _uncached_autocast(inputs[0].device.type):
            loss = self.loss_fn(*inputs)
        loss.backward()
        return loss

    def _clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def _key(self, inputs: Sequence[torch.Tensor]) -> tuple:
        return (
            tuple((t.shape, t.dtype, t.device) for t in inputs),
            tuple(p.requires_grad for p in self.params),
        )

    def _capture(self, inputs: Sequence[torch.Tensor]) -> None:
        self.graph = self.loss = None
        self.inputs = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._clear_grads()
                self._fwd_bwd(self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self._clear_grads()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = self._fwd_bwd(self.inputs)
        self.graph, self.loss = graph, loss.detach()
        self.grads = [p.grad for p in self.params]

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if not inputs[0].is_cuda:  # the CPU: the same step, eagerly (gradients set, not accumulated)
            self._clear_grads()
            loss = self._fwd_bwd(inputs).detach()
            self.grads = [p.grad for p in self.params]
            return loss
        key = self._key(inputs)
        if key != self.key:
            self._capture(inputs)
            self.key = key
        for static, new in zip(self.inputs, inputs):
            static.copy_(new)
        self.graph.replay()
        self.restore_grads()
        return self.loss.clone()

    def restore_grads(self) -> None:
        """Point every parameter's ``.grad`` at the last step's gradient (None where it has none)."""
        for p, g in zip(self.params, self.grads):
            p.grad = g
