"""``python -m recursive_lightning generate``: the continuation of a prompt by a checkpoint (greedy, or sampled
with ``--temperature``; cached decoding), printed as it is decoded."""

from __future__ import annotations

import argparse
import math
import sys
import time

from recursive_lightning.config import check_seed
from recursive_lightning.errors import ArgumentParser, UserError
from recursive_lightning.model.layout import MAX_LOOP_STEPS
from recursive_lightning.validation import check_device, check_max_new_tokens


def _parser() -> ArgumentParser:
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
    return p


def _check_args(args: argparse.Namespace) -> None:
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


def _check_depth(model: object, k: int, dial: str) -> int:
    """``k`` as the one test-time depth ``--<dial>`` asks of ``model``, or one sentence naming the fix.

    The shared check's examples are eval's comma lists; generate decodes at one depth, so its range sentence
    gives one integer. Whether the dial applies to the model is asked first, so the sentence for a wrong
    dial comes before the one for a wrong count."""
    from recursive_lightning.model.depth import check_depth  # heavy

    check_depth(model, 1, dial)  # the dial fits the model (a Mela model, a looped layout) whatever k is
    if not 1 <= k <= MAX_LOOP_STEPS:
        flag, unit = ("--loops", "loop") if dial == "loops" else ("--h-cycles", "cycle")
        raise UserError(
            f"{flag} must be one whole {unit} count from 1 to {MAX_LOOP_STEPS}, not {k}; e.g. {flag} 4."
        )
    return check_depth(model, k, dial)


def main(argv: list[str]) -> int:
    import torch  # heavy

    from recursive_lightning.evaluation.perplexity import EOS_TOKEN  # heavy
    from recursive_lightning.model.decoding import decode  # heavy
    from recursive_lightning.model.depth import at_depth, depth_dial  # heavy
    from recursive_lightning.model.recursive.adaptive_exit import (  # heavy
        ExitStats,
        check_adaptive_exit,
        decode_adaptive,
    )
    from recursive_lightning.training.checkpoint import load_checkpoint  # heavy

    args = _parser().parse_args(argv)
    _check_args(args)  # one sentence for a bad option, before the checkpoint is read
    loaded = load_checkpoint(args.checkpoint, device=args.device)
    if loaded.tokenizer is None:
        raise UserError(f"checkpoint '{loaded.path}' carries no tokenizer, which generation needs.")
    model, tok = loaded.model.eval(), loaded.tokenizer
    dial = "loops" if args.loops is not None else "h_cycles" if args.h_cycles is not None else None
    k = None if dial is None else _check_depth(model, getattr(args, dial), dial)  # one sentence when wrong
    if args.exit_kl is not None:
        if depth_dial(model) == "h_cycles":
            raise UserError(
                "--exit-kl: adaptive exit stops a looped model's loop steps, and Mela's depth is its H cycles; "
                "drop --exit-kl, or set Mela's depth with --h-cycles N (e.g. --h-cycles 4)."
            )
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
