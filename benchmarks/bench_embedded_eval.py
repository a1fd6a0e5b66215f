"""What the default sweep's ``evaluate:`` (the embedded tasks, 0-shot) adds to one trial: wall-clock and process CPU
time of ``evaluate_checkpoint`` on a trial's checkpoint, as the sweep runs it (one thread per worker).

    python benchmarks/bench_embedded_eval.py runs/sweeps/default/trials/<point>   # a trial (or any run) directory
    python benchmarks/bench_embedded_eval.py RUN_DIR --threads 2 --reps 3

The items are built (or read from the cache) before the clock starts; ``--cold`` builds them into a fresh cache
inside the timed region instead, as the first trial of a fresh machine does. On a shared machine compare the CPU
time: other processes' load inflates the wall-clock.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a run or trial directory, or a .ckpt file")
    p.add_argument(
        "--sweep",
        default=str(Path(__file__).parent.parent / "ablations" / "default.yaml"),
        help="its evaluate:",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--cold", action="store_true", help="build the items into a fresh cache inside the timing")
    args = p.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(args.threads)
    from recursive_lightning.data.embedded_tasks import embedded_task_items
    from recursive_lightning.evaluation.options import EvalOptions
    from recursive_lightning.evaluation.run import evaluate_checkpoint
    from recursive_lightning.sweep.spec import load_sweep
    from recursive_lightning.training.checkpoint import load_checkpoint

    ev = load_sweep(args.sweep).evaluate
    loaded = load_checkpoint(args.checkpoint, device="cpu")
    cache = loaded.run.data.cache_dir
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            if args.cold:
                loaded.run.data.cache_dir = str(Path(tmp) / f"cache-{rep}")
            else:
                embedded_task_items(cache)
            t0, c0 = time.perf_counter(), time.process_time()
            r = evaluate_checkpoint(
                args.checkpoint,
                EvalOptions(
                    tasks=ev.get("tasks") or [],
                    shots=ev.get("shots", [0]),
                    limit=ev.get("limit"),
                    mlflow=False,
                    out_dir=tmp,
                ),
                loaded=loaded,
            )
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            heads = {t: f"{h['metric']}={h['value']:.3f}" for t, h in r["headline"].get("0", {}).items()}
            print(
                f"rep {rep}: wall {wall:.1f} s, cpu {cpu:.1f} s ({args.threads} thread(s)); {heads}",
                flush=True,
            )


if __name__ == "__main__":
    main()
