"""Continuations that share a context, scored in one packed sequence (a tree attention mask).

A multiple-choice item (HellaSwag, ARC, PIQA, SciQ, MMLU) asks for log p(x_i | c) for several continuations
x_i of one context c. Scored one by one, c is run once per choice. Packed, one row holds

    c[0] .. c[m-1] | x_1[0] .. x_1[k_1-2] | x_2[0] .. x_2[k_2-2] | ...        (a "tree": trunk + branches)

with rotary positions 0..m-1 for the trunk and m, m+1, ... again for every branch, and an attention mask by
which a branch token sees the trunk and the earlier tokens of its own branch only. Row m-1 predicts every
x_i[0]; branch token x_i[j] predicts x_i[j+1]. Everything else the packable models do (embeddings, norms,
MLPs, every topology's routers and combinations) acts per position, so each branch gets exactly the
logits of c + x_i run alone, up to float rounding. Models with multi-resolution steps pool neighbouring
positions and are scored the ordinary way (``RecursiveLM.packable``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from recursive_lightning.evaluation.perplexity import Scored, model_device, score_rows


@dataclass
class Tree:
    """One packed row: a shared context (trunk) and the continuations (branches) scored after it."""

    context: list[int]
    branches: list[tuple[int, list[int]]] = field(default_factory=list)  # (request index, continuation)

    def __len__(self) -> int:
        return len(self.context) + sum(len(c) - 1 for _, c in self.branches)


def plan_trees(
    requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_branches: int, max_tokens: int
) -> tuple[list[Tree], list[int]]:
    """Group ``(context, continuation)`` requests by identical context into trees of at most ``max_branches``
    continuations and ``max_tokens`` tokens. Returns the trees with two or more branches, and the indices
    of the requests left alone (their context is not shared, or packing would not fit)."""
    by_context: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, (ctx, cont) in enumerate(requests):
        if len(ctx) >= 1 and len(cont) >= 1:
            by_context[tuple(ctx)].append(i)
    trees: list[Tree] = []
    alone: set[int] = set(range(len(requests)))
    for ctx, members in by_context.items():
        open_tree: Tree | None = None
        for i in members:
            cont = list(requests[i][1])
            if open_tree is None or (
                len(open_tree.branches) >= max_branches or len(open_tree) + len(cont) - 1 > max_tokens
            ):
                open_tree = Tree(list(ctx))
                trees.append(open_tree)
            open_tree.branches.append((i, cont))
    trees = [t for t in trees if len(t.branches) >= 2]
    for t in trees:
        alone.difference_update(i for i, _ in t.branches)
    return trees, sorted(alone)


def pack(trees: Sequence[Tree]) -> dict[str, Any]:
    """Token ids, positions and attention mask of a batch of trees (right-padded), and the scored rows."""
    width = max(len(t) for t in trees)
    n = len(trees)
    x = torch.zeros(n, width, dtype=torch.long)
    pos = torch.zeros(n, width, dtype=torch.long)
    seg = torch.full((n, width), -1, dtype=torch.long)  # 0 trunk, j + 1 branch j, -1 padding
    rows_b, rows_p, targets, owner = [], [], [], []
    for r, t in enumerate(trees):
        m = len(t.context)
        x[r, :m] = torch.as_tensor(t.context)
        pos[r, :m] = torch.arange(m)
        seg[r, :m] = 0
        o = m
        for j, (req, cont) in enumerate(t.branches):
            k = len(cont) - 1
            x[r, o : o + k] = torch.as_tensor(cont[:-1], dtype=torch.long)
            pos[r, o : o + k] = torch.arange(m, m + k)
            seg[r, o : o + k] = j + 1
            rows_b += [r] * (k + 1)
            rows_p += [m - 1, *range(o, o + k)]
            targets += cont
            owner += [req] * (k + 1)
            o += k
    q = torch.arange(width)
    causal = q[:, None] >= q[None, :]  # (query, key)
    key_seg, query_seg = seg[:, None, :], seg[:, :, None]
    mask = causal & ((key_seg == 0) | (key_seg == query_seg))
    mask |= torch.eye(width, dtype=torch.bool)  # padding rows attend to themselves (no empty softmax)
    return {"x": x, "pos": pos, "mask": mask, "rows": (rows_b, rows_p, targets), "owner": owner}


@torch.inference_mode()
def score_trees(
    model: torch.nn.Module,
    trees: Sequence[Tree],
    max_requests: int,
    progress: Callable[[int], Any] | None = None,
) -> dict[int, Scored]:
    """Score every branch of ``trees``, longest rows first, with at most ``max_requests`` branches per
    forward pass. Returns ``{request index: Scored}``."""
    device = model_device(model)
    order = sorted(trees, key=len, reverse=True)
    batches: list[list[Tree]] = []
    for t in order:
        if not batches or sum(len(b.branches) for b in batches[-1]) + len(t.branches) > max_requests:
            batches.append([])
        batches[-1].append(t)
    out: dict[int, Scored] = {}
    for batch in batches:
        p = pack(batch)
        h = model.hidden(p["x"].to(device), positions=p["pos"].to(device), mask=p["mask"].to(device))
        lp, hit = score_rows(model, h, *p["rows"])
        sums: dict[int, float] = defaultdict(float)
        greedy: dict[int, bool] = defaultdict(lambda: True)
        counts: dict[int, int] = defaultdict(int)
        for req, v, ok in zip(p["owner"], lp.tolist(), hit.tolist()):
            sums[req] += v
            greedy[req] = greedy[req] and ok
            counts[req] += 1
        for req in sums:
            out[req] = Scored(sums[req], greedy[req], counts[req])
        if progress is not None:
            progress(sum(len(t.branches) for t in batch))
    return out
