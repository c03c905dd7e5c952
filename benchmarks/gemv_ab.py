"""gptj.native's decode GEMVs from two source trees, timed in one process: did a kernel change keep the speed?

Each tree's library is built (or found) by that tree's own gptj.native.build (the cache names a library
by its sources' hash, so both trees' share the cache folder), then both are loaded with ctypes into this process and called on the same streamed weights (distinct
copies over --min-mb MB each, a new copy every call, as decode reads them), alternated in a fresh
order every round. One process takes both through the same swings of the host's memory bandwidth,
which separate processes on a shared machine do not share (docs/PERFORMANCE.md#speculate-decode-rows
used it). Each cell: the median ms per call and before / after (above 1: after is faster).

    git worktree add /tmp/wt-before <commit>
    python benchmarks/gemv_ab.py --before /tmp/wt-before --rows 1 2 8 --rounds 15
    python benchmarks/gemv_ab.py --before /tmp/wt-a --after /tmp/wt-b ...   # two other trees
    python benchmarks/gemv_ab.py --kinds w4a8 --rows 1 8 64 512 --shapes 28672x4096   # W4A8's GEMM (w4a8.c)
    python benchmarks/gemv_ab.py --smoke --json      # this tree against itself, small: does it run?

Without --before the tree is timed against itself: the noise floor of the ratio. Where gptj.native
cannot build or run here it says so in one line and exits 0 (with --json: {"skipped": REASON}).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from _smoke import parse_args
from gptj.quant.ops import pack_w4a8, quantize_int4, unpack_int4

ROOT = Path(__file__).resolve().parent.parent
W4A8_GROUP = 128
SHAPES = ("12288x4096", "4096x4096", "16384x4096", "4096x16384", "50400x4096")  # GPT-J's layers and head


def library(tree: Path, isa: str | None = None) -> Path | None:
    """The path of `tree`'s gptj.native library for this CPU (or for `isa`, one of its build.ISAS' names:
    another ISA this CPU runs), built by that tree's own build code."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    pick = "None" if isa is None else f"next(i for i in build.ISAS if i.name == {isa!r})"
    run = subprocess.run([sys.executable, "-c", f"from gptj.native import build; print(build.library_path(isa={pick}) or '')"],
                         env=env, capture_output=True, text=True)
    path = run.stdout.strip()
    return Path(path) if run.returncode == 0 and path else None


def bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.gemv_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    lib.gemv_int8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
    if hasattr(lib, "gemm_w4a8"):  # trees from c7f9b5c on
        lib.gemm_w4a8.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4 + [ctypes.c_long, ctypes.c_int]
    return lib


def w4a8_weight(N: int, K: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight in W4A8's layout (groups of 128): (packed, scales and zeros)."""
    q, s, z = quantize_int4(torch.randn(N, K, generator=g) * 0.02, W4A8_GROUP)
    return pack_w4a8(unpack_int4(q), s, z)


def time_cell(libs: dict[str, ctypes.CDLL], kind: str, N: int, K: int, M: int, rounds: int, min_mb: float,
              threads: int) -> dict[str, float]:
    """Median seconds per call of each library's GEMV of `kind` on streamed (N, K) weights, M rows of x."""
    esz = {"bf16": 2, "int8": 1, "w4a8": 0.5}[kind]
    g = torch.Generator().manual_seed(N + K)
    copies = max(2, int(min_mb * 1e6 // (N * K * esz)))
    weights = [torch.randn(N, K, generator=g).bfloat16() if kind == "bf16"
               else w4a8_weight(N, K, g) if kind == "w4a8"
               else torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8) for _ in range(copies)]
    scale = torch.rand(N, generator=g).bfloat16()
    x, y = torch.randn(M, K, generator=g).bfloat16(), torch.empty(M, N, dtype=torch.bfloat16)
    if kind == "w4a8":  # float32 in and out (gptj.native.linear_w4a8)
        x, y = x.float(), y.float()

    def call(lib: ctypes.CDLL, w) -> None:  # noqa: ANN001
        rc = (lib.gemv_bf16(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), M, N, K, threads) if kind == "bf16"
              else lib.gemm_w4a8(x.data_ptr(), w[0].data_ptr(), w[1].data_ptr(), y.data_ptr(), M, N, K, W4A8_GROUP,
                                 N, threads) if kind == "w4a8"
              else lib.gemv_int8(x.data_ptr(), w.data_ptr(), scale.data_ptr(), None, y.data_ptr(), M, N, K, threads))
        if rc != 0:
            raise RuntimeError(f"gemv_{kind} failed ({rc})")

    times: dict[str, list[float]] = {name: [] for name in libs}
    for _ in range(rounds):
        for name in random.sample(list(libs), len(libs)):
            start = time.perf_counter()
            for w in weights:
                call(libs[name], w)
            times[name].append((time.perf_counter() - start) / len(weights))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, default=ROOT, help="the source tree to compare against (default: this one)")
    ap.add_argument("--after", type=Path, default=ROOT, help="the source tree compared (default: this one)")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), help="NxK weight shapes")
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 2, 8], help="rows of x (M)")
    ap.add_argument("--kinds", nargs="*", default=["bf16", "int8"], choices=("bf16", "int8", "w4a8"),
                    help="bf16, int8: the decode GEMVs (gemv.c); w4a8: W4A8's GEMM (w4a8.c, groups of 128)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--min-mb", type=float, default=400.0, help="MB of distinct weight copies per cell")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", help="the library of this ISA (gptj.native.build.ISAS: avx2, generic, ...) instead of "
                                  "the best this CPU runs")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object (the table to stderr)")
    args = parse_args(ap, {"shapes": ["256x128"], "rows": [1, 2], "rounds": 2, "min_mb": 1.0,
                                 "kinds": ["bf16", "int8", "w4a8"]}, argv)
    torch.set_num_threads(args.threads)
    paths = {"before": library(args.before.resolve(), args.isa), "after": library(args.after.resolve(), args.isa)}
    missing = [name for name, p in paths.items() if p is None]
    if missing:
        reason = f"gptj.native's library could not be built or run here ({', '.join(missing)})"
        print(f"gemv_ab: skipped: {reason}", file=sys.stderr)
        if args.json:
            print(json.dumps({"skipped": reason}))
        return 0
    libs = {name: bind(p) for name, p in paths.items()}
    missing = [name for name, lib in libs.items() if "w4a8" in args.kinds and not hasattr(lib, "gemm_w4a8")]
    if missing:
        print(f"gemv_ab: the {' and '.join(missing)} tree has no W4A8 GEMM (it came with c7f9b5c)", file=sys.stderr)
        return 2
    cells = []
    for shape in args.shapes:
        N, K = (int(v) for v in shape.lower().split("x"))
        for kind in args.kinds:
            for M in args.rows:
                t = time_cell(libs, kind, N, K, M, args.rounds, args.min_mb, args.threads)
                cell = {"N": N, "K": K, "M": M, "kind": kind, "before_ms": t["before"] * 1e3,
                        "after_ms": t["after"] * 1e3, "ratio": t["before"] / t["after"]}
                cells.append(cell)
                print(f"{N}x{K} {kind} M={M}: before {cell['before_ms']:.3f} ms, after {cell['after_ms']:.3f} ms, "
                      f"before / after {cell['ratio']:.3f}", file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps({"before": str(args.before), "after": str(args.after), "threads": args.threads, "rounds": args.rounds, "cells": cells}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
