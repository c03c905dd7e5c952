"""`gptj quant-report` and `gptj compare`: how far a model's logits are from a reference's
(float32, a second checkpoint, or HF transformers)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from gptj.cli.common import add_prompt_flags, progress_line, tokenizer_for
from gptj.errors import GptjError
from gptj.runtime import flags

EXIT_DIFFER = 3  # gptj compare: it ran; the two models differ beyond the tolerance


def _modes(text: str) -> list[str]:
    from gptj.quant import QUANT_MODES

    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in QUANT_MODES for m in modes):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(QUANT_MODES)}, got {text!r}")
    return modes


def cmd_quant_report(args: argparse.Namespace) -> int:
    """Teacher-forced next-token top-1 agreement and logit error of each quantization mode against the float32
    model, on the first prompts of the bundled MLPerf sample set (and the unquantized model in --dtype as a
    yardstick). w8a8 needs a calibrated folder (gptj calibrate); calibrated on the same bundled prompts, its
    figures are in-sample. Each mode is also timed here with the serving kernels (one token; one prompt), and
    the CPU's kind and the W8A8 form it gets are named. fp8 runs on GPUs with FP8 units; elsewhere its math is
    emulated for the accuracy figures, untimed."""
    from gptj.bench.quant_report import format_report, quantization_report
    from gptj.device import resolve_device
    from gptj.runtime.spec import ModelSpec

    dtype = ModelSpec(path=args.model, dtype=args.dtype, device=args.device).torch_dtype  # auto / fast as everywhere
    report = quantization_report(args.model, modes=args.modes, n_prompts=args.prompts, max_tokens=args.max_tokens,
                                 group_size=args.group_size, dtype=dtype,
                                 device=resolve_device(args.device), speed=args.speed)
    print(json.dumps(report, indent=2) if args.json else format_report(report).rstrip())
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Teacher-forced logits of model A and model B (any checkpoint gptj loads: HF, gptj's own, quantized, a
    mesh-transformer-jax slim checkpoint; B may be A quantized on load), or of A in HF transformers against gptj
    (--hf), on the bundled MLPerf prompts or your own, each continued greedily by A: max and mean |dlogit|,
    top-1 agreement and the first diverging greedy token, per prompt and overall, then a verdict against a
    tolerance set by the two sides' number formats (docs/COMPARE.md). Exits 0 when they agree, 3 when they
    differ."""
    from gptj.bench.compare import compare, format_compare, gptj_side, hf_side
    from gptj.device import resolve_device

    if args.b is None and not args.hf and not args.quantize:
        raise GptjError("give a second model B, --hf (HF transformers on A) or --quantize MODE (A quantized on load)")
    if args.b is not None and args.hf:
        raise GptjError("give either a second model B or --hf, not both")
    if args.hf and args.quantize:
        raise GptjError("--quantize applies to B; with --hf, B is gptj's load of A: compare A A --quantize MODE "
                        "instead")
    from gptj.runtime.spec import ModelSpec

    # --dtype auto / fast resolve as every command's do (auto: A's checkpoint dtype)
    dtype = ModelSpec(path=args.a, dtype=args.dtype, device=args.device).torch_dtype
    device = resolve_device(args.device)
    tok = tokenizer_for(args.a)
    prompts = [tok.encode(p) for p in args.prompt] + [list(ids) for ids in args.prompt_ids]
    if args.dataset or not prompts:
        from gptj.mlperf.dataset import Dataset

        prompts += Dataset.load(args.dataset, tokenizer=tok, max_examples=args.prompts).input_ids
    prompts = [p[:args.max_tokens] for p in prompts]
    for i, p in enumerate(prompts):
        if not p:
            raise GptjError(f"prompt {i + 1} is empty")
    if args.hf:
        a, b = hf_side(args.a, dtype, device), gptj_side(args.a, dtype, device, name=f"gptj on {args.a}")
    else:
        a = gptj_side(args.a, dtype, device, config=args.config)
        b = gptj_side(args.b or args.a, dtype, device, quantize=args.quantize, group_size=args.group_size,
                      config=args.config)
    report = compare(a, b, prompts, args.new_tokens, progress=progress_line("compare"))
    print(json.dumps(report, indent=2) if args.json else format_compare(report).rstrip())
    return 0 if report["verdict"] == "agree" else EXIT_DIFFER


def register(sub: Any) -> None:  # argparse's _SubParsersAction (a private type)
    """Add `quant-report` and `compare` to `sub`."""
    p = sub.add_parser("quant-report", help="accuracy of int8/int4/w8a8/fp8 quantization vs float32",
                       description=cmd_quant_report.__doc__)
    p.add_argument("--model", required=True, help="a float model directory (HF / gptj format)")
    p.add_argument("--modes", "--quantize", type=_modes, default=["int8", "int4"],
                   help="comma-separated (default: int8,int4)")
    p.add_argument("--no-speed", dest="speed", action="store_false",
                   help="skip timing each mode with the serving kernels on this machine")
    p.add_argument("--group-size", type=flags.positive, help=flags.GROUP_SIZE_HELP)
    p.add_argument("--prompts", type=flags.positive, default=8, help="how many prompts of the sample set (default 8)")
    p.add_argument("--max-prompt-tokens", dest="max_tokens", type=flags.positive, default=128, metavar="N",
                   help="prompt tokens kept per prompt, its first (default 128)")
    flags.add_deprecated_alias(p, "--max-tokens", "--max-prompt-tokens")
    flags.add_dtype_flag(p, "auto", auto=True, help="activations and float weights of the quantized models: "
                                                    f"%(choices)s (default auto; {flags.DTYPE_RULES_HELP})")
    flags.add_device_flag(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    flags.add_threads_flag(p)
    p.set_defaults(func=cmd_quant_report)

    p = sub.add_parser("compare", help="how close two checkpoints' logits are (or one against HF transformers)",
                       description=cmd_compare.__doc__)
    p.add_argument("a", metavar="A", help="the reference model folder")
    p.add_argument("b", metavar="B", nargs="?", help="the model to check (default with --quantize: A)")
    p.add_argument("--hf", action="store_true", help="compare HF transformers' GPTJForCausalLM on A (the reference) "
                                                     "with gptj's load of A")
    p.add_argument("--config", help="for a slim checkpoint: a preset name or config.json (default gptj-6b)")
    add_prompt_flags(p)
    p.add_argument("--dataset", help="prompts in cnn_eval.json's format (the default when no --prompt is given: "
                                     "the bundled MLPerf sample set)")
    p.add_argument("--prompts", type=flags.positive, default=8, help="how many of the data set's prompts (default 8)")
    p.add_argument("--max-prompt-tokens", dest="max_tokens", type=flags.positive, default=128, metavar="N",
                   help="prompt tokens kept per prompt, its first (default 128)")
    flags.add_deprecated_alias(p, "--max-tokens", "--max-prompt-tokens")
    p.add_argument("--max-new-tokens", dest="new_tokens", type=flags.nonnegative, default=16, metavar="N",
                   help="greedy tokens A adds to each prompt, compared too (default 16)")
    flags.add_deprecated_alias(p, "--new-tokens", "--max-new-tokens")
    flags.add_dtype_flag(p, "auto", auto=True,
                         help="both sides' float dtype: %(choices)s (default auto: A's checkpoint's, as its "
                              "config.json records it, float32 when it records none; fast: bfloat16 where it runs "
                              "fast, else float32)")
    flags.add_device_flag(p)
    flags.add_quantize_flags(p, "quantize B's linears on load")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    flags.add_threads_flag(p)
    p.set_defaults(func=cmd_compare)
