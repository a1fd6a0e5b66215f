"""``python -m recursive_lightning describe``: parameters and forward FLOPs of a model, before training (meta
device, no weights allocated)."""

from __future__ import annotations

import json

from recursive_lightning.config import SECTIONS, apply_overrides, check_model_types, check_sections, load_yaml
from recursive_lightning.errors import ArgumentParser, UserError
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.sampled_loops import check_train_loops, format_training, parse_text

MAX_DESCRIBE_SEQ = 2**24  # `describe --seq-len`: 16M tokens (attention counted at L x L)


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="recursive_lightning describe",
        description="Parameters and forward FLOPs of a model, before training.",
    )
    p.add_argument("--config", help="a run or model YAML (its `model:` section is used)")
    p.add_argument("--preset", help="size preset, e.g. pythia-1.4b or cpu-small")
    p.add_argument("--layout", help="e.g. 24, 4+8R2+4, 4+8+8+4, 4+8x{1/8,1/4,1/2,1}+4")
    p.add_argument("--topology", help="base, residual, anchor, anchor_emb, ..., static, dynamic, mesh")
    p.add_argument("--buffer", type=int, help="MeSH buffer slots B (default N_loop + 3)")
    p.add_argument(
        "--seq-len",
        type=int,
        default=4096,
        help="tokens per sequence the FLOPs are counted at (default 4096)",
    )
    p.add_argument("--batch-size", type=int, default=1, help="sequences per forward pass (default 1)")
    p.add_argument(
        "--train-loops",
        metavar="SPEC",
        help="training with a sampled loop count (train.loops): poisson-lognormal:MEAN[:SIGMA] or "
        "uniform:LOW-HIGH; adds the expected training FLOPs per token (a run --config's train.loops is read too)",
    )
    p.add_argument(
        "--train-backprop",
        type=int,
        metavar="K",
        help="with --train-loops: gradients through the last K loop steps",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str]) -> int:
    from recursive_lightning.model.describe import (  # heavy
        describe,
        format_description,
        without_loading_the_compiler,
    )
    from recursive_lightning.training.loop_flops import expected_training_flops  # heavy

    args, rest = _parser().parse_known_args(argv)
    data: dict = {}
    loops = None
    if args.train_backprop is not None and args.train_loops is None:
        raise UserError("--train-backprop needs --train-loops (e.g. --train-loops poisson-lognormal:4).")
    for flag, value, top in (
        ("--seq-len", args.seq_len, MAX_DESCRIBE_SEQ),
        ("--batch-size", args.batch_size, 2**16),
    ):
        if not 1 <= value <= top:  # counted on the meta device: beyond these its tensor sizes overflow
            raise UserError(f"{flag} must lie in [1, {top:,}], not {value:,}.")
    if args.config:
        raw = load_yaml(args.config)
        if "model" not in raw and {"axes", "base", "overrides"} & set(raw):
            raise UserError(
                f"'{args.config}' is a sweep file; describe one of its models with a run config (e.g. "
                f"--config experiments/cpu/looped-mesh.yaml) or with --preset and --layout."
            )
        run_config = bool(set(raw) & set(SECTIONS))  # else a model file: the model's fields themselves
        if run_config:  # a misspelt section is refused as `train` refuses it
            check_sections(raw)
        if isinstance(raw.get("train"), dict):
            loops = raw["train"].get("loops")
        section = raw.get("model", {} if run_config else raw)
        if not isinstance(section, dict):
            raise UserError(
                f"the 'model' section of '{args.config}' must be a mapping of fields, not {section!r}."
            )
        data = dict(section)
    for key in ("preset", "layout", "topology", "buffer"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    data = apply_overrides({"model": data}, rest, sections=("model",))["model"]
    cfg = ModelConfig.from_dict(check_model_types(data))  # `--model.memstack maybe` is refused, as in train
    d = without_loading_the_compiler(lambda: describe(cfg, seq_len=args.seq_len, batch_size=args.batch_size))
    if args.train_loops is not None:
        loops = parse_text(args.train_loops, args.train_backprop)
    text = format_description(d)
    if loops is not None:  # per token: a batch of one sequence of --seq-len
        schedule = check_train_loops(loops, cfg)
        d.update(without_loading_the_compiler(lambda: expected_training_flops(cfg, args.seq_len, schedule)))
        text += "\n" + format_training(d)
    print(json.dumps(d) if args.json else text)
    return 0
