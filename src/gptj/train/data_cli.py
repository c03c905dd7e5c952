"""`gptj prepare-data`: raw text or summarization pairs to a prepared token folder.

    gptj prepare-data text FILE... --out DIR --seq-len N [--tokenizer DIR] [--jsonl-key KEY]
                                   [--force] [--quiet]
    gptj prepare-data summarization FILE --out DIR --seq-len N [--tokenizer DIR] [--force] [--quiet]

Self-contained: `gptj.cli.train` adds it with `register(sub)`. User errors are raised as
GptjError, which the CLI prints as one line (exit 1). The library is gptj.train.data.
"""

from __future__ import annotations

import argparse
from typing import Any

DEFAULT_SEQ_LEN = 2048


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (written atomically)")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, metavar="N",
                   help=f"tokens per sequence (default {DEFAULT_SEQ_LEN})")
    p.add_argument("--tokenizer", metavar="DIR", help="a directory with tokenizer.json (default: GPT-J's)")
    p.add_argument("--force", action="store_true", help="replace --out if it is an earlier prepared folder")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def register(sub: Any) -> None:  # argparse's _SubParsersAction (a private type)
    """Add the `prepare-data` subcommand (with `text` and `summarization`) to `sub`."""
    p = sub.add_parser(
        "prepare-data", help="tokenize training data into fixed-length sequences",
        description="Tokenize training data into fixed-length sequences of token ids (numpy memmaps: "
                    "input_ids uint16 or uint32, input_mask, loss_mask, meta.json) for training and fine-tuning.")
    kinds = p.add_subparsers(dest="data_kind", metavar="KIND", required=True)

    t = kinds.add_parser(
        "text", help="pack raw text (plain files or JSON lines) into sequences",
        description="Pack raw text into sequences: each document is tokenized and followed by EOS, all "
                    "are concatenated in order and cut into rows of --seq-len tokens (the last one padded). "
                    "A .jsonl file holds one JSON object per line, the document in its --jsonl-key field; "
                    "any other file is plain UTF-8 text and is one document.")
    t.add_argument("files", nargs="+", metavar="FILE", help="text or .jsonl files")
    _add_common(t)
    t.add_argument("--jsonl-key", default="text", metavar="KEY", help="the text field of .jsonl lines (default: text)")

    s = kinds.add_parser(
        "summarization", help="turn a cnn_eval.json-format file into prompt/response pairs",
        description="One sequence per example: the MLPerf prompt, then ' ' + output and EOS, then padding; "
                    "the loss covers only the response and EOS. Too-long articles are cut from their end.")
    s.add_argument("file", metavar="FILE", help="a JSON list of {instruction, input, output} objects")
    _add_common(s)
    s.add_argument("--prompt", choices=("gptj", "llama"), default="gptj",
                   help="the MLPerf prompt around each article: gptj-99's (default) or llama3.1-8b's (with "
                        "the Llama tokenizer's BOS: --tokenizer LLAMA_DIR)")
    p.set_defaults(func=cmd_prepare_data)


def summary(meta: dict, out: str) -> str:
    """The line printed after preparing: sequences, real tokens, padding share, folder."""
    slots = meta["n_sequences"] * meta["seq_len"]
    padding = 100.0 * (slots - meta["n_tokens"]) / slots
    return (f"prepared {meta['n_sequences']} sequences of {meta['seq_len']} tokens "
            f"({meta['n_tokens']} tokens, {padding:.1f}% padding) in {out}")


def cmd_prepare_data(args: argparse.Namespace) -> int:
    """Run `gptj prepare-data text|summarization`; print one summary line."""
    from gptj.train.data import prepare_summarization, prepare_text

    common = {"seq_len": args.seq_len, "tokenizer": args.tokenizer, "force": args.force,
              "progress": not args.quiet}
    if args.data_kind == "text":
        meta = prepare_text(args.files, args.out, jsonl_key=args.jsonl_key, **common)
    else:
        meta = prepare_summarization(args.file, args.out, prompt=args.prompt, **common)
    print(summary(meta, args.out))
    return 0
