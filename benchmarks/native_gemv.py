"""Decode GEMV on CPU: gptj.native's kernels against torch's, weights streamed from memory.

For each weight shape (N, K) and rows of x M, times

    native int8   gptj.native.linear_int8            x bf16 (M, K), w int8 (N, K), scale bf16 (N,)
    torch int8    torch._weight_int8pack_mm          same arguments
    native bf16   gptj.native.linear_bf16            w bf16 (N, K)
    oneDNN bf16   torch.ops.mkldnn._linear_pointwise on the oneDNN-packed weight (kernels.py's);
                  only where oneDNN computes bfloat16 (gptj.policy.can_pack), else "-"
    F.linear bf16 torch.nn.functional.linear         plain row-major bf16 weight
    F.linear f32  the same in float32 (x and w float32: what a CPU without bfloat16 arithmetic runs)

gptj.native's library is this CPU's best ISA (gptj.native.isa(): avx512-bf16 or avx2); under
`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` every column runs an AVX2-only CPU's code.

Every implementation gets its own set of distinct weight copies (over --min-mb MB each, far more
than the caches) and moves to the next copy on every call, so each call reads its weight from
memory, as a decode step does. Rounds alternate the implementations (each round times a burst of
calls of each in turn, a fresh order every round); the table shows the median over rounds of the
time per call, in ms, and the weight bytes per second (GB/s, 1e9 bytes). "speedup" is torch's time
over native's (int8: against _weight_int8pack_mm; bf16: against the fastest of oneDNN, F.linear bf16
and F.linear f32).
The streaming-read bandwidth of the machine (torch.sum over float32) is measured alongside.

A second part checks that the native kernels and torch's share one OpenMP runtime and thread pool:
native and torch calls alternated run as fast as each alone.

    python benchmarks/native_gemv.py                       # all shapes, M = 1 2 4 8
    python benchmarks/native_gemv.py --shapes 7168x1024 --rows 1 --rounds 15
    python benchmarks/native_gemv.py --smoke --json     # small shapes, one round: does it run?
    python benchmarks/native_gemv.py --int8-gemm --rows 8 16 24 32 64 128 512 1024 2048 --rounds 5
    python benchmarks/native_gemv.py --int4-gemm --rows 1 4 8 16 32 64 128 512 --rounds 5

--int8-gemm times int8 weights at many rows instead (prefill's calls: one weight copy, computed on, not
streamed): gptj.native's int8 GEMV and, where the library has one (AVX512-BF16's), its int8 GEMM (the
GEMV forced with int8_gemm_min_rows, then the GEMM), the weight dequantized for F.linear a chunk at a
time (gptj.quant.ops.chunked_linear: the policy's DEQUANTIZE), and oneDNN's bfloat16 GEMM on bfloat16
weights of the shape (what bfloat16 runs); the median over rounds, in ms, the implementations
alternated within each round. It says where the policy's native_int8_max_rows and the GEMM's crossover
come from.

--int4-gemm does the same for int4 weights (an Int4Linear of a random weight, --group): torch's int4
kernel, the dequantized matmul (Int4Linear's, gptj.native unpacking torch's layout; in float32 where the
policy upcasts: a CPU without bfloat16 arithmetic), gptj.native's int4 GEMV (every library) and GEMM
(AVX512-BF16's; there each forced with int4_gemm_min_rows), oneDNN's bfloat16 GEMM and gptj.native's
bfloat16 GEMV: where the policy's INT4_NATIVE_MIN_ROWS, INT4_AVX2_MAX_ROWS, the GEMM's crossover and the
int4 crossovers come from.

Where gptj.native's GEMV is not available (GPTJ_NATIVE=0, no compiler, a CPU without AVX2 + FMA)
it says so in one line and exits 0 (with --json: {"skipped": REASON}).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from gptj import native, policy, threads

import _smoke  # benchmarks/_smoke.py (a script's own folder is on sys.path)

SHAPES = ("7168x1024", "1024x1024", "1024x4096", "50400x1024", "16384x4096", "28672x4096")
IMPLS = ("native int8", "torch int8", "native bf16", "oneDNN bf16", "F.linear bf16", "F.linear f32")


def _copies(nbytes: int, min_mb: float) -> int:
    return max(2, -(-int(min_mb * 1e6) // nbytes))


def _make_impls(N: int, K: int, min_mb: float, seed: int) -> dict[str, tuple[list, object, int]]:
    """name -> (weight copies, fn(x, w), bytes per weight)"""
    g = torch.Generator().manual_seed(seed)
    n8 = _copies(N * K, min_mb)
    w8 = [torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8) for _ in range(n8)]
    scale = (torch.rand(N, generator=g) * 0.01 + 0.001).bfloat16()
    n16 = _copies(2 * N * K, min_mb)
    w16 = [(torch.rand(N, K, generator=g) - 0.5).bfloat16() for _ in range(n16)]
    onednn = policy.can_pack(torch.bfloat16, "cpu")
    wpk = [torch.ops.mkldnn._reorder_linear_weight((torch.rand(N, K, generator=g) - 0.5).bfloat16(), 1)
           for _ in range(n16)] if onednn else []
    w32 = [torch.rand(N, K, generator=g) - 0.5 for _ in range(_copies(4 * N * K, min_mb))]
    out = {
        "native int8": (w8, lambda x, w: native.linear_int8(x, w, scale), N * K),
        "torch int8": (w8, lambda x, w: torch._weight_int8pack_mm(x, w, scale), N * K),
        "native bf16": (w16, lambda x, w: native.linear_bf16(x, w), 2 * N * K),
        "oneDNN bf16": (wpk, lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), 2 * N * K),
        "F.linear bf16": (w16, lambda x, w: F.linear(x, w), 2 * N * K),
        "F.linear f32": (w32, lambda x, w: F.linear(x.float(), w), 4 * N * K),
    }
    if not onednn:
        del out["oneDNN bf16"]
    return out


def _sum_bandwidth(buf: torch.Tensor) -> float:
    t0 = time.perf_counter()
    torch.sum(buf)
    return buf.numel() * 4 / (time.perf_counter() - t0) / 1e9


def bench_shape(N: int, K: int, rows: list[int], rounds: int, min_mb: float, burst_ms: float,
                seed: int, out=sys.stdout) -> list[dict]:  # noqa: ANN001
    impls = _make_impls(N, K, min_mb, seed)
    rng = random.Random(seed)
    sumbuf = torch.ones(int(max(min_mb, 1) * 1e6) // 4)  # as large as each implementation's weight copies
    results = []
    for M in rows:
        x = torch.randn(M, K).bfloat16()
        names = [name for name in IMPLS if name in impls]
        pos = {name: 0 for name in names}
        times: dict[str, list[float]] = {name: [] for name in names}
        bw: list[float] = []
        # calls per burst: enough for ~burst_ms at 30 GB/s, at most one pass over the copies
        for name in names:
            copies, fn, nbytes = impls[name]
            fn(x, copies[0])  # warm-up (kernel selection, first-touch)
        for _ in range(rounds):
            order = list(names)
            rng.shuffle(order)
            bw.append(_sum_bandwidth(sumbuf))
            for name in order:
                copies, fn, nbytes = impls[name]
                calls = max(1, min(len(copies) - 1, int(burst_ms * 1e-3 * 30e9 / nbytes)))
                p = pos[name]
                t0 = time.perf_counter()
                for i in range(calls):
                    fn(x, copies[(p + i) % len(copies)])
                times[name].append((time.perf_counter() - t0) / calls)
                pos[name] = (p + calls) % len(copies)
        row = {"N": N, "K": K, "M": M, "sum_gbs": statistics.median(bw)}
        for name in names:
            t = statistics.median(times[name])
            row[name] = (t * 1e3, impls[name][2] / t / 1e9)
        results.append(row)
        print(_line(row), file=out, flush=True)
    del impls
    gc.collect()
    return results


HEADER = ("| N x K | M | native int8 | torch int8 | int8 speedup | native bf16 | oneDNN bf16 "
          "| F.linear bf16 | F.linear f32 | bf16 speedup | sum GB/s |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def _cell(v: tuple[float, float] | None) -> str:
    return "-" if v is None else f"{v[0]:.3f} ms ({v[1]:.1f} GB/s)"


def _line(r: dict) -> str:
    s8 = r["torch int8"][0] / r["native int8"][0]
    s16 = min(r[k][0] for k in ("oneDNN bf16", "F.linear bf16", "F.linear f32") if k in r) / r["native bf16"][0]
    return (f"| {r['N']}x{r['K']} | {r['M']} | {_cell(r['native int8'])} | {_cell(r['torch int8'])} | "
            f"{s8:.2f}x | {_cell(r['native bf16'])} | {_cell(r.get('oneDNN bf16'))} | "
            f"{_cell(r['F.linear bf16'])} | {_cell(r['F.linear f32'])} | {s16:.2f}x | {r['sum_gbs']:.1f} |")


def interleave_check(calls: int = 400, min_mb: float = 250) -> tuple[dict, str]:
    """Median time per call (ms) of a native and a torch kernel, each alone and alternated call by call.

    hot: weights that stay in cache (1 MB int8, 1 MB bf16), so the calls are short and
    compute-bound; two OpenMP runtimes would show here (the other runtime's threads spin on the
    cores for a while after each of its parallel regions). stream: 7168x1024 int8 weights from
    memory, as in decode.
    """
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1024).bfloat16()
    hot8 = torch.randint(-127, 128, (1024, 1024), generator=g, dtype=torch.int8)
    hot_s = torch.rand(1024, generator=g).bfloat16()
    hot16 = torch.rand(512, 1024, generator=g).bfloat16()
    onednn = policy.can_pack(torch.bfloat16, "cpu")  # else torch's bfloat16 partner is F.linear
    hot_pk = torch.ops.mkldnn._reorder_linear_weight(hot16, 1) if onednn else hot16
    N = 7168
    n = _copies(N * 1024, min_mb)
    ws = [torch.randint(-127, 128, (N, 1024), generator=g, dtype=torch.int8) for _ in range(2 * n)]
    sc = torch.rand(N, generator=g).bfloat16()
    pairs = {
        "hot int8 1024x1024": (lambda i: native.linear_int8(x, hot8, hot_s),
                               lambda i: torch._weight_int8pack_mm(x, hot8, hot_s)),
        "hot bf16 512x1024": (lambda i: native.linear_bf16(x, hot16),
                               (lambda i: torch.ops.mkldnn._linear_pointwise(x, hot_pk, None, "none", [], ""))
                               if onednn else (lambda i: F.linear(x, hot16))),
        "stream int8 7168x1024": (lambda i: native.linear_int8(x, ws[i % n], sc),
                                  lambda i: torch._weight_int8pack_mm(x, ws[n + i % n], sc)),
    }
    lines = ["| weights | native alone | native alternated | torch alone | torch alternated |",
             "|---|---:|---:|---:|---:|"]
    data: dict = {}
    for label, (fa, fb) in pairs.items():
        for f in (fa, fb):
            for i in range(20):
                f(i)
        alone: list[list[float]] = [[], []]
        for k, f in enumerate((fa, fb)):
            for i in range(calls):
                t0 = time.perf_counter()
                f(i)
                alone[k].append(time.perf_counter() - t0)
        mixed: list[list[float]] = [[], []]
        for i in range(calls):
            for k, f in enumerate((fa, fb)):
                t0 = time.perf_counter()
                f(i)
                mixed[k].append(time.perf_counter() - t0)
        ms = [statistics.median(v) * 1e3 for v in (alone[0], mixed[0], alone[1], mixed[1])]
        lines.append(f"| {label} | {ms[0]:.4f} ms | {ms[1]:.4f} ms | {ms[2]:.4f} ms | {ms[3]:.4f} ms |")
        data[label] = dict(zip(("native_alone_ms", "native_alternated_ms", "torch_alone_ms", "torch_alternated_ms"),
                               ms))
    runtimes = threads.openmp_runtimes()
    lines.append("")
    lines.append(f"OpenMP runtimes mapped in this process: {len(runtimes)} ({', '.join(runtimes) or 'none'})")
    return {"pairs": data, "openmp_runtimes": list(runtimes)}, "\n".join(lines)


GEMM_SHAPES = ("28672x4096", "16384x4096", "4096x16384", "4096x4096", "50400x4096")


def bench_int8_gemm(shapes: list[str], rows: list[int], rounds: int, out) -> list[dict]:
    """--int8-gemm's table: int8 weights at many rows, each implementation's median ms."""
    from gptj.quant.ops import chunked_linear

    default = native.int8_gemm_min_rows()
    impls = ["GEMV", *(["GEMM"] if default else []), "dequantize",
             *(["oneDNN bf16"] if policy.can_pack(torch.bfloat16, "cpu") else [])]
    print(f"int8 weights at many rows (the GEMM from {default or '-'} rows by default); median of {rounds}, ms\n",
          file=out)
    print(f"{'shape':>12} {'rows':>5} " + " ".join(f"{i:>12}" for i in impls), file=out, flush=True)
    table = []
    try:
        for shape in shapes:
            N, K = (int(v) for v in shape.lower().split("x"))
            g = torch.Generator().manual_seed(N + K)
            w = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
            scale = (torch.rand(N, generator=g) * 0.01 + 0.001).bfloat16()
            packed = (torch.ops.mkldnn._reorder_linear_weight(torch.randn(N, K, generator=g).bfloat16(), 1)
                      if "oneDNN bf16" in impls else None)
            for M in rows:
                x = torch.randn(M, K, generator=g).bfloat16()

                def forced(at: int):
                    def call():
                        native.int8_gemm_min_rows(at)
                        native.linear_int8(x, w, scale)
                    return call
                calls = {"GEMV": forced(1 << 30), "GEMM": forced(1),
                         "dequantize": lambda: chunked_linear(x, w, torch.bfloat16, scale),
                         "oneDNN bf16": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
                table.append(_time_row(shape, M, impls, calls, rounds, out))
    finally:
        native.int8_gemm_min_rows(default or None)
    return table


def _time_row(shape: str, M: int, impls: list[str], calls: dict, rounds: int, out) -> dict:
    """One line of a many-rows table: each implementation's median ms over rounds (a warm-up call first;
    the implementations in a fresh order every round)."""
    times: dict[str, list[float]] = {i: [] for i in impls}
    for i in impls:
        calls[i]()  # warm-up
    for _ in range(rounds):
        for i in random.sample(impls, len(impls)):
            t = time.perf_counter()
            calls[i]()
            times[i].append((time.perf_counter() - t) * 1e3)
    med = {i: statistics.median(v) for i, v in times.items()}
    print(f"{shape:>12} {M:>5} " + " ".join(f"{med[i]:>12.2f}" for i in impls), file=out, flush=True)
    return {"shape": shape, "rows": M, **med}


def bench_int4_gemm(shapes: list[str], rows: list[int], rounds: int, group: int, out) -> list[dict]:
    """--int4-gemm's table: int4 weights (an Int4Linear of a random weight) at many rows, each path's
    median ms: torch's int4 kernel, the dequantized matmul (in float32 where the policy upcasts), gptj.native's
    int4 GEMV and GEMM (each forced with int4_gemm_min_rows where the library has both), oneDNN's bfloat16
    GEMM on bfloat16 weights (where oneDNN computes bfloat16) and gptj.native's bfloat16 GEMV."""
    from gptj.quant import Int4Linear
    from gptj.quant.ops import cpu_int4_layout

    runs = native.int4_gemm_available(cpu_int4_layout())
    default = native.int4_gemm_min_rows() if runs else 0  # 0: no GEMM (the GEMV at every row count)
    impls = ["int4 kernel", "dequantize", *(["int4 GEMV"] if runs else []), *(["int4 GEMM"] if default else []),
             *(["oneDNN bf16"] if policy.can_pack(torch.bfloat16, "cpu") else []),
             *(["native bf16"] if native.available() else [])]
    print(f"int4 weights (group {group}) at many rows (gptj.native's {native.isa().name if runs else '-'} library: "
          f"GEMM from {default or '-'} rows by default); median of {rounds}, ms\n", file=out)
    print(f"{'shape':>12} {'rows':>5} " + " ".join(f"{i:>12}" for i in impls), file=out, flush=True)
    table = []
    try:
        for shape in shapes:
            N, K = (int(v) for v in shape.lower().split("x"))
            g = torch.Generator().manual_seed(N + K)
            weight = torch.randn(N, K, generator=g).bfloat16()
            lin = torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16).requires_grad_(False)
            lin.weight.copy_(weight)
            m = Int4Linear.from_float(lin, group)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if "oneDNN bf16" in impls else None
            kernel = m.weight if m.layout == "cpu" else m._kernel_weight
            # the dequantized matmul as the policy runs it: in float32 (UPCAST) where a CPU has no bfloat16 arithmetic
            up = torch.float32 if policy.Capabilities.probe("cpu").upcasts(torch.bfloat16) else torch.bfloat16
            for M in rows:
                x = torch.randn(M, K, generator=g).bfloat16()

                def forced(at: int):
                    def call():
                        native.int4_gemm_min_rows(at)
                        m._native_gemm(x)
                    return call
                calls = {"int4 kernel": lambda: torch._weight_int4pack_mm_for_cpu(x, kernel, m.group_size,
                                                                                  m._scales_and_zeros),
                         "dequantize": lambda: m._dequant_linear(x.to(up)),
                         "int4 GEMV": forced(1 << 30) if default else lambda: m._native_gemm(x),
                         "int4 GEMM": forced(1),
                         "oneDNN bf16": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                         "native bf16": lambda: native.linear_bf16(x, weight)}
                table.append(_time_row(shape, M, impls, calls, rounds, out))
    finally:
        native.int4_gemm_min_rows(default or None)
    return table


SMOKE = dict(shapes=["256x128"], rows=[1, 2], rounds=1, min_mb=1.0, burst_ms=0.1, interleave_calls=10)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), help="NxK weight shapes")
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 2, 4, 8], help="rows of x (M)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-mb", type=float, default=250.0, help="MB of distinct weight copies per implementation")
    ap.add_argument("--burst-ms", type=float, default=2.0, help="approximate length of one timed burst")
    ap.add_argument("--no-interleave", action="store_true", help="skip the OpenMP interleave check")
    ap.add_argument("--interleave-calls", type=int, default=400, help="timed calls per kernel in the interleave check")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object (tables to stderr)")
    ap.add_argument("--int8-gemm", action="store_true",
                    help=f"int8 weights at many rows instead (default shapes {' '.join(GEMM_SHAPES)})")
    ap.add_argument("--int4-gemm", action="store_true",
                    help="int4 weights at many rows instead (shapes as --int8-gemm)")
    ap.add_argument("--group", type=int, default=128, help="--int4-gemm's group size")
    ap.add_argument("--prefetch", type=int, metavar="BYTES",
                    help="every GEMV's software prefetch distance for this run (0: off; default: the library's, "
                         "8192; the int4 GEMVs keep theirs while it is on)")
    ap.add_argument("--prefetch-bf16", type=int, metavar="BYTES",
                    help="then the bfloat16 GEMV's alone (default: the library's, 1024 on AVX2, else 8192)")
    args = _smoke.parse_args(ap, SMOKE, argv)
    out = sys.stderr if args.json else sys.stdout

    torch.set_num_threads(args.threads)
    if not native.has("gemv"):
        why = "gptj.native's GEMV is not available here (GPTJ_NATIVE=0, no gcc, or no AVX2 + FMA)"
        print(f"native_gemv: skipped: {why}", file=sys.stderr)
        if args.json:
            print(json.dumps({"skipped": why}))
        return
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    from gptj.native import loader

    for flag, value in (("--prefetch", args.prefetch), ("--prefetch-bf16", args.prefetch_bf16)):
        if value is not None and value < 0:
            ap.error(f"{flag} takes a distance in bytes, 0 or more")
    lib = loader.load()
    if args.prefetch is not None:
        lib.gemv_set_tuning(args.prefetch, -1)
    if args.prefetch_bf16 is not None:
        lib.gemv_set_prefetch_bf16(args.prefetch_bf16)
    prefetch = {"int8": lib.gemv_get_prefetch(), "bf16": lib.gemv_get_prefetch_bf16()}
    if args.int8_gemm or args.int4_gemm:
        print(f"{cpu}, gptj.native {native.isa().name}, torch {torch.__version__}, {torch.get_num_threads()} threads\n",
              file=out)
        shapes = args.shapes if args.shapes != list(SHAPES) else list(GEMM_SHAPES)
        with torch.inference_mode():
            key, table = (("int8_gemm", bench_int8_gemm(shapes, args.rows, args.rounds, out)) if args.int8_gemm else
                          ("int4_gemm", bench_int4_gemm(shapes, args.rows, args.rounds, args.group, out)))
        if args.json:
            print(json.dumps({"cpu": cpu, "isa": native.isa().name, key: table}))
        return
    print(f"{cpu}, gptj.native {native.isa().name}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds, >= {args.min_mb:.0f} MB of weight copies per implementation, prefetch "
          f"{prefetch['int8']} (int8) and {prefetch['bf16']} (bf16) bytes ahead\n", file=out)
    print(HEADER, file=out, flush=True)
    result: dict = {"cpu": cpu, "isa": native.isa().name, "threads": torch.get_num_threads(), "rounds": args.rounds,
                    "prefetch": prefetch, "rows": []}
    with torch.inference_mode():
        for i, shape in enumerate(args.shapes):
            N, K = (int(v) for v in shape.lower().split("x"))
            for row in bench_shape(N, K, args.rows, args.rounds, args.min_mb, args.burst_ms, seed=i, out=out):
                result["rows"].append({k: ({"ms": v[0], "gb_s": v[1]} if isinstance(v, tuple) else v)
                                       for k, v in row.items()})
        if not args.no_interleave:
            print("\nnative and torch kernels alone and alternated call by call (1 row; median per call):\n", file=out)
            result["interleave"], text = interleave_check(args.interleave_calls, args.min_mb)
            print(text, file=out, flush=True)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
