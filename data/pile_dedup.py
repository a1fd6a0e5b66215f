"""Tokenise the deduplicated Pile with the GPT-NeoX tokenizer into litdata token shards.

    python data/pile_dedup.py --output /data/shards/pile-dedup-neox --max-tokens 2e9

Streams ``EleutherAI/the_pile_deduplicated`` from the Hugging Face Hub (no full download), tokenises with
``EleutherAI/gpt-neox-20b`` (50,277 ids -> uint16 shards) and writes ``<output>/{train,val}`` plus
``tokenizer.json``/``meta.json``/``COMPLETE`` -- the format of ``recursive_lightning.data.shards``. Train with
``--data <output>`` (the shard folder brings its own tokenizer). See data/README.md for sizes and times.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from recursive_lightning.data.hub import build_hub_shards  # noqa: E402
from recursive_lightning.data.tokenizer import load_tokenizer  # noqa: E402

DATASET = "EleutherAI/the_pile_deduplicated"
TOKENIZER = "EleutherAI/gpt-neox-20b"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, type=Path, help="shard folder to create")
    parser.add_argument(
        "--max-tokens", type=float, default=None, help="cap on train tokens (default: all, ~207B)"
    )
    parser.add_argument("--val-tokens", type=float, default=5e6, help="tokens of held-out documents for val")
    parser.add_argument(
        "--num-workers", type=int, default=None, help="tokenising processes (default: all cores)"
    )
    parser.add_argument("--num-inputs", type=int, default=None, help="file shards to split the stream into")
    parser.add_argument("--tokenizer", default=TOKENIZER, help="Hub name or tokenizer.json path")
    parser.add_argument("--chunk-bytes", default="64MB", help="size of each litdata chunk file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer, lambda: [], args.output.parent)
    output = build_hub_shards(
        args.output,
        tokenizer,
        dataset=DATASET,
        max_tokens=args.max_tokens,
        val_tokens=args.val_tokens,
        num_workers=args.num_workers,
        num_inputs=args.num_inputs,
        chunk_bytes=args.chunk_bytes,
        meta={"tokenizer": args.tokenizer},
    )
    print(f"shards ready: {output}")
    return output


if __name__ == "__main__":
    main()
