"""Tokenise FineWeb-Edu into litdata token shards with a 32K byte-level BPE.

    python data/fineweb_edu.py --output /data/shards/fineweb-edu-10bt --config sample-10BT --max-tokens 1e9

Streams ``HuggingFaceFW/fineweb-edu`` from the Hugging Face Hub. Unless ``--tokenizer`` names an existing
``tokenizer.json`` (or a Hub tokenizer), a byte-level BPE with ``--vocab-size`` ids (default 32,768 ->
uint16 shards) is first trained on ``--tokenizer-docs`` training documents of the stream and saved next to
the output. Writes ``<output>/{train,val}`` plus ``tokenizer.json``/``meta.json``/``COMPLETE`` -- the format
of ``recursive_lightning.data.shards``; train with ``--data <output>``. See data/README.md for sizes and times.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from recursive_lightning.data.hub import build_hub_shards, iter_hub_texts  # noqa: E402
from recursive_lightning.data.shards import is_validation_document  # noqa: E402
from recursive_lightning.data.tokenizer import load_tokenizer, train_bpe  # noqa: E402

DATASET = "HuggingFaceFW/fineweb-edu"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, type=Path, help="shard folder to create")
    parser.add_argument(
        "--config", default="sample-10BT", help="sample-10BT, sample-100BT, sample-350BT or default"
    )
    parser.add_argument(
        "--max-tokens", type=float, default=None, help="cap on train tokens (default: the config)"
    )
    parser.add_argument("--val-tokens", type=float, default=5e6, help="tokens of held-out documents for val")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json or Hub name (default: train a BPE)")
    parser.add_argument("--vocab-size", type=int, default=32_768, help="vocab of the BPE trained here")
    parser.add_argument("--tokenizer-docs", type=int, default=100_000, help="documents to train the BPE on")
    parser.add_argument(
        "--num-workers", type=int, default=None, help="tokenising processes (default: all cores)"
    )
    parser.add_argument("--num-inputs", type=int, default=None, help="file shards to split the stream into")
    parser.add_argument("--chunk-bytes", default="64MB", help="size of each litdata chunk file")
    return parser.parse_args(argv)


def bpe_tokenizer(args: argparse.Namespace):
    """Train (or reuse) the BPE on the first ``--tokenizer-docs`` training documents of the stream."""
    path = args.output.parent / f"{args.output.name}.bpe{args.vocab_size}.json"
    if path.is_file():
        return load_tokenizer(str(path), lambda: [], args.output.parent)
    print(f"training a {args.vocab_size}-token BPE on {args.tokenizer_docs} documents ...", flush=True)
    texts = (t for t in iter_hub_texts(DATASET, args.config) if not is_validation_document(t))
    tokenizer = train_bpe(itertools.islice(texts, args.tokenizer_docs), args.vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return tokenizer


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer, lambda: [], args.output.parent)
    else:
        tokenizer = bpe_tokenizer(args)
    output = build_hub_shards(
        args.output,
        tokenizer,
        dataset=DATASET,
        config=args.config,
        max_tokens=args.max_tokens,
        val_tokens=args.val_tokens,
        num_workers=args.num_workers,
        num_inputs=args.num_inputs,
        chunk_bytes=args.chunk_bytes,
        meta={"tokenizer": args.tokenizer or f"bpe:{args.vocab_size} (trained here)"},
    )
    print(f"shards ready: {output}")
    return output


if __name__ == "__main__":
    main()
