"""How far each number format moves GPT-J's logits, against gptj compare's tolerance.

`gptj compare` (gptj.bench.compare) calls two models alike when their largest logit difference is
within SAFETY * u of A's largest |logit|, u the coarser side's unit roundoff (FORMAT_UNIT). This
script measures that difference, as a multiple of u, for each format against float32 on random
models of the `small` preset's width (n_embd 256) at several depths, on the bundled MLPerf prompts
(teacher-forced): what SAFETY must cover, and whether depth adds to it.

    python benchmarks/compare_tolerance.py --layers 2,8,28 --json
    python benchmarks/compare_tolerance.py --smoke
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from _smoke import parse_args
from gptj.bench.compare import FORMAT_UNIT, SAFETY, compare, gptj_side
from gptj.config import get_preset
from gptj.mlperf.dataset import Dataset
from gptj.weights.io import random_state_dict, save_checkpoint

SIDES = {  # name -> (dtype, quantize on load)
    "bfloat16": (torch.bfloat16, None), "float16": (torch.float16, None), "int8": (torch.float32, "int8"),
    "int4": (torch.float32, "int4"), "fp8": (torch.float32, "fp8"),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="2,8,28", help="model depths (comma-separated)")
    ap.add_argument("--preset", default="small", help="the width's preset (its n_layer is replaced)")
    ap.add_argument("--formats", default=",".join(SIDES), help="comma-separated: " + ", ".join(SIDES))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, {"layers": "2", "preset": "tiny", "formats": "bfloat16,int8", "prompts": 1,
                           "max_tokens": 16}, argv)
    prompts = [p[:args.max_tokens] for p in Dataset.load(max_examples=args.prompts).input_ids]
    cpu = torch.device("cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n_layer in (int(x) for x in args.layers.split(",")):
            cfg = get_preset(args.preset).replace(n_layer=n_layer)
            folder = save_checkpoint(random_state_dict(cfg, seed=0), cfg, Path(tmp) / f"L{n_layer}", overwrite=True)
            ref = gptj_side(folder, torch.float32, cpu)
            for name in args.formats.split(","):
                dtype, quantize = SIDES[name]
                r = compare(ref, gptj_side(folder, dtype, cpu, quantize=quantize), prompts, new_tokens=0)
                rel = r["max_abs_diff"] / r["max_abs_logit_a"]
                rows.append({"n_layer": n_layer, "format": name, "max_rel_diff": rel,
                             "in_units": rel / FORMAT_UNIT[name], "tolerance_rel": r["tolerance_rel"],
                             "top1_agreement": r["top1_agreement"], "verdict": r["verdict"]})
    result = {"preset": args.preset, "prompts": len(prompts), "max_tokens": args.max_tokens, "safety": SAFETY,
              "rows": rows, "largest_in_units": max(r["in_units"] for r in rows)}
    if args.json:
        print(json.dumps(result))
        return
    print("| layers | format | max |dlogit| / max |logit| | in units of u | tolerance | top-1 agree | verdict |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n_layer']} | {r['format']} | {r['max_rel_diff']:.3g} | {r['in_units']:.2f} | "
              f"{r['tolerance_rel']:.3g} | {r['top1_agreement']:.3f} | {r['verdict']} |")


if __name__ == "__main__":
    main()
