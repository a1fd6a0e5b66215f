"""Mela's numerics: how far float32 and bf16 autocast logits are from float64 with the same weights, chunk by chunk.

    .venv/bin/python benchmarks/bench_mela_numerics.py                          # cpu-mela, both carries, 1 and 2 threads
    .venv/bin/python benchmarks/bench_mela_numerics.py --floors 1.5,0 --chunks 32
    .venv/bin/python benchmarks/bench_mela_numerics.py --ckpt runs/cpu-mela     # a trained checkpoint's weights
    .venv/bin/python benchmarks/bench_mela_numerics.py --preset mela-400m-narrow --chunks 2 --batch 1
    python benchmarks/bench_mela_numerics.py --device cuda                      # the GPU's float32 / bf16
    .venv/bin/python benchmarks/bench_mela_numerics.py --memory-gemms float32,tf32,bf16 --threads 2

For every (memory_carry, memory_step_floor, dtype, threads) one line: the largest |logit - float64 logit| of each
decoder chunk relative to the largest |float64 logit|, at chunks 1, 2, 4, ... and the last, and the maximum over
all chunks. The float64 reference always runs on the CPU. ``memory_step_floor: 0`` is Eq. 10's unbounded
Newton-Schulz step; the default floor bounds it (``model/mela/neural_memory.py``: ``step_floors``). The
``forgetting`` row (``--updates``) is a memory without Newton-Schulz, the error the decoder's own rounding gives.
``--memory-gemms`` rounds the operands of the neural memory's GEMMs (retrieval, surprise, Newton-Schulz) to TF32 or
bf16 with float32 accumulation, as a GPU's tensor cores would read them: the error of each precision the chunk
loop could run its GEMMs in, measured on any machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import os
import sys
import time
from collections.abc import Iterator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from recursive_lightning.model.build import build_model  # noqa: E402
from recursive_lightning.model.config import ModelConfig, preset  # noqa: E402


def model_config(name: str, **kw) -> ModelConfig:
    if name == "mela-400m-narrow":  # mela-400m's depth, cycles, P = 32, C = 64 at width 32
        return preset(
            "mela-400m", d_model=32, n_heads=4, n_kv_heads=2, hmm_d_model=32, hmm_heads=4, vocab_size=97, **kw
        )
    return preset(name, **kw)


def tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to TF32, the 10-bit mantissa a tensor core reads (round to nearest, ties away
    from zero, as CUDA's ``cvt.rna.tf32.f32``); products of TF32 values are exact in float32."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bfloat16 (nearest, ties to even) and held in float32."""
    return x.to(torch.bfloat16).to(x.dtype)


GEMM_FUNCTIONS = {
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm, torch.mm, torch.Tensor.mm
}  # fmt: skip
BADDBMM = {torch.baddbmm, torch.Tensor.baddbmm}


class RoundedGemms(torch.overrides.TorchFunctionMode):
    """Every float32 GEMM in the mode reads its operands rounded by ``rounding`` and accumulates in float32:
    what a GPU's TF32 or bf16 tensor-core GEMM with a float32 result computes, up to the order of the sums.
    ``baddbmm``'s added term stays float32 (a GEMM's epilogue)."""

    def __init__(self, rounding) -> None:
        super().__init__()
        self.rounding = rounding

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        r = self.rounding
        if func in GEMM_FUNCTIONS and args[0].dtype == torch.float32:
            args = (r(args[0]), r(args[1]), *args[2:])
        elif func in BADDBMM and args[1].dtype == torch.float32:
            args = (args[0], r(args[1]), r(args[2]), *args[3:])
        return func(*args, **kwargs)


MEMORY_GEMMS = {"float32": None, "tf32": tf32, "bf16": bf16}


@contextlib.contextmanager
def memory_gemms_in(precision: str) -> Iterator[None]:
    """While it lasts, the neural memory's chunk loop (retrieval, surprise, Newton-Schulz) with its GEMMs'
    operands rounded to ``precision`` (``MEMORY_GEMMS``), the rest of the model as it is; ``tf32-cuda``: the GPU's
    own TF32 for every float32 GEMM instead (torch's flag, off otherwise). What it changes is put back at its end."""
    from recursive_lightning.model.mela.neural_memory import NeuralMemory

    plain, tf32_before = NeuralMemory._store_and_retrieve, torch.backends.cuda.matmul.allow_tf32
    rounding = None if precision == "tf32-cuda" else MEMORY_GEMMS[precision]
    if rounding is not None:

        def rounded(self, *args, **kwargs):
            with RoundedGemms(rounding):
                return plain(self, *args, **kwargs)

        NeuralMemory._store_and_retrieve = rounded
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32-cuda"
    try:
        yield
    finally:
        NeuralMemory._store_and_retrieve = plain
        torch.backends.cuda.matmul.allow_tf32 = tf32_before


def gaps(
    model: torch.nn.Module,
    idx: torch.Tensor,
    want: torch.Tensor,
    dtype: str,
    device: str,
    memory: str = "float32",
) -> torch.Tensor:
    """Per-chunk max |logit - want| / max |want| of ``model`` in ``dtype`` (float32, or bf16 under autocast), its
    memory's GEMMs in ``memory`` precision (:func:`memory_gemms_in`)."""
    per_chunk = model.cfg.tokens_per_chunk
    with memory_gemms_in(memory), torch.no_grad():
        if dtype == "bf16":
            with torch.autocast(device, dtype=torch.bfloat16):
                got = model(idx.to(device))
        else:
            got = model(idx.to(device))
    err = (got.double().cpu() - want).abs().amax(dim=(0, 2)).view(-1, per_chunk).amax(1)
    return err / want.abs().amax()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu-mela", help="cpu-mela, mela-400m-narrow or any Mela preset")
    p.add_argument("--ckpt", help="a run directory or checkpoint: its trained weights instead of random ones")
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--carries", default="cycles,none")
    p.add_argument("--floors", default=None, help="memory_step_floor values (default: the config's and 0)")
    p.add_argument(
        "--updates", default="newton_schulz", help="memory_update values, e.g. newton_schulz,forgetting"
    )
    p.add_argument("--dtypes", default="float32,bf16")
    p.add_argument("--threads", default="1,2", help="CPU thread counts for the low-precision model")
    p.add_argument(
        "--memory-gemms",
        default="float32",
        help="the memory's GEMM operands, emulated: float32, tf32, bf16 (comma-separated; float32 accumulation); "
        "tf32-cuda: the GPU's own TF32 for every float32 GEMM (under bf16 autocast the memory's only)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    floors = [float(f) for f in (args.floors or f"{ModelConfig.memory_step_floor},0").split(",")]
    threads = [int(t) for t in args.threads.split(",")] if args.device == "cpu" else [torch.get_num_threads()]
    cpu = "" if args.device != "cpu" else f", {torch.get_num_threads()} threads by default"
    print(
        f"torch {torch.__version__}, device {args.device}{cpu}; {args.batch} x {args.chunks} chunks; seed {args.seed}"
    )
    if args.ckpt:
        from recursive_lightning.training.checkpoint import load_checkpoint

        loaded = load_checkpoint(args.ckpt)
        trained, base = loaded.model, loaded.run.model
        print(
            f"weights: {args.ckpt} at step {loaded.global_step} (trained with memory_step_floor {base.memory_step_floor})"
        )
    for carry in args.carries.split(","):
        for update in args.updates.split(","):
            for floor in floors if update == "newton_schulz" else [0.0]:
                kw = dict(memory_carry=carry, memory_update=update, memory_step_floor=floor)
                torch.manual_seed(args.seed)
                if args.ckpt:
                    import dataclasses

                    cfg = dataclasses.replace(base, **kw)
                    model = build_model(cfg)
                    model.load_state_dict(trained.state_dict())
                else:
                    cfg = model_config(args.preset, **kw)
                    model = build_model(cfg)
                model.eval()
                idx = torch.randint(0, cfg.vocab_size, (args.batch, args.chunks * cfg.tokens_per_chunk))
                t0 = time.perf_counter()
                with torch.no_grad():
                    want = copy.deepcopy(model).double()(idx)
                model.to(args.device)
                for dtype, memory in itertools.product(args.dtypes.split(","), args.memory_gemms.split(",")):
                    for n in threads:
                        torch.set_num_threads(n)
                        err = gaps(model, idx, want, dtype, args.device, memory)
                        marks = sorted({min(2**i, args.chunks) for i in range(args.chunks.bit_length() + 1)})
                        shown = " ".join(f"{m}:{float(err[m - 1]):.1e}" for m in marks)
                        where = f"{n} thr" if args.device == "cpu" else args.device
                        print(
                            f"{carry:6s} {update:13s} floor {floor:<4g} {dtype:7s} memory {memory:7s} {where:6s} "
                            f"max {float(err.max()):.1e} | chunk {shown}",
                            flush=True,
                        )
                print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
