"""Prompt-lookup speculation (issue 60) against plain decoding, batch 1, on the engine: the same model,
prompts and tokens, each mode in turn within every round.

    python benchmarks/speculate.py                        # every case (trains its 3 models first: ~20 minutes)
    python benchmarks/speculate.py --cases trained        # trains the tiny preset first (about a minute)
    python benchmarks/speculate.py --cases trained --trained DIR
    python benchmarks/speculate.py --cases summarizer     # fine-tunes a summarizer first (about 15 minutes)
    python benchmarks/speculate.py --cases repeater       # trains a model that copies first (about 3 minutes)
    python benchmarks/speculate.py --smoke                # a check that it runs (CI), not a measurement

Cases (--cases, comma-separated):

    trained      gptj's tiny preset trained on the repetitive corpus shipped in examples/data
                 (examples/train/pretrain_tiny.yaml, as benchmarks/quant_trained.py trains it); prompts:
                 windows of the held-out text. A model that continues text it has seen: it copies.
    summarizer   gptj's tiny preset fine-tuned to summarize (examples/train/finetune_summarization.yaml)
                 on pairs made from that corpus: an article of 3 of its paragraphs drawn at random,
                 the summary its first 3 sentences (lead-3, CNN-DailyMail's classic extractive
                 baseline: summaries there copy their articles' spans, here wholly). Prompts: the
                 MLPerf gptj-99 template around 3 held-out paragraphs; EOS ends the summary. Meant
                 to copy its prompt, it does not learn to in SUMMARY_STEPS steps (PERFORMANCE.md, SP8)
    repeater     gptj's tiny preset trained here on the shipped corpus (examples/data/pretrain.txt) to
                 copy: each row a random window of REPEAT_WINDOW tokens followed by itself, the loss on
                 the copy (REPEAT_STEPS steps of 16 rows, AdamW). Prompts: a window of the held-out text
                 and its first 4 tokens. It copies held-out text (98 % of tokens), by position (what
                 came REPEAT_WINDOW tokens before): copying at its purest, with trained weights (their
                 margins, their attention), not a random loop
    gptj-wide    random weights of GPT-J 6B's width (n_embd 4096, 16 heads of 256, rotary 64, the
                 50,400-token vocabulary; --layers layers) with prompts that repeat random spans: the
                 drafter finds matches, the model follows none (nothing to gain; the cost of trying)
    llama-wide   the same on Llama-3.1-8B's width (benchmarks/llama_shapes.py)
    llama-loop   llama-wide's weights made a model that copies itself (make_copier): its blocks' writes
                 to the residual scaled by COPY_SCALE and its head tied to its embedding, so it repeats
                 its last token: random Llama weights never loop (random GPT-J ones do), and this is
                 the cost of verifying drafts that are taken at Llama's width (GQA), not a summary's
                 acceptance

Measured per case and mode: decode tok/s = sum over prompts of (N_p - 1) / sum of (median t_N - median
t_1), the medians over --repeats runs of each prompt's N_p tokens (--new-tokens, greedy; EOS ignored but
by the summarizer, whose N_p ends at its EOS) and of 1 token, which removes the prefill; the
tokens (identical in both modes or the run fails), drafted and accepted tokens, tokens per step.
The modes alternate within each round. Prints a table, or --json.
"""

from __future__ import annotations

import argparse
import json
import random
import re
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
TRAIN_TEXT = ROOT / "examples" / "data" / "pretrain.txt"
SUMMARY_CONFIG = ROOT / "examples" / "train" / "finetune_summarization.yaml"
SUMMARY_PAIRS = 4000  # the summarizer's training pairs (articles drawn at random from the corpus)
SUMMARY_STEPS = 1000
LEAD = 3  # sentences in a summary
REPEAT_WINDOW, REPEAT_STEPS = 64, 300  # the repeater: the window it learns to copy, its training steps
CASES = ("trained", "summarizer", "repeater", "gptj-wide", "llama-wide", "llama-loop")
COPY_SCALE = 0.01  # llama-loop: the blocks' output projections scaled by this


def trained_model(work: Path, steps: int) -> Path:
    out = work / "trained"
    if not (out / "config.json").is_file():
        run = subprocess.run([sys.executable, "-m", "gptj.cli", "train", "--config", str(TRAIN_CONFIG), "--out", str(out),
                              "--max-steps", str(steps), "--quiet"], stdout=subprocess.DEVNULL)
        if run.returncode:
            raise SystemExit(f"speculate: training failed (exit {run.returncode})")
    return out


def paragraphs(path: Path) -> list[str]:
    return [" ".join(p.split()) for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]


def lead_pair(pars: list[str]) -> dict:
    """A cnn_eval.json entry: the article is `pars`, its summary the article's first LEAD sentences."""
    lead = re.findall(r"[^.]*\.", " ".join(pars))[:LEAD]
    return {"instruction": "Summarize the following news article:", "input": "\n".join(pars),
            "output": " ".join(s.strip() for s in lead)}


def summary_pairs() -> tuple[list[dict], list[dict]]:
    """(training pairs: 3 of the training text's paragraphs drawn at random, SUMMARY_PAIRS of them;
    held-out pairs: the held-out text's paragraphs 3 at a time)."""
    rng, train = random.Random(0), paragraphs(TRAIN_TEXT)
    held = paragraphs(EVAL_TEXT)
    return ([lead_pair(rng.sample(train, 3)) for _ in range(SUMMARY_PAIRS)],
            [lead_pair(held[i:i + 3]) for i in range(0, len(held) - 2, 3)])


def summarizer_model(work: Path, steps: int) -> Path:
    out = work / f"summarizer-{steps}"
    if (out / "config.json").is_file():
        return out
    train, held = summary_pairs()
    files = {}
    for name, pairs in (("train", train), ("eval", held)):
        files[name] = work / f"summary-{name}.json"
        files[name].write_text(json.dumps(pairs), encoding="utf-8")
    sets = {"data.train.summarization": files["train"], "data.eval.summarization": files["eval"],
            "data.seq_len": 256, "max_steps": steps, "eval_interval": max(1, steps // 4),
            "checkpoint_interval": max(1, steps // 4), "keep_checkpoints": 1}
    cmd = [sys.executable, "-m", "gptj.cli", "train", "--config", str(SUMMARY_CONFIG), "--out", str(out), "--quiet"]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode:
        raise SystemExit("speculate: fine-tuning the summarizer failed")
    return out


def repeater_model(work: Path, steps: int) -> Path:
    """The repeater (the docstring's cases), trained in this process and saved as a checkpoint."""
    from gptj.config import get_preset
    from gptj.tokenizer import load_tokenizer
    from gptj.weights.io import model_from_state_dict, random_state_dict, save_checkpoint

    out = work / f"repeater-{steps}"
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    ids = load_tokenizer().encode(TRAIN_TEXT.read_text(encoding="utf-8"))
    rng, config = random.Random(0), get_preset("tiny")
    model = model_from_state_dict(config, random_state_dict(config, seed=0, std=0.02)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    w = REPEAT_WINDOW
    for _ in range(steps):
        x = torch.tensor([ids[i:i + w] * 2 for i in (rng.randrange(len(ids) - w) for _ in range(16))])
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1])[:, w - 1:].flatten(0, 1), x[:, w:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_checkpoint(model.state_dict(), config, out)


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
    if case in ("summarizer", "repeater", "trained"):  # text, in the model's tokenizer
        from gptj.tokenizer import tokenizer_for_model

        tok = tokenizer_for_model(str(model_dir))
    if case == "summarizer":
        from gptj.mlperf.dataset import Example, build_prompt

        return [tok.encode(build_prompt(Example(p["instruction"], p["input"], p["output"])))
                for p in summary_pairs()[1][:n]]
    if case == "repeater":
        ids = tok.encode(EVAL_TEXT.read_text(encoding="utf-8"))
        step = max(1, (len(ids) - REPEAT_WINDOW) // max(1, n))
        return [ids[i * step:i * step + REPEAT_WINDOW] + ids[i * step:i * step + 4] for i in range(n)]
    if case == "trained":
        ids = tok.encode(EVAL_TEXT.read_text(encoding="utf-8"))
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
    vocab = model.config.vocab_size
    prompts = prompts_for(case, model_dir, args.prompts, args.prompt_len, vocab)
    engine = build_engine(model, EngineConfig(max_seqs=1, max_len=max(map(len, prompts)) + args.new_tokens + 8))
    eos = model.config.eos_token_id if case == "summarizer" else None  # the summarizer's summaries end
    plain = GenerationConfig(max_new_tokens=args.new_tokens, eos_token_id=eos, pad_token_id=0)
    modes = {"plain": plain, "ngram": plain.replace(prompt_lookup_num_tokens=args.speculate_tokens,
                                                      max_matching_ngram_size=args.speculate_ngram)}
    times = {m: [{1: [], args.new_tokens: []} for _ in prompts] for m in modes}  # per mode, prompt, length
    tokens, steps = {m: [] for m in modes}, {m: 0 for m in modes}
    timed_run(engine, prompts[0], plain.replace(max_new_tokens=2))  # first calls, untimed
    drafted0, accepted0 = engine.stats().draft_tokens, engine.stats().accepted_tokens
    for r in range(args.repeats):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for mode in order:
            for i, prompt in enumerate(prompts):
                for n in (1, args.new_tokens):
                    seconds, out, used = timed_run(engine, prompt, modes[mode].replace(max_new_tokens=n))
                    times[mode][i][n].append(seconds)
                    if n == args.new_tokens and r == 0:
                        tokens[mode].append(out)
                        steps[mode] += used
    stats = engine.stats()
    if tokens["ngram"] != tokens["plain"]:
        raise SystemExit(f"speculate: {case}: the tokens with drafts differ from those without")
    result = {"case": case, "model": str(model_dir), "dtype": args.dtype, "quantize": args.quantize,
              "prompts": len(prompts), "prompt_len": [len(p) for p in prompts],
              "new_tokens": args.new_tokens, "repeats": args.repeats}
    made = sum(len(out) for out in tokens["plain"])
    result["generated"] = made
    for mode in modes:
        decode = sum(statistics.median(t[args.new_tokens]) - statistics.median(t[1]) for t in times[mode])
        result[mode] = {"decode_tok_s": (made - len(prompts)) / decode if decode > 0 else None,
                        "tokens_per_step": made / steps[mode]}
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
    ap.add_argument("--summarizer", type=Path,
                    help="a fine-tuned checkpoint for the summarizer case (default: fine-tune one)")
    ap.add_argument("--summarizer-steps", type=int, default=SUMMARY_STEPS, help="the summarizer's fine-tuning steps")
    ap.add_argument("--repeater", type=Path, help="a trained checkpoint for the repeater case (default: train one)")
    ap.add_argument("--repeater-steps", type=int, default=REPEAT_STEPS, help="the repeater's training steps")
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
    args = parse_args(ap, {"cases": "trained", "train_steps": 3, "summarizer_steps": 3, "repeater_steps": 1,
                           "prompts": 1, "prompt_len": 32, "new_tokens": 8, "repeats": 1,
                           "work_dir": Path("/tmp/gptj-speculate-smoke")}, argv)
    torch.set_num_threads(args.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for case in args.cases.split(","):
        if case not in CASES:
            ap.error(f"unknown case {case!r} (choose from {', '.join(CASES)})")
        if case == "trained":
            model_dir = args.trained or trained_model(args.work_dir, args.train_steps)
        elif case == "repeater":
            model_dir = args.repeater or repeater_model(args.work_dir, args.repeater_steps)
        elif case == "summarizer":
            model_dir = args.summarizer or summarizer_model(args.work_dir, args.summarizer_steps)
        else:
            model_dir = wide_model(case, args.work_dir, args.layers)
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
