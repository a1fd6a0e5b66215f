"""CPU study of uptraining: recursive models initialised from a trained vanilla model vs from scratch.

1. A vanilla model of this package (``cpu-tiny``, ``--source-layers`` 8) trained on the embedded corpus.
2. A looped MeSH model ``2+2R2+2`` and a SpiralFormer-B ``2+2x{1/2,1}+2`` (coarse-to-fine, MeSH) — the
   ``4+4R2+4`` style at half depth (``--source-layers 16`` gives ``4+4R2+4``) — each initialised from it by
   stepwise / average / lower (``train --init-from``) and from scratch: same steps, seed, data order and
   recipe. The middle layers are 2 loops x the core, Bae et al.'s M = K m setting.
3. Validation perplexity on the held-out split at step 0 (before any update) and every ``--val-every`` steps,
   all curves in one PNG (one panel per target model, the vanilla source's final perplexity as a line).

    .venv/bin/python benchmarks/study_uptrain.py --out /tmp/uptrain-study
    .venv/bin/python benchmarks/study_uptrain.py --source-steps 10 --steps 4 --val-every 2   # a smoke run

Writes ``<out>/results.json`` and ``<out>/uptrain_study.png`` (``--figure`` copies the PNG elsewhere too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from recursive_lightning.config import RunConfig  # noqa: E402
from recursive_lightning.files import atomic_write_text  # noqa: E402
from recursive_lightning.tracking.runs import client  # noqa: E402
from recursive_lightning.training.run import train  # noqa: E402


def targets(layers: int) -> dict[str, str]:
    """Looped MeSH and SpiralFormer-B of the source's depth: prelude and coda of layers/4 each, a core of layers/4
    looped twice over the middle layers/2 (16 layers: 4+4R2+4 and 4+4x{1/2,1}+4)."""
    q = layers // 4
    return {
        f"looped MeSH {q}+{q}R2+{q}": f"{q}+{q}R2+{q}",
        f"SpiralFormer-B {q}+{q}x{{1/2,1}}+{q}": f"{q}+{q}x{{1/2,1}}+{q}",
    }


INITS = ("scratch", "stepwise", "average", "lower")


class StepZeroValidation(Callback):
    """Held-out perplexity of the model as training starts (after --init-from, before any update)."""

    def __init__(self) -> None:
        self.ppl: float | None = None

    @torch.no_grad()
    def on_train_start(self, trainer, pl_module) -> None:
        model = pl_module.model
        was_training = model.training
        model.eval()
        nll, tokens = 0.0, 0
        for batch in trainer.datamodule.val_dataloader():
            batch = batch.long().to(pl_module.device)
            logits = model(batch[:, :-1])
            nll += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"
            ).item()
            tokens += batch[:, 1:].numel()
        self.ppl = math.exp(nll / tokens)
        model.train(was_training)


def run_config(name: str, layout: str, topology: str, args: argparse.Namespace, steps: int) -> dict:
    return {
        "name": name,
        "model": {"preset": args.preset, "layout": layout, "topology": topology, "max_seq_len": args.seq_len},
        "data": {
            "tokenizer": "bpe:4096",
            "seq_len": args.seq_len,
            "batch_size": args.batch,
            "val_batches": 8,
        },
        "train": {
            "max_steps": steps,
            "lr": args.lr,
            "val_every": args.val_every,
            "checkpoint_every": steps,
            "seed": args.seed,
            "progress": False,
        },
    }


def one_run(cfg: dict, run_dir: Path) -> dict:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    probe = StepZeroValidation()
    t0 = time.time()
    result = train(RunConfig.from_dict(cfg), run_dir, callbacks=[probe])
    history = client(result.tracking_uri).get_metric_history(result.mlflow_run_id, "val/heldout/ppl")
    curve = {0: probe.ppl, **{int(m.step): float(m.value) for m in history}}
    steps = sorted(curve)
    print(
        f"  {cfg['name']}: ppl {probe.ppl:.1f} at step 0 -> {curve[steps[-1]]:.1f} at step {steps[-1]} "
        f"({time.time() - t0:.0f} s)",
        flush=True,
    )
    return {"steps": steps, "ppl": [curve[s] for s in steps], "seconds": time.time() - t0}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = list(results["runs"])
    fig, axes = plt.subplots(1, len(titles), figsize=(6 * len(titles), 4.2), sharey=True)
    styles = {
        "scratch": ("k", "--"),
        "stepwise": ("tab:blue", "-"),
        "average": ("tab:orange", "-"),
        "lower": ("tab:green", "-"),
    }
    source = results["source"]["ppl"][-1]
    for ax, title in zip(axes, titles):
        for init, r in results["runs"][title].items():
            color, ls = styles.get(init, ("tab:purple", ":"))
            ax.plot(r["steps"], r["ppl"], ls, color=color, marker="o", ms=3, label=init)
        ax.axhline(source, color="grey", lw=0.8, ls=":", label=f"vanilla source ({source:.0f})")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("validation perplexity (held-out, log scale)")
    axes[-1].legend(fontsize=8)
    meta = results["setup"]
    fig.suptitle(
        f"Uptraining from a {meta['source_layout']}-layer vanilla {meta['preset']} ({meta['source_steps']} steps) vs "
        f"scratch: {meta['steps']} steps, seed {meta['seed']}, {meta['batch']}x{meta['seq_len']} tokens/step",
        fontsize=10,
    )
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=90)
    os.replace(tmp, path)  # atomic
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/uptrain-study")
    p.add_argument("--preset", default="cpu-tiny")
    p.add_argument("--source-layers", type=int, default=8)
    p.add_argument("--source-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--val-every", type=int, default=15)
    p.add_argument("--val-batches", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--low-lr", type=float, default=3e-4, help="one more stepwise run at this peak LR (0: none)"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--figure", help="also copy the PNG here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    setup = {
        k: getattr(args, k) for k in ("preset", "source_steps", "steps", "seq_len", "batch", "lr", "seed")
    }
    setup["source_layout"] = str(args.source_layers)
    results: dict = {"setup": setup, "runs": {}}
    print(f"vanilla source: {args.preset} {args.source_layers} layers, {args.source_steps} steps", flush=True)
    src_cfg = run_config("uptrain-source", str(args.source_layers), "base", args, args.source_steps)
    src_cfg["train"]["val_every"] = max(args.val_every, args.source_steps // 5)
    results["source"] = one_run(src_cfg, out / "source")
    for title, layout in targets(args.source_layers).items():
        print(title, flush=True)
        results["runs"][title] = {}
        extra = [f"stepwise, lr {args.low_lr:g}"] if args.low_lr else []
        for init in (*INITS, *extra):
            cfg = run_config(f"uptrain-{layout}-{init.split(',')[0]}", layout, "mesh", args, args.steps)
            if init != "scratch":
                cfg["train"].update(init_from=str(out / "source"), init_strategy=init.split(",")[0])
                cfg["data"]["tokenizer"] = "init"  # the source's tokenizer (the same bpe:4096 of this corpus)
            if init in extra:
                cfg["train"]["lr"] = args.low_lr
            results["runs"][title][init] = one_run(cfg, out / "runs" / f"{layout}-{init.replace(', ', '-')}")
    results["seconds"] = time.time() - t0
    atomic_write_text(out / "results.json", json.dumps(results, indent=2))
    plot(results, out / "uptrain_study.png")
    if args.figure:
        shutil.copyfile(out / "uptrain_study.png", args.figure)
    print(
        f"done in {results['seconds']:.0f} s: {out / 'results.json'}, {out / 'uptrain_study.png'}", flush=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
