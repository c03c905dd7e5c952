"""gptj.quant.cuda's weight-only GEMVs under other launch plans (block sizes, warps, K split), timed
against bfloat16's F.linear on GPT-J 6B's decode linears, so one GPU call can choose the plans
(gptj.quant.cuda.plan_for's tables, per row count; "default" below is TILES, the first default).

    python benchmarks/gemv_sweep.py --out gemv.json     # a GPU: GPT-J 6B's shapes, bfloat16 inputs
    python benchmarks/gemv_sweep.py --smoke             # CPU: Triton's interpreter, tiny shapes (runs, not speed)

For each weight kind (int8, e4m3 where the GPU has FP8 units, int4 in groups of 128), each shape
(N, K): the serving model's fused q|k|v|fc_in (28672 x 4096), out_proj (4096 x 4096), fc_out
(4096 x 16384) and lm_head (50400 x 4096), and each row count of --rows: the median time of every
plan (CUDA graph replays on a GPU, see `timer`; a plan this Triton cannot build is listed as
failed), its weight bytes per second, its speed against F.linear on
the bfloat16 weight, and its largest error against the float64 product in units of the kernel's own
bound (tests/test_quant_cuda.py's: under 1 is right). --compiled adds gpt-fast's way for int8 and
e4m3: the dequantize-and-multiply in torch, fused by torch.compile. For e4m3 (not --smoke) the
sweep also times "scaled_mm (activations e4m3)": the fp8 GEMM path (x rounded to e4m3 per token,
torch._scaled_mm), another function, so its error is its own (act_rel_error), not against the
bound, and it is not among the plans chosen. The table ends with each kind's plan of the least time
summed over the shapes at the first row count (decode's batch 1), against the default.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from _smoke import parse_args

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
if not torch.cuda.is_available():  # Triton's interpreter on CPU tensors: read when a kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gptj.quant import cuda  # noqa: E402
from gptj.quant.ops import quantize_fp8, quantize_int4, quantize_int8  # noqa: E402

GPTJ_SHAPES = {"qkv|fc_in": (28672, 4096), "out_proj": (4096, 4096), "fc_out": (4096, 16384),
               "lm_head": (50400, 4096)}
EPS32 = 2.0**-23


def plans(grid: str) -> list[cuda.Tiles]:
    """The plans to time, the default first. "small" (15): the kind "mma"'s best on the H200
    (2026-11-28: n32 / n64 with k128, 4 warps; k512, 8 warps and n128 k512 lost, so are left to
    "full"), then the kinds "swapped" (the weight as tl.dot's A operand; 16 or 8 rows a program) and
    "fma" (float32 multiply-adds; 1 row a program for decode's batch 1, 2 and 4 for small batches),
    block sizes from the arithmetic (none measured yet), and three plans converting the weight to
    bfloat16 by bit operations (Tiles.convert "bits"; bfloat16 inputs only, others run "cast"): the
    default's and n64 k128's blocks, and swapped r8 n32 k128 (r8 n64 k128 spilled registers for
    e4m3 under Triton 3.6's ptxas, sm_90a). "full" (40): the old grid of the kind mma and more of
    the new kinds'. For fp8 the sweep adds torch._scaled_mm with e4m3 activations (`scaled_mm`)."""
    if grid == "smoke":  # one of each kind (the interpreter: runs, not speed)
        return [cuda.TILES, cuda.Tiles(kind="swapped", block_n=16, int8_block_k=64, num_warps=2, rows=4),
                cuda.Tiles(kind="fma", block_n=16, int8_block_k=256, rows=1),
                cuda.Tiles(kind="fma", block_n=16, int8_block_k=128, rows=2, split=2)]
    if grid == "default":
        return [cuda.TILES]
    out = [cuda.TILES, cuda.Tiles(block_n=32, int8_block_k=128), cuda.Tiles(block_n=64, int8_block_k=128)]
    out += [cuda.Tiles(convert="bits"), cuda.Tiles(block_n=64, int8_block_k=128, convert="bits"),
            cuda.Tiles(kind="swapped", block_n=32, int8_block_k=128, rows=8, convert="bits")]
    out += [cuda.Tiles(kind="swapped", block_n=bn, int8_block_k=bk, rows=r, num_warps=w)  # (128, 256, 8) with 4
            for bn, bk, r, w in ((64, 128, 16, 4), (64, 256, 16, 4), (128, 128, 16, 4), (64, 128, 8, 4))]  # warps
    # spilled registers (ptxas, sm_90a), as (128, 256, 8) with 8 warps did: left out (2026-11-28)
    out += [cuda.Tiles(kind="fma", block_n=bn, int8_block_k=bk, rows=r)
            for bn, bk, r in ((16, 256, 1), (32, 256, 1), (16, 512, 1), (16, 256, 2), (8, 256, 4))]
    if grid == "full":
        for bn, bk in itertools.product((32, 64, 128), (128, 256, 512)):
            out.append(cuda.Tiles(block_n=bn, int8_block_k=bk, num_warps=4))
        out += [cuda.Tiles(block_n=bn, int8_block_k=bk, num_warps=8) for bn, bk in ((64, 256), (128, 256), (128, 512))]
        out += [cuda.Tiles(block_n=bn, int8_block_k=bk, num_warps=4, split=1) for bn, bk in ((64, 256), (128, 256))]
        out += [cuda.Tiles(block_n=bn, int8_block_k=256, num_warps=4, num_stages=s) for bn in (64, 128) for s in (3, 4)]
        out += [cuda.Tiles(kind="swapped", block_n=bn, int8_block_k=bk, rows=r, num_warps=w)
                for bn, bk, r, w in ((64, 512, 16, 4), (128, 128, 16, 8), (256, 128, 16, 8), (64, 128, 4, 4),
                                     (128, 256, 8, 8))]
        out += [cuda.Tiles(kind="fma", block_n=bn, int8_block_k=bk, rows=r, num_warps=w)
                for bn, bk, r, w in ((8, 512, 1, 4), (32, 512, 1, 8), (64, 256, 1, 8), (32, 256, 2, 8),
                                     (16, 256, 4, 4))]
    return list(dict.fromkeys(out))


def timer(device: str):
    """-> time(fn) in ms. On a GPU: the median of a CUDA graph's replays of fn (do_bench_cudagraph), as
    the engine's decode steps run (the Python launch, some 20-40 us a call, is not paid; the small
    shapes' times were that launch under plain do_bench, 2026-11-28), else of do_bench's CUDA-event
    timings where fn cannot be captured. Elsewhere (Triton's interpreter: a rehearsal, not a
    measurement): one perf_counter timing of a call after the first."""
    if device == "cuda":
        import triton.testing

        def cuda(fn) -> float:  # noqa: ANN001
            fn()  # compiled and warm before the capture
            try:
                return triton.testing.do_bench_cudagraph(fn, rep=25, return_mode="median")
            except Exception:  # noqa: BLE001 - not capturable: timed with its launches
                torch.cuda.synchronize()
                return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")

        return cuda

    def cpu(fn) -> float:  # noqa: ANN001 - a plan ran once before, its result checked
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return cpu


def weights(kind: str, w: torch.Tensor):
    """(the kernel's call on x, its exact weight (N, K) float64, its terms' sizes, weight bytes)."""
    if kind == "int4":
        packed, scale, zero = quantize_int4(w, 128)
        N, K = w.shape
        from gptj.quant.ops import unpack_int4

        q = unpack_int4(packed).double().view(N, K // 128, 128) - 8
        s, z = scale.double()[..., None], zero.double()[..., None]
        exact, terms = (q * s + z).view(N, K), ((q * s).abs() + z.abs()).view(N, K)
        nbytes = packed.numel() + 2 * (scale.numel() + zero.numel())
        return (lambda x, t: cuda.int4_linear(x, packed, scale, zero, 128, tiles=t)), exact, terms, nbytes
    q, scale = quantize_int8(w) if kind == "int8" else quantize_fp8(w)
    exact = q.double() * scale.double()[:, None]
    return (lambda x, t: cuda.int8_linear(x, q, scale, tiles=t)), exact, exact.abs(), q.numel() + 2 * scale.numel()


def error_in_bounds(y: torch.Tensor, x: torch.Tensor, exact: torch.Tensor, terms: torch.Tensor,
                    roundings: int = 1) -> float:
    """max |y - x @ exact.T| / its bound (float32 sums of K terms, then `roundings` roundings to y's
    dtype: 1 for gptj.quant.cuda's kernels, 2 for the compiled form: the sum, then its scaled value)."""
    ref = x.double() @ exact.T
    acc = (x.shape[1] + 4) * EPS32 * (x.double().abs() @ terms.T)
    unit = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[x.dtype]
    return float(((y.double() - ref).abs() / (acc + roundings * unit * (ref.abs() + acc))).max())


SCALED_MM = "scaled_mm (activations e4m3)"


def scaled_mm(w: torch.Tensor, m: int, dtype: torch.dtype):
    """fp8's GEMM path for more rows (gptj.quant.linear.Fp8Linear.scaled_mm, reused): x rounded to e4m3
    per token (quantize_rows_fp8) and torch._scaled_mm with the weight's per-channel scale. Its error
    is not the weight-only kernels' (the activations are quantized): reported as act_rel_error, max
    |y - x @ w.T| / max |x| @ |w|.T, not against their bound. Where torch._scaled_mm refuses m rows,
    x is padded with zero rows to a multiple of 16 (the padding's time included)."""
    from gptj.quant.linear import Fp8Linear

    N, K = w.shape
    lin = Fp8Linear(K, N, bias=False, device=w.device)
    lin.weight, lin.weight_scale = quantize_fp8(w)
    lin.prepare()
    try:
        lin.scaled_mm(torch.zeros(m, K, dtype=dtype, device=w.device))
        return lambda x, _tiles: lin.scaled_mm(x)
    except RuntimeError:
        pad = -m % 16 or 16

        def padded(x, _tiles):  # noqa: ANN001
            return lin.scaled_mm(torch.nn.functional.pad(x, (0, 0, 0, pad)))[: x.shape[0]]

        return padded


def compiled(kind: str, w: torch.Tensor):
    """gpt-fast's form, `F.linear(x, q.to(x.dtype)) * scale`, fused by torch.compile (inductor) into a
    kernel that reads the int8 / e4m3 weight once: the other way the issue names, timed beside ours."""
    q, scale = quantize_int8(w) if kind == "int8" else quantize_fp8(w)
    fn = torch.compile(lambda x: torch.nn.functional.linear(x, q.to(x.dtype)) * scale.to(x.dtype), dynamic=False)
    return lambda x, _tiles: fn(x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="the inputs' dtype (serving's: bfloat16)")
    ap.add_argument("--kinds", default="int8,fp8,int4")
    ap.add_argument("--shapes", default=",".join(GPTJ_SHAPES), help=f"of {', '.join(GPTJ_SHAPES)}, or NxK")
    ap.add_argument("--rows", default="1,16", help="row counts (the first one chooses the plan)")
    ap.add_argument("--grid", default="small", choices=["default", "small", "full"],
                    help="the plans: the default alone, 15, or 40")
    ap.add_argument("--compiled", action="store_true",
                    help="also time gpt-fast's torch.compile'd dequantize-and-multiply (int8, fp8; compiles per shape)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, {"device": "cpu", "dtype": "float32", "kinds": "int8,int4", "shapes": "64x512",
                           "rows": "3", "grid": "smoke"}, argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gemv_sweep.py: no CUDA GPU here (--smoke runs Triton's interpreter on CPU)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    kinds = [k for k in args.kinds.split(",") if k]
    if "fp8" in kinds and args.device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        kinds.remove("fp8")  # Triton converts e4m3 on FP8 units only
    shapes = {}
    for name in args.shapes.split(","):
        n, _, k = name.partition("x")
        shapes[name] = GPTJ_SHAPES[name] if name in GPTJ_SHAPES else (int(n), int(k))
    rows = [int(m) for m in args.rows.split(",")]
    time_ms = timer(args.device)
    gen = torch.Generator().manual_seed(0)
    results = []
    for shape_name, (N, K) in shapes.items():
        w = (torch.randn(N, K, generator=gen) * 0.05).to(args.device)
        dense = w.to(dtype)
        for M in rows:
            x = torch.randn(M, K, generator=gen).to(dtype).to(args.device)
            base = time_ms(lambda: torch.nn.functional.linear(x, dense))
            results.append({"kind": args.dtype, "shape": shape_name, "M": M, "plan": "F.linear", "ms": base,
                            "gb_s": dense.numel() * dense.element_size() / base / 1e6, "vs_dense": 1.0})
            for kind in kinds:
                call, exact, terms, nbytes = weights(kind, w)
                runs = [(plan_name(tiles), call, tiles, 1) for tiles in plans(args.grid)]
                if args.compiled and kind != "int4":
                    runs.append(("torch.compile", compiled(kind, w), None, 2))
                if kind == "fp8" and args.grid != "smoke":
                    runs.append((SCALED_MM, scaled_mm(w, M, dtype), None, 0))
                for plan, fn, tiles, roundings in runs:
                    try:
                        y = fn(x, tiles)
                    except Exception as e:  # noqa: BLE001 - a plan this Triton cannot build: said, not fatal
                        results.append({"kind": kind, "shape": shape_name, "M": M, "plan": plan,
                                        "error": f"{type(e).__name__}: {(str(e) or ' ').splitlines()[0][:200]}"})
                        continue
                    ms = time_ms(lambda: fn(x, tiles))  # noqa: B023 - called at once
                    row = {"kind": kind, "shape": shape_name, "M": M, "plan": plan, "ms": ms,
                           "gb_s": nbytes / ms / 1e6, "vs_dense": base / ms}
                    if roundings:
                        row["error_in_bounds"] = error_in_bounds(y, x, exact, terms, roundings)
                    else:  # activations quantized: no weight-only bound holds
                        row["act_rel_error"] = float((y.double() - x.double() @ exact.T).abs().max()
                                                     / (x.double().abs() @ terms.T).max())
                    results.append(row)
        if args.out:  # what is done so far, in case the run is cut short (the full report replaces it)
            args.out.write_text(json.dumps({"partial": True, "dtype": args.dtype, "results": results}, indent=1))
    best = choose(results, kinds, rows[0])
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "dtype": args.dtype, "results": results, "best": best}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report) if args.json else "\n".join(table(report)))
    wrong = [r for r in results if r.get("error_in_bounds", 0) > 1 or math.isnan(r.get("error_in_bounds", 0))]
    if wrong:
        print(f"gemv_sweep.py: {len(wrong)} results past their error bound", file=sys.stderr)
    return 1 if wrong else 0


def plan_name(t: cuda.Tiles) -> str:
    """The kind "mma" with 16 rows a program (the plans timed before the other kinds) named as then."""
    head = "" if t.kind == "mma" and t.rows == cuda.BLOCK_M else f"{t.kind} r{t.rows} "
    return (head + f"n{t.block_n} k{t.int8_block_k} w{t.num_warps}" + (f" split{t.split}" if t.split else "")
            + (f" s{t.num_stages}" if t.num_stages else "") + (" bits" if t.convert == "bits" else "")
            + (" (default)" if t == cuda.TILES else ""))


def choose(results: list[dict], kinds: list[str], m: int) -> dict:
    """Per kind: the plan of the least time summed over the shapes at m rows, its sum, the default's;
    and per row count timed, that row count's plan of the least summed time ("by_rows": a plan whose
    speed depends on the rows, as the kind fma's of few rows a program, may win at one and not another)."""
    best = {}
    for kind in kinds:
        by_rows: dict[int, dict[str, float]] = {}
        failed = {r["plan"] for r in results if r["kind"] == kind and "error" in r}  # not on every shape: not summed
        for r in results:  # the weight-only plans (scaled_mm computes another function)
            if r["kind"] == kind and r["plan"] not in failed and r["plan"] != SCALED_MM:
                sums = by_rows.setdefault(r["M"], {})
                sums[r["plan"]] = sums.get(r["plan"], 0.0) + r["ms"]
        sums = by_rows[m]
        dense = sum(r["ms"] for r in results if r["plan"] == "F.linear" and r["M"] == m)
        plan = min(sums, key=sums.get)
        default = next(p for p in sums if p.endswith("(default)"))
        best[kind] = {"plan": plan, "ms": sums[plan], "default_ms": sums[default], "dense_ms": dense,
                      "vs_dense": dense / sums[plan],
                      "by_rows": {str(rows): {"plan": min(s, key=s.get), "ms": min(s.values())}
                                  for rows, s in by_rows.items()}}
    return best


def table(report: dict) -> list[str]:
    lines = [f"{report['device']}, torch {report['torch']}, {report['dtype']} inputs"]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"{r['kind']:>8} {r['shape']:>10} M={r['M']:<3} {r['plan']:<34} failed: {r['error']}")
            continue
        err = f"  err {r['error_in_bounds']:.2f} of bound" if "error_in_bounds" in r else ""
        if "act_rel_error" in r:
            err = f"  err {r['act_rel_error']:.1e} of max |x| @ |w|"
        lines.append(f"{r['kind']:>8} {r['shape']:>10} M={r['M']:<3} {r['plan']:<34} {r['ms'] * 1e3:9.1f} us "
                     f"{r['gb_s']:7.0f} GB/s {r['vs_dense']:5.2f}x dense{err}")
    for kind, b in report["best"].items():
        lines.append(f"best {kind}: {b['plan']}: {b['ms'] * 1e3:.0f} us over the shapes (default "
                     f"{b['default_ms'] * 1e3:.0f} us, dense {b['dense_ms'] * 1e3:.0f} us: {b['vs_dense']:.2f}x dense)")
        lines += [f"  at M={rows}: {r['plan']}: {r['ms'] * 1e3:.0f} us" for rows, r in b.get("by_rows", {}).items()]
    return lines


if __name__ == "__main__":
    sys.exit(main())
