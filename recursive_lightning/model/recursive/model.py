"""The recursive language model: embeddings -> prelude -> loop steps over the core -> coda -> head.

    h_emb        = sqrt(d) * E[x]                          (MeSH App. B)
    h^(0), H^(0) = topology.start(h_emb, f_pre(h_emb))
    for t in 0..K-1:                                       (K' at test time: ``loops``, depth.py)
        u~       = step_t(h^(t), f_core)                   full resolution: f_core(h^(t)); else Eqs. 8-22
        h^(t+1), H^(t+1) = topology.step(t, h^(t), u~, H^(t))  (SpiralFormer Eq. 4)
    logits       = head(norm(f_coda(topology.finish(h^(K)))))

A vanilla layout has no loop steps; ``4+8+8+4`` loops over distinct cores (MeSH Table 8).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from recursive_lightning.model.block import Block, Stack, make_norm
from recursive_lightning.model.config import TOPOLOGY_TERMS, ModelConfig
from recursive_lightning.model.decoding import DecodeCache, Generates
from recursive_lightning.model.loss import cross_entropy
from recursive_lightning.model.recursive.depth import loop_plan
from recursive_lightning.model.recursive.mesh import MeSH
from recursive_lightning.model.recursive.resolution import ResolutionStep
from recursive_lightning.model.recursive.topology import Additive, Combination, Topology
from recursive_lightning.model.shared_grad import SHARED_MIN_NUMEL, accumulate_weight_grads


def build_topology(cfg: ModelConfig, n_steps: int) -> Topology:
    """The recurrence topology named by ``cfg.topology`` for ``n_steps`` loop steps."""
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


@dataclass
class Trace:
    """Hidden states captured along the prelude -> core iterations -> coda path (for probes).

    ``blocks`` lists (name, input, output) of each computational block f: prelude, each core step
    (input h^(t), output the update u~^(t)), coda. ``states`` are h_emb, h^(0) .. h^(K), h_out.
    """

    blocks: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    states: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    routing: dict[str, list[torch.Tensor]] | None = None  # MeSH write/read weights per step t = -1..K-1
    coefficients: list[torch.Tensor] | None = None  # static/dynamic combination coefficients per step
    scaling: list[list[dict[str, torch.Tensor]]] | None = None  # per step: self-aggregation α / allocation β
    attention: dict[str, list[torch.Tensor]] | None = None  # per stack name: attention maps per layer


class RecursiveLM(Generates, nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        lay = cfg.parsed_layout
        self.layout = lay
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.prelude = Stack(cfg, lay.prelude)
        self.cores = nn.ModuleList(Stack(cfg, n) for n in lay.cores)
        self.coda = Stack(cfg, lay.coda)
        self.norm = make_norm(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.topology = build_topology(cfg, lay.n_loop)
        self.steps = nn.ModuleList(
            ResolutionStep(cfg, g, w, s, lam)
            for g, w, s, lam in zip(lay.chunk, cfg.offsets(), cfg.shifts(), cfg.gains())
        )
        self.emb_scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        # sum a looped core's weight gradients in one buffer (shared_grad.py); training/parallel.py turns it
        # off where compile, FSDP2 or activation checkpointing handle each use themselves
        self.shared_grads_in_place = True
        self.shared_grads_min_numel = SHARED_MIN_NUMEL  # only weights this large (shared_grad.py)
        self.looped_cores = [i for i in range(len(self.cores)) if lay.core_index.count(i) > 1]
        # test-time depth: K' loop steps instead of the trained K (depth.py; None: K), and truncated
        # backpropagation: gradients through the last ``backprop_loops`` loop steps only (None: all)
        self.loops: int | None = None
        self.backprop_loops: int | None = None
        self.reset_parameters()

    # ------------------------------------------------------------------ init (MeSH App. B)
    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.layout.n_compute) if self.cfg.depth_init else std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, nn.LayerNorm | nn.RMSNorm) and module.weight is not None:
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        for block in self.blocks():
            nn.init.normal_(block.attn.proj.weight, std=out_std)
            nn.init.normal_(block.mlp.down.weight, std=out_std)
        if isinstance(self.topology, Combination):
            self.topology.reset_parameters()

    def blocks(self) -> list[Block]:
        """Every distinct transformer layer (the FSDP wrapping unit)."""
        stacks = [self.prelude, *self.cores, self.coda]
        return [layer for s in stacks for layer in s.layers]

    # ------------------------------------------------------------------ forward
    @property
    def packable(self) -> bool:
        """Whether every operation but attention acts per position, so that several sequences can share one
        row under an attention ``mask`` (true unless a loop step runs at a coarser resolution)."""
        return all(step.full_resolution for step in self.steps)

    def hidden(
        self,
        idx: torch.Tensor,
        trace: Trace | None = None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: DecodeCache | None = None,
    ) -> torch.Tensor:
        """Final hidden states (b, l, d) after the final norm.

        ``positions`` (b, l) and ``mask`` (b, l, l), True = may attend, describe a packed input (rotary
        positions and who sees whom); only for :attr:`packable` models. ``cache`` continues a sequence whose
        earlier positions it holds (``decoding.py``)."""
        packed = {} if positions is None and mask is None else {"positions": positions, "mask": mask}
        if packed and not self.packable:
            raise ValueError(
                "a packed input (positions/mask) needs a full-resolution model: multi-resolution steps pool "
                "neighbouring positions"
            )
        if packed and cache is not None:
            raise ValueError("a packed input cannot continue a decoding cache")

        def stack_args(site: str) -> dict:  # what each call site's Stack gets: its KV caches, or the packing
            return {"kv": cache.kv[site]} if cache is not None else packed

        h_emb = self.embed(idx) * self.emb_scale
        h_pre = self.prelude(h_emb, **stack_args("prelude"))
        if trace is not None:
            trace.blocks.append(("prelude", h_emb, h_pre))
            trace.states.append(("h_emb", h_emb))
        h, carry = self.topology.start(h_emb, h_pre)
        if trace is not None:
            trace.states.append(("h(0)", h))
        looped = [self.cores[i] for i in self.looped_cores]
        plan = self.loop_plan()
        grad = torch.is_grad_enabled()
        first_grad = len(plan) - self.backprop_loops if self.backprop_loops else 0
        with accumulate_weight_grads(looped, self.shared_grads_in_place, self.shared_grads_min_numel):
            for t, s in enumerate(plan):  # loop step t with the parameters of trained step s (depth.py)
                core, site = self.cores[self.layout.core_index[s]], stack_args(f"step{t}")
                with torch.set_grad_enabled(grad and t >= first_grad):
                    u = self.steps[s](
                        h,
                        functools.partial(core, **site) if site else core,
                        cache.steps[t] if cache is not None else None,
                    )
                    if trace is not None:
                        trace.blocks.append((f"core {t + 1}", h, u))
                    h, carry = self.topology.step(s, h, u, carry)
                if trace is not None:
                    trace.states.append((f"h({t + 1})", h))
        h = self.topology.finish(h, carry)
        out = self.coda(h, **stack_args("coda"))
        if cache is not None:
            cache.length += idx.shape[1]
        if trace is not None:
            trace.blocks.append(("coda", h, out))
            trace.states.append(("h_out", out))
        return self.norm(out)

    def forward(self, idx: torch.Tensor, trace: Trace | None = None) -> torch.Tensor:
        """Logits (b, l, vocab) for token ids (b, l)."""
        return self.head(self.hidden(idx, trace))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(self(idx), targets, overwrite_logits=True)  # the logits never leave here

    @torch.no_grad()
    def traced(self, idx: torch.Tensor, attention: bool | set[str] = False) -> tuple[torch.Tensor, Trace]:
        """Run once recording states, router weights and (optionally) attention maps; same logits.

        ``attention``: True for every stack, or a set of stack names ("prelude", "core0", ..., "coda")."""
        trace = Trace()
        topo = self.topology
        if isinstance(topo, MeSH):
            topo.record = {"write": [], "read": []}
        if isinstance(topo, Combination):
            topo.record = []
        for step in self.steps:
            step.record = []
        stacks = {
            "prelude": self.prelude,
            **{f"core{i}": c for i, c in enumerate(self.cores)},
            "coda": self.coda,
        }
        if attention is not True:
            stacks = {n: s for n, s in stacks.items() if attention and n in attention}
        for s in stacks.values():
            for layer in s.layers:
                layer.attn.capture = []
        try:
            logits = self(idx, trace)
        finally:
            if isinstance(topo, MeSH):
                trace.routing, topo.record = topo.record, None
            if isinstance(topo, Combination):
                trace.coefficients, topo.record = topo.record, None
            trace.scaling = [step.record for step in self.steps]
            for step in self.steps:
                step.record = None
            if stacks:
                trace.attention = {}
                for name, s in stacks.items():
                    trace.attention[name] = [layer.attn.capture for layer in s.layers]
                    for layer in s.layers:
                        layer.attn.capture = None
        return logits, trace

    def compile_glue(self, **options) -> None:
        """``torch.compile`` the work between the layers, each piece a region of its own: every
        multi-resolution step's S_down and S_up (with the shift) and every MeSH step's routers, write and read
        (``train.compile: glue``, which also compiles each layer; ``training/parallel.compile_model``)."""
        for step in self.steps:
            step.compile_glue(**options)
        if isinstance(self.topology, MeSH):
            self.topology.compile_glue(**options)

    def loop_plan(self) -> list[int]:
        """The trained step whose parameters each loop step uses, at the depth ``loops`` (depth.py)."""
        return loop_plan(self.layout, self.loops)

    # ------------------------------------------------------------------ generation
    @property
    def window(self) -> int:
        """Positions a decoding step can see (rotary and chunk boundaries are trained up to here)."""
        return self.cfg.max_seq_len

    def new_cache(self) -> DecodeCache:
        return DecodeCache.empty(self)

    def layer_lists(self) -> list[nn.ModuleList]:
        """The wrapping units of FSDP2 / activation checkpointing / per-layer compile."""
        return [s.layers for s in (self.prelude, *self.cores, self.coda)]

    @property
    def cacheable(self) -> bool:
        """Cached decoding needs every multi-resolution step causal (s >= g - 1, Prop. 1)."""
        return all(step.causal for step in self.steps)
