"""gptj.native's attention and elementwise kernels, per ISA library this CPU runs, on GPT-J's heads.

Times, in ms (median of --repeats calls after one warm-up; the median of --rounds such measurements,
each round measuring every library in a rotated order), on 16 heads of 256 in blocks of 16 tokens:
    decode bf16 / int8 N   attention_paged: N sequences (each its own blocks), --context tokens each,
                           bfloat16 or int8 KV
    prefill bf16 / int8    prefill_paged: a --chunk-token prompt chunk from position 0, and one after
                           --context tokens (bfloat16 KV)
    gelu                   8 rows of 16384 (fc_in's output at batch 8)
    argmax 32x50400        argmax_rows over 32 rows of 50,400 float32 logits (a greedy step's), and
                           torch's `max(dim=-1).indices` on the same rows, in the same rounds (the
                           "torch" row; "-" where a library predates the kernel)
for each library of gptj.native.ISAS this CPU runs (built if needed; the AVX2 one on an AVX-512
machine too, and the portable one, what an ARM CPU would build), and for each --library
NAME=PATH:ISA given (a library built from other sources, for example an earlier commit's, compiled
with that ISA's flags): how a change to the kernels is checked against the code before it on the
same machine, in the same process.

    python benchmarks/native_attention.py
    python benchmarks/native_attention.py --library old=/tmp/old.so:avx512-bf16
    python benchmarks/native_attention.py --smoke --json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch

import _smoke  # benchmarks/_smoke.py (a script's own folder is on sys.path)
from gptj import native
from gptj.native import loader


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def run(args: argparse.Namespace) -> dict:
    H, D, B = args.heads, args.head_dim, 16
    per_seq = -(-args.context // B)
    n_blocks = per_seq * max(args.batches) + per_seq
    g = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(n_blocks, H, B, D, generator=g).bfloat16() for _ in range(2))
    ki, vi = (torch.randint(-127, 128, (n_blocks, H, B, D), generator=g, dtype=torch.int8) for _ in range(2))
    ks, vs = (torch.rand(n_blocks, H, B, generator=g) * 0.01 for _ in range(2))
    x = torch.randn(8, 16384, generator=g).bfloat16()
    logits = torch.randn(32 if not args.smoke else 4, 50400, generator=g)
    argmax = f"argmax {logits.shape[0]}x{logits.shape[1]}"

    def tables(N: int):
        order = torch.randperm(n_blocks, generator=g).int()
        stab = order[:N * per_seq].contiguous()
        return (torch.arange(N + 1, dtype=torch.int32), stab, (torch.arange(N) * per_seq).int(),
                torch.full((N,), args.context, dtype=torch.int32), torch.zeros(N, 1, dtype=torch.int32),
                torch.zeros(N, dtype=torch.int32))

    libs = []
    for isa in native.ISAS:
        lib = native.open_isa(isa.name)
        if lib is not None:
            libs.append((isa.name, lib, isa))
    for spec in args.library:
        name, _, rest = spec.partition("=")
        path, _, isa_name = rest.rpartition(":")
        isa = next((i for i in native.ISAS if i.name == isa_name), None)
        if not name or not path or isa is None:
            raise SystemExit(f"--library {spec!r}: want NAME=PATH:ISA, ISA one of {', '.join(i.name for i in native.ISAS)}")
        libs.append((name, ctypes.CDLL(path), isa))
    if not libs:
        return {"skipped": native.unavailable_reason() or "no gptj.native library runs here"}
    q_chunk = torch.randn(args.chunk, H, D, generator=g).bfloat16()
    table = torch.randperm(n_blocks, generator=g)[:per_seq + -(-args.chunk // B)].int()
    # rounds: every library once per round, in a rotated order (the first measured in a process ran
    # up to 20 % slower than the same library later: warming, not code); the median over rounds
    times: dict[str, dict[str, list[float]]] = {name: {} for name, _, _ in libs}
    for r in range(args.rounds):
        for name, lib, isa in libs[r % len(libs):] + libs[:r % len(libs)]:
            loader._bind(lib, isa)
            row = times[name]
            for N in args.batches:
                q = torch.randn(N, H, D, generator=g).bfloat16()
                t = tables(N)
                row.setdefault(f"decode bf16 {N}", []).append(
                    timed(lambda: native.attention_paged(q, kc, vc, *t), args.repeats))
                row.setdefault(f"decode int8 {N}", []).append(
                    timed(lambda: native.attention_paged(q, ki, vi, *t, ks, vs), args.repeats))
            row.setdefault("prefill bf16 @0", []).append(
                timed(lambda: native.prefill_paged(q_chunk, kc, vc, table, 0), args.repeats))
            row.setdefault("prefill int8 @0", []).append(
                timed(lambda: native.prefill_paged(q_chunk, ki, vi, table, 0, ks, vs), args.repeats))
            row.setdefault(f"prefill bf16 @{args.context}", []).append(
                timed(lambda: native.prefill_paged(q_chunk, kc, vc, table, args.context - args.chunk), args.repeats))
            row.setdefault("gelu 8x16384", []).append(timed(lambda: native.gelu(x), args.repeats))
            if loader._argmax_rows is not None:
                row.setdefault(argmax, []).append(timed(lambda: native.argmax_rows(logits), args.repeats))
        times.setdefault("torch", {}).setdefault(argmax, []).append(
            timed(lambda: logits.max(dim=-1).indices, args.repeats))
    results = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in times.items()}
    loader._state.clear()  # the process's own library is loaded again on next use
    for bound in loader.BOUND:
        setattr(loader, bound, None)
    return {"threads": torch.get_num_threads(), "heads": H, "head_dim": D, "context": args.context,
            "chunk": args.chunk, "ms": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--context", type=int, default=800, help="tokens each decode sequence attends over")
    p.add_argument("--chunk", type=int, default=128, help="prefill chunk tokens")
    p.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8])
    p.add_argument("--repeats", type=int, default=50, help="calls per measurement (their median)")
    p.add_argument("--rounds", type=int, default=3, help="measurements per library, in rotated orders")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--library", action="append", default=[], metavar="NAME=PATH:ISA")
    p.add_argument("--json", action="store_true")
    args = _smoke.parse_args(p, {"heads": 2, "head_dim": 32, "context": 40, "chunk": 16, "batches": [1, 2],
                                 "repeats": 2, "rounds": 1})
    if args.threads:
        torch.set_num_threads(args.threads)
    out = run(args)
    if args.json:
        print(json.dumps(out))
        return
    if "skipped" in out:
        print(f"skipped: {out['skipped']}")
        return
    cols = list(dict.fromkeys(c for row in out["ms"].values() for c in row))
    print(f"{out['threads']} threads, {out['heads']} heads of {out['head_dim']}, {out['context']} tokens, ms")
    print("| library | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, row in out["ms"].items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.3f}" if c in row else "-" for c in cols) + " |")


if __name__ == "__main__":
    main()
