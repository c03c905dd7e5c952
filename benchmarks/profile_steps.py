"""Where a decode step of the MLPerf shape spends its time: the engine's host phases (StepTimes) and,
under torch.profiler, the device's kernels grouped by kind, at N samples x 4 beams running at once.

    python benchmarks/profile_steps.py --model DIR --device cuda --dtype bfloat16 --samples 256 --out prof
    python benchmarks/profile_steps.py --model DIR ... --quantize fp8 --kv-dtype fp8
    python benchmarks/profile_steps.py --model TINY --smoke    # CPU, a tiny model: runs, not a measurement
    python benchmarks/profile_steps.py --model TINY --device cpu --dtype float32 --samples 128 --no-kernels
                                       # the host phases alone (the profiler's hooks slow the host)

The engine is built as `gptj mlperf` builds it (gptj.runtime.build, MLPerf's generation settings,
warmed: CUDA graphs captured). The --samples prompts (the bundled articles, each copy told apart as
benchmarks/standin_dataset.py does) are added at once; once all are prefilled (no waiting request,
no prompt chunk in the step), --warm-steps decode steps run untimed, then --steps are timed: their
StepTimes per phase (schedule, forward, wait: the sampler's device-to-host copy, update) and the
profiler's device time per kernel, summed by kind (GEMM, attention, elementwise, copies...) and the
top kernels by name. The wall time of a step against its device time says how host-bound it is.
Writes OUT/profile.json (and OUT/trace.json, the profiler's Chrome trace, with --trace).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from _smoke import parse_args

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from gptj.decode import GenerationConfig  # noqa: E402
from gptj.engine.config import EngineConfig  # noqa: E402
from gptj.errors import GptjError  # noqa: E402
from gptj.files import atomic_write_json  # noqa: E402
from gptj.mlperf.dataset import DEFAULT_DATASET, Dataset, load_examples  # noqa: E402
from gptj.runtime.build import build_engine, load_model  # noqa: E402
from gptj.runtime.spec import ModelSpec  # noqa: E402

# a kernel's kind, by the first of these its name contains (lower case); the rest are "other"
KINDS = (("gemm", ("gemm", "gemv", "cutlass", "cublas", "matmul", "::mm", "addmm", "bmm", "linear", "_int8_kernel",
                   "_int4_kernel", "scaled_mm", "sm90_xmma", "nvjet", "splitk")),
         ("attention", ("_decode", "_prefill", "attention", "flash", "sdpa")),
         ("kv store / copy", ("_store_kernel", "copy", "memcpy", "memset", "index", "gather", "scatter", "cat")),
         ("sampling", ("softmax", "topk", "sort", "argmax", "radix", "take_along")),
         ("elementwise", ("elementwise", "vectorized", "layer_norm", "layernorm", "gelu", "rotary", "reduce",
                          "quantize", "unrolled", "fill")))


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a gptj or HF model folder")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantize", help="weight-only or fp8 weights, as gptj mlperf --quantize")
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--samples", type=int, default=256, help="samples running at once (x 4 beams)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--warm-steps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=15, help="kernels listed by name")
    ap.add_argument("--out", default="profile-steps")
    ap.add_argument("--trace", action="store_true", help="also write the profiler's Chrome trace (large)")
    ap.add_argument("--json", action="store_true", help="print profile.json's object instead of the table")
    ap.add_argument("--no-kernels", action="store_true",
                    help="time the steps without torch.profiler (its hooks slow the host): host phases only")
    ap.add_argument("--attention-variant", choices=("sum", "dot", "auto"),
                    help="the cuda attention backend's decode kernel (CudaAttention.decode_variant: auto, its "
                         "default, runs dot for beam steps; sum: CUDA cores; dot: the shared blocks by tl.dot), "
                         "set before the CUDA graphs are captured")
    args = parse_args(ap, {"device": "cpu", "dtype": "float32", "samples": 3, "max_new_tokens": 12,
                           "warm_steps": 1, "steps": 2, "top": 5}, argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = ModelSpec(path=args.model, device=args.device, dtype=args.dtype, quantize=args.quantize)
    model = load_model(spec, progress=False)
    gen = GenerationConfig.mlperf(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens)
    articles = Dataset(load_examples(DEFAULT_DATASET)).input_ids  # the bundled ones, repeated
    todo = [articles[i % len(articles)] for i in range(args.samples)]
    longest = max(len(p) for p in todo)
    # no prefix cache: MLPerf's samples share no prompt block, these repeats would
    variant = args.attention_variant
    engine = build_engine(model, EngineConfig(max_seqs=args.samples * gen.num_beams, kv_dtype=args.kv_dtype,
                                              max_len=longest + gen.max_new_tokens, prefix_caching=False),
                          warm=None if variant else gen)
    if variant:  # the kernel chosen, then warmed as build_engine warms (the graphs capture the chosen kernel)
        backend = engine.runner.attention
        if not hasattr(backend, "decode_variant"):
            raise GptjError(f"--attention-variant: the {backend.name} attention backend has no decode variants "
                            "(the cuda backend's)")
        backend.decode_variant = variant
        if engine.runner.graphs is not None:
            engine.warm(gen)
    cuda = engine.device.type == "cuda"
    for p in todo:
        engine.add_request(p, gen)
    start = time.perf_counter()
    while engine.scheduler.waiting or any(not r.beam for r in engine.requests.values()):
        engine.step()  # prefill until every sample decodes (its beams started)
        if not engine.requests:
            break
    prefill_s = time.perf_counter() - start
    for _ in range(args.warm_steps):
        engine.step()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    engine.times.reset()
    if cuda:
        torch.cuda.synchronize()
    with contextlib.nullcontext() if args.no_kernels else torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    rows = engine.times.per_step_ms()["decode_rows"]
    kernels: dict[str, float] = defaultdict(float)  # name -> device (or CPU self) microseconds over the steps
    for ev in prof.key_averages() if prof is not None else ():
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        # CUDA: the kernels by name. An aten op that launched one can carry its time as its own device
        # time too (torch 2.11 on the H200, 2026-11-28: index_put's 9.1 ms listed as the op and as its
        # kernel), so ops are left out there, or the copies counted twice; CPU: the ops (no kernels)
        if us > 0 and ev.key.startswith("aten::") != cuda:
            kernels[ev.key] += us
    by_kind: dict[str, float] = defaultdict(float)
    for name, us in kernels.items():
        by_kind[kind_of(name)] += us
    n = max(args.steps, 1)
    device_ms = sum(kernels.values()) / 1000 / n
    result = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("json",)},
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "samples": args.samples, "decode_rows_per_step": rows, "prefill_s": prefill_s,
        "step_ms": 1000 * wall_s / n,
        # CPU: the aten ops' own time (not the device's: there is none); None with --no-kernels
        "kernel_ms_per_step": None if args.no_kernels else device_ms,
        "host_phases_ms": {k: v for k, v in engine.times.per_step_ms().items() if k not in ("step", "decode_rows")},
        "by_kind_ms": {k: v / 1000 / n for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top": [{"name": k[:120], "ms": v / 1000 / n, "kind": kind_of(k)}
                for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]],
    }
    if args.trace and prof is not None:
        prof.export_chrome_trace(str(out / "trace.json"))
    atomic_write_json(out / "profile.json", result)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['device']}, torch {result['torch']}: {args.samples} samples x {gen.num_beams} beams "
          f"({rows:.0f} rows a step), prefill of all {prefill_s:.1f} s"
          + (f", attention decode variant {variant}" if variant else ""))
    kernel_note = "kernels not profiled" if args.no_kernels else \
        f"{device_ms:.2f} ms of kernels ({'device' if cuda else 'CPU ops'})"
    print(f"decode step {result['step_ms']:.2f} ms wall, {kernel_note}; host phases: "
          + ", ".join(f"{k} {v:.2f}" for k, v in result["host_phases_ms"].items()))
    for kind, ms in result["by_kind_ms"].items():
        print(f"  {kind:16s} {ms:8.2f} ms a step")
    for row in result["top"]:
        print(f"    {row['ms']:8.3f} ms  {row['kind']:16s} {row['name'][:90]}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except GptjError as e:  # a mode this device cannot run, a bad folder: one line
        print(f"profile_steps.py: {e}", file=sys.stderr)
        sys.exit(2)
