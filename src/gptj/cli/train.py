"""`gptj prepare-data` (gptj.train.data_cli's) and `gptj train`: training data, then pre-training,
fine-tuning or evaluating a checkpoint."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from gptj.errors import GptjError
from gptj.runtime import flags


def cmd_train(args: argparse.Namespace) -> int:
    """Pre-train or fine-tune a GPT-J from a YAML config (see examples/train/). Under torchrun --nproc-per-node
    N: data-parallel (distributed: ddp) or sharded (distributed: fsdp)."""
    from gptj.train.config import load_config
    from gptj.train.trainer import train

    overrides = list(args.set or [])
    if args.out:
        overrides.append(f"out={args.out}")
    cfg = load_config(args.config, overrides)
    if args.eval_only or args.checkpoint:
        return _eval_only(args, cfg)
    record = train(cfg, stop_after=args.max_steps, resume=args.resume, progress=not args.quiet, device=args.device)
    from gptj.parallel.launch import under_torchrun

    if not under_torchrun() or int(os.environ.get("RANK", "0")) == 0:
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items())
        early = (f" (stopped at step {args.max_steps} of {cfg.max_steps}: --resume continues)"
                 if args.max_steps is not None and args.max_steps < cfg.max_steps else "")
        what = "adapter" if cfg.lora is not None else "model"
        print(f"trained to {shown or 'the last step'}{early}; {what}, checkpoints and metrics.jsonl in {cfg.out}")
    return 0


def _eval_only(args: argparse.Namespace, cfg) -> int:  # noqa: ANN001 - gptj.train.config.TrainConfig
    from gptj.parallel.launch import under_torchrun
    from gptj.train.trainer import evaluate_only

    if not args.eval_only:
        raise GptjError("--checkpoint goes with --eval-only (training starts from the config's model.checkpoint)")
    if args.resume or args.max_steps is not None:
        raise GptjError("--eval-only trains nothing: drop --resume / --max-steps")
    record = evaluate_only(cfg, args.checkpoint, progress=not args.quiet, device=args.device)
    if under_torchrun() and int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.json:
        print(json.dumps(record))
    else:
        at = f" (step {record['step']})" if "step" in record else ""
        print(f"{record['checkpoint']}{at}: eval loss {record['eval_loss']:.4f}, perplexity {record['eval_ppl']:.4g}, "
              f"next-token accuracy {record['eval_accuracy']:.4f} over {record['eval_tokens']:,} target tokens")
    return 0


def register(sub: Any) -> None:  # argparse's _SubParsersAction (a private type)
    """Add `prepare-data` and `train` to `sub`."""
    from gptj.train.data_cli import register as register_prepare_data

    register_prepare_data(sub)

    p = sub.add_parser("train", help="pre-train or fine-tune from a YAML config", description=cmd_train.__doc__)
    p.add_argument("--config", required=True, help="the YAML config")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config value, e.g. --set optimizer.lr=1e-3 (repeatable)")
    p.add_argument("--out", help="output folder (overrides the config's out)")
    p.add_argument("--max-steps", type=flags.positive,
                   help="stop after this step (the schedule still spans the config's max_steps); --resume continues")
    p.add_argument("--resume", action="store_true", help="continue from the output folder's last checkpoint")
    p.add_argument("--eval-only", action="store_true", help="train nothing: eval loss, perplexity and next-token "
                                                            "accuracy of a checkpoint on the config's eval set (the "
                                                            "numbers training's evaluation reports for it)")
    p.add_argument("--checkpoint", metavar="DIR", help="with --eval-only: the model folder to evaluate (default: the "
                                                       "output folder's, the last step trained)")
    p.add_argument("--json", action="store_true", help="with --eval-only: print the result as one JSON object")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (under torchrun: one GPU per rank)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    flags.add_threads_flag(p)
    p.set_defaults(func=cmd_train)
