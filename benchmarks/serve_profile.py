"""Where a served token's time goes: `gptj serve` under load, against the engine's own decode step.

    python benchmarks/serve_profile.py --concurrency 1,8,32 --rounds 2
    python benchmarks/serve_profile.py --model DIR --gptj-args "--dtype bfloat16 --quantize w8a8 --kv-dtype int8"

Each round first runs `gptj bench latency` at batch 1 on the same model, prompt length and new tokens
(the engine alone: its decode step is the floor a served token at 1 client can reach), then starts
`gptj serve` and runs serve_vs_vllm's load (--input-len random prompt ids, --max-tokens new tokens with
ignore_eos, greedy, streamed; C clients of --requests-per-client requests each) at every --concurrency,
after one uncounted warm-up request. Around each load it reads

    the server's /metrics    the engine's steps: how many, how many prefilled a prompt chunk, their wall
                             time by phase (schedule, forward, update), rows decoded
    /proc/PID/task           the server's CPU time per thread: the engine thread with its OpenMP team
                             (the OS thread name gptj-engine), the event loop (the main thread: HTTP,
                             detokenizing, SSE), the rest (tokenizer pool, ...)
    this process             the client's CPU time (it runs on the same cores)

and reports per load: output tok/s and TPOT p50 as the clients saw them; the engine's share of the
wall time (busy: inside a step); the mean decode-only step (steps without a prompt chunk), the rows
decoded per step (all steps), and the prefill steps' time per request; per output token, the CPU each side spent. TPOT at 1 client over the
bench's decode step says what serving costs beyond the engine (the issue's target: within 1.10).

The model is --model DIR, or serve_vs_vllm's ~0.2 B GPT-J (written once under --work-dir). Linux only
(/proc); the server runs on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import serve_load  # benchmarks/serve_load.py (a script's own folder is on sys.path)
import serve_vs_vllm
from _smoke import parse_args

CLOCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the process's threads by group: engine (threads named gptj-engine:
    the engine loop and its OpenMP workers), loop (the main thread: the event loop), other."""
    out = {"engine": 0.0, "loop": 0.0, "other": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the name, which may hold spaces
        seconds = (int(fields[11]) + int(fields[12])) / CLOCK  # utime, stime
        group = "loop" if int(tid) == pid else "engine" if name == "gptj-engine" else "other"
        out[group] += seconds
    return out


def engine_metrics(url: str) -> dict[str, float]:
    """The engine's step counters on /metrics, summed over the served models."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(gptj_engine_\w+?|gptj_compute_threads)(?:\{(.*)\})? (\S+)$", line)
        if m:
            label = re.search(r'(?:phase|threads)="(\w+)"', m.group(2) or "")
            key = m.group(1) + (f":{label.group(1)}" if label else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def snapshot(url: str, pid: int) -> dict:
    return {"time": time.perf_counter(), "metrics": engine_metrics(url), "cpu": thread_cpu(pid),
            "client_cpu": time.process_time()}


def profile(before: dict, after: dict, res: serve_load.LoadResult, requests: int) -> dict:
    """One load's figures from the snapshots around it and the clients' view."""
    wall = after["time"] - before["time"]
    m = {k: after["metrics"].get(k, 0.0) - before["metrics"].get(k, 0.0) for k in after["metrics"]}
    steps, prefill_steps = m.get("gptj_engine_steps_total", 0), m.get("gptj_engine_prefill_steps_total", 0)
    phases = {p: m.get(f"gptj_engine_step_seconds_total:{p}", 0.0) for p in ("schedule", "forward", "wait", "update")}
    busy = sum(phases.values())
    prefill_s = m.get("gptj_engine_prefill_step_seconds_total", 0.0)
    decode_steps = steps - prefill_steps
    tokens = max(res.total_output_tokens, 1)
    cpu = {k: after["cpu"][k] - before["cpu"][k] for k in after["cpu"]}
    cpu["client"] = after["client_cpu"] - before["client_cpu"]
    return {
        "out_tok_s": res.output_throughput, "ttft_p50_ms": res.ttft_p50_ms, "ttft_p99_ms": res.ttft_p99_ms,
        "tpot_p50_ms": res.tpot_p50_ms, "tpot_p99_ms": res.tpot_p99_ms, "itl_p50_ms": res.itl_p50_ms,
        "wall_s": wall, "steps": steps, "prefill_steps": prefill_steps,
        "busy_share": busy / wall if wall > 0 else float("nan"),
        "decode_step_ms": 1000 * (busy - prefill_s) / decode_steps if decode_steps else float("nan"),
        "decode_rows_per_step": m.get("gptj_engine_decode_rows_total", 0) / steps if steps else 0.0,  # all steps
        "step_phase_ms": {p: 1000 * v / steps for p, v in phases.items()} if steps else {},
        "prefill_s_per_request": prefill_s / requests,
        "idle_s": wall - busy,
        "threads": after["metrics"].get("gptj_compute_threads", float("nan")),
        # decode steps the thread tuner timed at each count (its probes included; none with --threads)
        "thread_steps": {k.rsplit(":", 1)[1]: v for k, v in m.items() if k.startswith("gptj_engine_thread_steps_total:") and v},
        "cpu_ms_per_token": {k: 1000 * v / tokens for k, v in cpu.items()},
        "cpu_share": {k: v / wall for k, v in cpu.items()},  # cores' worth each side kept busy
    }


def bench_latency(model: Path, args: argparse.Namespace) -> dict:
    """`gptj bench latency` at batch 1 on the load's prompt length and new tokens (a process of its own)."""
    cmd = [sys.executable, "-m", "gptj.cli", "bench", "latency", "--model", str(model), "--batch-size", "1",
           "--prompt-len", str(args.input_len), "--max-new-tokens", str(args.max_tokens),
           "--repeats", str(args.bench_repeats), "--json", *shlex.split(args.bench_args)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"serve_profile: gptj bench latency failed: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout)


def run_round(model: Path, args: argparse.Namespace) -> dict:
    out: dict = {}
    if args.baseline:
        out["bench"] = bench_latency(model, args)
        print(f"bench latency: decode step {out['bench']['decode_step_ms']:.2f} ms", file=sys.stderr)
    out["loads"] = {}
    with serve_load.spawned_server(f"gptj={model}", args.gptj_args, args.startup_timeout) as url:
        pid = serve_load.SPAWNED[url]
        warm = serve_vs_vllm.load_args(url, 1, args, seed=args.seed + 1_000_000)
        warm.num_prompts, warm.warmup = 1, 1
        asyncio.run(serve_load.bench(url, warm))
        for c in args.concurrency:
            load = serve_vs_vllm.load_args(url, c, args, seed=args.seed + c)
            before = snapshot(url, pid)
            report = asyncio.run(serve_load.bench(url, load))
            after = snapshot(url, pid)
            res = report["results"][0]
            if res.failed:
                raise SystemExit(f"serve_profile: {res.failed} requests failed at concurrency {c}: {res.errors}")
            out["loads"][c] = row = profile(before, after, res, load.num_prompts)
            print(f"C={c}: {row['out_tok_s']:.1f} tok/s, TPOT p50 {row['tpot_p50_ms']:.2f} ms, decode step "
                  f"{row['decode_step_ms']:.2f} ms", file=sys.stderr)
    if "bench" in out and 1 in out["loads"]:
        out["tpot_1_over_bench_step"] = out["loads"][1]["tpot_p50_ms"] / out["bench"]["decode_step_ms"]
    return out


def table(rounds: list[dict]) -> str:
    head = ("round", "C", "tok/s", "TPOT p50", "step (decode)", "rows", "busy", "prefill s/req",
            "CPU ms/token: engine", "loop", "other", "client", "threads (steps at each)")
    rows = [head]
    for i, r in enumerate(rounds, 1):
        for c, x in r["loads"].items():
            cpu = x["cpu_ms_per_token"]
            rows.append((str(i), str(c), f"{x['out_tok_s']:.1f}", f"{x['tpot_p50_ms']:.2f}", f"{x['decode_step_ms']:.2f}",
                         f"{x['decode_rows_per_step']:.1f}", f"{x['busy_share']:.0%}", f"{x['prefill_s_per_request']:.3f}",
                         *(f"{cpu[k]:.2f}" for k in ("engine", "loop", "other", "client")),
                         f"{x['threads']:g}" + "".join(f" ({n}: {v:g})" for n, v in sorted(x["thread_steps"].items()))))
    widths = [max(len(row[j]) for row in rows) for j in range(len(head))]
    lines = ["  ".join(s.rjust(w) for s, w in zip(row, widths)) for row in rows]
    for i, r in enumerate(rounds, 1):
        if "tpot_1_over_bench_step" in r:
            lines.append(f"round {i}: bench latency's decode step {r['bench']['decode_step_ms']:.2f} ms; "
                         f"served TPOT p50 at 1 client / that step = {r['tpot_1_over_bench_step']:.3f}")
    return "\n".join(lines) + "\n(ms; busy: the engine's share of the wall time inside its steps)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="a GPT-J folder (default: serve_vs_vllm's ~0.2 B model)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/gptj-serve-vs-vllm"))
    serve_vs_vllm.add_load_args(p, rounds=1)
    p.add_argument("--gptj-args", default="--dtype bfloat16", help="`gptj serve` flags")
    p.add_argument("--bench-args", default="--dtype bfloat16",
                   help="`gptj bench latency` flags: the same model settings as --gptj-args")
    p.add_argument("--bench-repeats", type=int, default=3)
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip gptj bench latency")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--json", action="store_true")
    return p


SMOKE = dict(concurrency=[1, 2], requests_per_client=1, input_len=8, max_tokens=4, rounds=1, bench_repeats=1,
             gptj_args="--dtype float32 --threads 1", bench_args="--dtype float32 --threads 1")


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = parse_args(p, SMOKE, argv)
    serve_vs_vllm.check_load_args(p, args)
    if not os.path.isdir("/proc/self/task"):
        p.error("needs Linux's /proc (per-thread CPU times)")
    args.model = serve_vs_vllm.default_model(args)
    rounds = [run_round(args.model, args) for _ in range(args.rounds)]
    if args.json:
        print(json.dumps({"model": str(args.model), "gptj_args": args.gptj_args, "bench_args": args.bench_args,
                          "input_len": args.input_len, "max_tokens": args.max_tokens,
                          "requests_per_client": args.requests_per_client, "rounds": rounds}, indent=2))
    else:
        print(table(rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
