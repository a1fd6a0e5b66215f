"""Thread policy: each command's inner loop with the default threads against 1 and 2 threads,
quiet and with one busy process beside it (``python -c "while True: pass"``), interleaved; each run a fresh
process (OpenMP reads its settings at start), medians over ``--reps``.

    .venv/bin/python benchmarks/bench_threads.py                      # all workloads, quiet and loaded
    .venv/bin/python benchmarks/bench_threads.py --conditions loaded --reps 3

Workloads (random weights: the speed does not depend on them):
  decode-mela     generate: cpu-mela, greedy cached decoding after a 64-token prompt (tokens/s)
  decode-looped   generate: cpu-tiny 2+4R2+2 MeSH (the default sweep's looped model), same (tokens/s)
  eval            eval perplexity: cpu-tiny 2+4R2+2 MeSH, no-grad forward of 16x128 windows (tokens/s)
  train-tiny      train: cpu-tiny 2+4R2+2 MeSH, loss + backward + AdamW on 16x128 (tokens/s)
  train-large     train: pythia-160m 2+4R2+2 (d_model 768), 4x128 (tokens/s)
Settings: ``1`` / ``2`` (OMP_NUM_THREADS; libgomp's default wait policy), ``2p`` (2 threads,
OMP_WAIT_POLICY=PASSIVE), ``default`` (no variable set: the CLI's policy, recursive_lightning/threads.py).
Goals: loaded, default >= 0.9x one thread for every workload; quiet, train-large 2 threads >= 1.5x one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("decode-mela", "decode-looped", "eval", "train-tiny", "train-large")
SETTINGS = ("1", "2", "2p", "default")
LOOPED = {"layout": "2+4R2+2", "topology": "mesh"}


def _work(name: str):
    """(model, one unit of work returning its token count)."""
    import torch

    from recursive_lightning.model.build import build_model
    from recursive_lightning.model.config import preset
    from recursive_lightning.model.decoding import decode

    torch.manual_seed(0)
    if name.startswith("decode"):
        cfg = preset("cpu-mela") if name == "decode-mela" else preset("cpu-tiny", **LOOPED)
        model = build_model(cfg).eval()
        idx = torch.randint(0, cfg.vocab_size, (1, 64))

        def step() -> int:
            with torch.no_grad():
                for _ in decode(model, idx, 64):
                    pass
            return 64

        return model, step
    if name == "eval":
        model = build_model(preset("cpu-tiny", **LOOPED)).eval()
        x = torch.randint(0, model.cfg.vocab_size, (16, 128))

        def step() -> int:
            with torch.no_grad():
                model(x)
            return x.numel()

        return model, step
    cfg = preset("cpu-tiny", **LOOPED) if name == "train-tiny" else preset("pythia-160m", **LOOPED)
    b = 16 if name == "train-tiny" else 4
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (b, 129))

    def step() -> int:
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return b * 128

    return model, step


def worker(name: str, setting: str, seconds: float) -> None:
    from recursive_lightning import threads

    # "default": what a CLI command does (libgomp's passive wait before torch loads, then the model's count)
    with threads.for_command(None) if setting == "default" else nullcontext():
        import torch

        model, step = _work(name)
        n = threads.apply_for(model) if setting == "default" else torch.get_num_threads()
        step()  # warm-up
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            done += step()
        print(f"{done / (time.perf_counter() - t0):.1f} {n}")


def run(name: str, setting: str, seconds: float) -> tuple[float, int]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    }
    env["PYTHONPATH"] = str(ROOT)
    if setting != "default":
        env["OMP_NUM_THREADS"] = setting.rstrip("p")
    if setting.endswith("p"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    cmd = [sys.executable, __file__, "--worker", name, setting, "--seconds", str(seconds)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.split()
    return float(out[0]), int(out[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=SETTINGS)
    p.add_argument("--conditions", nargs="*", default=["quiet", "loaded"], choices=["quiet", "loaded"])
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--seconds", type=float, default=3.0, help="timed seconds per run, after a warm-up step")
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(*args.worker, args.seconds)
    print(
        f"{os.cpu_count()} cores, load average at start {os.getloadavg()[0]:.1f}; tokens/s, median of "
        f"{args.reps} interleaved run(s) of {args.seconds:g} s; (threads used by default)"
    )
    for cond in args.conditions:
        busy = None
        if cond == "loaded":
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            got: dict[tuple[str, str], list[tuple[float, int]]] = {}
            for _ in range(args.reps):
                for name in args.workloads:
                    for s in args.settings:
                        got.setdefault((name, s), []).append(run(name, s, args.seconds))
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        print(
            f"\n{cond}:\n| workload | "
            + " | ".join(args.settings)
            + " | default / 1 thread (medians; paired: median of per-rep ratios) |"
        )
        print("| --- |" + " ---: |" * (len(args.settings) + 1))
        for name in args.workloads:
            med = {s: statistics.median(r for r, _ in got[(name, s)]) for s in args.settings}
            cells = [
                f"{med[s]:,.0f}" + (f" ({got[(name, s)][0][1]})" if s == "default" else "")
                for s in args.settings
            ]
            ratio = ""
            if "default" in med and "1" in med:
                pairs = [d / o for (d, _), (o, _) in zip(got[(name, "default")], got[(name, "1")])]
                ratio = f"{med['default'] / med['1']:.2f}x; paired {statistics.median(pairs):.2f}x"
            print(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
