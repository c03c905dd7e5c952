"""Prompt-lookup speculation (issue 60) against plain decoding, batch 1, on the engine: the same model,
prompts and tokens, each mode in turn within every round.

    python benchmarks/speculate.py                        # trains the tiny preset first (about a minute)
    python benchmarks/speculate.py --cases trained --trained DIR
    python benchmarks/speculate.py --smoke                # a check that it runs (CI), not a measurement

Cases (--cases, comma-separated):

    trained      gptj's tiny preset trained on the repetitive corpus shipped in examples/data
                 (examples/train/pretrain_tiny.yaml, as benchmarks/quant_trained.py trains it); prompts:
                 windows of the held-out text. A model that continues text it has seen: it copies.
    gptj-wide    random weights of GPT-J 6B's width (n_embd 4096, 16 heads of 256, rotary 64, the
                 50,400-token vocabulary; --layers layers) with prompts that repeat random spans: the
                 drafter finds matches, the model follows none (nothing to gain; the cost of trying)
    llama-wide   the same on Llama-3.1-8B's width (benchmarks/llama_shapes.py)
    llama-loop   llama-wide's weights made a model that copies itself (make_copier): its blocks' writes
                 to the residual scaled by COPY_SCALE and its head tied to its embedding, so it repeats
                 its last token: random Llama weights never loop (random GPT-J ones do), and this is
                 the cost of verifying drafts that are taken at Llama's width (GQA), not a summary's
                 acceptance

Measured per case and mode: decode tok/s = (N - 1) / (median t_N - median t_1) over --repeats runs
of N = --new-tokens greedy tokens (EOS ignored) and of 1 token, which removes the prefill; the
tokens (identical in both modes or the run fails), drafted and accepted tokens, tokens per step.
The modes alternate within each round. Prints a table, or --json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from _smoke import parse_args

ROOT = Path(__file__).resolve().parent.parent
TRAIN_CONFIG = ROOT / "examples" / "train" / "pretrain_tiny.yaml"
EVAL_TEXT = ROOT / "examples" / "data" / "pretrain_eval.txt"
CASES = ("trained", "gptj-wide", "llama-wide", "llama-loop")
COPY_SCALE = 0.01  # llama-loop: the blocks' output projections scaled by this


def trained_model(work: Path, steps: int) -> Path:
    out = work / "trained"
    if not (out / "config.json").is_file():
        run = subprocess.run([sys.executable, "-m", "gptj.cli", "train", "--config", str(TRAIN_CONFIG), "--out", str(out),
                              "--max-steps", str(steps), "--quiet"], stdout=subprocess.DEVNULL)
        if run.returncode:
            raise SystemExit(f"speculate: training failed (exit {run.returncode})")
    return out


def wide_model(case: str, work: Path, layers: int) -> Path:
    out = work / f"{'llama-wide' if case == 'llama-loop' else case}-{layers}"
    if (out / "config.json").is_file():
        return out
    if case.startswith("llama"):
        sys.path.insert(0, str(Path(__file__).parent))
        from llama_shapes import write_model

        return write_model(out, layers)
    from gptj.config import get_preset
    from gptj.weights.io import random_state_dict, save_checkpoint

    config = get_preset("gptj-6b").replace(n_layer=layers)
    return save_checkpoint(random_state_dict(config, dtype=torch.bfloat16), config, out)


def prompts_for(case: str, model_dir: Path, n: int, length: int, vocab: int) -> list[list[int]]:
    if case == "trained":
        from gptj.tokenizer import tokenizer_for_model

        ids = tokenizer_for_model(str(model_dir)).encode(EVAL_TEXT.read_text(encoding="utf-8"))
        step = max(1, (len(ids) - length) // max(1, n))
        return [ids[i * step:i * step + length] for i in range(n)]
    rng = random.Random(0)
    prompts = []
    for _ in range(n):
        span = [rng.randrange(2, vocab) for _ in range(24)]
        prompts.append((span * (length // 24 + 1))[:length])
    return prompts


def make_copier(model: torch.nn.Module) -> None:
    """A Llama that repeats its last token (llama-loop): every block's o_proj and down_proj scaled by
    COPY_SCALE, so the residual stays near the token's embedding, and the LM head tied to the
    embedding, so that embedding scores highest (a row's dot product with itself: 4,096 terms of one
    sign, against sums of random signs)."""
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.o_proj.weight.mul_(COPY_SCALE)
            block.mlp.down_proj.weight.mul_(COPY_SCALE)
        model.lm_head.weight = model.transformer.wte.weight


def timed_run(engine, prompt: list[int], gen) -> tuple[float, list[int], int]:  # noqa: ANN001
    """Seconds to generate gen.max_new_tokens for `prompt` alone, its tokens, and the steps taken."""
    steps = engine.steps
    t0 = time.perf_counter()
    out = engine.generate([prompt], gen)[0]
    return time.perf_counter() - t0, out, engine.steps - steps


def measure(case: str, model_dir: Path, args: argparse.Namespace) -> dict:
    from gptj.decode import GenerationConfig
    from gptj.engine.config import EngineConfig
    from gptj.runtime.build import build_engine, load_model
    from gptj.runtime.spec import ModelSpec

    loop = case == "llama-loop"  # (made a copier in the float dtype, then quantized as asked)
    model = load_model(ModelSpec(path=str(model_dir), dtype=args.dtype, device="cpu",
                                 quantize=None if loop else args.quantize))
    if loop:
        make_copier(model)
        if args.quantize:
            from gptj.quant import quantize_model

            quantize_model(model, args.quantize)
    engine = build_engine(model, EngineConfig(max_seqs=1, max_len=args.prompt_len + args.new_tokens + 8))
    vocab = model.config.vocab_size
    prompts = prompts_for(case, model_dir, args.prompts, args.prompt_len, vocab)
    plain = GenerationConfig(max_new_tokens=args.new_tokens, eos_token_id=None, pad_token_id=0)
    modes = {"plain": plain, "ngram": plain.replace(prompt_lookup_num_tokens=args.speculate_tokens,
                                                      max_matching_ngram_size=args.speculate_ngram)}
    times = {m: {1: [], args.new_tokens: []} for m in modes}
    tokens, steps = {m: [] for m in modes}, {m: 0 for m in modes}
    timed_run(engine, prompts[0], plain.replace(max_new_tokens=2))  # first calls, untimed
    drafted0, accepted0 = engine.stats().draft_tokens, engine.stats().accepted_tokens
    for r in range(args.repeats):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for mode in order:
            for prompt in prompts:
                for n in (1, args.new_tokens):
                    seconds, out, used = timed_run(engine, prompt, modes[mode].replace(max_new_tokens=n))
                    times[mode][n].append(seconds)
                    if n == args.new_tokens and r == 0:
                        tokens[mode].append(out)
                        steps[mode] += used
    stats = engine.stats()
    if tokens["ngram"] != tokens["plain"]:
        raise SystemExit(f"speculate: {case}: the tokens with drafts differ from those without")
    result = {"case": case, "model": str(model_dir), "dtype": args.dtype, "quantize": args.quantize, "prompts": len(prompts),
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats}
    n = args.new_tokens
    for mode in modes:
        decode = statistics.median(times[mode][n]) - statistics.median(times[mode][1])
        result[mode] = {"decode_tok_s": (n - 1) / decode if decode > 0 else None,
                        "tokens_per_step": len(prompts) * n / steps[mode]}
    drafted, accepted = stats.draft_tokens - drafted0, stats.accepted_tokens - accepted0
    result["ngram"].update(drafted=drafted, accepted=accepted, acceptance=accepted / drafted if drafted else None)
    p, s = result["plain"]["decode_tok_s"], result["ngram"]["decode_tok_s"]
    result["speedup"] = s / p if p and s else None
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--trained", type=Path, help="a trained checkpoint for the trained case (default: train one)")
    ap.add_argument("--train-steps", type=int, default=200, help="training steps (the config's: 200; fewer stop early)")
    ap.add_argument("--layers", type=int, default=2, help="the wide cases' layers")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/gptj-speculate"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--quantize", choices=("int8", "int4"), help="weight-only quantization at load (default: none)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--speculate-tokens", type=int, default=5)
    ap.add_argument("--speculate-ngram", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, {"cases": "trained", "train_steps": 3, "prompts": 1, "prompt_len": 32, "new_tokens": 8,
                           "repeats": 1, "work_dir": Path("/tmp/gptj-speculate-smoke")}, argv)
    torch.set_num_threads(args.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for case in args.cases.split(","):
        if case not in CASES:
            ap.error(f"unknown case {case!r} (choose from {', '.join(CASES)})")
        model_dir = (args.trained or trained_model(args.work_dir, args.train_steps)) if case == "trained" \
            else wide_model(case, args.work_dir, args.layers)
        results.append(measure(case, model_dir, args))
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"{'case':<11} {'plain tok/s':>11} {'ngram tok/s':>11} {'speedup':>8} {'accepted':>14} {'tok/step':>8}")
    for r in results:
        g = r["ngram"]
        acc = f"{g['accepted']}/{g['drafted']}"
        print(f"{r['case']:<11} {r['plain']['decode_tok_s'] or 0:>11.1f} {g['decode_tok_s'] or 0:>11.1f} "
              f"{r['speedup'] or 0:>7.2f}x {acc:>14} {g['tokens_per_step']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
