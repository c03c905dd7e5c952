"""W4A8 against int4 on CPU: the same int4 weights, each layer called as a model calls it.

For each weight shape (N, K) and rows of x M (bfloat16 activations), times

    int4   Int4Linear (gptj.quant.int4): the path the policy gives M rows here (gptj.native's int4 GEMV
           on the exact weights at a few rows; torch's int4 kernel or gptj.native's GEMM past them)
    w4a8   W4A8Linear (gptj.quant.w4a8): x rounded to int8 per block of 32, gptj.native's GEMM on the
           integers (w4a8.c)

Both from one random float weight per copy, quantized with --group. Each implementation gets distinct
copies (over --min-mb MB each) and moves to the next copy on every call, so each call reads its weight
from memory as a decode step does; from --stream-max-rows rows on (prefill) one copy is computed on.
Rounds alternate the two (a fresh order every round); the table shows the median time per call in ms,
the int4 bytes read per second (GB/s, 1e9 bytes; weights and scales) and int4's time over w4a8's.

    python benchmarks/w4a8_gemv.py                                    # Llama-3.1-8B's shapes, M = 1 2 4 8 128
    GPTJ_NATIVE_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/w4a8_gemv.py
                                                                      # an AVX2-only CPU's code
    python benchmarks/w4a8_gemv.py --smoke --json                     # does it run?

Where gptj.native is not available it says so in one line and exits 0 (with --json: {"skipped": REASON}).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch
from torch import nn

import _smoke
from gptj import native
from gptj.quant import Int4Linear, W4A8Linear

# Llama-3.1-8B's linears as gptj serves them: q|k|v fused, o, gate|up fused, down, the LM head
SHAPES = ("6144x4096", "4096x4096", "28672x4096", "4096x14336", "128256x4096")
SMOKE = dict(shapes=["64x256"], rows=[1, 3], rounds=1, min_mb=0.05, group=64)


def _layers(N: int, K: int, group: int, copies: int, seed: int) -> dict[str, list[nn.Module]]:
    out: dict[str, list[nn.Module]] = {"int4": [], "w4a8": []}
    g = torch.Generator().manual_seed(seed)
    for _ in range(copies):
        lin = nn.Linear(K, N, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(N, K, generator=g) * 0.02)
        out["int4"].append(Int4Linear.from_float(lin, group))
        out["w4a8"].append(W4A8Linear.from_float(lin, group))
    return out


def bench_shape(N: int, K: int, rows: list[int], args: argparse.Namespace, seed: int, out) -> list[dict]:  # noqa: ANN001
    nbytes = N * K // 2 + 4 * N * (K // args.group)  # the weight and its bfloat16 scales and zeros
    copies = max(2, -(-int(args.min_mb * 1e6) // nbytes))
    layers = _layers(N, K, args.group, copies, seed)
    rng, results = random.Random(seed), []
    for M in rows:
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).bfloat16()
        stream = M < args.stream_max_rows
        pos, times = {k: 0 for k in layers}, {k: [] for k in layers}
        for k in layers:
            layers[k][0](x)  # warm-up: the kernels chosen, the first touch
        calls = max(1, min(copies - 1, int(2e-3 * 30e9 / nbytes))) if stream else 1
        for _ in range(args.rounds):
            for k in rng.sample(list(layers), len(layers)):
                p = pos[k]
                t0 = time.perf_counter()
                for i in range(calls):
                    layers[k][(p + i) % copies if stream else 0](x)
                times[k].append((time.perf_counter() - t0) / calls)
                pos[k] = (p + calls) % copies
        row = {"N": N, "K": K, "M": M, "streamed": stream, "int4_path": layers["int4"][0].path(x)}
        for k in layers:
            t = statistics.median(times[k])
            row[k] = {"ms": t * 1e3, "gb_s": nbytes / t / 1e9}
        row["speedup"] = row["int4"]["ms"] / row["w4a8"]["ms"]
        results.append(row)
        print(f"| {N}x{K} | {M} | {'streamed' if stream else 'one copy'} | {row['int4']['ms']:.3f} "
              f"({row['int4']['gb_s']:.1f}, {row['int4_path']}) | {row['w4a8']['ms']:.3f} ({row['w4a8']['gb_s']:.1f}) "
              f"| {row['speedup']:.2f}x |", file=out, flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), help="NxK weight shapes")
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 2, 4, 8, 128], help="rows of x (M)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group", type=int, default=128, help="int4's group size (a multiple of 32)")
    ap.add_argument("--min-mb", type=float, default=250.0, help="MB of distinct weight copies per implementation")
    ap.add_argument("--stream-max-rows", type=int, default=16,
                    help="from this many rows on, one copy is computed on instead of streaming copies")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object (the table to stderr)")
    args = _smoke.parse_args(ap, SMOKE, argv)
    out = sys.stderr if args.json else sys.stdout
    if not native.w4a8_available():
        why = f"gptj.native is not available here: {native.unavailable_reason()}"
        print(f"w4a8_gemv: skipped: {why}", file=sys.stderr)
        if args.json:
            print(json.dumps({"skipped": why}))
        return
    torch.set_num_threads(args.threads)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"{cpu}, gptj.native {native.isa().name}, torch {torch.__version__}, {args.threads} threads, "
          f"{args.rounds} rounds, group {args.group}\n\n| N x K | M | weights | int4 ms (GB/s, path) | w4a8 ms (GB/s) "
          "| int4 / w4a8 |\n|---|---:|---|---:|---:|---:|", file=out, flush=True)
    result = {"cpu": cpu, "isa": native.isa().name, "threads": args.threads, "rows": []}
    with torch.inference_mode():
        for i, shape in enumerate(args.shapes):
            N, K = (int(v) for v in shape.lower().split("x"))
            result["rows"] += bench_shape(N, K, args.rows, args, i, out)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
