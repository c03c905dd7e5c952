"""A stand-in for CNN-DailyMail's cnn_eval.json at its full size, built from gptj's bundled samples.

    python benchmarks/standin_dataset.py --out /tmp/cnn_standin.json          # 13,368 samples

MLPerf's checker wants an accuracy run over all 13,368 samples and 13,368 performance samples; the
real set cannot be downloaded here. This file repeats the bundled 30 articles (each copy's
instruction carries its index, so no two prompts are the same) to that count, so a full-length
submission run can be exercised end to end (docs/SUBMISSION.md). Its ROUGE scores mean nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gptj.files import atomic_write_json
from gptj.mlperf.dataset import DEFAULT_DATASET
from gptj.mlperf.evaluate import FULL_DATASET_SIZE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--samples", type=int, default=FULL_DATASET_SIZE, help=f"default {FULL_DATASET_SIZE}")
    p.add_argument("--json", action="store_true", help="print what was written as one JSON object")
    args = p.parse_args()
    base = json.loads(Path(DEFAULT_DATASET).read_text(encoding="utf-8"))
    out = []
    for i in range(args.samples):
        e = dict(base[i % len(base)])
        e["instruction"] = f"{e['instruction'].rstrip()} (stand-in sample {i})\n"
        out.append(e)
    atomic_write_json(args.out, out)
    if args.json:
        print(json.dumps({"out": args.out, "samples": len(out), "bundled": len(base),
                          "distinct_prompts": len({(e["instruction"], e["input"]) for e in out})}))
    else:
        print(f"{args.out}: {len(out)} samples built from {len(base)} bundled ones")


if __name__ == "__main__":
    main()
