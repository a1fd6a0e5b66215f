"""training/host.py: with freed memory kept, a training step stops page-faulting its large tensors in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

# six training steps of a small model with Pythia's 50k vocabulary: its logits, their gradient and the
# (vocab x d) embedding/head gradients are the step's large tensors, allocated and freed every step
STEPS = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from recursive_lightning.training.host import keep_freed_memory
    assert keep_freed_memory()
from recursive_lightning.model.config import preset
from recursive_lightning.model.recursive.model import RecursiveLM
torch.manual_seed(0)
model = RecursiveLM(preset("cpu-tiny", layout="1+1x{1/2,1}+1", topology="mesh", vocab_size=50304))
opt = torch.optim.AdamW(model.parameters())
idx = torch.randint(0, 50304, (1, 513))
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_per_step(mode: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True
    ).stdout
    return [int(x) for x in out.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt knobs")
def test_kept_memory_is_reused_instead_of_faulted_in_every_step():
    system, kept = faults_per_step("system"), faults_per_step("keep")
    logits_pages = 512 * 50304 * 4 // 4096
    # glibc's default: the large tensors are fresh mmaps, faulted in page by page in every step
    assert min(system[-2:]) > logits_pages, system
    # kept: after a few steps the heap holds blocks that fit and the steps reuse their pages (now and then
    # a step still extends the heap, depending on where small allocations landed)
    assert sum(kept[2:]) < sum(system[2:]) / 4, (kept, system)
    assert min(kept[2:]) < logits_pages // 100, kept
