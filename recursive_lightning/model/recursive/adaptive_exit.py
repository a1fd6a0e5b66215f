"""Per-token adaptive exit at decode (Huginn Sec. 6, "zero-shot adaptive compute"): a generated token
stops looping once two successive loop steps' next-token distributions agree,

    KL(p^(t) || p^(t-1)) < threshold,    p^(t) = softmax(head(norm(f_coda(finish(h^(t))))))

and the token is read from p^(t). Up to ``model.loops`` (or the trained K) loop steps run per token; the prompt
is prefilled at that full depth.

Every loop step has its own keys and values (``decoding.py``), so a token that exits at step e leaves steps
e+1 .. K'-1 without an entry for its position. We follow Huginn's KV-cache sharing [our reading of its
"the latest state computed for a position" fill-in]: the token's keys and values of step e are written into the
caches of the steps it skipped, so later tokens attending at step t > e see the exited token's last state.
With ``threshold`` 0 no token exits early and decoding is exactly ordinary cached decoding at that depth.

Checking the criterion after step t runs the coda and the head on the state after step t (the coda's keys and
values of the candidate are kept aside, the chosen step's committed): the price of knowing when to stop, as in
Huginn. Adaptive exit needs a full-resolution looped model (a multi-resolution step's cache is per chunk, not
per position) and works on one row at a time or on a batch (a batch loops until every row has exited; an exited
row keeps its exit step's logits and keys/values).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from recursive_lightning.errors import UserError
from recursive_lightning.model.block import KV
from recursive_lightning.model.decoding import DecodeCache, pick


@dataclass
class ExitStats:
    """The loop steps each generated token used (one entry per token and row), for ``mean_loops``."""

    loops: list[int] = field(default_factory=list)
    max_loops: int = 0

    @property
    def mean_loops(self) -> float:
        return sum(self.loops) / len(self.loops) if self.loops else float("nan")


def check_adaptive_exit(model: torch.nn.Module, threshold: object) -> float:
    """``threshold`` as a KL threshold for ``model``, or one sentence naming ``--exit-kl`` and the fix."""
    layout = getattr(model, "layout", None)
    if layout is None or not hasattr(model, "steps"):
        raise UserError(
            "--exit-kl: adaptive exit stops a looped model's loop steps; Mela's depth is its H cycles."
        )
    if layout.kind != "looped" or not model.packable:
        raise UserError(
            f"--exit-kl needs a looped full-resolution layout like 4+8R4+4, not '{layout.text}' "
            "(multi-resolution steps cache per chunk, distinct cores and vanilla layouts do not loop)."
        )
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not threshold >= 0:
        raise UserError(
            f"--exit-kl must be a KL threshold >= 0 in nats, not {threshold!r}; e.g. --exit-kl 5e-4."
        )
    return float(threshold)


def _logits(
    model: torch.nn.Module, h: torch.Tensor, carry: dict, coda_kv: list[KV]
) -> tuple[torch.Tensor, list[KV]]:
    """Next-token logits (b, vocab) of the state after a loop step, and the coda's keys/values with it, leaving
    ``coda_kv`` as it was (a KV's extend makes new tensors)."""
    trial = [KV() for _ in coda_kv]
    for new, old in zip(trial, coda_kv):
        new.k, new.v = old.k, old.v
    out = model.coda(model.topology.finish(h, carry), kv=trial)
    return model.head(model.norm(out))[:, -1], trial


@torch.no_grad()
def hidden_adaptive(
    model: torch.nn.Module, token: torch.Tensor, cache: DecodeCache, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new position per row, ``token`` (b, 1), continuing ``cache``: the next-token logits (b, vocab) of the
    step each row exits at, and the loop steps each row used (b,)."""
    kv = cache.kv
    h_emb = model.embed(token) * model.emb_scale
    h, carry = model.topology.start(h_emb, model.prelude(h_emb, kv=kv["prelude"]))
    plan = model.loop_plan()
    b = token.shape[0]
    used = torch.full((b,), len(plan), dtype=torch.long, device=token.device)
    done = torch.zeros(b, dtype=torch.bool, device=token.device)
    logits = prev = coda = None
    for t, s in enumerate(plan):
        core = functools.partial(model.cores[model.layout.core_index[s]], kv=kv[f"step{t}"])
        h, carry = model.topology.step(s, h, model.steps[s](h, core), carry)
        if t > 0:  # an exited row's keys/values at this step are its exit step's (its logits are kept below)
            keep = done.view(b, 1, 1, 1)
            for layer, last in zip(kv[f"step{t}"], kv[f"step{t - 1}"]):
                layer.k[:, :, -1:] = torch.where(keep, last.k[:, :, -1:], layer.k[:, :, -1:])
                layer.v[:, :, -1:] = torch.where(keep, last.v[:, :, -1:], layer.v[:, :, -1:])
        step_logits, step_coda = _logits(model, h, carry, kv["coda"])
        if logits is None:
            logits, coda = step_logits, step_coda
        else:
            logits = torch.where(done[:, None], logits, step_logits)
            for c, new in zip(coda, step_coda):  # an exited row keeps the coda keys/values of its exit step
                c.k[:, :, -1:] = torch.where(done.view(b, 1, 1, 1), c.k[:, :, -1:], new.k[:, :, -1:])
                c.v[:, :, -1:] = torch.where(done.view(b, 1, 1, 1), c.v[:, :, -1:], new.v[:, :, -1:])
        logp = step_logits.float().log_softmax(-1)
        if prev is not None and threshold > 0:  # threshold 0: no early exit (a rounded KL may fall below 0)
            kl = (logp.exp() * (logp - prev)).sum(-1)  # KL(p^(t) || p^(t-1))
            newly = ~done & (kl < threshold)
            used = torch.where(newly, torch.full_like(used, t + 1), used)
            done = done | newly
        prev = logp
        if bool(done.all()) and t < len(plan) - 1:
            for later in range(t + 1, len(plan)):  # KV-cache sharing: the skipped steps get step t's entry
                for layer, last in zip(kv[f"step{later}"], kv[f"step{t}"]):
                    layer.extend(last.k[:, :, -1:], last.v[:, :, -1:])
            break
    kv["coda"] = coda
    cache.length += 1
    return logits, used


@torch.no_grad()
def decode_adaptive(
    model: torch.nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    threshold: float,
    stats: ExitStats,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """``decoding.decode`` with adaptive exit for every generated token after the first (the prompt's last
    position is prefilled at full depth); each token's loop count goes to ``stats``. Past ``max_seq_len`` the
    window slides and is prefilled again at full depth, as ``decode`` does."""
    threshold = check_adaptive_exit(model, threshold)
    limit = model.window
    stats.max_loops = len(model.loop_plan())
    cache = model.new_cache()
    logits = model.head(model.hidden(idx[:, -limit:], cache=cache)[:, -1])
    for i in range(max_new_tokens):
        nxt = pick(logits, temperature, top_k, generator)
        yield nxt
        if i == max_new_tokens - 1:
            return
        idx = torch.cat([idx, nxt[:, None]], dim=1)
        if cache.length < limit:
            logits, used = hidden_adaptive(model, nxt[:, None], cache, threshold)
            stats.loops += used.tolist()
        else:
            cache = model.new_cache()
            logits = model.head(model.hidden(idx[:, -limit:], cache=cache)[:, -1])
