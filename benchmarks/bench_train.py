"""Training throughput on the CPU: our Lightning module vs a Hugging Face GPTNeoXForCausalLM of identical size
trained by a plain PyTorch loop on the same batches, measured side by side (interleaved) in one run.

    .venv/bin/python benchmarks/bench_train.py [--preset cpu-small] [--seq-len 256] [--batch 16] [--steps 20]

Reports tokens/s of each, their ratio (goal >= 1.0) and model FLOPs utilisation against this machine's
measured float32 matrix-multiply peak.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def matmul_peak(n: int = 2048, reps: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from recursive_lightning.config import RunConfig
    from recursive_lightning.model.describe import describe
    from recursive_lightning.training.module import RecursiveLMModule
    from recursive_lightning.training.optim import build_optimizer

    run = RunConfig.from_dict(
        {
            "name": "bench",
            "model": {"preset": args.preset, "scale_embeddings": False},
            "data": {"seq_len": args.seq_len, "batch_size": args.batch},
        }
    )
    m = run.model
    ours = RecursiveLMModule(run.to_dict()).model
    hf = GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=m.vocab_size,
            hidden_size=m.d_model,
            num_hidden_layers=m.parsed_layout.n_layers,
            num_attention_heads=m.n_heads,
            intermediate_size=4 * m.d_model,
            rotary_pct=m.rotary_pct,
            max_position_embeddings=m.max_seq_len,
            use_parallel_residual=True,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
    )
    n_ours = sum(p.numel() for p in ours.parameters())
    n_hf = sum(p.numel() for p in hf.parameters())
    opt_ours, _ = build_optimizer(ours, run.train)
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=run.train.lr, betas=(0.9, 0.95), weight_decay=0.01)
    batches = [torch.randint(0, m.vocab_size, (args.batch, args.seq_len + 1)) for _ in range(4)]

    def step_ours(b):
        logits = ours(b[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), b[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)

    def step_hf(b):
        out = hf(input_ids=b[:, :-1], labels=b[:, :-1].clone())
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)

    times = {"ours": [], "hf": []}
    for i in range(args.steps + 2):
        for name, fn in (("ours", step_ours), ("hf", step_hf)):
            t = time.perf_counter()
            fn(batches[i % len(batches)])
            if i >= 2:
                times[name].append(time.perf_counter() - t)
    tokens = args.batch * args.seq_len
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    flops_token = 3 * describe(m, seq_len=args.seq_len)["flops_forward"] / args.seq_len
    peak = matmul_peak()
    print(
        f"preset {args.preset} ({n_ours:,} params ours, {n_hf:,} HF), batch {args.batch}x{args.seq_len}, "
        f"{args.threads} threads, median of {args.steps} interleaved steps"
    )
    print(f"ours  {tps['ours']:10.0f} tokens/s   MFU {tps['ours'] * flops_token / peak:6.1%}")
    print(f"HF    {tps['hf']:10.0f} tokens/s   MFU {tps['hf'] * flops_token / peak:6.1%}")
    print(
        f"ratio ours/HF = {tps['ours'] / tps['hf']:.2f}  (measured fp32 matmul peak {peak / 1e9:.0f} GFLOP/s)"
    )


if __name__ == "__main__":
    main()
