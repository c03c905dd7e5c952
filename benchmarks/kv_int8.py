"""int8 KV memory against bfloat16 KV on the same model (`--kv-dtype int8`).

    python benchmarks/kv_int8.py                 # full-width GPT-J shape: n_embd 4096, 16 heads of 256
    python benchmarks/kv_int8.py --smoke         # a check that it runs

Measured, for a bfloat16 model with random weights (std --std) and GPT-J's head shapes:

    capacity    sequences of --max-len tokens the same KV memory (--budget-gib) holds: plan_kv's answer
    agreement   teacher-forced top-1 agreement of int8 KV with bfloat16 KV over every position of the
                first --prompts bundled MLPerf prompts (the engine's prompt logprobs; the prompt's
                attention reads the stored keys, so int8 rounding is in every position); and, as
                yardsticks on the same weights in float32: bfloat16 (model and KV) against float32,
                and int8 KV against float32 KV in the float32 model; and the noise floor: bfloat16
                KV against itself with the attention computed by the fallback instead of
                gptj.native (kernels "off": the same formula, other roundings)
    offline     samples/s of the first --prompts prompts, beam 4, --new-tokens new tokens, all
                submitted at once, each KV dtype alternated --rounds times (best round kept)

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from _smoke import parse_args
from gptj.config import GPTJConfig
from gptj.decode import GenerationConfig
from gptj.engine import Engine, EngineConfig
from gptj.engine.config import plan_kv
from gptj.mlperf.dataset import Dataset
from gptj.runtime.build import build_engine
from gptj.weights.io import model_from_state_dict, random_state_dict


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--max-len", type=int, default=2048)
    args = parse_args(ap, {"width": 256, "layers": 1, "prompts": 2, "new_tokens": 4, "rounds": 1}, argv)

    cfg = GPTJConfig(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 256), rotary_dim=64,
                     n_inner=4 * args.width, n_positions=2048)
    weights = random_state_dict(cfg, seed=0, dtype=torch.bfloat16, std=args.std)
    model = model_from_state_dict(cfg, weights)
    prompts = Dataset.load(max_examples=args.prompts).input_ids
    budget = int(args.budget_gib * 2**30)

    capacity = {}
    for kv in ("auto", "int8"):
        plan = plan_kv(cfg, torch.bfloat16, "cpu", EngineConfig(max_seqs=100000, max_len=args.max_len, kv_dtype=kv),
                       free_bytes=budget * 2)  # memory_fraction 0.5 of twice the budget: the budget
        capacity[kv] = plan.n_blocks // plan.blocks_per_seq

    def top1(kv: str, model: torch.nn.Module = model, kernels: str = "auto") -> list[int]:
        engine = Engine(model, EngineConfig(max_seqs=4, max_len=2048, kv_dtype=kv, kernels=kernels))
        reqs = [engine.add_request(p, GenerationConfig(max_new_tokens=1), prompt_logprobs=1) for p in prompts]
        while engine.has_work:
            engine.step()
        return [t.top[0][0] for r in reqs for t in r.prompt_token_logprobs if t is not None]

    def agree(a: list[int], b: list[int]) -> float:
        return round(sum(x == y for x, y in zip(a, b)) / len(a), 4)

    ref, got = top1("auto"), top1("int8")
    other_kernel = top1("auto", kernels="off")  # bfloat16 KV again, attention by the fallback's formulas
    fp32 = model_from_state_dict(cfg, {k: v.float() for k, v in weights.items()})
    ref32, got32 = top1("auto", fp32), top1("int8", fp32)
    del fp32

    gen = GenerationConfig.mlperf(max_new_tokens=args.new_tokens, min_new_tokens=min(30, args.new_tokens))
    offline: dict[str, float] = {}
    for _ in range(args.rounds):
        for kv in ("auto", "int8"):
            engine = build_engine(model, EngineConfig(max_seqs=4 * len(prompts), max_len=2048, kv_dtype=kv,
                                                      max_prefill_tokens=sum(map(len, prompts))))
            t = time.perf_counter()
            engine.generate(prompts, gen)
            rate = len(prompts) / (time.perf_counter() - t)
            offline[kv] = max(offline.get(kv, 0.0), rate)

    print(json.dumps({
        "model": {"n_embd": args.width, "layers": args.layers, "heads": cfg.n_head, "std": args.std},
        "capacity_sequences": {"budget_gib": args.budget_gib, "max_len": args.max_len, **capacity,
                               "ratio": round(capacity["int8"] / capacity["auto"], 3)},
        "top1_agreement_int8_vs_bf16": {"positions": len(ref), "agreement": agree(got, ref),
                                         "yardstick_bf16_vs_fp32": agree(ref, ref32),
                                         "noise_floor_bf16_kernels_off_vs_auto": agree(other_kernel, ref),
                                         "int8_vs_fp32_kv_in_fp32_model": agree(got32, ref32)},
        "offline_samples_per_s": {k: round(v, 4) for k, v in offline.items()} | {
            "ratio": round(offline["int8"] / offline["auto"], 3)},
    }, indent=2))


if __name__ == "__main__":
    main()
