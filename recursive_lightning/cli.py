"""``python -m recursive_lightning <command>``: describe, train, sweep, report, eval, probe, generate."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time

from recursive_lightning import threads as thread_policy
from recursive_lightning.config import (
    SECTIONS,
    apply_overrides,
    check_model_types,
    check_sections,
    check_seed,
    load_yaml,
)
from recursive_lightning.errors import ArgumentParser, Terminated, UserError
from recursive_lightning.model.config import ModelConfig
from recursive_lightning.sampled_loops import check_train_loops, format_training, parse_text
from recursive_lightning.uris import mask_url
from recursive_lightning.validation import check_device, check_max_new_tokens

MAX_DESCRIBE_SEQ = 2**24  # `describe --seq-len`: 16M tokens (attention counted at L x L)


def _describe(argv: list[str]) -> int:
    from recursive_lightning.model.describe import (  # heavy
        describe,
        format_description,
        without_loading_the_compiler,
    )
    from recursive_lightning.training.loop_flops import expected_training_flops  # heavy

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
    args, rest = p.parse_known_args(argv)
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


def _generate(argv: list[str]) -> int:
    import torch  # heavy

    from recursive_lightning.evaluation.perplexity import EOS_TOKEN  # heavy
    from recursive_lightning.model.decoding import decode  # heavy
    from recursive_lightning.model.depth import at_depth, check_depth  # heavy
    from recursive_lightning.model.recursive.adaptive_exit import (  # heavy
        ExitStats,
        check_adaptive_exit,
        decode_adaptive,
    )
    from recursive_lightning.training.checkpoint import load_checkpoint  # heavy

    p = ArgumentParser(
        prog="recursive_lightning generate",
        description="Continuation of a prompt by a checkpoint (greedy, or sampled with --temperature), "
        "printed as it is decoded.",
    )
    p.add_argument("checkpoint", help="a .ckpt file or a run directory (its newest good checkpoint)")
    p.add_argument("--prompt", default="", help="text to continue (default: start of a document)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    p.add_argument("--top-k", type=int, help="sample only among the k most likely tokens")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.add_argument("--no-cache", action="store_true", help="recompute the window at every token")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    depth = p.add_mutually_exclusive_group()
    depth.add_argument(
        "--loops",
        type=int,
        help="decode a looped model at this test-time depth (loop count; default: trained)",
    )
    depth.add_argument(
        "--h-cycles", type=int, help="decode a Mela model at this many high-level cycles (default: trained)"
    )
    p.add_argument(
        "--exit-kl",
        type=float,
        metavar="KL",
        help="adaptive exit: stop a token's loop steps once two successive steps' next-token distributions "
        "differ by less than KL nats (e.g. 5e-4); prints the mean loop steps used",
    )
    args = p.parse_args(argv)
    check_max_new_tokens(args.max_new_tokens)
    if args.exit_kl is not None and args.no_cache:
        raise UserError(
            "--exit-kl decodes with the cache (exited tokens share their keys/values); drop --no-cache."
        )
    if not 0 <= args.temperature < math.inf:  # NaN fails too: it would sample from NaN probabilities
        raise UserError(f"--temperature must be a finite number >= 0 (0 = greedy), not {args.temperature}.")
    check_seed(args.seed, "--seed")
    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"--top-k must be >= 1, not {args.top_k}.")
    if args.top_k is not None and args.temperature == 0:
        raise UserError(
            "--top-k samples among the k most likely tokens, but --temperature 0 decodes greedily; "
            "give a --temperature above 0 (e.g. 0.8) or drop --top-k."
        )
    try:  # bytes the terminal could not decode reach Python as surrogate escapes the tokenizer cannot take
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(
            "--prompt is not UTF-8 text (the shell passed bytes that do not decode); give the prompt as UTF-8."
        ) from None
    check_device(args.device)
    loaded = load_checkpoint(args.checkpoint, device=args.device)
    if loaded.tokenizer is None:
        raise UserError(f"checkpoint '{loaded.path}' carries no tokenizer, which generation needs.")
    model, tok = loaded.model.eval(), loaded.tokenizer
    dial = "loops" if args.loops is not None else "h_cycles" if args.h_cycles is not None else None
    k = None if dial is None else check_depth(model, getattr(args, dial), dial)  # one sentence when wrong
    if args.exit_kl is not None:
        check_adaptive_exit(model, args.exit_kl)
    eos = tok.token_to_id(EOS_TOKEN)
    ids = tok.encode(args.prompt).ids if args.prompt else []
    if not ids:
        if eos is None:
            raise UserError(
                "give a --prompt: the checkpoint's tokenizer has no end-of-text token to start from."
            )
        ids = [eos]
    idx = torch.tensor([ids], device=next(model.parameters()).device)
    print(args.prompt, end="", flush=True)
    out: list[int] = []
    shown, t0 = "", time.perf_counter()
    sampling = {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "generator": torch.Generator(device=idx.device).manual_seed(args.seed),
    }
    stats = ExitStats()
    if args.exit_kl is None:
        tokens = decode(model, idx, args.max_new_tokens, use_cache=not args.no_cache, **sampling)
    else:
        tokens = decode_adaptive(model, idx, args.max_new_tokens, args.exit_kl, stats, **sampling)
    with at_depth(model, k):  # the decoding cache follows the depth (DecodeCache.empty: model.loop_plan())
        for nxt in tokens:
            token = int(nxt[0])
            if token == eos:
                break
            out.append(token)
            text = tok.decode(out)
            print(text[len(shown) :], end="", flush=True)
            shown = text
    seconds = time.perf_counter() - t0
    print(flush=True)
    loops = f", {stats.mean_loops:.2f} of {stats.max_loops} loop steps per token" if stats.loops else ""
    print(
        f"[{len(out)} tokens in {seconds:.2f}s, {len(out) / max(seconds, 1e-9):.1f} tokens/s{loops}]",
        file=sys.stderr,
    )
    return 0


COMMANDS = {
    "describe": ("recursive_lightning.cli", "_describe"),
    "generate": ("recursive_lightning.cli", "_generate"),
    "train": ("recursive_lightning.training.run", "main"),
    "sweep": ("recursive_lightning.sweep.runner", "main"),
    "report": ("recursive_lightning.sweep.report", "main"),
    "eval": ("recursive_lightning.evaluation.cli", "main"),
    "probe": ("recursive_lightning.probes.run", "main"),
    "ui": ("recursive_lightning.tracking.ui", "main"),
}

USAGE = """usage: python -m recursive_lightning <command> [options]

commands:
  describe   parameters and forward FLOPs of a model (meta device, no weights allocated)
  train      train one config (Lightning + litdata + MLflow), resumable
  sweep      run an ablation sweep (Optuna study + MLflow parent/child runs); default ablations/default.yaml
  report     tables and plots of a sweep's results
  eval       perplexity and lm-eval downstream accuracy of a checkpoint
  probe      the papers' diagnostic probes of a checkpoint, as figures and JSON
  generate   continuation of a prompt by a checkpoint (greedy or sampled, cached decoding)
  ui         the MLflow UI of a run or sweep directory (moved or copied ones too), on 127.0.0.1

`python -m recursive_lightning <command> --help` for the options of each command.

--threads N (before or after the command): CPU threads of torch (and of the processes a command starts);
default: one for models narrower than d_model 512 and for any model while the other cores are busy
(OMP_NUM_THREADS, when set, is respected as well). See "CPU threads" in docs/training.md.

With no command at all, `python -m recursive_lightning` runs `sweep`: the full default sweep
(ablations/default.yaml, about 5 minutes on 2 CPU cores) into runs/sweeps/default under the current
directory; it says so before it starts."""


GLOBAL_OPTIONS = (
    "\nglobal options (any command, anywhere on the line):\n"
    "  --threads N           CPU threads for torch (default: chosen per command and model size; see "
    '"CPU threads" in docs/training.md)'
)


def _pop_threads(argv: list[str]) -> tuple[list[str], int | None]:
    """The global ``--threads N`` / ``--threads=N`` taken out of ``argv`` (anywhere in it)."""
    out, threads, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--threads" or a.startswith("--threads="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in a else 2
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"--threads must be a whole number of CPU threads >= 1, not {value!r}.")
            threads = int(value)
            if threads > thread_policy.cores():  # thousands of OpenMP threads crash torch before any work
                raise UserError(
                    f"--threads {threads} is more than the {thread_policy.cores()} CPU core(s) this process may "
                    f"run on; pass --threads {thread_policy.cores()} or fewer."
                )
            continue
        out.append(a)
        i += 1
    return out, threads


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # text the terminal cannot encode (a prompt on an ASCII terminal): printed escaped, not a crash
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        argv, threads = _pop_threads(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        if not argv:
            # the package's main job: the embedded default sweep
            print(
                "no command given: running `sweep`, the default ablation sweep (ablations/default.yaml) into "
                "runs/sweeps/default; `--help` lists the commands.",
                file=sys.stderr,
                flush=True,
            )
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
        with thread_policy.for_command(threads):
            module = (
                sys.modules[__name__] if module_name == __name__ else importlib.import_module(module_name)
            )
            return int(getattr(module, func)(rest) or 0)
    except UserError as e:
        print(f"error: {mask_url(str(e))}", file=sys.stderr)  # a database URL in it: its password masked
        return 2
    except Terminated as e:  # SIGTERM (pre-emption): resumable, and not a finished run
        print(str(e), file=sys.stderr)
        return e.EXIT_CODE
    except KeyboardInterrupt as e:  # its sentence, where the command gave one (train: how to resume)
        print(str(e) or "interrupted", file=sys.stderr)
        return getattr(e, "EXIT_CODE", 130)  # 143: SIGTERM, turned into a stop like Ctrl-C (sweep)
    except SystemExit as e:  # after Terminated, which is one
        if e.code == 0 and {"-h", "--help"} & set(rest):  # the command's own help: the global option too
            print(GLOBAL_OPTIONS)
        raise


if __name__ == "__main__":
    raise SystemExit(main())
