"""`gptj init`, `gptj convert` and `gptj calibrate`: the commands that write a model folder."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gptj.cli.common import progress_line, tokenizer_for
from gptj.errors import GptjError
from gptj.runtime import flags


def cmd_init(args: argparse.Namespace) -> int:
    """Write a model with deterministic random weights in the canonical format."""
    from gptj.config import GPTJConfig
    from gptj.device import parse_dtype
    from gptj.models.registry import get_preset
    from gptj.weights.io import auto_progress, random_state_dict, save_checkpoint

    _check_out(args)
    config = get_preset(args.preset)
    if not isinstance(config, GPTJConfig):  # a Llama preset: written shard by shard (llama3.1-8b is 16 GB in bf16)
        from gptj.weights.hf_model import random_folder

        extra, said = None, " (no tokenizer: copy the real model's tokenizer files into it)"
        if config.vocab_size <= STANDIN_MAX_VOCAB:  # a stand-in trained on the bundled articles (none downloads)
            from gptj.mlperf.dataset import DEFAULT_DATASET, load_examples
            from gptj.tokenizer import write_standin_tokenizer

            texts = [t for e in load_examples(DEFAULT_DATASET) for t in (e.input, e.output)]
            extra, said = (lambda folder: write_standin_tokenizer(folder, texts, config.vocab_size),
                           " with a stand-in tokenizer trained on the bundled articles")
        out = random_folder(config, args.out, seed=args.seed, dtype=parse_dtype(args.dtype), overwrite=args.force,
                            extra=extra)
        print(f"wrote {args.preset} with random weights (seed {args.seed}, {args.dtype}) to {out}{said}")
        return 0
    progress = auto_progress(config)  # gptj-6b takes minutes: bars on stderr when it is a terminal
    sd = random_state_dict(config, seed=args.seed, dtype=parse_dtype(args.dtype), progress=progress)
    out = save_checkpoint(sd, config, args.out, overwrite=args.force, progress=progress)
    print(f"wrote {args.preset} with random weights (seed {args.seed}, {args.dtype}) to {out}")
    return 0


STANDIN_MAX_VOCAB = 4096  # presets up to this vocabulary get a stand-in tokenizer (llama-tiny: 512)


def _check_out(args: argparse.Namespace) -> None:
    """An --out in the way is refused before any weight is read or made (the writer checks it again)."""
    out = Path(args.out)
    if not args.force and out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise GptjError(f"{out}: already exists (choose a new --out, or pass --force to replace it)")


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert an HF GPT-J directory or a mesh-transformer-jax slim checkpoint (step_383500/) to the canonical
    HF-compatible directory."""
    from gptj.device import parse_dtype
    from gptj.weights.io import convert

    _check_out(args)
    dtype = parse_dtype(args.dtype) if args.dtype else None
    shards = None
    if args.tp is not None and args.tp > 1:  # each rank's shard beside the checkpoint (gptj.parallel.shards)
        from gptj.parallel.shards import write_shards

        if args.quantize:
            raise GptjError("--tp with --quantize is not supported: tensor-parallel shards are float")

        say = progress_line("convert")

        def shards(folder, sd, cfg):  # noqa: ANN001, ANN202 - convert's `also` (the plan checked as it cuts)
            if not args.quiet:  # (no bar of its own: a 6B model's shards take a while)
                say(f"writing the tensor-parallel shards of {args.tp} ranks")
            write_shards(sd, cfg, folder, args.tp)
    out = convert(args.src, args.out, fmt=args.fmt, dtype=dtype, config=args.config,
                  overwrite=args.force, progress=not args.quiet, quantize=args.quantize, group_size=args.group_size,
                  also=shards)
    print(f"wrote {out}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Run calibration prompts through the float model, record each linear's input |max| per channel, and store
    SmoothQuant's smoothing factors in the model folder (calibration.safetensors, recorded in config.json), so
    that --quantize w8a8 can load it. MLPerf's closed division allows calibrating on its calibration list
    (cnn_dailymail_calibration.json)."""
    from gptj.mlperf.dataset import Dataset
    from gptj.device import resolve_device
    from gptj.runtime.spec import ModelSpec
    from gptj.weights.io import calibrate

    dataset = Dataset.load(args.dataset, tokenizer=tokenizer_for(args.model), max_examples=args.samples)
    prompts = dataset.input_ids
    name = Path(dataset.path).name
    dtype = ModelSpec(path=args.model, dtype=args.dtype, device=args.device).torch_dtype  # auto / fast as everywhere
    record = calibrate(args.model, prompts, name, alpha=args.alpha, dtype=dtype, device=resolve_device(args.device))
    print(f"calibrated {args.model} for w8a8 on {record['samples']} prompts ({record['tokens']:,} tokens) of {name}, "
          f"alpha {record['alpha']:g}: wrote calibration.safetensors and config.json's 'calibration' "
          f"(use --quantize w8a8)")
    return 0


def register(sub: Any) -> None:  # argparse's _SubParsersAction (a private type)
    """Add `init`, `convert` and `calibrate` to `sub`."""
    from gptj.models.registry import PRESETS

    p = sub.add_parser("init", help="write a model with deterministic random weights", description=cmd_init.__doc__)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=flags.nonnegative, default=0)
    flags.add_dtype_flag(p)
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("convert", help="convert a checkpoint to gptj's canonical (HF-compatible) format",
                       description=cmd_convert.__doc__)
    p.add_argument("src", help="source checkpoint directory")
    p.add_argument("--from", dest="fmt", choices=("auto", "hf", "mtj"), default="auto", help="source format")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    flags.add_dtype_flag(p, None, help="convert weights to this dtype (default: as stored)")
    p.add_argument("--config", help="for slim checkpoints: a preset name or config.json (default gptj-6b)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    flags.add_quantize_flags(p, "write quantized linears: int8 / int4 weight-only, w8a8, fp8 (a gptj-only format: "
                                "HF transformers refuses it)")
    p.add_argument("--tp", type=flags.positive,
                   help="also write per-rank tensor-parallel shards (tp{N}/rank{r}.safetensors)")
    flags.add_threads_flag(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("calibrate", help="calibrate a float model for w8a8 (SmoothQuant factors)",
                       description=cmd_calibrate.__doc__)
    p.add_argument("--model", required=True, help="a float model directory (HF / gptj format); written to")
    p.add_argument("--dataset", help="prompts in cnn_eval.json's format (default: the bundled MLPerf sample set)")
    p.add_argument("--samples", type=flags.positive, help="use the first N (default: all)")
    p.add_argument("--alpha", type=flags.unit_interval, default=None,
                   help="migration strength: s = max|X|^alpha / max|W|^(1 - alpha) (default 0.5)")
    flags.add_dtype_flag(p, "auto", auto=True, help="the float model's dtype while calibrating: %(choices)s (default "
                                                    f"auto; {flags.DTYPE_RULES_HELP})")
    flags.add_device_flag(p)
    flags.add_threads_flag(p)
    p.set_defaults(func=cmd_calibrate)
