"""``python -m recursive_lightning <command>``: describe, train, sweep, report, eval, probe."""

from __future__ import annotations

import argparse
import json
import os
import sys

from recursive_lightning.errors import UserError


def _describe(argv: list[str]) -> int:
    from recursive_lightning.model.accounting import describe, format_description
    from recursive_lightning.model.config import ModelConfig

    p = argparse.ArgumentParser(
        prog="recursive_lightning describe",
        description="Parameters and forward FLOPs of a model, before training.",
    )
    p.add_argument("--config", help="a run or model YAML (its `model:` section is used)")
    p.add_argument("--preset", help="size preset, e.g. pythia-1.4b or cpu-small")
    p.add_argument("--layout", help="e.g. 24, 4+8R2+4, 4+8+8+4, 4+8x{1/8,1/4,1/2,1}+4")
    p.add_argument("--topology", help="base, residual, anchor, anchor_emb, ..., static, dynamic, mesh")
    p.add_argument("--buffer", type=int, help="MeSH buffer slots B (default N_loop + 3)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args, rest = p.parse_known_args(argv)
    data: dict = {}
    if args.config:
        from recursive_lightning.config import load_yaml

        raw = load_yaml(args.config)
        data = dict(raw.get("model", raw))
    for key in ("preset", "layout", "topology", "buffer"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    from recursive_lightning.config import apply_overrides

    data = apply_overrides({"model": data}, rest, sections=("model",))["model"]
    cfg = ModelConfig.from_dict(data)
    d = describe(cfg, seq_len=args.seq_len, batch_size=args.batch_size)
    print(json.dumps(d) if args.json else format_description(d))
    return 0


COMMANDS = {
    "describe": ("recursive_lightning.cli", "_describe"),
    "train": ("recursive_lightning.training.run", "main"),
    "sweep": ("recursive_lightning.sweep.runner", "main"),
    "report": ("recursive_lightning.sweep.report", "main"),
    "eval": ("recursive_lightning.evaluation.run", "main"),
    "probe": ("recursive_lightning.probes.run", "main"),
}

USAGE = """usage: python -m recursive_lightning <command> [options]

commands:
  describe   parameters and forward FLOPs of a model (meta device, no weights allocated)
  train      train one config (Lightning + litdata + MLflow), resumable
  sweep      run an ablation sweep (Optuna study + MLflow parent/child runs); default ablations/default.yaml
  report     tables and plots of a sweep's results
  eval       perplexity and lm-eval downstream accuracy of a checkpoint
  probe      the papers' diagnostic probes of a checkpoint, as figures and JSON

`python -m recursive_lightning <command> --help` for the options of each command."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        if not argv:
            # the package's main job: the embedded default sweep
            argv = ["sweep"]
        else:
            print(USAGE)
            return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command '{command}'; choose one of: {', '.join(COMMANDS)}.", file=sys.stderr)
        return 2
    os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
    module_name, func = COMMANDS[command]
    try:
        import importlib

        if module_name == __name__:
            return _describe(rest)
        return int(getattr(importlib.import_module(module_name), func)(rest) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
