"""Recurrence topologies: how each loop step's update is fused into the running state.

One interface for every topology (SpiralFormer Eq. 4, U(u~, h, H; t)):

    h0, carry = topology.start(h_emb, h_pre)      # before the first loop step
    h, carry  = topology.step(t, h, u, carry)     # u = core output (or the shifted multi-res update)
    h_final   = topology.finish(h, carry)         # what the coda receives

``carry`` is the topology carrier H^(t): a dict of tensors (h^(0), h_emb, the MeSH buffer, ...).
MeSH (the buffer with write/read routers) lives in :mod:`recursive_lightning.model.recursive.mesh`;
``build_topology`` (which picks one by ``cfg.topology``) in :mod:`recursive_lightning.model.recursive.model`.
"""

from __future__ import annotations

import torch
from torch import nn

from recursive_lightning.model.config import ModelConfig

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
