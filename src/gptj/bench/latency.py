"""`gptj bench latency`: what gpt-fast's benchmark reports, measured on gptj's engine.

    prefill_ms     wall time of the engine step that admits the batch: every prompt prefilled
                   (the engine runs one forward per prompt) and its first token picked
    decode_tok_s   new tokens per second over all sequences during the decode phase: the
                   engine's following (new_tokens - 1) steps, each one forward for the whole batch
    weights_gb_s   weight bytes read per decode step x decode steps per second (the roofline's
                   memory side; see `weight_bytes_per_step`)
    kv_gb_s        KV-cache bytes read per decode step x steps per second (the other memory traffic)
    gflop_s        2 x matmul weights x tokens/s, plus attention's 4 x n_layer x n_embd x context
    peak_rss_mb    the process's peak resident memory (VmHWM), model loading included

How it is timed: the model is loaded and its engine built as every command does
(gptj.runtime.build), sized to hold the batch and prefill it in one step (`engine_config`). The
prompts are submitted as requests with fixed lengths (eos_token_id=None, min_new_tokens =
max_new_tokens = new_tokens) and the engine is stepped by hand, exactly what `Engine.generate`
does; the first `step()` (admission + prefill of every prompt + first token) is the prefill
time, the remaining steps the decode time. Warm-up runs the whole generation `warmup` times
first; figures are medians over `repeats` runs. Each run has prompts of its own, so that no run
reuses another's KV blocks (prefix caching).

torch is imported inside functions so `gptj --help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptj import cpu
from gptj.errors import GptjError
from gptj.runtime import flags

if TYPE_CHECKING:
    import torch

    from gptj.config import GPTJConfig
    from gptj.engine.config import EngineConfig
    from gptj.models.gptj import GPTJForCausalLM
    from gptj.runtime.spec import ModelSpec

REQUIRED_KEYS = ("prefill_ms", "decode_tok_s", "weights_gb_s", "gflop_s", "peak_rss_mb")


# --- model-side accounting ------------------------------------------------------------------


def matmul_params(config: GPTJConfig) -> int:
    """Weights each token multiplies (q, k, v, out, fc_in, fc_out per layer, and lm_head)."""
    E, inner = config.n_embd, config.inner_dim
    return config.n_layer * (4 * E * E + 2 * E * inner) + E * config.vocab_size


def model_params(config: GPTJConfig) -> int:
    """The model's parameter count from its config's tensor shapes (a quantized config counts its
    logical float weights). Counting the modules would not do: the serving kernels repack the
    weights into fused linears and non-parameter buffers (gptj.kernels)."""
    from gptj.weights.io import expected_shapes

    return sum(math.prod(shape) for shape in expected_shapes(config.replace(quantization=None)).values())


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_bytes_per_step(model: torch.nn.Module, batch_size: int) -> int:
    """Bytes of weights one decode step of `batch_size` rows reads.

    Every parameter and buffer (quantized weights and their scales included) is read once per
    step, except the embedding table (only `batch_size` of its rows are read) and the rotary
    table (a few rows). Tensors shared between modules count once.
    """
    total = 0
    seen: set[tuple[int, int]] = set()
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        if t is None or t.device.type == "meta":
            continue
        key = (id(t), 0) if t.is_mkldnn else (t.data_ptr(), t.numel())  # oneDNN-packed: no data_ptr
        if key in seen:
            continue
        seen.add(key)
        if name == "rope" or name.endswith(".rope"):
            continue
        nbytes = _tensor_bytes(t)
        if name.startswith("transformer.wte.") and vocab:
            nbytes = nbytes * min(batch_size, vocab) // vocab
        total += nbytes
    return total


def kv_bytes_read(config: GPTJConfig, kv_element_size: int, context: int) -> int:
    """Bytes of keys and values one row reads attending over `context` positions (all layers)."""
    return 2 * config.n_layer * config.n_embd * context * kv_element_size


def attention_flops(config: GPTJConfig, context: int) -> int:
    """FLOPs of q k^T and p v for one query token over `context` keys, all layers."""
    return 4 * config.n_layer * config.n_embd * context


def peak_rss_mb() -> float:
    """The process's peak resident set (VmHWM from /proc/self/status; ru_maxrss elsewhere), in MB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return rss / 1e6 if sys.platform == "darwin" else rss * 1024 / 1e6


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`n` distinct prompts of `length` random ordinary token ids (below GPT-J's EOS, 50256)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab_size, 50256), (n, length), generator=g).tolist()


# --- timing -----------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_engine_run(engine: Any, prompts: Sequence[Sequence[int]], new_tokens: int,
                    speculation: dict[str, int] | None = None) -> tuple[float, float]:
    """One fixed-length generation on `engine`: (prefill seconds, decode seconds).

    Prefill is the first step (admits every prompt, prefills each, picks the first tokens);
    decode is the remaining new_tokens - 1 tokens (steps; fewer where drafts are taken:
    `speculation`, GenerationConfig's prompt-lookup fields).
    """
    from gptj.decode import GenerationConfig
    from gptj.engine.request import FAILED

    gen = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                           pad_token_id=0, **(speculation or {}))  # (no EOS: nothing is padded)
    reqs = [engine.add_request(p, gen) for p in prompts]
    _sync(engine.device)
    t0 = time.perf_counter()
    engine.step()
    _sync(engine.device)
    t1 = time.perf_counter()
    if any(r.status == "waiting" for r in reqs):
        raise GptjError("the engine did not admit the whole batch in one step (not enough KV blocks?)")
    while any(not r.done for r in reqs):
        engine.step()
    _sync(engine.device)
    t2 = time.perf_counter()
    failed = [r for r in reqs if r.status == FAILED]
    if failed:
        raise GptjError(f"generation failed: {failed[0].error}")
    if any(len(r.output) != new_tokens for r in reqs):
        raise GptjError("generation stopped early; the timings would not be of fixed-length runs")
    return t1 - t0, t2 - t1


def engine_config(batch_size: int, prompt_len: int, new_tokens: int, num_beams: int = 1,
                  asked: EngineConfig | None = None) -> EngineConfig:
    """The bench's engine: it holds the whole batch (batch_size x num_beams sequences of prompt_len
    + new_tokens) and admits (prefills) it in one step, unless `asked` (the engine flags) says
    otherwise: what it sets wins.

    Its KV blocks, unless asked: the batch's, plus the room the scheduler keeps free while it
    admits beside running requests (a block per new sequence, and gptj.engine.config's admission
    watermark), so that the whole batch is admitted in the first step."""
    from gptj.engine.config import EngineConfig, blocks_to_admit

    asked = asked or EngineConfig()
    seqs = asked.max_seqs or batch_size * num_beams
    max_len = asked.max_len or prompt_len + new_tokens
    blocks = seqs * -(-max_len // asked.block_size) + seqs
    return dataclasses.replace(asked, max_seqs=seqs, max_len=max_len,
                               kv_blocks=asked.kv_blocks or blocks_to_admit(blocks),
                               max_prefill_tokens=max(asked.max_prefill_tokens, batch_size * prompt_len))


def make_engine(model: GPTJForCausalLM, batch_size: int, prompt_len: int, new_tokens: int,
                num_beams: int = 1, asked: EngineConfig | None = None) -> Any:
    """An engine that holds the whole batch and admits (prefills) it in one step (gptj.runtime.build)."""
    from gptj.runtime.build import build_engine

    return build_engine(model, engine_config(batch_size, prompt_len, new_tokens, num_beams, asked))


def _check_settings(batch_size: int, prompt_len: int, new_tokens: int, warmup: int, repeats: int) -> None:
    for name, value, low in (("batch_size", batch_size, 1), ("prompt_len", prompt_len, 1),
                             ("new_tokens", new_tokens, 2), ("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            extra = " (one token comes from prefill; decode needs at least one more)" if name == "new_tokens" else ""
            raise GptjError(f"{name} must be an integer >= {low}, got {value!r}{extra}")


def measure_latency(model: GPTJForCausalLM, batch_size: int = 1, prompt_len: int = 128, new_tokens: int = 64,
                    warmup: int = 1, repeats: int = 3, seed: int = 0,
                    engine: EngineConfig | None = None, speculation: dict[str, int] | None = None) -> dict[str, Any]:
    """`run_latency`'s measurements on a model already loaded (figures only, no settings echo).
    `speculation`: GenerationConfig's prompt-lookup fields (--speculate): then the drafted and accepted
    tokens of the timed runs and their decode tokens per step are reported too."""
    import torch

    _check_settings(batch_size, prompt_len, new_tokens, warmup, repeats)
    config = model.config
    if prompt_len + new_tokens > config.n_positions:
        raise GptjError(f"prompt_len {prompt_len} + new_tokens {new_tokens} exceeds the model's "
                        f"{config.n_positions} positions")
    runner = make_engine(model, batch_size, prompt_len, new_tokens, asked=engine)

    def prompts(run: int) -> list[list[int]]:  # each run its own, so none reuses another's cached prefix
        return random_prompts(batch_size, prompt_len, config.vocab_size, seed + run)

    for i in range(warmup):
        time_engine_run(runner, prompts(i), new_tokens, speculation)
    prefill, decode = [], []
    before, steps_before = runner.stats(), runner.steps
    for i in range(warmup, warmup + repeats):
        p, d = time_engine_run(runner, prompts(i), new_tokens, speculation)
        prefill.append(p)
        decode.append(d)
    after = runner.stats()
    decode_steps = runner.steps - steps_before - repeats  # (each run's first step prefills)
    prefill_s, decode_s = statistics.median(prefill), statistics.median(decode)

    B, P, N = batch_size, prompt_len, new_tokens
    steps = N - 1  # decode steps; the first token comes from prefill
    # Decode step j (1..steps) feeds the token at position P + j - 1: it attends over P + j keys.
    contexts = sum(P + j for j in range(1, steps + 1))
    kv_elem = model.transformer.wte.weight.element_size()  # the engine keeps K/V in the activations' dtype
    w_bytes = weight_bytes_per_step(model, B)
    mm = matmul_params(config)
    decode_flops = B * (steps * 2 * mm + attention_flops(config, 1) * contexts)
    # Prefill: every prompt token through the layers, logits for the last one only, causal attention.
    layer_mm = mm - config.n_embd * config.vocab_size
    prefill_flops = B * (P * 2 * layer_mm + 2 * config.n_embd * config.vocab_size
                         + attention_flops(config, 1) * P * (P + 1) // 2)
    out = {
        "prefill_ms": prefill_s * 1e3,
        "prefill_tok_s": B * P / prefill_s,
        "prefill_gflop_s": prefill_flops / prefill_s / 1e9,
        "decode_tok_s": B * steps / decode_s,
        "decode_step_ms": decode_s / steps * 1e3,
        "weights_gb_s": w_bytes * steps / decode_s / 1e9,
        "kv_gb_s": B * kv_bytes_read(config, kv_elem, 1) * contexts / decode_s / 1e9,
        "gflop_s": decode_flops / decode_s / 1e9,
        "peak_rss_mb": peak_rss_mb(),
        "weight_bytes_per_step": w_bytes,
        "params": model_params(config),
        "threads": torch.get_num_threads(),
    }
    if speculation:
        out |= {"draft_tokens": after.draft_tokens - before.draft_tokens,
                "accepted_tokens": after.accepted_tokens - before.accepted_tokens,
                "tokens_per_step": steps * repeats / max(1, decode_steps)}  # a sequence's, per decode step
    device = model.transformer.wte.weight.device
    if device.type == "cuda":
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 1e6
        graphs = runner.runner.graphs
        graph_ms = graphs.replay_ms(batch_size) if graphs is not None else None
        if graph_ms is not None:  # the step's device time alone: the rest of decode_step_ms is the host's
            out["graph_step_ms"] = graph_ms
    return out


def run_latency(model_dir: str | Path, batch_size: int = 1, prompt_len: int = 128, new_tokens: int = 64,
                dtype: str = "bfloat16", quantize: str | None = None, device: str = "cpu",
                warmup: int = 1, repeats: int = 3, compile: str = "auto", kernels: str = "auto",  # noqa: A002
                spec: ModelSpec | None = None, engine: EngineConfig | None = None,
                speculation: dict[str, int] | None = None) -> dict[str, Any]:
    """Load `model_dir` and measure prefill and decode on the engine (see the module docstring).

    spec: how the model runs (default: from dtype, quantize, device, compile, kernels); engine:
    the engine flags asked (see `engine_config`). Returns a flat dict: the figures (prefill_ms,
    prefill_tok_s, decode_tok_s, decode_step_ms, weights_gb_s, kv_gb_s, gflop_s, prefill_gflop_s,
    peak_rss_mb, ...) and the settings.
    """
    from gptj.runtime.build import load_model
    from gptj.runtime.spec import ModelSpec

    _check_settings(batch_size, prompt_len, new_tokens, warmup, repeats)
    if spec is None:
        spec = ModelSpec(path=str(model_dir), dtype=dtype, device=device, quantize=quantize)
    if engine is None:
        from gptj.engine.config import EngineConfig

        engine = EngineConfig(kernels=kernels, compile=compile)
    t0 = time.perf_counter()
    model = load_model(spec)
    load_s = time.perf_counter() - t0
    figures = measure_latency(model, batch_size, prompt_len, new_tokens, warmup, repeats, engine=engine,
                              speculation=speculation)
    settings = {"model": str(model_dir), "batch_size": batch_size, "prompt_len": prompt_len,
                "new_tokens": new_tokens, "dtype": spec.dtype, "quantize": spec.quantize,
                "device": str(model.transformer.wte.weight.device), "warmup": warmup, "repeats": repeats,
                "compile": engine.compile, "kernels": engine.kernels, "load_s": load_s}
    if settings["device"] == "cpu":
        settings["cpu"] = cpu.describe()  # which kind of CPU the kernels were chosen for (gptj.cpu)
    return figures | settings


def format_latency(r: dict[str, Any]) -> str:
    """A few human-readable lines for a `run_latency` result."""
    quant = f", {r['quantize']} weights" if r.get("quantize") else ""
    lines = [
        f"model      {r['model']} ({r['params'] / 1e9:.2f}B params), {r['dtype']}{quant}, "
        f"{r['device']}" + (f" ({r['cpu']})" if r.get("cpu") else "") + f", {r['threads']} threads",
        f"settings   batch {r['batch_size']}, prompt {r['prompt_len']} tokens, {r['new_tokens']} new tokens; "
        f"median of {r['repeats']} after {r['warmup']} warm-up",
        f"prefill    {r['prefill_ms']:.1f} ms for the batch ({r['prefill_tok_s']:.0f} prompt tok/s, "
        f"{r['prefill_gflop_s']:.1f} GFLOP/s)",
        f"decode     {r['decode_tok_s']:.1f} tok/s ({r['decode_step_ms']:.2f} ms/step)",
        f"memory bw  {r['weights_gb_s']:.2f} GB/s weights ({r['weight_bytes_per_step'] / 1e6:.1f} MB/step) "
        f"+ {r['kv_gb_s']:.2f} GB/s KV cache",
        f"compute    {r['gflop_s']:.2f} GFLOP/s during decode",
        f"peak RSS   {r['peak_rss_mb']:.0f} MB" + (f" (GPU {r['peak_gpu_mb']:.0f} MB)" if "peak_gpu_mb" in r else ""),
    ]
    if "draft_tokens" in r:
        lines.append(f"speculate  {r['accepted_tokens']} of {r['draft_tokens']} drafted tokens taken, "
                     f"{r['tokens_per_step']:.2f} tokens per decode step")
    return "\n".join(lines)


# --- CLI ------------------------------------------------------------------------------------


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `bench` (with its `latency` benchmark) to the CLI's subcommands."""
    p = subparsers.add_parser("bench", help="measure speed: prefill, decode tok/s, memory bandwidth",
                              description="Benchmarks of gptj's engine.")
    bench_sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True, parser_class=type(p))
    q = bench_sub.add_parser(
        "latency", help="prefill time and decode tokens/s of one fixed-size batch",
        description="Prefill time and decode tokens/s of one batch of random prompts on the engine, with the "
                    "weight bandwidth and FLOP rate they imply and the peak memory (gpt-fast's figures).")
    q.add_argument("--model", required=True, help="model directory (HF / gptj format)")
    q.add_argument("--batch-size", type=flags.positive, default=1)
    q.add_argument("--prompt-len", type=flags.positive, default=128, help="prompt tokens per sequence")
    q.add_argument("--max-new-tokens", dest="new_tokens", type=_at_least_two, default=64, metavar="N",
                   help="new tokens per sequence (>= 2)")
    flags.add_deprecated_alias(q, "--new-tokens", "--max-new-tokens")
    flags.add_model_flags(q, quantize_help="weight-only quantization (default: none)")
    flags.add_engine_flags(q, max_seqs_help="sequences running at once (default: batch-size)")
    flags.add_speculate_flags(q)
    q.add_argument("--warmup", type=flags.nonnegative, default=1, help="untimed runs first")
    q.add_argument("--repeats", type=flags.positive, default=3, help="timed runs (median reported)")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    flags.add_threads_flag(q)
    p.set_defaults(func=cmd_bench)
    return p


def _at_least_two(text: str) -> int:
    value = flags.positive(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2, got {text!r}")
    return value


def bench_config(args: argparse.Namespace) -> tuple[ModelSpec, EngineConfig]:
    """`gptj bench latency`'s ModelSpec and EngineConfig (the batch's, unless the engine flags say)."""
    return flags.model_spec(args), engine_config(args.batch_size, args.prompt_len, args.new_tokens,
                                                 asked=flags.engine_config(args))


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command != "latency":
        raise GptjError(f"unknown benchmark {args.bench_command!r}")
    spec, engine = bench_config(args)
    result = run_latency(args.model, batch_size=args.batch_size, prompt_len=args.prompt_len,
                         new_tokens=args.new_tokens, warmup=args.warmup, repeats=args.repeats, spec=spec,
                         engine=engine, speculation=flags.speculation(args))
    if args.json:
        print(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                          for k, v in result.items()}))
    else:
        print(format_latency(result))
    return 0
