"""This machine's memory read bandwidth as torch sees it: the roofline's memory side for decode.

Decode reads every weight once per step, so its speed limit is bandwidth / weight bytes per
token. This measures the bandwidth three ways on a buffer far larger than the caches:

    sum      torch.sum over a float32 tensor          (pure streaming read)
    mv fp32  torch.mv: float32 matrix x vector        (what a batch-1 decode step does)
    mv bf16  torch.mv: bfloat16 matrix x vector

    python benchmarks/membw.py --gb 1.5 --threads 2 --repeats 5
    python benchmarks/membw.py --smoke --json       # 50 MB buffers, one repeat: does it run?

Reports the best and the median of the repeats in GB/s (1e9 bytes); --json prints one object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import _smoke  # benchmarks/_smoke.py (a script's own folder is on sys.path)


def _measure(fn, nbytes: int, repeats: int) -> dict[str, float]:  # noqa: ANN001
    fn()  # warm-up: page in, pick kernels
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return {"best_gb_s": max(rates), "median_gb_s": statistics.median(rates)}


def measure(gb: float = 1.5, threads: int | None = None, repeats: int = 5) -> dict[str, object]:
    if threads:
        torch.set_num_threads(threads)
    out: dict[str, object] = {"gb": gb, "threads": torch.get_num_threads(), "repeats": repeats,
                              "cpu": platform.processor() or platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            out["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    with torch.inference_mode():
        n = int(gb * 1e9) // 4
        x = torch.ones(n, dtype=torch.float32)
        out["sum"] = _measure(lambda: torch.sum(x), x.numel() * 4, repeats)
        del x
        cols = 4096
        for name, dtype in (("mv_fp32", torch.float32), ("mv_bf16", torch.bfloat16)):
            size = torch.empty((), dtype=dtype).element_size()
            rows = int(gb * 1e9) // (cols * size)
            m = torch.full((rows, cols), 0.5, dtype=dtype)
            v = torch.ones(cols, dtype=dtype)
            out[name] = _measure(lambda m=m, v=v: torch.mv(m, v), m.numel() * size, repeats)
            del m
    return out


SMOKE = dict(gb=0.05, repeats=1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.5, help="buffer size in GB (well above the caches)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = _smoke.parse_args(ap, SMOKE, argv)
    r = measure(args.gb, args.threads, args.repeats)
    if args.json:
        print(json.dumps(r))
        return
    print(f"{r['cpu']}, {r['threads']} threads, {r['gb']} GB buffers, {r['repeats']} repeats")
    for key in ("sum", "mv_fp32", "mv_bf16"):
        print(f"{key:8s} best {r[key]['best_gb_s']:6.1f} GB/s   median {r[key]['median_gb_s']:6.1f} GB/s")


if __name__ == "__main__":
    main()
