"""Mela on the CPU: what the memory costs in wall-clock against its share of FLOPs, how close the chunk loop
of the memory update runs to plain matmuls, and decoding memory that does not grow with the length.

    .venv/bin/python benchmarks/bench_mela.py                 # all three parts
    .venv/bin/python benchmarks/bench_mela.py --part train --reps 8
    .venv/bin/python benchmarks/bench_mela.py --part train --compiled-memory --threads 1   # + train.compile: glue's memory part

``train``: one training step (loss + backward + AdamW) of cpu-mela, of the same model with the HMM bypassed
(memory rows = the learned chunk-0 vectors everywhere: the decoder alone) and of cpu-transformerpp (same
parameter count), interleaved after a warm-up; medians. The memory's wall-clock share is
1 - t(decoder alone) / t(Mela), set against the HMM's share of ``describe``'s forward FLOPs.

``loop``: the chunk loop of one neural memory (Eqs. 9-11 with Newton-Schulz-5: retrieval, surprise, momentum,
orthogonalised update; forward + backward), at the Mela-400M memory shape (d=768, 4 heads, depth 2,
expansion 2, C=64), against one square float32 matmul of the same FLOPs (counted by FlopCounterMode).

``decode``: greedy cached decoding of 1K and 8K tokens with cpu-mela, each in a fresh process: tokens/s, peak
RSS of the process and the decoding state's size at the end.

``eval``: the ``eval`` command with ``--context-lengths`` at 1x and 16x the training length (256 and 4,096) on a
cpu-mela checkpoint and on cpu-transformerpp, each in a fresh process: peak RSS and time (goal: Mela's
16x within 2x of its 1x peak; Mela's decoder is chunk-local and is scored a few chunks at a time, Transformer++
needs the full window).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from recursive_lightning.model.build import build_model  # noqa: E402
from recursive_lightning.model.config import preset  # noqa: E402
from recursive_lightning.model.describe import describe  # noqa: E402
from recursive_lightning.model.mela.neural_memory import NeuralMemory  # noqa: E402
from recursive_lightning.training.host import keep_freed_memory  # noqa: E402


def decoder_alone(model: torch.nn.Module) -> torch.nn.Module:
    """The same Mela with the HMM bypassed: every chunk's memory rows are the chunk-0 vectors."""

    def rows(x: torch.Tensor, n_chunks: int) -> list[torch.Tensor]:
        b, C, d = x.shape[0], model.cfg.chunk_size, model.cfg.d_model
        first = model.memory_init.to(x.dtype).expand(b, n_chunks, C, d)
        return [first] + [torch.zeros_like(first)] * (model.cfg.h_cycles - 1 if model.cfg.memstack else 0)

    model.memory_rows = rows
    return model


def part_train(args) -> None:
    models = {
        "Mela": build_model(preset(args.mela)),
        "Mela decoder alone": decoder_alone(build_model(preset(args.mela))),
        "Transformer++": build_model(preset(args.transformerpp)),
    }
    if args.compiled_memory:  # train.compile: glue's memory region alone (the layers stay eager)
        models["Mela, memory update compiled"] = build_model(preset(args.mela))
        models["Mela, memory update compiled"].compile_glue()
    opts = {k: torch.optim.AdamW(m.parameters(), 1e-3) for k, m in models.items()}
    idx = torch.randint(0, models["Mela"].cfg.vocab_size, (args.batch, args.seq_len + 1))

    def step(name: str) -> float:
        t = time.perf_counter()
        models[name].loss(idx[:, :-1], idx[:, 1:]).backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        return time.perf_counter() - t

    for name in models:
        step(name)
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(args.reps):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            times[name].append(step(name))
    med = {k: statistics.median(v) for k, v in times.items()}
    d = describe(preset(args.mela), seq_len=args.seq_len, batch_size=args.batch)
    flop_share = 1 - d["flops_decoder"] / d["flops_forward"]
    wall_share = 1 - med["Mela decoder alone"] / med["Mela"]
    tokens = args.batch * args.seq_len
    print(
        f"\n## train step ({args.mela} vs {args.transformerpp}, {args.batch} x {args.seq_len}, "
        f"{torch.get_num_threads()} threads, {args.reps} interleaved reps, medians)\n"
    )
    print("| model | params | step (s) | tokens/s |")
    print("| --- | ---: | ---: | ---: |")
    for name, m in models.items():
        n = sum(p.numel() for p in m.parameters())
        print(f"| {name} | {n / 1e6:.2f}M | {med[name]:.3f} | {tokens / med[name]:,.0f} |")
    if args.compiled_memory:
        share = 1 - med["Mela decoder alone"] / med["Mela, memory update compiled"]
        print(
            f"\nmemory update compiled: Mela's step {med['Mela, memory update compiled'] / med['Mela']:.3f}x "
            f"eager's; the memory's wall-clock share {share:.3f}"
        )
    print(
        f"\nmemory's share: wall-clock {wall_share:.3f} vs forward FLOPs {flop_share:.3f} "
        f"(goal: wall-clock <= FLOPs + 0.10 = {flop_share + 0.10:.3f}: "
        f"{'met' if wall_share <= flop_share + 0.10 else 'missed'})"
    )


def part_loop(args) -> None:
    torch.manual_seed(0)
    d, heads, C, b, chunks = 768, 4, 64, args.loop_batch, args.loop_chunks
    mem = NeuralMemory(d, heads, depth=2, expansion=2, chunk_size=C, update="newton_schulz")
    x = torch.randn(b, C * chunks, d)
    with torch.no_grad():
        proj = mem.qkv(x)
    # the loop alone: the q, k, v projection is an input (its matmul is plain already); the gates' linear map
    # (d -> 3 x heads, one matmul) stays
    mem.qkv = _Given(proj)
    mem.out = torch.nn.Identity()

    def run() -> None:
        y, _ = mem(x)
        y.sum().backward()

    run()
    counter = FlopCounterMode(display=False)
    with counter:
        run()
    flops = counter.get_total_flops()
    n = round((flops / 2) ** (1 / 3))
    a, bm = torch.randn(n, n), torch.randn(n, n)
    a @ bm
    t_loop, t_mm = [], []
    for _ in range(args.reps):
        t = time.perf_counter()
        run()
        t_loop.append(time.perf_counter() - t)
        t = time.perf_counter()
        a @ bm
        t_mm.append(time.perf_counter() - t)
    lo, mm = statistics.median(t_loop), statistics.median(t_mm)
    print(
        f"\n## memory update chunk loop (d={d}, {heads} heads, depth 2, expansion 2, C={C}, batch {b}, "
        f"{chunks} chunks, NS-5; forward + backward)\n"
    )
    print(
        f"loop {lo * 1e3:.1f} ms for {flops / 1e9:.2f} GFLOP ({flops / lo / 1e9:.1f} GFLOP/s); one {n}x{n} "
        f"matmul of the same FLOPs {mm * 1e3:.1f} ms ({flops / mm / 1e9:.1f} GFLOP/s): ratio {lo / mm:.2f} "
        f"(goal <= 1.5: {'met' if lo / mm <= 1.5 else 'missed'})"
    )


class _Given(torch.nn.Module):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = value.clone().requires_grad_(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.value


DECODE = """
import json, resource, sys, time, torch
from recursive_lightning.model.build import build_model
from recursive_lightning.model.config import preset
torch.manual_seed(0)
model = build_model(preset(sys.argv[1])).eval()
n = int(sys.argv[2])
prompt = torch.randint(0, model.cfg.vocab_size, (1, 64))
with torch.no_grad():  # warm-up: two chunks on a throwaway cache
    warm = model.new_cache()
    model.hidden(prompt, cache=warm)
    for _ in range(2 * model.cfg.tokens_per_chunk):
        model.hidden(prompt[:, :1], cache=warm)
cache = model.new_cache()
t = time.perf_counter()
with torch.no_grad():
    h = model.hidden(prompt, cache=cache)
    for _ in range(n):
        nxt = model.head(h[:, -1]).argmax(-1)
        h = model.hidden(nxt[:, None], cache=cache)
dt = time.perf_counter() - t
print(json.dumps({"tokens": n, "tok_s": n / dt, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "state_elements": cache.numel(), "chunks": cache.chunks}))
"""


def part_decode(args) -> None:
    print(f"\n## cached decoding ({args.mela}, batch 1, 64-token prompt, greedy, a fresh process each)\n")
    print("| tokens | tokens/s | peak RSS (MB) | decoding state (elements) | chunks completed |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")}
    rows = []
    for n in (1024, 8192):
        out = subprocess.run(
            [sys.executable, "-c", DECODE, args.mela, str(n)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(
            f"| {n:,} | {r['tok_s']:.0f} | {r['peak_rss_mb']:.0f} | {r['state_elements']:,} | {r['chunks']} |"
        )
    growth = rows[1]["peak_rss_mb"] / rows[0]["peak_rss_mb"] - 1
    print(f"\npeak RSS 8K vs 1K: {100 * growth:+.1f}% (goal: the same peak)")


EVAL = """
import json, resource, sys
from recursive_lightning.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def part_eval(args) -> None:
    """`eval --context-lengths` of a cpu-mela checkpoint (and the Transformer++ of its size) at 1x and 16x the
    training length, each in a fresh process: the same 8,192 held-out tokens scored at both lengths."""
    import tempfile
    import time as _time

    from recursive_lightning.config import RunConfig, load_yaml
    from recursive_lightning.training.run import train

    print(
        f"\n## eval --context-lengths at 1x and 16x the training length ({args.seq_len}), a fresh process each\n"
    )
    print("| model | context length | peak RSS (MB) | seconds | perplexity |")
    print("| --- | ---: | ---: | ---: | ---: |")
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")}
    tmp = Path(tempfile.mkdtemp(prefix="bench-mela-eval-"))
    peaks = {}
    for name in (args.mela, args.transformerpp):
        raw = load_yaml(Path(__file__).resolve().parents[1] / "experiments" / "cpu" / "mela.yaml")
        raw["model"]["preset"] = name
        raw["data"]["seq_len"] = args.seq_len
        raw["train"].update(max_steps=2, warmup_steps=1, val_every=2, checkpoint_every=2, progress=False)
        run = tmp / name
        train(
            RunConfig.from_dict(raw), run, tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}"
        )  # weights do not matter
        for L in (args.seq_len, 16 * args.seq_len):
            cmd = [sys.executable, "-c", EVAL, "eval", str(run), "--ppl", "heldout=embedded:heldout",
                   "--tasks", "none", "--context-lengths", str(L), "--ctx-max-tokens", "8192", "--no-mlflow",
                   "--out", str(tmp / f"{name}-{L}")]  # fmt: skip
            t = _time.perf_counter()
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            dt = _time.perf_counter() - t
            r = json.loads(out.stdout.strip().splitlines()[-1])
            res = json.loads(next((tmp / f"{name}-{L}").glob("eval-*.json")).read_text())
            ppl = res["ppl_ctx"]["lengths"][str(L)]["ppl"]
            peaks[(name, L)] = r["peak_rss_mb"]
            print(f"| {name} | {L:,} | {r['peak_rss_mb']:.0f} | {dt:.1f} | {ppl:.1f} |", flush=True)
    for name in (args.mela, args.transformerpp):
        ratio = peaks[(name, 16 * args.seq_len)] / peaks[(name, args.seq_len)]
        goal = " (goal for Mela: within 2x)" if name == args.mela else ""
        print(f"\n{name}: peak RSS at 16x / 1x = {ratio:.2f}{goal}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "train", "loop", "decode", "eval"), default="all")
    p.add_argument("--mela", default="cpu-mela")
    p.add_argument("--transformerpp", default="cpu-transformerpp")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--loop-batch", type=int, default=2)
    p.add_argument("--loop-chunks", type=int, default=4)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--compiled-memory",
        action="store_true",
        help="train: also Mela with each memory's projections and chunk update compiled (MelaLM.compile_glue)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; peak RSS so far "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
    )
    if args.part in ("all", "train"):
        part_train(args)
    if args.part in ("all", "loop"):
        part_loop(args)
    if args.part in ("all", "decode"):
        part_decode(args)
    if args.part in ("all", "eval"):
        part_eval(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
