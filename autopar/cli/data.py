"""`autopar data`: prepare token datasets from text or JSONL, and describe prepared ones.

Only argparse and autopar's error type are imported here, so registering the command costs the
rest of the CLI nothing; numpy, tokenizers and the dataset code load when the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from autopar.errors import AutoparError


def add_data_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `data prepare` and `data info` on autopar's subcommands."""
    from autopar.cli.arguments import POSITIVE

    data = subparsers.add_parser("data", help="prepare token datasets for `autopar run` and describe them")
    data.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    actions = data.add_subparsers(dest="data_command", metavar="{prepare,info}", required=True)

    prepare = actions.add_parser(
        "prepare", help="tokenize text/JSONL files or directories into memory-mappable shards")
    prepare.add_argument("--input", required=True, nargs="+", metavar="PATH",
                         help="text files (.txt, .py, .md, ...), JSONL files (.jsonl, one {\"text\": ...} per line) "
                              "or directories holding them (searched recursively)")
    prepare.add_argument("--out", required=True, metavar="DIR", help="dataset directory to create")
    prepare.add_argument("--tokenizer", metavar="FILE",
                         help="HuggingFace tokenizer.json (default: bytes, vocab 257 with end-of-document id 256)")
    prepare.add_argument("--eos-token", metavar="TOKEN",
                         help="end-of-document token of the tokenizer (default: <|endoftext|>, </s>, ... if it has one)")
    prepare.add_argument("--text-field", default="text", metavar="KEY", help="JSONL field holding the text (default text)")
    prepare.add_argument("--shard-tokens", type=POSITIVE, default=None, metavar="N",
                         help="tokens per shard file (default 64 Mi)")
    prepare.add_argument("--overwrite", action="store_true", help="replace a dataset already prepared at --out")
    prepare.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    prepare.set_defaults(handler=run_prepare)

    info = actions.add_parser("info", help="print a prepared dataset's index summary")
    info.add_argument("path", metavar="DIR", help="dataset directory (made by `autopar data prepare`)")
    info.add_argument("--verify", action="store_true", help="also re-hash every shard against the index")
    info.add_argument("--json", action="store_true", help="print the index (without the shard list) as JSON")
    info.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    info.set_defaults(handler=run_info)
    return data


def run_prepare(args: argparse.Namespace) -> int:
    if args.shard_tokens is not None and args.shard_tokens <= 0:
        raise AutoparError(f"--shard-tokens must be a positive number of tokens, got {args.shard_tokens}")
    if not args.text_field.strip():
        raise AutoparError("--text-field is empty: name the JSONL field holding the text (default text)")
    if not args.out.strip():
        raise AutoparError("--out is empty: give the dataset directory to create")
    if args.eos_token is not None and args.tokenizer is None:
        raise AutoparError("--eos-token names a token of a --tokenizer; the byte-level default has its own "
                           "end-of-document id (256): give --tokenizer too, or drop --eos-token")
    from autopar.runtime.data.prepare import DEFAULT_SHARD_TOKENS, prepare_tokens, stderr_progress

    print(f"preparing {', '.join(args.input)} -> {args.out} ...", file=sys.stderr, flush=True)
    summary = prepare_tokens(args.input, args.out, tokenizer=args.tokenizer, progress=stderr_progress(),
                             overwrite=args.overwrite, shard_tokens=DEFAULT_SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens,
                             text_field=args.text_field, eos_token=args.eos_token)
    eos = "none" if summary.eos_id is None else summary.eos_id
    print(f"dataset {summary.path}: {summary.num_documents:,} documents from {summary.num_files:,} files "
          f"({summary.skipped_files} binary skipped), {summary.num_tokens:,} tokens in {summary.num_shards} "
          f"shard(s) of {summary.dtype}, vocab {summary.vocab_size:,}, EOS id {eos}, {summary.seconds:.1f} s")
    return 0


def run_info(args: argparse.Namespace) -> int:
    from autopar.runtime.data.loader import TokenDataset

    dataset = TokenDataset(args.path)
    if args.verify:
        dataset.verify()
    index = dataset.index
    if args.json:
        print(json.dumps({k: v for k, v in index.items() if k != "shards"} | {"num_shards": dataset.num_shards},
                         indent=2))
        return 0
    tokenizer = index.get("tokenizer", {})
    described = tokenizer.get("file") or tokenizer.get("kind", "?")
    print(f"dataset      {dataset.path}")
    print(f"tokens       {dataset.num_tokens:,} in {dataset.num_shards} shard(s) of {dataset.dtype.name}")
    print(f"documents    {index.get('num_documents', '?')} from {index.get('num_files', '?')} file(s)")
    print(f"vocabulary   {dataset.vocab_size:,} (largest id in the data {dataset.max_token_id():,}), "
          f"EOS id {'none' if dataset.eos_id is None else dataset.eos_id}")
    print(f"tokenizer    {described}")
    print(f"fingerprint  {dataset.fingerprint}")
    if args.verify:
        print("verified     every shard matches its sha256")
    return 0
