"""``benchmarks/bench_mela_numerics.py --memory-gemms``: the emulated TF32 and bf16 GEMMs round what they say,
and reach every GEMM of the neural memory's chunk loop (the precision study's figures rest on both)."""

from __future__ import annotations

import sys

import torch
from conftest import ROOT
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_mela_numerics as bench  # noqa: E402

from recursive_lightning.model.mela.neural_memory import NeuralMemory  # noqa: E402


def test_tf32_and_bf16_keep_the_mantissa_a_tensor_core_reads():
    x = torch.randn(4096) * torch.logspace(-20, 20, 4096)
    t = bench.tf32(x)
    assert (t.view(torch.int32) & 0x1FFF == 0).all()  # 10 mantissa bits left
    assert ((t - x).abs() <= x.abs() * 2.0**-11).all()  # round to nearest
    assert bench.tf32(torch.tensor([1 + 2.0**-11, -(1 + 2.0**-11)])).tolist() == [1 + 2**-10, -(1 + 2**-10)]
    assert torch.equal(bench.bf16(x), x.to(torch.bfloat16).float())
    a, b = torch.randn(3, 8, 64), torch.randn(3, 64, 8)
    with bench.RoundedGemms(bench.tf32):
        got = a @ b
    want = bench.tf32(a).double() @ bench.tf32(b).double()  # products exact, sums in float32
    assert (got.double() - want).abs().max() < 1e-5 < (a.double() @ b.double() - want).abs().max()


class _AtenGemms(TorchDispatchMode):
    """Counts the ATen GEMMs (``mm``, ``bmm``, ``baddbmm``, ``addmm``) dispatched while it is active."""

    GEMMS = (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.baddbmm, torch.ops.aten.addmm)

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in self.GEMMS
        return func(*args, **(kwargs or {}))


def test_the_emulation_reaches_every_gemm_of_the_memory(monkeypatch):
    """Inside the memory's chunk loop, as ``memory_gemms_in`` wraps it, every ATen GEMM (retrieval, surprise,
    Newton-Schulz's bmm and baddbmm) had both operands through the rounding: two roundings per GEMM; the loop is
    its own again afterwards."""
    rounded = []
    monkeypatch.setitem(bench.MEMORY_GEMMS, "counted", lambda t: rounded.append(t.shape) or t)
    plain, gemms = NeuralMemory._store_and_retrieve, _AtenGemms()

    def counted(self, *args, **kwargs):
        with gemms:
            return plain(self, *args, **kwargs)

    monkeypatch.setattr(NeuralMemory, "_store_and_retrieve", counted)
    torch.manual_seed(0)
    memory = NeuralMemory(32, heads=4, depth=2, expansion=2, chunk_size=8, step_floor=12.0)
    with bench.memory_gemms_in("counted"):
        memory(torch.randn(2, 24, 32))
    assert gemms.count >= 3 * (3 + 4 + 5 * 3)  # chunks x (retrieval, surprise, Newton-Schulz-5) at least
    assert len(rounded) == 2 * gemms.count
    assert NeuralMemory._store_and_retrieve is counted
