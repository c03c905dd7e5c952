"""gptj's exact decoding path against HF transformers' generate, same weights, same process.

Measures new tokens per second for greedy and MLPerf beam search (4 beams), alternating the
two implementations so machine noise hits both alike, and reports the ratio. Also checks the
tokens are identical (in float32) so the speed comparison is between equal computations.

    python benchmarks/generate_vs_hf.py --preset small --dtype float32 --repeats 3
    python benchmarks/generate_vs_hf.py --smoke --json     # tiny model, a few tokens: does it run?

HF's model is built from its public GPTJConfig and given gptj's state dict with load_state_dict
(strict: a renamed tensor in a new transformers fails here rather than leaving random weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import transformers

from gptj.config import get_preset
from gptj.decode import GenerationConfig, generate
from gptj.device import parse_dtype
from gptj.weights.io import model_from_state_dict, random_state_dict

import _smoke  # benchmarks/_smoke.py (a script's own folder is on sys.path)


def hf_generate(model, prompts, gen: GenerationConfig):
    width = max(map(len, prompts))
    ids = torch.tensor([[gen.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    beams = dict(num_beams=gen.num_beams, early_stopping=gen.early_stopping) if gen.num_beams > 1 else {}
    out = model.generate(ids, attention_mask=mask, max_new_tokens=gen.max_new_tokens,
                         min_new_tokens=gen.min_new_tokens, do_sample=False, pad_token_id=gen.pad_token_id,
                         eos_token_id=gen.eos_token_id, **beams)
    rows = out[:, width:].tolist()
    return [r[: r.index(gen.eos_token_id) + 1] if gen.eos_token_id in r else r for r in rows]


SMOKE = dict(preset="tiny", batch_size=2, prompt_len=8, new_tokens=4, repeats=1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object (the lines go to stderr)")
    args = _smoke.parse_args(ap, SMOKE, argv)
    out = sys.stderr if args.json else sys.stdout

    cfg, dtype = get_preset(args.preset), parse_dtype(args.dtype)
    sd = random_state_dict(cfg, seed=0, dtype=torch.float32, std=0.2)
    ours = model_from_state_dict(cfg, {k: v.to(dtype) for k, v in sd.items()})
    hf = transformers.GPTJForCausalLM(transformers.GPTJConfig(**cfg.to_hf_dict()))
    hf.load_state_dict(sd)
    hf = hf.to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 50000, (args.prompt_len - 3 * i,), generator=g).tolist()
               for i in range(args.batch_size)]

    print(f"preset {args.preset}, {args.dtype}, batch {args.batch_size}, prompt <= {args.prompt_len}, "
          f"new {args.new_tokens}, threads {torch.get_num_threads()}", file=out)
    result = {"preset": args.preset, "dtype": args.dtype, "batch_size": args.batch_size,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "threads": torch.get_num_threads()}
    for name, gen in (("greedy", GenerationConfig(max_new_tokens=args.new_tokens, eos_token_id=None)),
                      ("beam4", GenerationConfig(max_new_tokens=args.new_tokens, num_beams=4,
                                                 min_new_tokens=args.new_tokens))):
        times = {"gptj": [], "hf": []}
        outputs = {}
        with torch.inference_mode():
            for r in range(args.repeats + 1):  # the first round warms up
                for impl, fn in (("gptj", lambda: generate(ours, prompts, gen)),
                                 ("hf", lambda: hf_generate(hf, prompts, gen))):
                    t0 = time.perf_counter()
                    outputs[impl] = fn()
                    if r:
                        times[impl].append(time.perf_counter() - t0)
        n_tokens = sum(map(len, outputs["gptj"]))
        same = outputs["gptj"] == outputs["hf"]
        t_ours, t_hf = statistics.median(times["gptj"]), statistics.median(times["hf"])
        print(f"{name:7s} gptj {n_tokens / t_ours:8.1f} tok/s   hf {n_tokens / t_hf:8.1f} tok/s   "
              f"gptj/hf speed {t_hf / t_ours:5.2f}x   identical tokens: {same}", file=out)
        result[name] = {"gptj_tok_s": n_tokens / t_ours, "hf_tok_s": n_tokens / t_hf, "gptj_over_hf": t_hf / t_ours,
                        "new_tokens": n_tokens, "identical_tokens": same}
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
