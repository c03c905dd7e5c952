"""W8A8's GEMM on CPU: gptj.native's packed int8 GEMM against oneDNN's, at decode's and prefill's rows.

For each weight shape (N, K) and rows of x M, times, on the same int8 weight and the same rows:

    native         gptj.native.linear_w8a8 on pack_w8a8's panels (int16 pairs into int32: vpmaddwd on
                   AVX2, vpdpwssd on AVX-512), bfloat16 out
    oneDNN SPLIT   oneDNN's u8 x s8 GEMM on twice the rows (p = max(q, 0), n = max(-q, 0)): what a CPU
                   without VNNI runs when gptj.native is not there (exact)
    oneDNN SHIFTED oneDNN's GEMM on q + 128 in one pass: exact only with AVX-512 VNNI, timed only there

and prints ms per call (best of --rounds rounds of a burst of calls; implementations alternate every
round) with the integer operations per second of the fastest. These are the timings behind
gptj.policy's W8A8 form (w8a8_form: NATIVE where the CPU lacks VNNI). Under
`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` both run an AVX2-only CPU's code (gptj.native loads
its AVX2 library, oneDNN its AVX2 kernels).

    python benchmarks/w8a8_gemm.py
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/w8a8_gemm.py
    python benchmarks/w8a8_gemm.py --smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from _smoke import parse_args

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from gptj import cpu, native, policy  # noqa: E402


def best_ms(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1000 * (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["4096x4096", "16384x4096", "4096x16384"],
                    help="weight shapes NxK (GPT-J 6B: 4096x4096, 16384x4096, 4096x16384)")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 128, 512])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parse_args(ap, {"shapes": ["64x96"], "rows": [1, 7], "rounds": 1}, argv)
    torch.set_num_threads(args.threads)
    if not native.has("gemv"):
        out = {"skipped": f"gptj.native is not available here: {native.unavailable_reason()}"}
        print(json.dumps(out) if args.json else out["skipped"])
        print(f"w8a8_gemm: skipped: {out['skipped']}", file=sys.stderr)
        return 0
    onednn = policy.onednn_int8("cpu")
    shifted = onednn and cpu.int8_sums_exact()
    g = torch.Generator().manual_seed(0)
    rows_out = []
    for shape in args.shapes:
        N, K = (int(v) for v in shape.lower().split("x"))
        w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        ws = torch.rand(N, generator=g) + 0.5
        panels = native.pack_w8a8(w)
        prepacked = torch.ops.onednn.qlinear_prepack(w, None) if onednn else None
        zeros, ones = torch.zeros(N, dtype=torch.int64), torch.ones(N)
        for M in args.rows:
            qu, sx = native.quantize_rows_u8(torch.randn(M, K, generator=g).bfloat16())
            q = (qu.to(torch.int16) - 128).to(torch.int8)
            impls = {"native": lambda: native.linear_w8a8(qu, sx, panels, ws)}
            if onednn:
                def split():
                    halves = torch.ops.onednn.qlinear_pointwise(
                        torch.cat((q, -q)).clamp_(min=0).view(torch.uint8), 1.0, 0, prepacked, ones, zeros, None,
                        1.0, 0, torch.float32, "none", [], "")
                    return halves[:M] - halves[M:]
                impls["oneDNN SPLIT"] = split
            if shifted:
                impls["oneDNN SHIFTED"] = lambda: torch.ops.onednn.qlinear_pointwise(
                    qu, 1.0, 128, prepacked, ws, zeros, None, 1.0, 0, torch.float32, "none", [], "")
            calls = max(1, min(10, int(2e9 / (M * N * K))))
            times = {name: float("inf") for name in impls}
            for r in range(args.rounds):
                for name in (list(impls) if r % 2 == 0 else list(reversed(impls))):
                    times[name] = min(times[name], best_ms(impls[name], calls))
            fastest = min(times, key=times.get)
            rows_out.append({"N": N, "K": K, "M": M, "ms": times, "fastest": fastest,
                             "gop_s": 2 * M * N * K / times[fastest] / 1e6})
    result = {"isa": native.isa().name, "cpu": cpu.describe(), "threads": args.threads, "rows": rows_out}
    if args.json:
        print(json.dumps(result))
        return 0
    names = list(rows_out[0]["ms"]) if rows_out else []
    print(f"gptj.native {result['isa']} library, {result['cpu']}, {args.threads} threads; ms per call (best of "
          f"{args.rounds} rounds)")
    print("| N x K | rows | " + " | ".join(names) + " | fastest | GOP/s |")
    print("|---|---|" + "---|" * len(names) + "---|---|")
    for row in rows_out:
        print(f"| {row['N']} x {row['K']} | {row['M']} | " + " | ".join(f"{row['ms'][n]:.2f}" for n in names)
              + f" | {row['fastest']} | {row['gop_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
