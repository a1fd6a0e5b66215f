"""Mela's Hierarchical Memory Module (HMM, Sec. 3): patchify, L- and H-modules, HLR, dual-memory fusion.

    x_p       = Conv1d_{kernel=stride=P}(x)                       (Sec. 3.1; N_p = floor(N / P))
    l = h     = x_p
    for i in 1..H:                                               (HLR, Sec. 3.2; cycles < H without gradients)
        repeat L times:  l = f_L(Fuse_L[l; h; x_p])
        h = f_H(Fuse_H[h; l])
        z(i) = Fusion_i(l, h)                                    (Eq. 12; every cycle with MemStack, else only H)

A module f_L / f_H is a stack of memory blocks, each
    x = x + GatedAttn(RMSNorm(x));  x = x + NeuralMemory(RMSNorm(x))      (Sec. 3.1, Fig. 1b)

Readings of ours: x_p is fed to the L-module's input fusion at every step as in HRM (z_L <- f_L(z_L + z_H
+ x)); without it, detaching l and h before the last cycle would leave the patchify layer and the
embeddings without any gradient from the memory. The gated attention is causal and local to one chunk
of C patches (rotary positions 0..C-1), so that a patch sees no later patch and a chunk's memory tokens
can be computed when the chunk completes (decoding); the residual around each sub-layer and the absence
of an FFN are our reading of Fig. 1b; input fusions are 2-layer GELU MLPs like the output fusion.

Which fast-weight state a block application starts from [reading, ``memory_carry``]:

* ``cycles`` (default): each memory block has one memory (M, S), carried from application to application
  through the H x L cycles and on to the next chunk; ``forward`` runs all cycles over chunk t before chunk
  t+1, so the carry stays causal. It follows Sec. 3.2, "the l state and h state are refined H-1 times ...
  followed by a single final refinement step" and "through their interaction, memory representations undergo
  progressive transformation during consolidation": a block's memory is part of what is refined, and
  consolidation accumulates in it (Sec. 5.3: "deeper recurrent updates in the H-module deliver gains"), where
  Eqs. 10-11 give one recurrence per memory, not one per application. The H-1 cycles without gradients
  write constant increments into each memory; the state entering the last cycle keeps the gradient of the
  state the chunk started from (M_0 or the previous chunk's), as HRM's one-step gradient [reading]. At the
  paper's 4K (2 chunks, the HMM read at chunk 0 only) this gives eta its gradient: the momentum S entering
  the last cycle is the earlier cycles' (with ``none`` it is S_0 = 0 and eta gets none).
* ``none``: every application (H * (L * l_layers + h_layers) per forward) stores its memories from its block's
  learned M_0, as HRM/TRM restart nothing but their l and h states.

``forward`` takes and returns the states (``memory_slots``: per block or per application) so that decoding
can feed one chunk at a time (``model/mela/model.py``); it runs chunk by chunk from the patchify on, the operations that
decoding runs, so cached decoding reproduces the full forward's memory rows exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from recursive_lightning.model.block import Rotary, qkv_rotary
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.mela.neural_memory import MemoryState, NeuralMemory


def _straight_through(start: MemoryState, now: MemoryState) -> MemoryState:
    """``now`` in value, ``start`` in gradient: start + (now - start) with the increment detached."""

    def st(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        return None if a is None or b is None else [x + (y - x).detach() for x, y in zip(a, b)]

    return MemoryState(st(start.weights, now.weights), st(start.momentum, now.momentum))


class GatedAttention(nn.Module):
    """Causal attention within each chunk of C patches with a sigmoid output gate (Qiu et al. 2025:
    Y' = SDPA(Q, K, V) * sigmoid(X W_g), elementwise, before the output projection)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, self.heads, self.chunk = cfg.hmm_width, cfg.hmm_n_heads, cfg.chunk_size
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.gate = nn.Linear(d, d, bias=False) if cfg.hmm_gate else None
        self.proj = nn.Linear(d, d, bias=False)
        rot_cfg = dataclasses.replace(cfg, d_model=d, n_heads=self.heads, max_seq_len=cfg.chunk_size)
        self.rotary = Rotary(rot_cfg, table=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        xc = rearrange(x, "b (c n) d -> (b c) n d", n=self.chunk)  # chunks never see each other
        qkv = self.qkv(xc).unflatten(-1, (3 * self.heads, -1))  # (bc, n, q | k | v heads, hd)
        cos, sin = self.rotary.cos_sin_range(0, self.chunk, x.device, x.dtype)
        # q and k rotated together, each (bc, h, n, hd), with the decoder's written-out backward (block.py)
        q, k, v = qkv_rotary(qkv, cos, sin, (self.heads, self.heads), self.rotary.dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = rearrange(y, "bc h n d -> bc n (h d)")
        if self.gate is not None:
            y = y * torch.sigmoid(self.gate(xc))
        return rearrange(self.proj(y), "(b c) n d -> b (c n) d", b=b)


def normed(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)``: a memory block's RMSNorm as a region ``MemoryBlock.compile_glue`` compiles (one user-level
    frame: dynamo does not compile a bare ``torch.nn`` module, whose code it skips). In eager mode an RMSNorm is a
    kernel per operation wherever torch's fused kernel is refused: on CUDA under autocast (a bf16 input with a
    float32 weight) and on the CPU."""
    return norm(x)


class MemoryBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.hmm_width
        self.norm1 = nn.RMSNorm(d, eps=cfg.norm_eps) if cfg.hmm_attention else None
        self.attn = GatedAttention(cfg) if cfg.hmm_attention else None
        self.norm2 = nn.RMSNorm(d, eps=cfg.norm_eps) if cfg.neural_memory else None
        self.memory = (
            NeuralMemory(
                d,
                cfg.memory_heads,
                cfg.memory_depth,
                cfg.memory_expansion,
                cfg.chunk_size,
                cfg.memory_update,
                cfg.ns_steps,
                cfg.memory_read,
                cfg.memory_max_lr,
                cfg.memory_step_floor,
            )
            if cfg.neural_memory
            else None
        )
        self.normed: Callable = normed  # compiled by compile_glue

    def compile_glue(self, **options) -> None:
        """``train.compile: glue``: the block's norms as compiled regions, and its neural memory's
        (``NeuralMemory.compile_glue``); the attention is a unit of ``train.compile: layers``."""
        self.normed = torch.compile(normed, **options)
        if self.memory is not None:
            self.memory.compile_glue(**options)

    def forward(
        self, x: torch.Tensor, state: MemoryState | None = None
    ) -> tuple[torch.Tensor, MemoryState | None]:
        if self.attn is not None:
            x = x + self.attn(self.normed(self.norm1, x))
        if self.memory is not None:
            y, state = self.memory(self.normed(self.norm2, x), state)
            x = x + y
        return x, state


def fusion_mlp(d_in: int, d_hidden: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(d_in, d_hidden, bias=False), nn.GELU(), nn.Linear(d_hidden, d_out, bias=False)
    )


class MemoryModule(nn.Module):
    """The L- or H-module: an input fusion MLP over its concatenated inputs, then memory blocks."""

    def __init__(self, cfg: ModelConfig, n_layers: int, n_inputs: int) -> None:
        super().__init__()
        d = cfg.hmm_width
        self.fuse = fusion_mlp(n_inputs * d, d, d)
        self.blocks = nn.ModuleList(MemoryBlock(cfg) for _ in range(n_layers))

    def forward(self, inputs: list[torch.Tensor], states: list) -> tuple[torch.Tensor, list]:
        x = self.fuse(torch.cat(inputs, dim=-1)).to(inputs[0].dtype)
        new = []
        for block, state in zip(self.blocks, states):
            x, state = block(x, state)
            new.append(state)
        return x, new


class DualMemoryFusion(nn.Module):
    """z = Fusion(l, h) (Sec. 3.3, Eq. 12), projected to the decoder width: a 2-layer MLP over [h; l], a
    learned per-channel weighted sum (w_h * h + w_l * l) [reading: per channel], or h only ("none")."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, d_out, self.kind = cfg.hmm_width, cfg.d_model, cfg.fusion
        if self.kind == "mlp":
            self.mlp = fusion_mlp(2 * d, d, d_out)
            return
        if self.kind == "weighted_sum":
            self.w_h = nn.Parameter(torch.full((d,), 0.5))
            self.w_l = nn.Parameter(torch.full((d,), 0.5))
        # "none" is parameter-free (config.validate refuses hmm_d_model != d_model); the weighted sum is
        # projected to the decoder width when the widths differ [reading]
        self.proj = nn.Linear(d, d_out, bias=False) if d != d_out else None

    def forward(self, l_state: torch.Tensor, h_state: torch.Tensor) -> torch.Tensor:
        if self.kind == "mlp":
            return self.mlp(torch.cat([h_state, l_state], dim=-1))
        z = self.w_h * h_state + self.w_l * l_state if self.kind == "weighted_sum" else h_state
        return z if self.proj is None else self.proj(z)


class HierarchicalMemory(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patchify = nn.Conv1d(
            cfg.d_model, cfg.hmm_width, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.l_module = MemoryModule(cfg, cfg.l_layers, n_inputs=3)  # [l; h; x_p]
        self.h_module = MemoryModule(cfg, cfg.h_layers, n_inputs=2)  # [h; l]
        # MemStack: one fusion per cycle (Eq. 12); without it only the last cycle's
        self.fusions = nn.ModuleList(
            DualMemoryFusion(cfg) for _ in range(cfg.h_cycles if cfg.memstack else 1)
        )
        self.record: list[bool] | None = None  # tests: whether each block application carried gradients
        # test-time depth: H' cycles instead of the trained H (model/depth.py; None: H)
        self.h_cycles: int | None = None

    @property
    def cycles(self) -> int:
        """H, the high-level cycles a forward runs: ``h_cycles`` when set, else the config's."""
        return self.h_cycles or self.cfg.h_cycles

    @property
    def applications(self) -> list[tuple[str, int]]:
        """(module, block index) of every memory block application of one forward, in execution order."""
        cfg, out = self.cfg, []
        for _ in range(self.cycles):
            out += [("l", j) for _ in range(cfg.l_cycles) for j in range(cfg.l_layers)]
            out += [("h", j) for j in range(cfg.h_layers)]
        return out

    @property
    def memory_slots(self) -> list[tuple[str, int]]:
        """The fast-weight states a forward keeps: one per memory block with ``memory_carry: cycles``, one per
        block application with ``none``."""
        cfg = self.cfg
        if cfg.memory_carry == "cycles":
            return [("l", j) for j in range(cfg.l_layers)] + [("h", j) for j in range(cfg.h_layers)]
        return self.applications

    def forward(self, x: torch.Tensor, states: list | None = None) -> tuple[list[torch.Tensor], list]:
        """x: token embeddings (b, N, d) with N a multiple of P*C. Returns z(1..H) (only z(H) without
        MemStack), each (b, N/P, d_model), and the memory states after the last chunk (one per entry of
        ``memory_slots``)."""
        cfg = self.cfg
        states = list(states) if states is not None else [None] * len(self.memory_slots)
        if cfg.memory_carry == "cycles":
            blocks = list(self.l_module.blocks) + list(self.h_module.blocks)
            states = [  # M_0 made explicit, so that the straight-through in _hlr reaches it
                b.memory.initial_state(x.shape[0]) if s is None and b.memory is not None else s
                for s, b in zip(states, blocks)
            ]
        # Chunk by chunk, from the patchify on: the HMM's attention is local to a chunk and its memory stores
        # the chunks in order, so this is the all-chunks pass, computed with the very operations (shapes
        # included) that decoding runs when a chunk completes. Newton-Schulz lifts rounding differences in an
        # update's near-null directions ~500x a step, so any other order makes cached decoding drift from the
        # full forward (1e-2 after 20 chunks in float32 when the patchify and the HMM ran over all chunks at
        # once); with the same operations the memory rows agree exactly.
        PC, outs = cfg.tokens_per_chunk, []
        for t in range(x.shape[1] // PC):
            chunk = x[:, t * PC : (t + 1) * PC].contiguous()
            # (b, C, d_hmm); the residual streams stay in the embeddings' dtype under autocast, as the decoder's
            x_p = self.patchify(chunk.transpose(1, 2)).transpose(1, 2).to(x.dtype)
            zs, states = self._hlr(x_p, states)
            outs.append(zs)
        return [torch.cat(z, dim=1) for z in zip(*outs)], states

    def _hlr(self, x_p: torch.Tensor, states: list) -> tuple[list[torch.Tensor], list]:
        """HLR (Sec. 3.2) over x_p (b, n, d_hmm), n a multiple of C, from ``states`` (per memory slot)."""
        cfg = self.cfg
        carry = cfg.memory_carry == "cycles"
        slot = {key: i for i, key in enumerate(self.memory_slots)} if carry else None
        grad = torch.is_grad_enabled()
        start = list(states)  # the chunk's starting states (carrying gradients from earlier chunks)
        new_states: list = []  # ``none``: one state per application, in execution order
        l_state = h_state = x_p
        zs = []

        def run(module: MemoryModule, name: str, inputs: list[torch.Tensor], n_blocks: int) -> torch.Tensor:
            if carry:  # the block's one memory, continued from its previous application
                keys = [slot[(name, j)] for j in range(n_blocks)]
                out, st = module(inputs, [states[k] for k in keys])
                for k, s in zip(keys, st):
                    states[k] = s
            else:  # from the state of this application (M_0 or the previous chunk's)
                out, st = module(inputs, states[len(new_states) : len(new_states) + n_blocks])
                new_states.extend(st)
            self._note(out)
            return out

        H = self.cycles
        # cycle i fuses through fusion i - (H - H_trained): at another depth H than trained the last cycles keep
        # the trained fusions, ends aligned, so z(H) is always the last fusion's [reading, model/depth.py]
        shift = H - len(self.fusions) if cfg.memstack else H - 1
        for i in range(H):
            last = i == H - 1
            if carry and last and grad and H > 1:
                # the H-1 cycles without gradients wrote constant increments into each memory; the state
                # entering the last cycle still depends on the chunk's starting state (M_0 or the previous
                # chunk's) through the identity [reading, as HRM's one-step gradient], so M_0 and the
                # cross-chunk memory keep their gradients
                states = [
                    s if s0 is None or s is None else _straight_through(s0, s) for s0, s in zip(start, states)
                ]
            with torch.set_grad_enabled(grad and last):  # HLR: H-1 cycles without gradients
                for _ in range(cfg.l_cycles):
                    l_state = run(self.l_module, "l", [l_state, h_state, x_p], cfg.l_layers)
                h_state = run(self.h_module, "h", [h_state, l_state], cfg.h_layers)
            if i - shift >= 0:
                zs.append(self.fusions[i - shift](l_state, h_state))
        if (
            shift < 0
        ):  # fewer cycles than trained: the fusions no cycle reached add nothing (MemStack, Eq. 13)
            zs = [torch.zeros_like(zs[0])] * -shift + zs
        return zs, states if carry else new_states

    def _note(self, x: torch.Tensor) -> None:
        if self.record is not None:
            self.record.append(x.requires_grad)
