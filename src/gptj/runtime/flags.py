"""The CLI flags of running a model, each declared once, and how parsed flags become a `ModelSpec`
and an `EngineConfig`. generate, serve (and publish), mlperf and bench all add theirs from here:

    add_model_flags(p)    --dtype --device --quantize --group-size --kernels --compile
    add_parallel_flags(p) --tp --pp
    add_engine_flags(p)   --max-seqs --max-model-len --kv-blocks --block-size --no-prefix-caching
                          --prefill-chunk --kv-memory-fraction
    add_threads_flag(p)   --threads

    model_spec(args, path)           -> ModelSpec
    engine_config(args, **workload)  -> EngineConfig (the flags given, over the command's workload)

An engine flag not given leaves the setting to the command's workload (generate: all its prompts
at once; mlperf: its batch of samples x beams; bench: its batch) and then to EngineConfig's own
default, so the same flags give the same engine through every command (tests/test_front_door.py).

No torch here (nor anything that imports it at module level): `gptj --help` builds every parser.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gptj.engine.config import EngineConfig
    from gptj.runtime.spec import ModelSpec


# --- argparse value types -------------------------------------------------------------------


def number(kind: type, positive: bool):  # noqa: ANN201 - an argparse type function
    """argparse type: a finite int/float that is > 0 (positive) or >= 0."""
    what = f"{'a positive' if positive else 'a non-negative'} {'integer' if kind is int else 'number'}"

    def parse(text: str):  # noqa: ANN202
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value > 0 if positive else value >= 0) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


positive, nonnegative = number(int, True), number(int, False)
positive_float, nonnegative_float = number(float, True), number(float, False)


def unit_interval(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def probability(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


class _Lazy:
    """argparse choices read from a module only when a value is checked or the help is shown (the
    modules that own them import torch; `gptj --help` must not). A flag with these choices needs a
    metavar: argparse lists the choices as the metavar otherwise, when the flag is added."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def _values(self) -> tuple:
        import importlib

        return tuple(getattr(importlib.import_module(self.module), self.name))

    def __contains__(self, value: object) -> bool:
        return value in self._values()

    def __iter__(self):  # noqa: ANN204
        return iter(self._values())


def _dtype_names() -> tuple[str, ...]:
    from gptj.device import DTYPE_NAMES

    return DTYPE_NAMES


QUANT_MODES = _Lazy("gptj.quant", "QUANT_MODES")
COMPILE_MODES = _Lazy("gptj.engine.config", "COMPILE_MODES")
KERNEL_MODES = _Lazy("gptj.policy", "PACK_MODES")
BLOCK_SIZES = _Lazy("gptj.engine.config", "BLOCK_SIZES")
KV_DTYPES = _Lazy("gptj.engine.config", "KV_DTYPES")
GRAPH_MODES = _Lazy("gptj.engine.config", "GRAPH_MODES")


# --- declaring the flags ----------------------------------------------------------------------

# gptj serve's --prefill-chunk: long prompts prefilled this many tokens per engine step, so that they
# do not stall the running requests (docs/PERFORMANCE.md, "Chunked prefill"); elsewhere whole prompts.
SERVE_PREFILL_CHUNK = 2048

GROUP_SIZE_HELP = ("int4 / w4a8 group size: 32, 64, 128 or 256 (default: 128, or the largest that divides every "
                   "quantized layer's inputs)")


DTYPE_RULES_HELP = ("auto: the checkpoint's own, as its config.json records it (torch_dtype; float32 when it "
                    "records none), so a run matches HF transformers on the same checkpoint; fast: bfloat16 where "
                    "it runs fast (a GPU; a CPU with AVX512-BF16 or AMX, or where gptj.native runs: AVX2), float32 "
                    "elsewhere")


def add_dtype_flag(p: Any, default: str | None = "float32", help: str | None = None,  # noqa: A002
                   auto: bool = False) -> None:
    """--dtype; `auto` offers the rules "auto" (the checkpoint's dtype: gptj.weights.hf.checkpoint_dtype) and
    "fast" (gptj.policy.fast_dtype) too, resolved in ModelSpec."""
    choices = (*_dtype_names(), "auto", "fast") if auto else _dtype_names()
    if help is None and auto:
        help = f"the model's float dtype: %(choices)s (default {default}; {DTYPE_RULES_HELP})"
    p.add_argument("--dtype", choices=choices, default=default, help=help)


def add_device_flag(p: Any, help: str = "cpu, cuda, cuda:N or auto") -> None:  # noqa: A002
    p.add_argument("--device", default="cpu", help=help)


def add_quantize_flags(p: Any, help: str = "quantize the model's linears on load (int8 / int4: weight-only; w4a8: "  # noqa: A002
                                           "int4 weights, inputs rounded to int8 per 32; w8a8: int8 activations "
                                           "too, after `gptj calibrate`; fp8: e4m3, GPUs with FP8 units)") -> None:
    p.add_argument("--quantize", choices=QUANT_MODES, metavar="MODE", help=f"{help}: %(choices)s")
    p.add_argument("--group-size", type=positive, help=GROUP_SIZE_HELP)


def add_kernel_flags(p: Any) -> None:
    p.add_argument("--compile", choices=COMPILE_MODES, default="auto", metavar="MODE",
                   help="torch.compile the decode attention on CUDA: auto = below float32 (default), on, off")
    p.add_argument("--kernels", choices=KERNEL_MODES, default="auto", metavar="MODE",
                   help="auto: fused blocks and oneDNN-packed bfloat16 weights below float32 (default); "
                        "off: the plain model")


def add_model_flags(p: Any, dtype: str = "auto", quantize_help: str | None = None) -> None:
    """How the model runs: --dtype (default `dtype`), --device, --quantize, --group-size, --compile, --kernels."""
    add_dtype_flag(p, dtype, auto=True)
    add_device_flag(p)
    add_quantize_flags(p, *(quantize_help,) if quantize_help else ())
    add_kernel_flags(p)


def add_lora_flag(p: Any, served: bool = False) -> None:
    """--lora: one adapter merged into the weights (generate), or (served) adapters served by name over
    the one base model, each request choosing one by its model name."""
    if served:
        p.add_argument("--lora", dest="lora_adapters", action="append", default=[], metavar="NAME=DIR",
                       help="serve a LoRA adapter (HF PEFT format) over the model as model NAME, unmerged: requests "
                            "for the base and for each adapter run together in one engine (repeatable; one --model)")
    else:
        p.add_argument("--lora", metavar="DIR", help="a LoRA adapter (HF PEFT format: adapter_config.json + "
                                                      "adapter_model.safetensors), merged into the weights on load")


def add_parallel_flags(p: Any) -> None:
    p.add_argument("--tp", type=positive, default=1,
                   help="tensor parallel over N processes (gloo on CPU, NCCL on CUDA); spawned by gptj, or "
                        "run under torchrun --nproc-per-node N")
    p.add_argument("--pp", type=positive, default=1,
                   help="pipeline parallel over N processes: the layers split, micro-batches in flight; with "
                        "--tp T, T x N processes (N stages of T tensor ranks)")


def add_engine_flags(p: Any, batch_alias: bool = False, prefill_chunk: int | None = None,
                     max_seqs_help: str | None = None) -> None:
    """How big the engine is. batch_alias: gptj serve's names, --max-num-seqs (vLLM's) besides --max-seqs,
    and --max-batch-size a deprecated alias (elsewhere, as in gptj mlperf, it counts samples per batch).
    prefill_chunk: the command's default (serve: SERVE_PREFILL_CHUNK, so long prompts do not stall the
    running ones for long; elsewhere whole prompts)."""
    names = ("--max-seqs", "--max-num-seqs") if batch_alias else ("--max-seqs",)
    p.add_argument(*names, dest="max_seqs", type=positive, metavar="N",
                   help=max_seqs_help or "sequences running at once, beams counted each (default: the command's "
                                         "batch, else as many as the KV memory holds, at most 256)")
    if batch_alias:
        add_deprecated_alias(p, "--max-batch-size", "--max-num-seqs")
    p.add_argument("--max-model-len", type=positive, metavar="N",
                   help="prompt + new tokens per sequence (default: the command's longest, else the model's)")
    p.add_argument("--kv-blocks", type=positive, metavar="N",
                   help="KV memory in blocks of --block-size tokens (default: max-seqs sequences of "
                        "max-model-len tokens, within --kv-memory-fraction of the free memory)")
    p.add_argument("--block-size", type=int, choices=BLOCK_SIZES, metavar="N",
                   help="tokens per KV block: %(choices)s (default 16)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, metavar="DTYPE",
                   help="KV memory's storage: auto (the model's dtype, default), int8 or fp8 (e4m3) (a scale per "
                        "token and head: about twice the sequences in the same memory)")
    p.add_argument("--kv-memory-fraction", type=probability, metavar="F",
                   help="of the free memory after loading, at most, for KV blocks (default 0.5)")
    p.add_argument("--cuda-graphs", choices=GRAPH_MODES, metavar="MODE",
                   help="decode-only steps replayed from CUDA graphs captured per batch size: auto (on CUDA, "
                        "default) or off")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="turn prefix caching off (it is on by default: the KV blocks of a prompt prefix computed "
                        "before are reused)")
    p.add_argument("--prefill-chunk", type=nonnegative, default=prefill_chunk,
                   help="prompt tokens prefilled per engine step, so long prompts do not stall running requests "
                        "(0: whole prompts)" + ("" if prefill_chunk else " (default: whole prompts)"))


SPECULATE_METHODS = ("ngram",)


def add_speculate_flags(p: Any) -> None:
    """--speculate ngram and its two settings (gptj.engine.draft; GenerationConfig's prompt lookup)."""
    from gptj.generation_config import SPECULATE_NGRAM, SPECULATE_TOKENS

    p.add_argument("--speculate", choices=SPECULATE_METHODS, metavar="METHOD",
                   help="draft tokens and verify them in the step (ngram: from the prompt and the output so far; "
                        "greedy and sampled requests; the tokens are those without it in float32, a seed's too)")
    p.add_argument("--speculate-tokens", type=positive, default=SPECULATE_TOKENS, metavar="K",
                   help=f"tokens drafted per step at most (default {SPECULATE_TOKENS})")
    p.add_argument("--speculate-ngram", type=positive, default=SPECULATE_NGRAM, metavar="N",
                   help=f"the longest suffix matched, in tokens (default {SPECULATE_NGRAM})")


def speculation(args: argparse.Namespace) -> dict[str, Any]:
    """GenerationConfig's prompt-lookup fields as --speculate and its settings ask (none: off)."""
    if getattr(args, "speculate", None) is None:
        return {}
    return {"prompt_lookup_num_tokens": args.speculate_tokens, "max_matching_ngram_size": args.speculate_ngram}


def add_threads_flag(p: Any, help: str = "torch compute threads (default: the usable cores)") -> None:  # noqa: A002
    p.add_argument("--threads", type=positive, default=None, help=help)


class _DeprecatedAlias(argparse.Action):
    """An old flag name: stores into the new flag's dest, saying once on stderr which name to use."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        import sys

        print(f"{parser.prog}: warning: {option_string} is deprecated, use {self.new} (the old name goes in a "
              f"later release)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_deprecated_alias(p: Any, old: str, new: str) -> None:
    """`old` as a deprecated name of the flag `new` (added to `p`, a parser or group, before): the same
    dest, type and choices, hidden from --help; using it prints one warning line on stderr."""
    target = p._option_string_actions[new]  # (argparse has no public lookup by flag)
    p.add_argument(old, dest=target.dest, type=target.type, choices=target.choices, metavar=target.metavar,
                   action=_DeprecatedAlias, new=new, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


# --- parsed flags -> spec and engine config ---------------------------------------------------


def model_spec(args: argparse.Namespace, path: object = None) -> ModelSpec:
    """The ModelSpec the flags describe (path: the model folder; default args.model when it names
    one folder, else None: a template for each model, as gptj serve's)."""
    from pathlib import PurePath

    from gptj.runtime.spec import ModelSpec

    if path is None and isinstance(getattr(args, "model", None), (str, PurePath)):
        path = args.model
    return ModelSpec(path=None if path is None else str(path), dtype=args.dtype, device=args.device,
                     quantize=getattr(args, "quantize", None), group_size=getattr(args, "group_size", None),
                     tp=getattr(args, "tp", 1), pp=getattr(args, "pp", 1), lora=getattr(args, "lora", None))


# flag (dest) -> EngineConfig field
_ENGINE_FLAGS = {"max_seqs": "max_seqs", "max_model_len": "max_len", "kv_blocks": "kv_blocks",
                 "block_size": "block_size", "kv_memory_fraction": "memory_fraction", "kv_dtype": "kv_dtype",
                 "cuda_graphs": "cuda_graphs"}


def engine_config(args: argparse.Namespace, **workload: Any) -> EngineConfig:
    """The EngineConfig the flags ask for: each engine flag given wins; a setting no flag gives
    comes from `workload` (the command's own defaults: max_seqs, max_len, max_prefill_tokens),
    else EngineConfig's default. --kernels and --compile are the engine's (their one home)."""
    from gptj.engine.config import EngineConfig

    settings = dict(workload)
    for dest, name in _ENGINE_FLAGS.items():
        if getattr(args, dest, None) is not None:
            settings[name] = getattr(args, dest)
    if not getattr(args, "prefix_caching", True):
        settings["prefix_caching"] = False
    if hasattr(args, "prefill_chunk"):
        settings["prefill_chunk"] = args.prefill_chunk or None
    settings.update(kernels=args.kernels, compile=args.compile)
    # without --threads the engine chooses its compute threads from its steps' times (up to the cores)
    settings.setdefault("adapt_threads", getattr(args, "threads", None) is None)
    return EngineConfig(**settings)


def flags_given(spec: ModelSpec, engine: EngineConfig) -> list[str]:
    """The flags behind the settings of `spec` and `engine` that differ from the defaults, e.g. to
    say which did not apply (gptj mlperf --server: the server runs the model its own way)."""
    import dataclasses

    from gptj.engine.config import EngineConfig
    from gptj.runtime.spec import ModelSpec

    flag_of = {name: dest for dest, name in _ENGINE_FLAGS.items()} | {"prefix_caching": "no_prefix_caching"}
    default = ModelSpec(path=spec.path)  # (--dtype auto: the checkpoint's, once a folder is named)
    given = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(ModelSpec)
             if f.name != "path" and getattr(spec, f.name) != getattr(default, f.name)]
    given += [f"--{flag_of.get(f.name, f.name).replace('_', '-')}" for f in dataclasses.fields(EngineConfig)
              if getattr(engine, f.name) != getattr(EngineConfig(), f.name)
              and f"--{f.name}" not in given  # (--kernels, --compile: named once)
              and f.name != "adapt_threads"]  # (no flag of its own: it follows --threads)
    return given
