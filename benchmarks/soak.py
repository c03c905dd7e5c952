"""Soak test for `gptj serve`: many clients that retry per Retry-After lose nothing (issue 16).

Starts `gptj serve` on loopback (the tiny preset with random weights by default, or --model), then
runs --clients concurrent clients, each completing --requests completions one after another. A
client answered 429 (queue full) or 503 (loading, draining, too many connections) waits what the
answer's Retry-After says and tries again; any other answer, a broken connection, or a request not
completed within --time-limit-s (the whole run's bound) counts as lost. Reports:

    lost                 requests never completed (must be 0)
    attempts p50/p90/max per completed request (the median must be <= 3)
    latency p50/p90      first attempt sent -> completion received, retries and waits included
    retry_after          the Retry-After values the server gave (min, p50, max)

Exits 1 if a request was lost or the median attempts exceed 3. Not part of CI's default run (it
takes minutes at full size); `--smoke` (a few clients) checks that it runs.

    python benchmarks/soak.py                      # 256 clients x 3 requests on the tiny preset
    python benchmarks/soak.py --model tiny=/tmp/tiny --serve-args "--max-batch-size 8" --json

Standard library only: asyncio with raw HTTP/1.1, one connection per attempt.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import _smoke  # benchmarks/_smoke.py (a script's own folder is on sys.path)
from serve_load import spawned_server

MAX_MEDIAN_ATTEMPTS = 3


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    retry_after: list[int] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)


async def post(url: str, body: dict, api_key: str | None) -> tuple[int, dict[str, str], bytes]:
    """One POST on a fresh connection: (status, headers lowercased, body)."""
    u = urllib.parse.urlparse(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    try:
        data = json.dumps(body).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n"
                + (f"Authorization: Bearer {api_key}\r\n" if api_key else "") + "\r\n")
        writer.write(head.encode() + data)
        await writer.drain()
        raw = await reader.read()  # Connection: close: the answer ends with the connection
    finally:
        writer.close()
    header, _, payload = raw.partition(b"\r\n\r\n")
    lines = header.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out, rest = b"", payload
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size.split(b";")[0], 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        payload = out
    return status, headers, payload


async def client(url: str, body: dict, args: argparse.Namespace, tally: Tally, deadline: float) -> None:
    for _ in range(args.requests):
        start, attempts = time.monotonic(), 0
        while True:
            if time.monotonic() >= deadline:
                tally.lost.append(f"not completed within --time-limit-s {args.time_limit_s:g} ({attempts} attempts)")
                return
            attempts += 1
            try:
                async with asyncio.timeout(max(0.001, deadline - time.monotonic())):
                    status, headers, payload = await post(url, body, args.api_key)
            except TimeoutError:
                continue  # the deadline check above counts it lost
            except (OSError, ValueError, IndexError) as e:
                tally.lost.append(f"{type(e).__name__}: {e}"[:200])
                break
            tally.statuses[str(status)] = tally.statuses.get(str(status), 0) + 1
            if status == 200:
                tally.latencies.append(time.monotonic() - start)
                tally.attempts.append(attempts)
                break
            if status in (429, 503):
                wait = int(headers.get("retry-after", "1"))
                tally.retry_after.append(wait)
                await asyncio.sleep(min(wait, max(0.0, deadline - time.monotonic())))
                continue
            tally.lost.append(f"HTTP {status}: {payload[:200].decode('utf-8', 'replace')}")
            break


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def soak(url: str, args: argparse.Namespace) -> dict:
    body = {"model": args.model_name, "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True}
    tally = Tally()
    t0 = time.monotonic()
    deadline = t0 + args.time_limit_s
    await asyncio.gather(*(client(url, body, args, tally, deadline) for _ in range(args.clients)))
    total = args.clients * args.requests
    completed = len(tally.attempts)
    lost = total - completed
    median_attempts = statistics.median(tally.attempts) if tally.attempts else None
    return {
        "url": url, "clients": args.clients, "requests_per_client": args.requests, "max_tokens": args.max_tokens,
        "requests": total, "completed": completed, "lost": lost, "lost_reasons": sorted(set(tally.lost))[:10],
        "duration_s": time.monotonic() - t0,
        "attempts": {"total": sum(tally.attempts), "p50": median_attempts, "p90": pct(tally.attempts, 90),
                     "max": max(tally.attempts, default=None)},
        "latency_s": {"p50": pct(tally.latencies, 50), "p90": pct(tally.latencies, 90),
                      "max": max(tally.latencies, default=None)},
        "retry_after_s": {"min": min(tally.retry_after, default=None), "p50": pct(tally.retry_after, 50),
                          "max": max(tally.retry_after, default=None)},
        "statuses": tally.statuses,
        "ok": lost == 0 and median_attempts is not None and median_attempts <= MAX_MEDIAN_ATTEMPTS,
    }


@contextlib.contextmanager
def tiny_model():  # noqa: ANN201 - a context yielding "tiny=DIR"
    with tempfile.TemporaryDirectory(prefix="gptj-soak-") as tmp:
        out = Path(tmp) / "tiny"
        subprocess.run([sys.executable, "-m", "gptj.cli", "init", "--preset", "tiny", "--out", str(out), "--seed", "1"],
                       check=True, stdout=subprocess.DEVNULL)
        yield f"tiny={out}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", help="a running gptj server (default: start one)")
    where.add_argument("--model", help="NAME=DIR: start `gptj serve --model NAME=DIR` (default: a tiny random model)")
    p.add_argument("--serve-args", default="", help="more `gptj serve` flags for the server it starts")
    p.add_argument("--model-name", default="tiny", help="the served model to ask (default tiny)")
    p.add_argument("--api-key", help="the server's --api-key, if any")
    p.add_argument("--clients", type=int, default=256, help="concurrent clients (default 256)")
    p.add_argument("--requests", type=int, default=3, help="completions per client, one after another (default 3)")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per completion (default 16)")
    p.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.")
    p.add_argument("--time-limit-s", type=float, default=900.0,
                   help="the whole run's bound: what is not completed by then is lost (default 900)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


SMOKE = dict(clients=4, requests=2, max_tokens=2, time_limit_s=300.0)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = _smoke.parse_args(p, SMOKE, argv)
    for name in ("clients", "requests", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.model and "=" in args.model:
        args.model_name = args.model.split("=", 1)[0]
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            model = args.model or stack.enter_context(tiny_model())
            url = stack.enter_context(spawned_server(model, args.serve_args, args.startup_timeout))
        report = asyncio.run(soak(url, args))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        a, lat, ra = report["attempts"], report["latency_s"], report["retry_after_s"]
        print(f"{report['clients']} clients x {report['requests_per_client']} requests: {report['completed']}/"
              f"{report['requests']} completed, {report['lost']} lost, in {report['duration_s']:.1f} s")
        print(f"attempts per request p50 {a['p50']} p90 {a['p90']} max {a['max']} (total {a['total']}); latency "
              f"p50 {lat['p50'] or 0:.2f} s p90 {lat['p90'] or 0:.2f} s; Retry-After min {ra['min']} p50 {ra['p50']} "
              f"max {ra['max']}; statuses {report['statuses']}")
        for reason in report["lost_reasons"]:
            print(f"  lost: {reason}")
    if not report["ok"]:
        print(f"soak: FAILED ({report['lost']} lost; median attempts {report['attempts']['p50']}, "
              f"at most {MAX_MEDIAN_ATTEMPTS} allowed)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
