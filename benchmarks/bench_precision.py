"""CPU training step in float32 against bf16 autocast (what ``train.precision: bf16-mixed`` runs), per preset,
interleaved in one process, medians; the threads each model gets by default (``recursive_lightning/threads.py``).

    OMP_NUM_THREADS=... is left unset: .venv/bin/python benchmarks/bench_precision.py --reps 8

Each step: the LightningModule's loss on a fixed batch, backward, AdamW (``train.lr`` 3e-3), as ``train`` runs it
(layout 2+4R2+2, MeSH: the default sweep's looped model; Mela presets as built). bf16-mixed is ``torch.autocast("cpu", torch.bfloat16)``
around the forward, as Lightning's ``MixedPrecision`` plugin does on the CPU. Prints the CPU's bf16 flags:
``train.precision: auto`` picks bf16-mixed on a CPU only where it is faster (``training/parallel.py``)."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recursive_lightning import threads  # noqa: E402
from recursive_lightning.model.build import build_model  # noqa: E402
from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.training.host import keep_freed_memory  # noqa: E402

SHAPES = {
    "cpu-tiny": (16, 128),
    "cpu-small": (16, 256),
    "cpu-base": (8, 256),
    "pythia-160m": (4, 128),
    "cpu-mela": (8, 256),
    "mela-400m": (1, 512),
}


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    return " ".join(f for f in ("amx_bf16", "avx512_bf16") if f in text) or "no native bf16"


def step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor, tgt: torch.Tensor, bf16: bool
) -> float:
    """Seconds of one training step: loss (under bf16 autocast or not), backward, AdamW."""
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        loss = model.loss(idx, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="*", default=list(SHAPES))
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    keep_freed_memory()
    print(f"CPU bf16: {cpu_flags()}; torch {torch.__version__}")
    print("| preset | width | batch | threads | fp32 ms | bf16-mixed ms | bf16 / fp32 |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for name in args.presets:
        looped = {} if preset(name).arch == "mela" else {"layout": "2+4R2+2", "topology": "mesh"}
        cfg = preset(name, **looped)
        torch.set_num_threads(threads.default_threads(threads.model_width(cfg)))
        torch.manual_seed(0)
        model = build_model(cfg).train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        b, seq = SHAPES.get(name, (4, 128))
        idx = torch.randint(0, cfg.vocab_size, (b, seq))
        tgt = torch.randint(0, cfg.vocab_size, (b, seq))

        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.warmup + args.reps):
            for bf16 in (False, True) if r % 2 == 0 else (True, False):  # ABBA
                t = step(model, opt, idx, tgt, bf16)
                if r >= args.warmup:
                    times[bf16].append(t)
        fp32, bf16 = (1000 * statistics.median(times[k]) for k in (False, True))
        print(
            f"| {name} | {threads.model_width(cfg)} | {b}x{seq} | {torch.get_num_threads()} | {fp32:.1f} | {bf16:.1f} | "
            f"{bf16 / fp32:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
