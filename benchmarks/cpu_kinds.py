"""Each quantization mode against bfloat16 on each kind of x86 CPU: which mode is fastest where.

    python benchmarks/cpu_kinds.py            # GPT-J's layer shapes (n_embd 4096, n_inner 16384), 2 layers
    python benchmarks/cpu_kinds.py --smoke    # a check that it runs

For each CPU kind (--isas) and each mode (--modes: none = bfloat16 weights, float32 = the exact
float32 model, int8, int4, w8a8 from a calibrated folder; the quantized ones in bfloat16) it runs
`gptj bench latency` in a process of its own, at each --batch-sizes, on a bfloat16 model with random weights and GPT-J's layer shapes, and prints decode tokens/s, prefill
tokens/s and each mode's ratio to bfloat16 on the same kind, and the fastest mode per column.

The kinds other than this CPU's own ("native") are its code paths under a ceiling, on this CPU:
ONEDNN_MAX_CPU_ISA (oneDNN's kernels; gptj.cpu reads it too, so gptj.native loads that kind's
library: avx512 on AVX-512 without BF16, avx2 on AVX2; and without VNNI W8A8 runs its GEMM: the NATIVE form) and ATEN_CPU_CAPABILITY (torch's own kernels and inductor's code). That is how such
a CPU's code runs, not how fast such a CPU is: the ratios between modes carry over, the absolute
figures do not (cores, caches and memory differ). Each run prints the kind the process saw.

Prints a table, or one JSON object with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from _smoke import parse_args
from gptj.config import GPTJConfig
from gptj.mlperf.dataset import Dataset
from gptj.weights.io import calibrate, random_state_dict, save_checkpoint

ISAS = {  # name: the environment a process of that kind runs under ("native": this CPU as it is)
    "native": {},
    "AVX512_CORE_VNNI": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI", "ATEN_CPU_CAPABILITY": "avx512"},  # Cascade Lake
    "AVX512_CORE": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512"},  # Skylake-SP
    "AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}


def make_model(folder: Path, width: int, layers: int, calibrated: bool) -> Path:
    """A bfloat16 model with GPT-J's head shapes (heads of 256); `calibrated` for w8a8 on 2 bundled prompts."""
    heads = max(1, width // 256)
    cfg = GPTJConfig(n_layer=layers, n_embd=width, n_head=heads, rotary_dim=min(64, width // heads),
                     n_inner=4 * width, n_positions=2048)
    path = save_checkpoint(random_state_dict(cfg, seed=0, dtype=torch.bfloat16, std=0.02), cfg, folder)
    if calibrated:
        calibrate(path, Dataset.load(max_examples=2).input_ids, "2 bundled MLPerf prompts", dtype=torch.bfloat16)
    return path


def run_one(model: Path, isa: str, mode: str, batch: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "gptj.cli", "bench", "latency", "--model", str(model), "--batch-size", str(batch),
           "--prompt-len", str(args.prompt_len), "--max-new-tokens", str(args.new_tokens), "--warmup", "1",
           "--repeats", str(args.repeats), "--threads", str(args.threads), "--json"]
    cmd += ["--dtype", "float32" if mode == "float32" else "bfloat16"]  # never bench's default (auto)
    if mode not in ("none", "float32"):
        cmd += ["--quantize", mode]
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    proc = subprocess.run(cmd, env={**env, **ISAS[isa]}, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{isa} {mode} batch {batch}: {proc.stderr.strip().splitlines()[-1:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"cpu": r["cpu"], "decode_tok_s": r["decode_tok_s"], "prefill_tok_s": r["prefill_tok_s"]}


def table(results: dict) -> str:
    lines = []
    for isa, by_mode in results.items():
        kinds = {r["cpu"] for runs in by_mode.values() for r in runs.values()}
        lines.append(f"{isa}: {', '.join(sorted(kinds))}")
        cols = [(b, key) for b in next(iter(by_mode.values())) for key in ("decode_tok_s", "prefill_tok_s")]
        lines.append("  mode   " + "".join(f"{key.split('_')[0]} b{b}".rjust(20) for b, key in cols))
        for mode, runs in by_mode.items():
            base = by_mode.get("none", runs)
            cells = [f"{runs[b][key]:8.1f} ({runs[b][key] / base[b][key]:.2f}x)" for b, key in cols]
            lines.append(f"  {mode:<6} " + "".join(c.rjust(20) for c in cells))
        best = [max(by_mode, key=lambda m: by_mode[m][b][key]) for b, key in cols]
        lines.append("  best   " + "".join(m.rjust(20) for m in best))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--isas", default="native,AVX512_CORE,AVX2", help=f"comma-separated, of {', '.join(ISAS)}")
    ap.add_argument("--modes", default="none,int8,int4,w8a8")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--work-dir", type=Path)
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, {"width": 256, "layers": 1, "isas": "AVX2", "modes": "none",
                           "batch_sizes": "2", "prompt_len": 8, "new_tokens": 3, "repeats": 1}, argv)
    isas = args.isas.split(",")
    if unknown := [i for i in isas if i not in ISAS]:
        ap.error(f"unknown --isas {unknown[0]!r} (one of {', '.join(ISAS)})")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        modes = args.modes.split(",")
        model = make_model(Path(tmp) / "model", args.width, args.layers, "w8a8" in modes)
        results = {isa: {mode: {b: run_one(model, isa, mode, b, args) for b in batches} for mode in modes}
                   for isa in isas}
    print(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "results": results})
          if args.json else table(results))


if __name__ == "__main__":
    main()
