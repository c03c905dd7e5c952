"""What several command families share: prompts as token ids, a model's tokenizer, a long
command's progress line, and the checks made before any rank or adapter loads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path



def token_ids(text: str) -> list[int]:
    """'1,2, 3' or '1 2 3' -> [1, 2, 3]."""
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def add_prompt_flags(p: argparse.ArgumentParser) -> None:
    """--prompt TEXT and --prompt-ids 1,2,3, each repeatable (gptj generate, gptj compare)."""
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], type=token_ids, metavar="1,2,3",
                   help="a prompt as token ids (repeatable)")


def tokenizer_for(model_dir: str | None):  # noqa: ANN201 - the one a model folder carries, else GPT-J's
    from gptj.tokenizer import tokenizer_for_model

    return tokenizer_for_model(model_dir)


def progress_line(command: str):  # noqa: ANN201 - (str) -> None
    """A step of a long command, said as it starts, on stderr (stdout keeps the result): `gptj
    compare: loading ... (12 s)`, with the seconds since the command began."""
    import time

    start = time.monotonic()

    def say(what: str) -> None:
        print(f"gptj {command}: {what} ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)

    return say


def check_parallel(tp: int, pp: int, model: str | Path) -> None:
    """Refuse a plan the model cannot take before any rank starts (the ranks check it again)."""
    if tp * pp == 1 or not (Path(model) / "config.json").is_file():
        return  # one process; or the loader says what is wrong with the folder
    from gptj.parallel.pp import check_split
    from gptj.parallel.tp import check_plan
    from gptj.parallel.tp_llama import check_llama_plan
    from gptj.weights.checkpoint import GPTJ, Checkpoint

    checkpoint = Checkpoint.read(model, 0, tp)  # rank 0's shard of `gptj convert --tp`, when there is one
    config = checkpoint.config
    if tp > 1:
        (check_plan if checkpoint.arch is GPTJ else check_llama_plan)(config, tp)
    if pp > 1:
        check_split(config.n_layer, pp)


def warn_lora_base(command: str, adapter: str, base: str) -> None:
    """One line on stderr when an adapter names another base model than the one it is applied to."""
    from gptj.lora import base_mismatch

    why = base_mismatch(adapter, base)
    if why:
        print(f"gptj {command}: warning: {why}", file=sys.stderr)
