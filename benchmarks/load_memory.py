"""Peak memory and time of loading gptj-6b (or llama3.1-8b) in bfloat16 (and preparing it for serving),
against the weight bytes and a plain file read.

    python benchmarks/load_memory.py --dir /tmp/gptj-6b-bf16     # writes the checkpoint once (12.1 GB)
    python benchmarks/load_memory.py --dir /tmp/gptj-6b-l4 --layers 4 --repeats 1   # gptj-6b's shapes, 4 layers
    python benchmarks/load_memory.py --preset llama3.1-8b --dir /tmp/llama-8b-bf16 --repeats 1   # 16.1 GB
    python benchmarks/load_memory.py --preset llama3.1-8b --dir /tmp/llama-8b-bf16 --quantize int8 --cases off

Cases, each in a fresh subprocess:
  kernels off     load_model only (what `--kernels off` serves)
  kernels native  load_model + prepare_for_serving(max_rows=1): fused blocks, native layout (batch-1 engines:
                  `gptj generate`, `bench latency`)
  kernels onednn  load_model + prepare_for_serving(max_rows=64): fused blocks reordered for oneDNN (batched engines)

--quantize MODE loads the float folder quantized as it is read (`gptj --quantize`): the weight bytes are
then the quantized model's, and `peak_over_file` says how the peak compares with the float file's bytes.

Targets (issue 15, item 7): peak RSS <= 1.1 x the weight bytes with the default kernels; load time
<= 1.5 x the time to read the files. The file read and the loads run in fresh subprocesses,
alternating, with the page cache warm for all (the first read warms it), so the ratios compare
like with like. `peak_over_weights` is the process's peak RSS over the weight bytes;
`added_over_weights` subtracts the RSS of the interpreter with torch and gptj imported (so a
few-layer model gives the per-layer ratio the whole model would).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
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
import json, sys, time, torch
from gptj.bench.latency import peak_rss_mb
from gptj.kernels import prepare_for_serving
from gptj.weights.io import load_model
case, quantize = sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else None)
def rss():
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmRSS:'))
base = rss()
t = time.perf_counter()
model = load_model(sys.argv[1], dtype=torch.bfloat16, quantize=quantize)
weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
load_s = time.perf_counter() - t
if case != 'off':
    prepare_for_serving(model, 'auto', max_rows=1 if case == 'native' else 64)
dt = time.perf_counter() - t
with torch.inference_mode():  # touches every weight (an int8 checkpoint's pages are not read before)
    logits = model(torch.tensor([[15496, 995]]))
peak = peak_rss_mb() * 1e6
print(json.dumps({'load_s': load_s, 'total_s': dt, 'weights': weights, 'peak': peak, 'base': base,
                  'finite': bool(torch.isfinite(logits).all())}))
"""

CASES = ("off", "native", "onednn")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/gptj-6b-bf16")
    ap.add_argument("--preset", default="gptj-6b", choices=("gptj-6b", "llama3.1-8b"),
                    help="the model written to --dir when it holds none")
    ap.add_argument("--layers", type=int, help="the preset's shapes with this many layers (cheaper; written to --dir)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {', '.join(CASES)}")
    ap.add_argument("--quantize", choices=("int8", "int4", "fp8"), help="quantize as read (the float folder's)")
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if not cases or any(c not in CASES for c in cases):
        ap.error(f"--cases: choose from {', '.join(CASES)}")
    out = Path(args.dir)
    if not (out / "config.json").exists():
        import torch

        from gptj.models.registry import PRESETS
        from gptj.weights.hf_model import random_folder
        from gptj.weights.io import random_state_dict, save_checkpoint

        cfg = PRESETS[args.preset]
        if args.layers:
            cfg = cfg.replace(**{"n_layer" if args.preset == "gptj-6b" else "num_hidden_layers": args.layers})
        print(f"writing a random {args.preset} ({cfg.n_layer} layers) bfloat16 checkpoint to", out, flush=True)
        if args.preset == "gptj-6b":
            save_checkpoint(random_state_dict(cfg, dtype=torch.bfloat16), cfg, out, progress=True)
        else:  # written one tensor at a time, as `gptj init --preset llama3.1-8b` writes it
            random_folder(cfg, out, dtype=torch.bfloat16, progress=True)
    subprocess.run([sys.executable, "-c", CHILD_READ, str(out)], check=True, capture_output=True)  # warm the cache
    reads, runs = [], {c: [] for c in cases}
    for _ in range(args.repeats):
        r = subprocess.run([sys.executable, "-c", CHILD_READ, str(out)], check=True, capture_output=True, text=True)
        reads.append(float(r.stdout.split()[0]))
        for case in cases:
            r = subprocess.run([sys.executable, "-c", CHILD_LOAD, str(out), case, *([args.quantize] * bool(args.quantize))],
                               check=True, capture_output=True, text=True)
            runs[case].append(json.loads(r.stdout.strip().splitlines()[-1]))
    read_s = min(reads)
    file_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    result = {"dir": str(out), "read_s": read_s, "quantize": args.quantize, "file_gb": file_bytes / 1e9}
    for case, rs in runs.items():
        best = min(rs, key=lambda r: r["peak"])
        w = best["weights"]
        result[f"kernels {case}"] = {
            "weights_gb": w / 1e9, "peak_rss_gb": best["peak"] / 1e9, "peak_over_weights": best["peak"] / w,
            "added_over_weights": (best["peak"] - best["base"]) / w, "peak_over_file": best["peak"] / file_bytes,
            "load_s": min(r["load_s"] for r in rs), "load_and_prepare_s": min(r["total_s"] for r in rs),
            "load_over_read": min(r["load_s"] for r in rs) / read_s, "logits_finite": best["finite"],
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
