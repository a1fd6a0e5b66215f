"""Mela (Sec. 4): a LLaMA-style decoder reading the Hierarchical Memory Module through memory tokens.

    x            = E[tokens]                                  (b, N, d); N cut into chunks of P*C tokens
    z(1..H)      = HMM(x)                                     (hierarchical_memory.py), each (b, N/P, d)
    chunk j      = [C memory rows | P*C text rows]            (Sec. 4.1; total length N (P+1) / P)
    memory rows  = z(H) at chunk j-1's C patches; C learned vectors for chunk 0
    y(a)         = B(a)(y(a-1)) + z(a) at memory rows, a < H  (MemStack, Eq. 13; text rows untouched)
    logits       = head(norm(y(L))) at text rows only

Causality [reading, see the design notes]: read literally, chunk j's memory tokens come from chunk j's own
patches, which every text token of chunk j would then see: its future. Here chunk j reads the memory as it
stood after chunk j-1, and a text token attends to its chunk's memory rows and its chunk's earlier text
only, so the memory is the only channel between chunks. Chunks are therefore independent rows of one
batch (b * n_chunks, C + P*C) under a plain causal mask, with rotary positions 0 .. C+P*C-1 restarting in
every chunk [reading]; MemStack adds nothing to chunk 0's memory rows [reading].

Decoding (:class:`MelaCache`) keeps one memory state per HMM block application and the keys/values of the
current chunk only; when a chunk's P*C tokens are complete, the HMM advances over its C patches and the next
chunk's memory rows are prefilled. The state does not grow with the sequence.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from recursive_lightning.model.block import KV, Block, Rotary
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.model.decoding import Generates
from recursive_lightning.model.loss import cross_entropy
from recursive_lightning.model.mela.hierarchical_memory import HierarchicalMemory
from recursive_lightning.model.mela.neural_memory import NeuralMemory


@dataclass
class MelaCache:
    """Decoding state: HMM memory states, the current chunk's KV caches and text embeddings."""

    kv: list[KV]
    states: list | None = None  # one MemoryState per HMM block application (None: M_0)
    memory: list[torch.Tensor] | None = (
        None  # the current chunk's memory rows: z(H), then MemStack's z(1..H-1)
    )
    text: list[torch.Tensor] = field(default_factory=list)  # embeddings of the current chunk's text so far
    text_len: int = 0
    chunks: int = 0  # completed chunks
    length: int = 0  # positions seen

    def numel(self) -> int:
        """Elements held: constant in the sequence length (at most one chunk of keys/values)."""
        n = sum(t.numel() for kv in self.kv if kv.k is not None for t in (kv.k, kv.v))
        n += sum(s.numel() for s in self.states or [] if s is not None)
        n += sum(t.numel() for t in (self.memory or []) + self.text)
        return n


class MelaLM(Generates, nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.layout = cfg.parsed_layout
        C, PC = cfg.chunk_size, cfg.tokens_per_chunk
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.hmm = HierarchicalMemory(cfg)
        self.memory_init = nn.Parameter(torch.empty(C, cfg.d_model))  # chunk 0's memory rows [reading]
        self.layers = nn.ModuleList(Block(cfg) for _ in range(self.layout.n_layers))
        self.rotary = Rotary(dataclasses.replace(cfg, max_seq_len=C + PC), table=True)
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.shared_grads_in_place = False  # no looped core (training/parallel.py sets this for RecursiveLM)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * len(self.layers)) if self.cfg.depth_init else std
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding | nn.Conv1d):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
        nn.init.normal_(self.memory_init, std=std)
        for layer in self.layers:
            nn.init.normal_(layer.attn.proj.weight, std=out_std)
            nn.init.normal_(layer.mlp.down.weight, std=out_std)
        for module in self.hmm.modules():
            if isinstance(module, NeuralMemory):
                module.reset_parameters()

    def compile_glue(self, **options) -> None:
        """``torch.compile`` the HMM's work between its compiled attention units as regions of their own
        (``train.compile: glue``, which also compiles each layer; ``training/parallel.compile_model``): each
        neural memory's projections and chunk update, and each memory block's norms (in eager mode a kernel per
        operation wherever the fused RMSNorm kernel is refused: on CUDA under autocast, whose input is bf16 and
        weight float32, and on the CPU). The L- and H-modules' input fusions and the dual-memory fusions stay
        eager, a few kernels each per application: compiled, the input fusions' graphs (one per grad mode, input
        count and gradient pattern) passed the recompile limit that ``tests/model/test_mela.py`` holds."""
        for module in (self.hmm.l_module, self.hmm.h_module):
            for block in module.blocks:
                block.compile_glue(**options)

    def use_memory_kernel(self) -> None:
        """Every neural memory's chunk updates, and their backward, as fused Triton kernels
        (``train.memory_kernel: triton``; ``model/mela/memory_kernel.py``, ``memory_kernel_backward.py``)."""
        for module in self.hmm.modules():
            if isinstance(module, NeuralMemory):
                module.use_memory_kernel()

    def compile_units(self) -> list[nn.Module]:
        """What ``train.compile: layers`` compiles one by one: the decoder layers and each memory block's gated
        attention. A memory block as a whole is left to eager mode around its compiled chunk update (``glue``):
        compiled whole, its Python chunk loop unrolls into the graph, which is specialised again for each grad
        mode of the cycles and each layout of the carried memory (three times the compile time of these units
        for a small Mela on the CPU)."""
        blocks = [*self.hmm.l_module.blocks, *self.hmm.h_module.blocks]
        return [*self.layers, *(b.attn for b in blocks if b.attn is not None)]

    def layer_lists(self) -> list[nn.ModuleList]:
        """The wrapping units of FSDP2 / activation checkpointing / per-layer compile."""
        return [self.layers, self.hmm.l_module.blocks, self.hmm.h_module.blocks]

    packable = False  # chunk boundaries and the memory make positions depend on where a sequence starts
    cacheable = True
    window: int | None = None  # no context window: the decoder is chunk-local and the memory constant-size

    # ------------------------------------------------------------------ forward
    def memory_rows(self, x: torch.Tensor, n_chunks: int) -> list[torch.Tensor]:
        """Memory rows of every chunk, (b, n_chunks, C, d): z(H) first, then MemStack's z(1..H-1).
        ``x``: embeddings of at least the first n_chunks - 1 complete chunks."""
        b, C, d = x.shape[0], self.cfg.chunk_size, self.cfg.d_model
        first = self.memory_init.to(x.dtype).expand(b, C, d)
        if n_chunks == 1:
            zs = []
        else:
            zs, _ = self.hmm(x[:, : (n_chunks - 1) * self.cfg.tokens_per_chunk])
        rows = [torch.cat([first, zs[-1]], dim=1) if zs else first]
        rows += [F.pad(z, (0, 0, C, 0)) for z in zs[:-1]]  # MemStack adds nothing at chunk 0
        return [r.view(b, n_chunks, C, d) for r in rows]

    def hidden(self, idx: torch.Tensor, cache: MelaCache | None = None, **packing) -> torch.Tensor:
        """Final hidden states (b, N, d) of the text positions, after the final norm. ``cache`` continues a
        decoded sequence (:meth:`new_cache`)."""
        if packing.get("positions") is not None or packing.get("mask") is not None:
            raise ValueError(
                "Mela cannot score packed sequences: its chunks depend on where a sequence starts"
            )
        if cache is not None:
            return self._extend(idx, cache)
        b, N = idx.shape
        C, PC, d = self.cfg.chunk_size, self.cfg.tokens_per_chunk, self.cfg.d_model
        n = -(-N // PC)
        x = self.embed(F.pad(idx, (0, n * PC - N)))  # the padding sits after every real token: causal
        memory, *stack = self.memory_rows(x, n)
        rows = torch.cat([memory, x.view(b, n, PC, d)], dim=2).view(b * n, C + PC, d)
        cos, sin = self.rotary.cos_sin_range(0, C + PC, x.device, x.dtype)
        for a, layer in enumerate(self.layers):
            rows = layer(rows, cos, sin)
            if a < len(stack):  # Eq. 13
                rows = torch.cat([rows[:, :C] + stack[a].reshape(b * n, C, d), rows[:, C:]], dim=1)
        return self.norm(rows[:, C:]).reshape(b, n * PC, d)[:, :N]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (b, N, vocab) at the text positions."""
        return self.head(self.hidden(idx))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(self(idx), targets, overwrite_logits=True)

    # ------------------------------------------------------------------ decoding
    def new_cache(self) -> MelaCache:
        return MelaCache([KV() for _ in self.layers])

    def _run_layers(
        self, x: torch.Tensor, cache: MelaCache, stack: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        start = cache.kv[0].length
        cos, sin = self.rotary.cos_sin_range(start, x.shape[1], x.device, x.dtype)
        for a, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv=cache.kv[a])
            if stack is not None and a < len(stack):
                x = x + stack[a]
        return x

    def _extend(self, idx: torch.Tensor, cache: MelaCache) -> torch.Tensor:
        b, PC, C = idx.shape[0], self.cfg.tokens_per_chunk, self.cfg.chunk_size
        x = self.embed(idx)
        outs = []
        while x.shape[1]:
            if cache.text_len == 0:  # a new chunk: prefill its memory rows
                if cache.memory is None:
                    cache.memory = [self.memory_init.to(x.dtype).expand(b, C, -1)]
                memory, *stack = cache.memory
                self._run_layers(memory, cache, stack)
            take = min(x.shape[1], PC - cache.text_len)
            part, x = x[:, :take], x[:, take:]
            outs.append(self._run_layers(part, cache))
            cache.text.append(part)
            cache.text_len += take
            cache.length += take
            if cache.text_len == PC:  # chunk complete: the HMM advances over its C patches
                zs, cache.states = self.hmm(torch.cat(cache.text, dim=1), cache.states)
                cache.memory = [zs[-1], *zs[:-1]]
                cache.kv = [KV() for _ in self.layers]
                cache.text, cache.text_len = [], 0
                cache.chunks += 1
        return self.norm(torch.cat(outs, dim=1))


def memory_without_gradient(cfg: ModelConfig, seq_len: int) -> list[str]:
    """Names of the memory parameters (one per block and kind, e.g. ``hmm.h_module.blocks.0.memory.eta``)
    that get no gradient from the loss at ``seq_len`` tokens. Which parameters the loss reaches depends on
    the chunk count, the cycles, the blocks and the readings, not on the widths or on P and C: a copy with
    width 8, P = C = 1, H decoder layers and min(chunks, 4) tokens takes one backward pass on the CPU (milliseconds)."""
    if cfg.arch != "mela":
        return []
    n_chunks = min(-(-seq_len // cfg.tokens_per_chunk), 4)  # reachability is the same from 3 chunks on
    small = dataclasses.replace(
        cfg,
        d_model=8,
        n_heads=2,
        n_kv_heads=1,
        hmm_d_model=8,
        hmm_heads=2,
        memory_heads=1,
        vocab_size=5,
        patch_size=1,
        chunk_size=1,
        layout=str(cfg.h_cycles),  # MemStack's z(H-1) reaches the text through one more layer
        n_layers_hint=None,
        tie_embeddings=False,
    )
    with torch.device("cpu"):
        torch.manual_seed(0)
        model = MelaLM(small)
        idx = torch.randint(0, small.vocab_size, (1, n_chunks + 1))
        with torch.enable_grad():
            model.loss(idx[:, :-1], idx[:, 1:]).backward()
    dead = []
    for name, p in model.hmm.named_parameters():
        if p.grad is None or not p.grad.abs().sum():
            base = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
            if f"hmm.{base}" not in dead:
                dead.append(f"hmm.{base}")
    return dead


def memory_gradient_warning(cfg: ModelConfig, seq_len: int) -> str | None:
    """One sentence for ``train`` when the loss reaches some HMM parameters not at all (None when it reaches
    every one)."""
    dead = memory_without_gradient(cfg, seq_len)
    if not dead:
        return None
    hint = " or memory_carry cycles" if cfg.memory_carry == "none" else ""
    hint += " or memory_read after" if cfg.memory_read == "before" else ""
    shown = ", ".join(dead[:6]) + (f" and {len(dead) - 6} more" if len(dead) > 6 else "")
    return (
        f"warning: at data.seq_len {seq_len} ({-(-seq_len // cfg.tokens_per_chunk)} chunk(s) of P*C = "
        f"{cfg.tokens_per_chunk} tokens, memory_carry {cfg.memory_carry}, memory_read {cfg.memory_read}) the "
        f"loss gives no gradient to {shown}; use more chunks per sequence (a longer data.seq_len or a smaller "
        f"model.chunk_size){hint}."
    )
