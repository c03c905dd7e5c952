"""Peak memory and time of loading gptj-6b in bfloat16, against the weight bytes and a plain file read.

    python benchmarks/load_memory.py --dir /tmp/gptj-6b-bf16     # writes the checkpoint once (12.1 GB)

Targets (issue 4): peak RSS <= 1.1 x the weight bytes; load time <= 1.5 x the time to read the files.
The file read and the load run in fresh subprocesses, alternating, with the page cache warm for
both (the first read warms it), so the ratio compares like with like.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CHILD_READ = """
import sys, time, pathlib
t = time.perf_counter(); n = 0
for f in sorted(pathlib.Path(sys.argv[1]).glob('*.safetensors')):
    with open(f, 'rb', buffering=0) as fh:
        buf = bytearray(64 << 20)
        while (k := fh.readinto(buf)):
            n += k
print(time.perf_counter() - t, n)
"""

CHILD_LOAD = """
import sys, time, resource, torch
from gptj.weights.io import load_model
t = time.perf_counter()
model = load_model(sys.argv[1], dtype=torch.bfloat16)
dt = time.perf_counter() - t
weights = sum(p.numel() * p.element_size() for p in model.parameters())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
with torch.inference_mode():
    logits = model(torch.tensor([[15496, 995]]))
print(dt, weights, peak, bool(torch.isfinite(logits).all()))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/gptj-6b-bf16")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    out = Path(args.dir)
    if not (out / "config.json").exists():
        import torch

        from gptj.config import get_preset
        from gptj.weights.io import random_state_dict, save_checkpoint

        cfg = get_preset("gptj-6b")
        print("writing a random gptj-6b bfloat16 checkpoint to", out, flush=True)
        save_checkpoint(random_state_dict(cfg, dtype=torch.bfloat16), cfg, out, progress=True)
    subprocess.run([sys.executable, "-c", CHILD_READ, str(out)], check=True, capture_output=True)  # warm the cache
    reads, loads = [], []
    for _ in range(args.repeats):
        r = subprocess.run([sys.executable, "-c", CHILD_READ, str(out)], check=True, capture_output=True, text=True)
        reads.append(float(r.stdout.split()[0]))
        r = subprocess.run([sys.executable, "-c", CHILD_LOAD, str(out)], check=True, capture_output=True, text=True)
        dt, weights, peak, finite = r.stdout.split()
        loads.append((float(dt), int(weights), int(peak), finite == "True"))
    read_s = min(reads)
    load_s, weights, peak, finite = min(loads)
    result = {"weights_gb": weights / 1e9, "peak_rss_gb": peak / 1e9, "peak_over_weights": peak / weights,
              "read_s": read_s, "load_s": load_s, "load_over_read": load_s / read_s, "logits_finite": finite}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
