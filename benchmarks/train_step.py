"""Training-step throughput: gptj's trainer step against HF transformers' GPTJForCausalLM on the
same weights, batch and optimizer (AdamW), in one process, alternating rounds so that machine
noise hits both alike.

    python benchmarks/train_step.py --preset small --batch-size 8 --seq-len 128 --steps 10 --rounds 3

Both compute next-token cross-entropy over every position (HF: labels=input_ids) in float32 (or
with --bf16, bfloat16 autocast over float32 weights); the report is target tokens per second and
gptj / HF.

    python benchmarks/train_step.py --smoke --json     # tiny model, one step: does it run?
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch

import _smoke  # benchmarks/_smoke.py (a script's own folder is on sys.path)


SMOKE = dict(preset="tiny", batch_size=2, seq_len=16, steps=1, rounds=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object (the lines go to stderr)")
    args = _smoke.parse_args(p, SMOKE, argv)
    out = sys.stderr if args.json else sys.stdout

    import transformers

    from gptj.config import get_preset
    from gptj.train.trainer import _loss_sum
    from gptj.weights.io import model_from_state_dict, random_state_dict

    config = get_preset(args.preset)
    sd = random_state_dict(config, seed=0)
    ours = model_from_state_dict(config, sd).train()
    for prm in ours.parameters():
        prm.requires_grad_(True)
    hf = transformers.GPTJForCausalLM(transformers.GPTJConfig(**config.to_hf_dict())).train()
    hf.load_state_dict({k: v.clone() for k, v in sd.items()})  # strict: every tensor by its public name
    ids = torch.randint(0, 50000, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    targets = torch.ones_like(ids, dtype=torch.bool)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.bf16 else contextlib.nullcontext
    n_targets = args.batch_size * (args.seq_len - 1)

    def ours_step(opt: torch.optim.Optimizer) -> None:
        loss = _loss_sum(ours, ids, mask, targets, "bf16" if args.bf16 else "float32", torch.device("cpu"))
        (loss / n_targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def hf_step(opt: torch.optim.Optimizer) -> None:
        with autocast():
            loss = hf(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with torch.no_grad():  # the same model: the same loss before training
        a = float(_loss_sum(ours, ids, mask, targets, "float32", torch.device("cpu"))) / n_targets
        b = float(hf(input_ids=ids, labels=ids).loss)
    if abs(a - b) > 1e-4 * abs(b):
        raise SystemExit(f"the two models disagree before training: loss {a} vs {b}")
    runs = {"gptj": (ours_step, torch.optim.AdamW(ours.parameters(), lr=1e-4, foreach=False)),
            "HF transformers": (hf_step, torch.optim.AdamW(hf.parameters(), lr=1e-4, foreach=False))}
    best = {name: float("inf") for name in runs}
    for name, (step, opt) in runs.items():  # warm-up
        step(opt)
    for _ in range(args.rounds):
        for name, (step, opt) in runs.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step(opt)
            best[name] = min(best[name], (time.perf_counter() - start) / args.steps)
    print(f"preset {args.preset}, batch {args.batch_size} x {args.seq_len}, "
          f"{'bf16 autocast' if args.bf16 else 'float32'}, AdamW, {torch.get_num_threads()} threads; "
          f"best of {args.rounds} rounds of {args.steps} steps", file=out)
    for name, seconds in best.items():
        print(f"{name:16s} {seconds * 1000:8.1f} ms/step  {n_targets / seconds:9.0f} target tok/s", file=out)
    print(f"gptj / HF: {best['HF transformers'] / best['gptj']:.2f}x", file=out)
    if args.json:
        print(json.dumps({"preset": args.preset, "batch_size": args.batch_size, "seq_len": args.seq_len,
                          "steps": args.steps, "rounds": args.rounds, "bf16": args.bf16, "initial_loss": a,
                          "gptj_ms_step": best["gptj"] * 1000, "hf_ms_step": best["HF transformers"] * 1000,
                          "gptj_tok_s": n_targets / best["gptj"], "hf_tok_s": n_targets / best["HF transformers"],
                          "gptj_over_hf": best["HF transformers"] / best["gptj"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
