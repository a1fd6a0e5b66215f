"""Recurrence topologies: how each loop step's update is fused into the running state.

One interface for every topology (SpiralFormer Eq. 4, U(u~, h, H; t)):

    h0, carry = topology.start(h_emb, h_pre)      # before the first loop step
    h, carry  = topology.step(t, h, u, carry)     # u = core output (or the shifted multi-res update)
    h_final   = topology.finish(h, carry)         # what the coda receives

``carry`` is the topology carrier H^(t): a dict of tensors (h^(0), h_emb, the MeSH buffer, ...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recursive_lightning.model.config import TOPOLOGY_TERMS, ModelConfig

Carry = dict[str, torch.Tensor]


class Topology(nn.Module):
    """``base``: h^(t+1) = f_core(h^(t)) (MeSH Alg. 1 with h_sup = 0)."""

    def start(self, h_emb: torch.Tensor, h_pre: torch.Tensor) -> tuple[torch.Tensor, Carry]:
        return h_pre, {"h0": h_pre, "h_emb": h_emb}

    def step(self, t: int, h: torch.Tensor, u: torch.Tensor, carry: Carry) -> tuple[torch.Tensor, Carry]:
        return u, carry

    def finish(self, h: torch.Tensor, carry: Carry) -> torch.Tensor:
        return h


class Additive(Topology):
    """Fixed additive supplements (MeSH Alg. 1, Table 5): h^(t+1) = u + sum of the chosen h_sup terms.

    residual: h^(t); anchor: h^(0) (prelude output); anchor_emb (anchor*): h_emb.
    """

    def __init__(self, terms: tuple[str, ...]) -> None:
        super().__init__()
        self.terms = terms

    def step(self, t: int, h: torch.Tensor, u: torch.Tensor, carry: Carry) -> tuple[torch.Tensor, Carry]:
        sources = {"residual": h, "anchor": carry["h0"], "anchor_emb": carry["h_emb"]}
        for term in self.terms:
            u = u + sources[term]
        return u, carry


class Combination(Topology):
    """Learnable combinations (MeSH App. E.3): h^(t+1) = a_core u + a_res h^(t) + a_anc h^(0) + a_emb h_emb.

    ``static``: per-step trainable scalars. ``dynamic``: per-step, per-token coefficients from a
    Linear(d, 4) of the current state h^(t), initialised to the static starting point.
    """

    INIT = (1.0, 1 / 3, 1 / 3, 1 / 3)  # core, residual, anchor, anchor_emb

    def __init__(self, cfg: ModelConfig, n_steps: int, dynamic: bool) -> None:
        super().__init__()
        self.dynamic = dynamic
        if dynamic:
            self.coef = nn.ModuleList(nn.Linear(cfg.d_model, 4) for _ in range(n_steps))
        else:
            self.alpha = nn.Parameter(torch.empty(n_steps, 4))
        self.reset_parameters()
        self.record: list[torch.Tensor] | None = None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init = torch.tensor(self.INIT)
        if self.dynamic:
            for lin in self.coef:
                nn.init.zeros_(lin.weight)
                lin.bias.copy_(init)
        else:
            self.alpha.copy_(init.repeat(len(self.alpha), 1))

    def step(self, t: int, h: torch.Tensor, u: torch.Tensor, carry: Carry) -> tuple[torch.Tensor, Carry]:
        a = self.coef[t](h) if self.dynamic else self.alpha[t].to(h.dtype)  # (b, l, 4) or (4,)
        if self.record is not None:
            self.record.append(a.detach())
        a = a.unbind(-1)
        if self.dynamic:
            a = [x.unsqueeze(-1) for x in a]
        return a[0] * u + a[1] * h + a[2] * carry["h0"] + a[3] * carry["h_emb"], carry


class MeSH(Topology):
    """Memory-as-State-Highways (MeSH Sec. 3.2, Alg. 2).

    A B-slot buffer M (slot 0 = h_emb, others zero, Eq. 2) and step-wise write/read routers
    Linear(d, B) + softmax over slots (Eq. 3) for steps t = -1 (transitional) .. K-1.
    Step t writes m_b += u * w_write,b (Eq. 5) and reads h^(t+1) = sum_b m_b * w_read,b (Eq. 6).

    The buffer is linear in what was written, m_b = [b = 0] h_emb + sum_tau w_write,b^(tau) u^(tau), so it is
    kept in that factored form: ``carry["writes"]`` lists every write (u^(tau), w_write^(tau)). A read is then
    h_emb * w_read,0 + sum_tau <w_write^(tau), w_read> u^(tau) — the same numbers as materialising the
    (B, b, l, d) buffer (see :meth:`buffer`), at O((t + 2) L d) instead of O(2 B L d) memory traffic per
    step, which keeps MeSH's wall-clock overhead near its FLOP overhead.
    """

    def __init__(self, cfg: ModelConfig, n_steps: int) -> None:
        super().__init__()
        self.slots = cfg.buffer_slots
        self.transition_input = cfg.mesh_transition_input
        # index 0 is the transitional step t = -1; index t + 1 is loop step t
        self.write = nn.ModuleList(nn.Linear(cfg.d_model, self.slots) for _ in range(n_steps + 1))
        self.read = nn.ModuleList(nn.Linear(cfg.d_model, self.slots) for _ in range(n_steps + 1))
        self.record: dict[str, list[torch.Tensor]] | None = None  # router weights of the last forward

    def _route(self, idx: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        write, read = self.write[idx], self.read[idx]
        # both routers in one matmul over h (two Linear(d, B) parameters as before), softmax over slots (Eq. 3)
        logits = F.linear(h, torch.cat([write.weight, read.weight]), torch.cat([write.bias, read.bias]))
        weights = logits.float().unflatten(-1, (2, self.slots)).softmax(-1).to(h.dtype)
        w_write, w_read = weights.unbind(-2)  # (b, l, B) each
        if self.record is not None:
            self.record["write"].append(w_write.detach())
            self.record["read"].append(w_read.detach())
        return w_write, w_read

    @staticmethod
    def _read(
        carry: Carry, writes: list[tuple[torch.Tensor, torch.Tensor]], w_read: torch.Tensor
    ) -> torch.Tensor:
        """Eq. 6 on the factored buffer: slot 0's h_emb, plus each write u^(tau) with gain <w_write^(tau), w_read>."""
        h = carry["h_emb"].to(w_read.dtype) * w_read[..., :1]
        for u, w_write in writes:
            h = torch.addcmul(h, (w_write * w_read).sum(-1, keepdim=True), u)
        return h

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

    def start(self, h_emb: torch.Tensor, h_pre: torch.Tensor) -> tuple[torch.Tensor, Carry]:
        if self.record is not None:
            self.record = {"write": [], "read": []}
        router_in = h_pre if self.transition_input == "prelude" else h_emb
        w_write, w_read = self._route(0, router_in)  # transitional routers (Alg. 2 lines 9-13)
        writes = [(h_pre, w_write)]  # Eq. 5: write the prelude output
        carry: Carry = {"h_emb": h_emb, "writes": writes}  # type: ignore[dict-item]
        h0 = self._read(carry, writes, w_read)
        return h0, {**carry, "h0": h0}

    def step(self, t: int, h: torch.Tensor, u: torch.Tensor, carry: Carry) -> tuple[torch.Tensor, Carry]:
        # routers read the state that entered the core, h^(t) (Alg. 2 line 17)
        w_write, w_read = self._route(t + 1, h)
        writes = [*carry["writes"], (u, w_write)]  # Eq. 5: distributed write of the core output
        return self._read(carry, writes, w_read), {**carry, "writes": writes}  # Eq. 6: read


def build_topology(cfg: ModelConfig, n_steps: int) -> Topology:
    name = cfg.topology
    if name == "base":
        return Topology()
    if name == "mesh":
        return MeSH(cfg, n_steps)
    if name in ("static", "dynamic"):
        return Combination(cfg, n_steps, dynamic=name == "dynamic")
    terms = tuple(name.split("+"))
    assert all(t in TOPOLOGY_TERMS for t in terms), name  # validated by ModelConfig
    return Additive(terms)
