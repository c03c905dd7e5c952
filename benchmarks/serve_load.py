"""Load test for `gptj serve`, like vLLM's benchmark_serving: offered load in, latency out.

For each offered load (--rates, requests/s; "inf" sends every request at once) it sends
--num-prompts streamed completion requests with Poisson arrivals (exponential gaps, --seed) and
reports per load:

    completed / failed    requests that ended with [DONE] / with an HTTP error, an error event,
                          a broken stream or --request-timeout
    duration              first request sent -> last request finished
    throughput            completed requests/s and output tokens/s over that duration
    TTFT p50/p99          request sent -> first streamed chunk carrying text or token ids
    TPOT p50/p99          (e2e - TTFT) / (output tokens - 1), requests with > 1 output token
    ITL p99 / max         gaps between a request's streamed chunks after the first (stalls show here)
    E2E p50               request sent -> [DONE]

Prompts are token ids: the bundled MLPerf gptj-99 sample set (30 CNN-DailyMail-style articles,
200-900 tokens; cycled when --num-prompts is larger; cut to fit the server's max_model_len), or
--dataset random: --input-len random ids. Output lengths are --max-tokens; add --ignore-eos for
exactly that many. Greedy by default; --beams K runs beam search (its text comes only at the end,
so TTFT = E2E then).

    # against a running server
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --rates 1,2,4,inf --num-prompts 64 \\
        --max-tokens 128 --ignore-eos
    # start one: `gptj serve --model NAME=DIR --port P` as a subprocess (--serve-args for its flags)
    python benchmarks/serve_load.py --model tiny=/tmp/tiny --serve-args "--max-batch-size 32" --json
    # does it run? one burst of 2 short requests (random ids), and the in-process engine beside it
    python benchmarks/serve_load.py --model tiny=/tmp/tiny --smoke --compare-engine --json

Standard library only: asyncio with raw HTTP/1.1 (asyncio.open_connection), keep-alive connections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from dataclasses import asdict, dataclass, field

import _smoke  # benchmarks/_smoke.py (a script's own folder is on sys.path)

# --- raw HTTP/1.1 -----------------------------------------------------------------------------


class HTTPError(Exception):
    pass


@dataclass
class Response:
    status: int
    reason: str
    headers: dict[str, str]
    reader: asyncio.StreamReader
    keep_alive: bool


class Client:
    """Keep-alive HTTP/1.1 connections to one server; one request per connection at a time."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SystemExit(f"serve_load: bad --url {url!r}: expected http://HOST:PORT")
        self.host, self.port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = parts.scheme == "https"
        self.prefix = parts.path.rstrip("/")
        self.url = f"{parts.scheme}://{self.host}:{self.port}{self.prefix}"
        self.auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port, ssl=self.ssl or None, limit=1 << 22)

    async def request(self, method: str, path: str, body: dict | None = None) -> tuple[Response, asyncio.StreamWriter]:
        raw = json.dumps(body).encode() if body is not None else b""
        head = (f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Accept: */*\r\nContent-Length: {len(raw)}\r\n{self.auth}"
                + ("Content-Type: application/json\r\n" if body is not None else "") + "\r\n").encode()
        while True:
            reused = bool(self.idle)
            reader, writer = self.idle.pop() if reused else await self._connect()
            try:
                writer.write(head + raw)
                await writer.drain()
                status_line = await reader.readline()
                if not status_line:
                    raise ConnectionResetError("the server closed the connection")
            except (ConnectionError, asyncio.IncompleteReadError):
                writer.close()
                if reused:  # a keep-alive connection the server dropped while idle: once more, fresh
                    continue
                raise
            break
        parts = status_line.decode("latin-1").rstrip("\r\n").split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            writer.close()
            raise HTTPError(f"not an HTTP response: {status_line[:60]!r}")
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        keep = parts[0] != "HTTP/1.0" and headers.get("connection", "").lower() != "close"
        return Response(int(parts[1]), parts[2] if len(parts) > 2 else "", headers, reader, keep), writer

    async def body_chunks(self, resp: Response):  # noqa: ANN201 - async iterator of bytes
        r = resp.reader
        if "chunked" in resp.headers.get("transfer-encoding", "").lower():
            while True:
                size = int((await r.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (await r.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                data = await r.readexactly(size)
                await r.readexactly(2)
                yield data
        elif "content-length" in resp.headers:
            n = int(resp.headers["content-length"])
            if n:
                yield await r.readexactly(n)
        else:
            resp.keep_alive = False
            while data := await r.read(1 << 16):
                yield data

    async def read_body(self, resp: Response) -> bytes:
        return b"".join([c async for c in self.body_chunks(resp)])

    def release(self, resp: Response, writer: asyncio.StreamWriter, complete: bool) -> None:
        if complete and resp.keep_alive:
            self.idle.append((resp.reader, writer))
        else:
            writer.close()

    async def get_json(self, path: str) -> tuple[int, object]:
        resp, writer = await self.request("GET", path)
        raw = await self.read_body(resp)
        self.release(resp, writer, True)
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw.decode("utf-8", "replace")

    def close_idle(self) -> None:
        for _, w in self.idle:
            w.close()
        self.idle.clear()


def error_text(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"]).splitlines()[0][:200]
    except (ValueError, KeyError, TypeError, IndexError):
        return raw.decode("utf-8", "replace").strip().splitlines()[0][:200] if raw.strip() else ""


# --- one request --------------------------------------------------------------------------------


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # between streamed chunks with tokens, after the first


async def one_request(client: Client, body: dict, timeout_s: float) -> Result:
    res = Result(prompt_tokens=len(body["prompt"]))
    t0 = time.perf_counter()
    writer = resp = None
    complete = False
    try:
        async with asyncio.timeout(timeout_s):
            resp, writer = await client.request("POST", "/v1/completions", body)
            if resp.status != 200:
                raw = await client.read_body(resp)
                complete = True
                res.error = f"HTTP {resp.status}" + (f": {error_text(raw)}" if raw else "")
                return res
            buf, counted, usage, done, last = b"", 0, None, False, 0.0
            async for data in client.body_chunks(resp):
                buf += data.replace(b"\r\n", b"\n")
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    payload = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n")
                                         if line.startswith(b"data:"))
                    if not payload:
                        continue
                    if payload.strip() == b"[DONE]":
                        done = True
                        continue
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        res.error = f"error event: {chunk['error'].get('message', chunk['error'])}"[:200]
                        continue
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        ids = choice.get("token_ids") or []
                        if choice.get("text") or ids:
                            now = time.perf_counter() - t0
                            if res.ttft is None:
                                res.ttft = now
                            else:
                                res.gaps.append(now - last)
                            last = now
                        counted += len(ids)
            complete = True
            res.e2e = time.perf_counter() - t0
            if res.error is None and not done:
                res.error = "the stream ended before [DONE]"
            res.output_tokens = int(usage["completion_tokens"]) if usage else counted
            res.ok = res.error is None
            return res
    except TimeoutError:
        res.error = f"no answer within --request-timeout {timeout_s:g} s"
        return res
    except (OSError, asyncio.IncompleteReadError, HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    finally:
        if writer is not None and resp is not None:
            client.release(resp, writer, complete)
        elif writer is not None:
            writer.close()


# --- one offered load ---------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class LoadResult:
    rate: float
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_output_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    itl_max_ms: float
    errors: dict[str, int] = field(default_factory=dict)


async def run_load(client: Client, bodies: list[dict], rate: float, max_concurrency: int | None, seed: int,
                   timeout_s: float) -> LoadResult:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(body: dict) -> Result:
        if gate is None:
            return await one_request(client, body, timeout_s)
        async with gate:
            return await one_request(client, body, timeout_s)

    tasks = []
    start = time.perf_counter()
    due = 0.0
    for body in bodies:
        if math.isfinite(rate):
            wait = start + due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            due += rng.expovariate(rate)
        tasks.append(asyncio.create_task(limited(body)))
    results: list[Result] = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    client.close_idle()
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1]
    e2e = [r.e2e for r in ok]
    itl = [g for r in ok for g in r.gaps]
    errors = Counter((r.error or "")[:120] for r in results if not r.ok)
    ms = 1000.0
    return LoadResult(rate=rate, completed=len(ok), failed=len(results) - len(ok), duration_s=duration,
                      request_throughput=len(ok) / duration, output_throughput=tokens / duration,
                      total_output_tokens=tokens,
                      ttft_p50_ms=percentile(ttft, 50) * ms, ttft_p99_ms=percentile(ttft, 99) * ms,
                      tpot_p50_ms=percentile(tpot, 50) * ms, tpot_p99_ms=percentile(tpot, 99) * ms,
                      e2e_p50_ms=percentile(e2e, 50) * ms, e2e_p99_ms=percentile(e2e, 99) * ms,
                      itl_p50_ms=percentile(itl, 50) * ms, itl_p99_ms=percentile(itl, 99) * ms,
                      itl_max_ms=max(itl, default=float("nan")) * ms,
                      errors=dict(errors.most_common(5)))


# --- prompts, server, table -----------------------------------------------------------------------


def make_prompts(args: argparse.Namespace, max_model_len: int | None) -> list[list[int]]:
    rng = random.Random(args.seed)
    room = (max_model_len - args.max_tokens) if max_model_len else None
    if room is not None and room < 1:
        raise SystemExit(f"serve_load: --max-tokens {args.max_tokens} leaves no room for a prompt in the "
                         f"server's max_model_len {max_model_len}")
    if args.dataset == "random":
        n = args.input_len if room is None else min(args.input_len, room)
        return [[rng.randrange(50256) for _ in range(n)] for _ in range(args.num_prompts)]  # no EOS (50256)
    from gptj.mlperf.dataset import Dataset
    from gptj.tokenizer import tokenizer_for_model

    local = args.model.partition("=")[2] or args.model if args.model else None
    dataset = Dataset.load(args.dataset_path, tokenizer=tokenizer_for_model(local))
    ids = dataset.input_ids
    return [list(ids[i % len(ids)][:room] if room else ids[i % len(ids)]) for i in range(args.num_prompts)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SPAWNED: dict[str, int] = {}  # URL -> PID of each server `spawned` runs now


@contextlib.contextmanager
def spawned(name: str, command, timeout_s: float, env: dict[str, str] | None = None):  # noqa: ANN001, ANN201
    """A server started as `command(port)` (a list of arguments) with `env` added, until GET /health
    answers 200; yields its URL (SPAWNED[url] its PID while it runs) and stops it (SIGTERM, then SIGKILL
    after 60 s) on the way out. Its log is a temporary file kept only when it fails."""
    import urllib.error
    import urllib.request

    port = free_port()
    cmd = command(port)
    log = tempfile.NamedTemporaryFile("w+b", prefix=f"{name}-", suffix=".log", delete=False)
    print(f"starting: {' '.join(shlex.quote(c) for c in cmd)} (log: {log.name})", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    failed = True
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                tail = log.read().decode("utf-8", "replace").strip().splitlines()[-5:]
                raise SystemExit(f"serve_load: {name} exited ({proc.returncode}) before it was ready:\n"
                                 + "\n".join(tail))
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"serve_load: {name} was not ready within {timeout_s:g} s (log: {log.name})")
            time.sleep(0.2)
        SPAWNED[url] = proc.pid
        yield url
        failed = False
    finally:
        SPAWNED.pop(url, None)
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: the server drains and exits
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        if not failed:  # kept only to explain a failure
            os.unlink(log.name)


def spawned_server(model: str, serve_args: str, timeout_s: float):  # noqa: ANN201
    """`gptj serve --model MODEL --port P` as a subprocess (see `spawned`)."""
    return spawned("gptj-serve", lambda port: [sys.executable, "-m", "gptj.cli", "serve", "--model", model, "--host",
                                               "127.0.0.1", "--port", str(port), *shlex.split(serve_args)], timeout_s)


def table(results: list[LoadResult]) -> str:
    head = ("rate", "done", "fail", "dur s", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
            "ITL p99", "ITL max", "E2E p50")
    rows = [head]
    for r in results:
        rows.append((("inf" if math.isinf(r.rate) else f"{r.rate:g}"), str(r.completed), str(r.failed),
                     f"{r.duration_s:.2f}", f"{r.request_throughput:.2f}", f"{r.output_throughput:.1f}",
                     *(f"{v:.1f}" for v in (r.ttft_p50_ms, r.ttft_p99_ms, r.tpot_p50_ms, r.tpot_p99_ms,
                                            r.itl_p99_ms, r.itl_max_ms, r.e2e_p50_ms))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    out = "\n".join(lines) + "\n(latencies in ms; rate in requests/s offered)"
    for r in results:
        for err, n in r.errors.items():
            out += f"\nrate {r.rate:g}: {n} x {err}"
    return out


def json_safe(r: LoadResult) -> dict:
    """r as a dict for JSON, which has no NaN or inf: no samples -> null, rate inf -> "inf"."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else "inf" if v == float("inf") else v)
            for k, v in asdict(r).items()}


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            rate = float("inf") if part in ("inf", "max") else float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected rates like 1,2,4,inf, got {text!r}") from None
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"rates must be > 0, got {part!r}")
        rates.append(rate)
    return rates


async def bench(url: str, args: argparse.Namespace) -> dict:
    client = Client(url, args.api_key)
    try:
        status, models = await client.get_json("/v1/models")
    except OSError as e:
        raise SystemExit(f"serve_load: cannot reach {client.url}: {e.strerror or e}") from None
    if status != 200 or not isinstance(models, dict):
        raise SystemExit(f"serve_load: GET {client.url}/v1/models answered {status}: {str(models)[:200]}")
    cards = {m["id"]: m for m in models.get("data", [])}
    name = args.model_name
    if name is None:
        if len(cards) != 1:
            raise SystemExit(f"serve_load: the server serves {sorted(cards)}; name one with --model-name")
        name = next(iter(cards))
    if name not in cards:
        raise SystemExit(f"serve_load: the server does not serve {name!r} (it serves {sorted(cards)})")
    max_model_len = cards[name].get("max_model_len")
    prompts = make_prompts(args, max_model_len)

    def body(prompt: list[int]) -> dict:
        b = {"model": name, "prompt": prompt, "max_tokens": args.max_tokens, "min_tokens": args.min_tokens,
             "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
             "temperature": args.temperature}
        if args.beams > 1:
            b.update(use_beam_search=True, best_of=args.beams, n=1, temperature=0)
        if args.ignore_eos:
            b["ignore_eos"] = True
        return b

    bodies = [body(p) for p in prompts]
    for i in range(args.warmup):  # not counted: first-call costs (compilation, allocation) out of the way
        r = await one_request(client, bodies[i % len(bodies)], args.request_timeout)
        if not r.ok:
            raise SystemExit(f"serve_load: the warm-up request failed: {r.error}")
    results = []
    for rate in args.rates:
        res = await run_load(client, bodies, rate, args.max_concurrency, args.seed, args.request_timeout)
        results.append(res)
        if not args.json:
            print(f"rate {'inf' if math.isinf(rate) else f'{rate:g}'}: {res.completed} done, {res.failed} failed, "
                  f"{res.duration_s:.1f} s", file=sys.stderr)
    client.close_idle()
    lens = [len(p) for p in prompts]
    return {"url": client.url, "model": name, "max_model_len": max_model_len, "num_prompts": len(prompts),
            "dataset": args.dataset, "prompt_tokens": {"min": min(lens), "mean": sum(lens) / len(lens),
                                                       "max": max(lens)},
            "max_tokens": args.max_tokens, "min_tokens": args.min_tokens, "ignore_eos": args.ignore_eos,
            "beams": args.beams, "temperature": args.temperature, "max_concurrency": args.max_concurrency,
            "seed": args.seed, "results": results, "prompts": prompts}


def engine_baseline(model: str, serve_args: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """The peer: the same prompts on gptj's engine in this process (no HTTP), all submitted at
    once, the engine built from the server's own flags as `gptj serve` builds it; run after the
    server has stopped."""
    import time

    from gptj.cli import build_parser
    from gptj.decode import GenerationConfig
    from gptj.runtime import flags
    from gptj.runtime.build import build_engine, load_model

    served = build_parser().parse_args(["serve", "--model", model, *shlex.split(serve_args)])
    spec = flags.model_spec(served, path=model.partition("=")[2] or model)
    engine = build_engine(load_model(spec), flags.engine_config(served))
    K = args.beams
    gen = GenerationConfig(max_new_tokens=args.max_tokens, min_new_tokens=args.min_tokens, num_beams=K,
                           eos_token_id=None if args.ignore_eos else 50256)
    engine.generate(prompts[:1], gen)  # warm-up, as the server's
    start = time.perf_counter()
    outputs = engine.generate(prompts, gen)
    seconds = time.perf_counter() - start
    tokens = sum(map(len, outputs))
    return {"duration_s": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "req_s": len(prompts) / seconds}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running gptj server, e.g. http://127.0.0.1:8000")
    where.add_argument("--model", help="NAME=DIR or DIR: start `gptj serve --model ...` for the run")
    p.add_argument("--serve-args", default="--dtype fast",
                   help='with --model: more `gptj serve` flags (default "--dtype fast": bfloat16 where it runs fast, '
                        'the serving figures\' dtype; give --dtype in yours to choose)')
    p.add_argument("--startup-timeout", type=float, default=600.0, help="with --model: seconds to wait for /health")
    p.add_argument("--model-name", help="the served model to use (default: the server's only one)")
    p.add_argument("--api-key", default=os.environ.get("GPTJ_SERVER_API_KEY"),
                   help="the server's --api-key (default $GPTJ_SERVER_API_KEY)")
    p.add_argument("--rates", type=parse_rates, default=[1.0, 2.0, 4.0, float("inf")],
                   help="offered loads in requests/s, comma-separated; inf = all at once (default 1,2,4,inf)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per offered load (default 64)")
    p.add_argument("--dataset", choices=("mlperf", "random"), default="mlperf",
                   help="mlperf: the bundled gptj-99 sample set (default); random: --input-len random ids")
    p.add_argument("--dataset-path", help="with --dataset mlperf: a cnn_eval.json instead of the bundled sample")
    p.add_argument("--input-len", type=int, default=512, help="with --dataset random: prompt tokens (default 512)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--beams", type=int, default=1, help="beam search with K beams (default 1: greedy/sampled)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--max-concurrency", type=int, help="at most N requests in flight (default: no limit)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted requests before the first load (default 1)")
    p.add_argument("--seed", type=int, default=0, help="arrivals and random prompts (default 0)")
    p.add_argument("--compare-engine", action="store_true",
                   help="with --model: afterwards run the same prompts on the engine in-process (no HTTP) and "
                        "report the server's all-at-once throughput as a ratio of it")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


SMOKE = dict(rates=[float("inf")], num_prompts=2, max_tokens=4, ignore_eos=True, dataset="random", input_len=8)


def parse_args(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """p's arguments, with --smoke's sizes as the defaults when it is given."""
    return _smoke.parse_args(p, SMOKE, argv)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = parse_args(p, argv)
    if args.compare_engine and not args.model:
        p.error("--compare-engine needs --model")
    for name in ("num_prompts", "max_tokens", "input_len", "beams"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")

    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(spawned_server(args.model, args.serve_args, args.startup_timeout))
        report = asyncio.run(bench(url, args))
    if args.compare_engine:
        base = engine_baseline(args.model, args.serve_args, report.pop("prompts"), args)
        burst = [r for r in report["results"] if math.isinf(r.rate)] or report["results"][-1:]
        base["server_over_engine"] = burst[0].output_throughput / base["output_tok_s"]
        report["engine_baseline"] = base
    report.pop("prompts", None)
    if args.json:
        report["results"] = [json_safe(r) for r in report["results"]]
        print(json.dumps(report, indent=2))
    else:
        pl = report["prompt_tokens"]
        method = f"beams {report['beams']}" if report["beams"] > 1 else "sampled" if report["temperature"] else "greedy"
        print(f"{report['url']} model {report['model']}: {report['num_prompts']} prompts per load "
              f"({report['dataset']}, {pl['min']}-{pl['max']} tokens, mean {pl['mean']:.0f}), max_tokens "
              f"{report['max_tokens']}{' (ignore_eos)' if report['ignore_eos'] else ''}, "
              f"{method}"
              f"{', max concurrency ' + str(report['max_concurrency']) if report['max_concurrency'] else ''}")
        print(table(report["results"]))
        if "engine_baseline" in report:
            b = report["engine_baseline"]
            print(f"engine in-process (same prompts, all at once, no HTTP): {b['output_tok_s']:.1f} output tok/s, "
                  f"{b['req_s']:.2f} req/s; server at the highest load / engine = {b['server_over_engine']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
