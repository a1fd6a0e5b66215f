"""MeSH, Memory-as-State-Highways (MeSH Sec. 3.2, Alg. 2): the recurrence topology that writes every loop
step's update into a B-slot buffer through a write router and reads the next state back through a read router.

The buffer is kept factored (the list of writes); :meth:`MeSH.write_buffer` appends to it (Eq. 5),
:meth:`MeSH.read_buffer` reads it (Eq. 6), :meth:`MeSH.buffer` materialises it as the paper draws it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.precision import upcast
from recursive_lightning.model.recursive.topology import Carry, Topology

Writes = list[tuple[torch.Tensor, torch.Tensor]]  # the factored buffer: every (u^(tau), w_write^(tau))


class MeSH(Topology):
    """Memory-as-State-Highways (MeSH Sec. 3.2, Alg. 2).

    A B-slot buffer M (slot 0 = h_emb, others zero, Eq. 2) and step-wise write/read routers
    Linear(d, B) + softmax over slots (Eq. 3) for steps t = -1 (transitional) .. K-1.
    Step t writes m_b += u * w_write,b (Eq. 5) and reads h^(t+1) = sum_b m_b * w_read,b (Eq. 6).

    The buffer is linear in what was written, m_b = [b = 0] h_emb + sum_tau w_write,b^(tau) u^(tau), so it is
    kept in that factored form: ``carry["writes"]`` lists every write (u^(tau), w_write^(tau)). A read is then
    h_emb * w_read,0 + sum_tau <w_write^(tau), w_read> u^(tau) — the same numbers as materialising the
    (B, b, l, d) buffer (see :meth:`buffer`), at O((t + 2) L d) instead of O(2 B L d) memory traffic per
    step, which keeps MeSH's wall-clock overhead near its FLOP overhead. Past the trained depth the list is
    collapsed back to B writes whenever it reaches 2B (:meth:`collapse_writes`), so a read never costs more
    than the materialised buffer's traffic.
    """

    def __init__(self, cfg: ModelConfig, n_steps: int) -> None:
        super().__init__()
        self.slots = cfg.buffer_slots
        self.transition_input = cfg.mesh_transition_input
        # index 0 is the transitional step t = -1; index t + 1 is loop step t
        self.write = nn.ModuleList(nn.Linear(cfg.d_model, self.slots) for _ in range(n_steps + 1))
        self.read = nn.ModuleList(nn.Linear(cfg.d_model, self.slots) for _ in range(n_steps + 1))
        self.record: dict[str, list[torch.Tensor]] | None = None  # router weights of the last forward
        self.glue: list[Callable] | None = None  # per step index, set by compile_glue (train.compile: glue)

    def route(self, idx: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The write and read router weights of step ``idx`` on ``h`` (Eq. 3), (b, l, B) each."""
        write, read = self.write[idx], self.read[idx]
        # both routers in one matmul over h (two Linear(d, B) parameters as before), slot-major: (2B, b l)
        weight, bias = torch.cat([write.weight, read.weight]), torch.cat([write.bias, read.bias])
        logits = torch.addmm(bias.unsqueeze(-1), weight, h.reshape(-1, h.shape[-1]).t())
        # softmax over slots (Eq. 3) along a leading dim: ATen vectorises it over the b l positions, where the
        # softmax over a last dim of B = 5 runs element by element (2 x 2048 x 5: 23 against 460 us)
        weights = upcast(logits).unflatten(0, (2, self.slots)).softmax(1).to(h.dtype)
        # (b, l, B) views of the slot-major rows; split, not unbind: its backward is one cat, unbind's a stack
        w_write, w_read = (w.squeeze(0).t().unflatten(0, h.shape[:-1]) for w in weights.split(1, 0))
        if self.record is not None:
            self.record["write"].append(w_write.detach())
            self.record["read"].append(w_read.detach())
        return w_write, w_read

    @staticmethod
    def write_buffer(writes: Writes, u: torch.Tensor, w_write: torch.Tensor) -> Writes:
        """Eq. 5 on the factored buffer: m_b += u * w_write,b for every slot b is kept as the write (u, w_write)."""
        return [*writes, (u, w_write)]

    @staticmethod
    def read_buffer(carry: Carry, writes: Writes, w_read: torch.Tensor) -> torch.Tensor:
        """Eq. 6 on the factored buffer: slot 0's h_emb, plus each write u^(tau) with gain <w_write^(tau), w_read>."""
        h_emb = carry["h_emb"].to(w_read.dtype)
        if torch.compiler.is_compiling():  # the compiler fuses the term-by-term form
            return _read_buffer_reference(h_emb, w_read, writes)
        return _FactoredRead.apply(h_emb, w_read, *(t for write in writes for t in write))

    @staticmethod
    def buffer(carry: Carry) -> torch.Tensor:
        """The buffer M as the paper draws it, (B, b, l, d): Eq. 2 plus every write of Eq. 5 so far."""
        h_emb, writes = carry["h_emb"], carry["writes"]
        slots = writes[0][1].shape[-1]
        m = torch.zeros((slots, *h_emb.shape), dtype=writes[0][0].dtype, device=h_emb.device)
        m[0] = h_emb
        for u, w_write in writes:
            m = m + w_write.permute(2, 0, 1).unsqueeze(-1) * u
        return m

    def compile_glue(self, **options) -> None:
        """``torch.compile`` each step's routers, write and read (Eqs. 3, 5, 6) as one region of its own
        (``train.compile: glue``): one graph per step index, since step t reads t + 2 writes. ``options`` go
        to ``torch.compile``. Router recording (probes) stays eager."""
        self.glue = [torch.compile(_mesh_update, **options) for _ in self.write]

    def write_read(
        self, idx: int, router_in: torch.Tensor, u: torch.Tensor, carry: Carry, writes: Writes
    ) -> tuple[torch.Tensor, Writes]:
        """Routers on ``router_in`` (Eq. 3), the write of ``u`` into the buffer (Eq. 5) and the read of the next
        state from it (Eq. 6) at step ``idx``. Returns h^(t+1) and the buffer's writes."""
        if self.glue is not None and self.record is None:
            write, read = self.write[idx], self.read[idx]
            h, w_write = self.glue[idx](
                router_in, u, carry["h_emb"], writes, write.weight, write.bias, read.weight, read.bias
            )
            return h, self.write_buffer(writes, u, w_write)
        w_write, w_read = self.route(idx, router_in)
        writes = self.write_buffer(writes, u, w_write)
        return self.read_buffer(carry, writes, w_read), writes

    def start(self, h_emb: torch.Tensor, h_pre: torch.Tensor) -> tuple[torch.Tensor, Carry]:
        if self.record is not None:
            self.record = {"write": [], "read": []}
        router_in = h_pre if self.transition_input == "prelude" else h_emb
        carry: Carry = {"h_emb": h_emb}
        # transitional routers (Alg. 2 lines 9-13); Eq. 5: write the prelude output
        h0, writes = self.write_read(0, router_in, h_pre, carry, [])
        return h0, {**carry, "writes": writes, "h0": h0}  # type: ignore[dict-item]

    def step(self, t: int, h: torch.Tensor, u: torch.Tensor, carry: Carry) -> tuple[torch.Tensor, Carry]:
        # routers read the state that entered the core, h^(t) (Alg. 2 line 17); Eq. 5: distributed write of
        # the core output; Eq. 6: read
        writes = carry["writes"]
        if len(writes) >= 2 * self.slots:  # only past the trained depth: K + 1 writes < 2 (K + 3)
            writes = self.collapse_writes(writes)
        h_next, writes = self.write_read(t + 1, h, u, carry, writes)
        return h_next, {**carry, "writes": writes}

    @staticmethod
    def collapse_writes(writes: Writes) -> Writes:
        """The same buffer as B writes, one per slot: (m_b, e_b) with m_b = sum_tau w_write,b^(tau) u^(tau)
        (Eq. 5 summed) and e_b the b-th unit vector, so that Eq. 6 reads the same h.

        A read of the factored buffer costs one product per write, so a model run at a test-time depth K'
        far above the trained K (``--loops``) would read O(K'^2) in all; collapsing whenever the list reaches
        2B writes keeps every read at most 2B products (O(K' B) in all). At the trained depth the list never
        gets there (K + 1 writes against 2B = 2 (K + 3) by default), so training is unchanged."""
        slots = writes[0][1].shape[-1]
        us = torch.stack([u for u, _ in writes])  # (T, b, l, d)
        ws = torch.stack([w.to(u.dtype) for u, w in writes])  # (T, b, l, B)
        m = torch.einsum("tblk,tbld->kbld", ws, us)  # (B, b, l, d): the buffer less slot 0's h_emb (Eq. 2)
        unit = torch.eye(slots, dtype=writes[0][1].dtype, device=m.device)
        return [(m[k], unit[k].expand(*m.shape[1:3], slots)) for k in range(slots)]


def _mesh_update(
    router_in: torch.Tensor,
    u: torch.Tensor,
    h_emb: torch.Tensor,
    writes: Writes,
    write_weight: torch.Tensor,
    write_bias: torch.Tensor,
    read_weight: torch.Tensor,
    read_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MeSH step as plain ops (the region ``MeSH.compile_glue`` compiles): both routers in one matmul and
    a softmax over slots (Eq. 3), the write of ``u`` (Eq. 5) and the read on the factored buffer (Eq. 6).
    Returns h^(t+1) and w_write."""
    slots = write_weight.shape[0]
    logits = F.linear(router_in, torch.cat([write_weight, read_weight]), torch.cat([write_bias, read_bias]))
    w_write, w_read = upcast(logits).unflatten(-1, (2, slots)).softmax(-1).to(router_in.dtype).unbind(-2)
    h = _read_buffer_reference(h_emb.to(w_read.dtype), w_read, MeSH.write_buffer(writes, u, w_write))
    return h, w_write


def _read_buffer_reference(h_emb: torch.Tensor, w_read: torch.Tensor, writes: Writes) -> torch.Tensor:
    """Eq. 6 on the factored buffer, term by term: h = h_emb w_read,0 + sum_tau <w_write^(tau), w_read> u^(tau)."""
    h = h_emb * w_read[..., :1]
    for u, w_write in writes:
        h = torch.addcmul(h, (w_write * w_read).sum(-1, keepdim=True), u)
    return h


class _FactoredRead(torch.autograd.Function):
    """:func:`_read_buffer_reference` with the gains of all T writes computed at once and a batched backward.

    The router weights are taken slot-major, (B, b, l) (``w.movedim(-1, 0)``: a view of what
    :meth:`MeSH.route` makes), so every sum over the B slots runs along a leading dim, vectorised over the
    positions. Forward: c_tau = <w_write^(tau), w_read> for every tau in one product over the stacked
    (T, B, b, l) write weights, then the same T addcmuls as the reference. Backward, with g = dL/dh:

        dL/du^(tau)       = c_tau g                  one broadcast product, (T, b, l, d)
        dL/dc_tau         = <g, u^(tau)>              one product and a sum over d per write
        dL/dw_read        = sum_tau dL/dc_tau w_write^(tau) + e_0 <g, h_emb>
        dL/dw_write^(tau) = dL/dc_tau w_read          one broadcast product, (T, B, b, l)
        dL/dh_emb         = w_read,0 g

    a fixed ~12 ATen calls plus two per write, where autograd's backward of the term-by-term sum takes ~8
    per write (T = t + 2 at loop step t, so the count grew with every step)."""

    @staticmethod
    def forward(ctx, h_emb, w_read, *flat):
        us, w_writes = flat[0::2], flat[1::2]
        wr = w_read.movedim(-1, 0)  # (B, b, l)
        ws = torch.stack([w.movedim(-1, 0) for w in w_writes])  # (T, B, b, l)
        gains = (ws * wr).sum(1)  # (T, b, l): c_tau
        h = h_emb * wr[0].unsqueeze(-1)
        for tau, u in enumerate(us):
            h.addcmul_(gains[tau].unsqueeze(-1), u)
        ctx.save_for_backward(h_emb, wr, ws, gains, *us)
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        h_emb, wr, ws, gains, *us = ctx.saved_tensors
        need = ctx.needs_input_grad
        n = len(us)
        grad_us: list[torch.Tensor | None] = [None] * n
        if any(need[2::2]):
            grad_us = list((gains.unsqueeze(-1) * grad).unbind(0))
        grad_w_read = grad_w_writes = None
        if need[1] or any(need[3::2]):
            grad_c = _inner_products(grad, (h_emb, *us))  # (T + 1, b, l): <g, u^(tau)>
            if need[1]:
                grad_wr = (grad_c[1:].unsqueeze(1) * ws).sum(0)  # (B, b, l)
                grad_wr[0].add_(grad_c[0])
                grad_w_read = grad_wr.movedim(0, -1)
            if any(need[3::2]):
                grad_w_writes = [w.movedim(0, -1) for w in (grad_c[1:].unsqueeze(1) * wr).unbind(0)]
        grad_h_emb = grad * wr[0].unsqueeze(-1) if need[0] else None
        flat = []
        for tau in range(n):
            flat += [grad_us[tau], None if grad_w_writes is None else grad_w_writes[tau]]
        return grad_h_emb, grad_w_read, *flat


def _inner_products(
    grad: torch.Tensor, us: tuple[torch.Tensor, ...], stacked: bool | None = None
) -> torch.Tensor:
    """(T + 1, b, l): <grad, u> at every position for each u. On the CPU a product and a sum over d per u (no
    (b, l, T + 1, d) stacked copy); elsewhere (``stacked``) one batched product over the stacked states, a
    fixed two kernel launches however many writes there are (GPU steps of small passes are launch-bound)."""
    if stacked is None:
        stacked = grad.device.type != "cpu"
    if not stacked:
        return torch.stack([(u * grad).sum(-1) for u in us])
    states = torch.stack(us, -2)  # (b, l, T + 1, d)
    return torch.matmul(states, grad.unsqueeze(-1)).squeeze(-1).movedim(-1, 0)
