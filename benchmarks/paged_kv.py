"""Paged KV memory against the slot design it replaced, at the same KV memory budget.

    git worktree add /tmp/gptj-old 8a4800c     # the slot design, the last commit before paged KV
    python benchmarks/paged_kv.py --old-src /tmp/gptj-old/src

Each engine runs in its own process (the old one with PYTHONPATH on the old tree) on the same
full-width GPT-J (n_embd 4096, 16 heads, --layers layers, random bfloat16 weights) and the bundled
MLPerf sample set's prompts (beam 4, --new-tokens new tokens). Measured, per engine:

    capacity       the most requests running at once, KV memory = what the slot design gives
                   --budget-requests requests (a prompt slot as long as the longest prompt plus
                   max_new_tokens, and a tail of max_new_tokens per beam, as gptj mlperf sized it)
    offline        samples/s over the whole set submitted at once (the Offline scenario's shape)
    decode         greedy tokens/s at batch 1 and 8 (100-token prompts)
    prefix (new)   time to first token of a prompt sharing a 512-token prefix with a finished one,
                   prefix caching on against off; tokens compared

Prints one JSON object per engine and the ratios new / old.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _smoke import parse_args


PARTS = ("offline", "decode1", "decode8", "prefix")


def build_model(layers: int, width: int = 4096, seed: int = 0):  # noqa: ANN201
    import torch

    from gptj.config import GPTJConfig
    from gptj.weights.io import model_from_state_dict, random_state_dict

    # GPT-J's shapes: heads of 256, rotary on the first 64 of each, MLP 4x wide
    cfg = GPTJConfig(n_layer=layers, n_embd=width, n_head=max(1, width // 256), rotary_dim=64, n_inner=4 * width,
                     n_positions=2048)
    return cfg, model_from_state_dict(cfg, random_state_dict(cfg, seed=seed, dtype=torch.bfloat16, std=0.02))


def kv_bytes_per_token(cfg) -> int:  # noqa: ANN001
    return 2 * cfg.n_layer * cfg.n_embd * 2  # keys + values, bfloat16


def make_engine(impl: str, model, cfg, budget_tokens: int, longest: int, new: int, beams: int, max_seqs: int):  # noqa: ANN001, ANN201
    from gptj.engine import Engine, EngineConfig

    if impl == "old":  # the slot design: n_prompts prompt slots of slot_len, beams x n_prompts tails
        slot_len = longest + new
        n_prompts = max(1, budget_tokens // (slot_len + beams * new))
        return Engine(model, EngineConfig(n_slots=n_prompts * beams, slot_len=slot_len, max_new_tokens=new,
                                          n_prompts=n_prompts, max_batch_size=max_seqs))
    from gptj.kernels import prepare_for_serving

    config = EngineConfig(max_seqs=max_seqs, kv_blocks=budget_tokens // 16, max_len=min(2048, longest + new))
    engine = Engine(model, config)
    prepare_for_serving(model, "auto", max_rows=engine.plan.max_seqs)
    return engine


def running(engine) -> int:  # noqa: ANN001
    return len(engine.running)


def worker(args: argparse.Namespace) -> dict:
    """One measurement (args.part) of one engine (args.worker), in a process of its own: each
    part prepares the model's kernels for its own batch size, as a real run would."""
    import torch

    from gptj.decode import GenerationConfig
    from gptj.mlperf.dataset import Dataset

    torch.manual_seed(0)
    cfg, model = build_model(args.layers, args.width)
    prompts = [p[:args.max_prompt] for p in Dataset.load().input_ids][:args.samples]
    longest, beams, new = max(map(len, prompts)), 4, args.new_tokens
    budget = args.budget_requests * (longest + new + beams * new)  # tokens of KV memory, the same for both
    result = {"kv_budget_tokens": budget, "kv_budget_mb": round(budget * kv_bytes_per_token(cfg) / 2**20, 1)}
    if args.part == "offline":
        beam = GenerationConfig(max_new_tokens=new, min_new_tokens=new, num_beams=beams, eos_token_id=None)
        engine = make_engine(args.worker, model, cfg, budget, longest, new, beams, max_seqs=256)
        engine.generate(prompts[:2], GenerationConfig(max_new_tokens=4, num_beams=beams))  # warm up
        reqs = [engine.add_request(p, beam) for p in prompts]
        most, t0 = 0, time.perf_counter()
        while engine.has_work:
            engine.step()
            most = max(most, running(engine))
        result["offline_samples_per_s"] = len(prompts) / (time.perf_counter() - t0)
        result["most_running"] = most
        result["outputs_digest"] = hash(tuple(tuple(r.output) for r in reqs)) & 0xFFFFFFFF
    elif args.part.startswith("decode"):
        batch = int(args.part.removeprefix("decode"))
        g = torch.Generator().manual_seed(1)
        ps = [torch.randint(0, 50000, (100,), generator=g).tolist() for _ in range(batch)]
        greedy = GenerationConfig(max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens,
                                  eos_token_id=None)
        engine = make_engine(args.worker, model, cfg, budget, 100, args.decode_tokens, 1, max_seqs=batch) \
            if args.worker == "new" else _old_greedy_engine(model, batch, 100 + args.decode_tokens)
        engine.generate(ps[:1], GenerationConfig(max_new_tokens=4))
        best = 0.0
        for _ in range(args.repeats):  # the best of a few: these machines are noisy
            t0 = time.perf_counter()
            engine.generate(ps, greedy)
            best = max(best, batch * args.decode_tokens / (time.perf_counter() - t0))
        result[f"decode_b{batch}_tokens_per_s"] = best
    elif args.part == "prefix":
        result.update(prefix_ttft(model, args))
    return result


def _old_greedy_engine(model, batch: int, length: int):  # noqa: ANN001, ANN202
    from gptj.engine import Engine, EngineConfig

    return Engine(model, EngineConfig(n_slots=batch, slot_len=length, max_new_tokens=length, max_batch_size=batch))


def prefix_ttft(model, args: argparse.Namespace) -> dict:  # noqa: ANN001
    import torch

    from gptj.decode import GenerationConfig
    from gptj.engine import Engine, EngineConfig
    from gptj.kernels import prepare_for_serving

    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 50000, (512,), generator=g).tolist()
    first, second = (prefix + torch.randint(0, 50000, (64,), generator=g).tolist() for _ in range(2))
    gen = GenerationConfig(max_new_tokens=8, eos_token_id=None)
    out = {}
    for caching in (False, True):
        engine = Engine(model, EngineConfig(max_seqs=4, max_len=1024, prefix_caching=caching))
        prepare_for_serving(model, "auto", max_rows=4)
        engine.generate([first], gen)
        req = engine.add_request(second, gen)
        t0 = time.perf_counter()
        while not req.output:
            engine.step()
        out[f"ttft_ms_prefix_{'on' if caching else 'off'}"] = (time.perf_counter() - t0) * 1000
        while not req.done:
            engine.step()
        out[f"tokens_prefix_{'on' if caching else 'off'}"] = req.output
    out["prefix_same_tokens"] = out.pop("tokens_prefix_on") == out.pop("tokens_prefix_off")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old-src", help="src/ of the slot-design tree (without it only this tree runs)")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--width", type=int, default=4096, help="n_embd (GPT-J's: 4096)")
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--max-prompt", type=int, default=1919)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--budget-requests", type=int, default=8, help="KV memory: what the slot design gives N requests")
    p.add_argument("--repeats", type=int, default=3, help="decode: the best of this many runs")
    p.add_argument("--json", action="store_true", help="one JSON object: every run and the ratios")
    p.add_argument("--worker", choices=("old", "new"), help=argparse.SUPPRESS)
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    args = parse_args(p, {"samples": 3, "new_tokens": 4, "decode_tokens": 4, "max_prompt": 64, "budget_requests": 2,
                          "repeats": 1, "width": 256})
    if args.worker:
        print(json.dumps(worker(args)))
        return
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    trees = [(impl, src) for impl, src in (("old", args.old_src), ("new", here)) if src is not None]
    runs: dict[str, dict] = {impl: {"impl": impl} for impl, _ in trees}
    passed = [a for a in sys.argv[1:] if a not in ("--old-src", args.old_src)]
    for part in PARTS:  # old and new in turn, part by part: a slow spell of the machine hits both
        for impl, src in trees:
            if part == "prefix" and impl == "old":
                continue
            cmd = [sys.executable, __file__, "--worker", impl, "--part", part, *passed]
            env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            runs[impl].update(json.loads(out.strip().splitlines()[-1]))
    new = runs["new"]
    summary = {"runs": runs, "prefix_ttft_speedup": round(new["ttft_ms_prefix_off"] / new["ttft_ms_prefix_on"], 2),
               "prefix_same_tokens": new["prefix_same_tokens"]}
    if "old" in runs:
        old = runs["old"]
        summary["new_over_old"] = {k: round(new[k] / old[k], 2) for k in (
            "most_running", "offline_samples_per_s", "decode_b1_tokens_per_s", "decode_b8_tokens_per_s")}
        summary["same_offline_tokens"] = old["outputs_digest"] == new["outputs_digest"]
    if args.json:
        print(json.dumps(summary))
        return
    for run in runs.values():
        print(json.dumps(run))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))

if __name__ == "__main__":
    main()
