"""`gptj tokenize` and `gptj detokenize`: text to GPT-J token ids and back."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gptj.cli.common import token_ids
from gptj.errors import GptjError


def _tokenizer(path: str | None):  # noqa: ANN202 - an explicit --tokenizer must exist
    from gptj.tokenizer import load_tokenizer

    return load_tokenizer(path)


def cmd_tokenize(args: argparse.Namespace) -> int:
    """Text to GPT-J token ids."""
    tok = _tokenizer(args.tokenizer)
    texts = args.text if args.text else [sys.stdin.read()]
    for text in texts:
        ids = tok.encode(text)
        print(json.dumps(ids) if args.json else ",".join(map(str, ids)))
    return 0


def cmd_detokenize(args: argparse.Namespace) -> int:
    """Token ids to text; ids as arguments, or one comma-separated row per stdin line."""
    tok = _tokenizer(args.tokenizer)
    if args.ids:
        rows = args.ids
    else:  # one sequence per line on stdin, as FasterTransformer's token converter reads a CSV
        rows = []
        for n, line in enumerate(sys.stdin, 1):
            if line.strip():
                try:
                    rows.append(token_ids(line.strip().strip("[]")))
                except argparse.ArgumentTypeError as e:
                    raise GptjError(f"stdin line {n}: {e}") from None
    for ids in rows:
        text = tok.decode(ids)
        print(json.dumps(text, ensure_ascii=False) if args.json else text)
    return 0


def register(sub: Any) -> None:  # argparse's _SubParsersAction (a private type)
    """Add `tokenize` and `detokenize` to `sub`."""
    p = sub.add_parser("tokenize", help="text to token ids", description=cmd_tokenize.__doc__)
    p.add_argument("text", nargs="*", help="texts (default: all of stdin as one text)")
    p.add_argument("--tokenizer", help="a directory with tokenizer.json (default: GPT-J's)")
    p.add_argument("--json", action="store_true", help="print JSON lists")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("detokenize", help="token ids to text", description=cmd_detokenize.__doc__)
    p.add_argument("ids", nargs="*", type=token_ids, help="comma-separated ids, one sequence per argument")
    p.add_argument("--tokenizer", help="a directory with tokenizer.json (default: GPT-J's)")
    p.add_argument("--json", action="store_true", help="print each text as a JSON string")
    p.set_defaults(func=cmd_detokenize)
