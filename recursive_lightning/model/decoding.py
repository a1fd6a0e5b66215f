"""Cached autoregressive decoding for every model family (SpiralFormer Alg. 2 for multi-resolution steps).

Each call site of a layer keeps its own keys and values: the prelude, every loop step's pass through the
shared core (the core is one set of weights but sees a different input at each step, so each step has its
own cache), and the coda. A multi-resolution step caches at its own resolution: the core runs once per
*complete chunk* (the chunk trigger of Alg. 2), on a coarse sequence whose positions are chunk indices, and
every token reads the up-scaled summary of its shifted source chunk (``ResolutionStep.extend``). The
topologies act per position, so their state (MeSH's buffer, the anchors) needs no cache.

    cache = DecodeCache.empty(model)
    h = model.hidden(prompt, cache=cache)        # prefill: same states as model.hidden(prompt)
    h = model.hidden(next_tokens, cache=cache)   # one (or more) new positions per call

Every call returns what the full forward gives for those positions, up to float rounding
(``tests/model/test_decoding.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from recursive_lightning.model.block import KV


@dataclass
class StepCache:
    """What a multi-resolution step keeps between decoding calls: how many positions it has seen, their
    input states h^(t) from the first incomplete chunk on, and the core outputs z^ of every complete chunk."""

    seen: int = 0
    pending: torch.Tensor | None = None  # (b, positions of the incomplete chunk seen so far, d)
    z_hat: torch.Tensor | None = None  # (b, complete chunks, d)


@dataclass
class DecodeCache:
    kv: dict[str, list[KV]]  # per call site ("prelude", "step0", ..., "coda"): one KV per layer
    steps: list[StepCache] = field(default_factory=list)  # per loop step
    length: int = 0  # positions seen

    @classmethod
    def empty(cls, model: torch.nn.Module) -> DecodeCache:
        sites = {"prelude": len(model.prelude.layers), "coda": len(model.coda.layers)}
        plan = model.loop_plan()  # one site per loop step at the model's depth (recursive/depth.py)
        for t, s in enumerate(plan):
            sites[f"step{t}"] = len(model.cores[model.layout.core_index[s]].layers)
        return cls({k: [KV() for _ in range(n)] for k, n in sites.items()}, [StepCache() for _ in plan])


def pick(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token per row from (b, vocab) logits: the argmax at temperature 0, else a sample from
    softmax(logits / temperature), restricted to the ``top_k`` most likely tokens when given."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    use_cache: bool = True,
    window: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (b,), ``max_new_tokens`` times (greedy at temperature 0, see
    :func:`pick`); rows share one length.

    With the cache the prompt is prefilled once, then each step feeds one token. Past ``max_seq_len``
    positions (or ``window``) the window slides as without a cache: the last ``max_seq_len`` tokens are
    prefilled again at every step (rotary positions and chunk boundaries restart with the window). Without
    the cache (or for a model with a non-causal shift, which cannot be cached) every step recomputes the
    window."""
    limits = [w for w in (window, model.window) if w]  # Mela has no window of its own (window None)
    limit = min(limits) if limits else None
    use_cache = use_cache and model.cacheable
    cache = model.new_cache() if use_cache else None
    h = model.hidden(idx[:, -limit:] if limit else idx, cache=cache)
    for i in range(max_new_tokens):
        nxt = pick(model.head(h[:, -1]), temperature, top_k, generator)
        yield nxt
        if i == max_new_tokens - 1:
            return
        idx = torch.cat([idx, nxt[:, None]], dim=1)
        if use_cache and (limit is None or cache.length < limit):
            h = model.hidden(nxt[:, None], cache=cache)
        else:
            cache = model.new_cache() if use_cache else None
            h = model.hidden(idx[:, -limit:] if limit else idx, cache=cache)


class Generates:
    """``generate`` for every model family (mixed into ``RecursiveLM`` and ``MelaLM``)."""

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        stop: list[int] | None = None,
        use_cache: bool = True,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Decoding (greedy at temperature 0, else sampled, optionally top-k) with the model's decoding cache
        (KV caches per call site and SpiralFormer Alg. 2 chunk triggers, or Mela's memory state and one chunk
        of keys/values), or by full recomputation at every token; ``stop`` ends a single row early."""
        for nxt in decode(
            self, idx, max_new_tokens, use_cache, temperature=temperature, top_k=top_k, generator=generator
        ):
            idx = torch.cat([idx, nxt[:, None]], dim=1)
            if stop is not None and idx.shape[0] == 1 and nxt.item() in stop:
                break
        return idx
