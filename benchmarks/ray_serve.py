"""What Ray Serve costs and gives: the same load against `gptj serve` (one process) and against
`gptj serve --ray` (through the gateway at /v1 and through the model's own route /NAME/v1).

Everything runs on this machine, one configuration after the other, with the same prompts and the
same offered loads (benchmarks/serve_load.py does the measuring). It starts its own Ray instance
(`ray start --head` on loopback, with Ray's token authentication and a token of its own) and stops it.

    python benchmarks/ray_serve.py --model tiny=/tmp/tiny --replicas 1 --rates inf,4 --num-prompts 32 \\
        --max-tokens 32 --ignore-eos --dataset random --input-len 64
    python benchmarks/ray_serve.py --model tiny=/tmp/tiny --smoke --json   # one burst of 2 short requests each

Without Ray installed (pip install 'gptj[ray]') it says so in one line and measures `gptj serve` alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import serve_load  # noqa: E402


@contextlib.contextmanager
def ray_head(timeout_s: float = 300.0):  # noqa: ANN201 - yields the cluster's address
    """A Ray head node of this script's own on loopback: `ray start --head --block` in a session of its
    own, stopped by signalling that process (it shuts down its Ray processes), not with `ray stop`,
    which would stop every Ray instance on the machine."""
    folder = Path(tempfile.mkdtemp(prefix="gptj-ray-"))
    (folder / "token").write_text(secrets.token_hex(32))
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(folder / "token"), RAY_USAGE_STATS_ENABLED="0")
    ray = str(Path(sys.executable).parent / "ray")
    port = serve_load.free_port()
    log_path = folder / "ray-start.log"
    with open(log_path, "wb") as log:
        head = subprocess.Popen([ray, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
                                 "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={folder / 'ray'}"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True,
                                # one node, nowhere to move replicas to: on SIGTERM stop at once, no drain
                                env={**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
    try:
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started" not in log_path.read_text(errors="replace"):
            if head.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
                raise SystemExit("ray_serve: `ray start --head` " + (
                    f"exited ({head.returncode})" if head.returncode is not None else f"not up in {timeout_s:g} s")
                    + ":\n" + "\n".join(tail))
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()  # SIGTERM: the node drains and stops the Ray processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        with contextlib.suppress(ProcessLookupError):  # whatever of its session is left
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="NAME=DIR")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--serve-args", default="--dtype fast",
                   help="more gptj serve flags for both servers (default \"--dtype fast\": bfloat16 where it runs fast)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object (the table to stderr)")
    p.add_argument("--smoke", action="store_true",
                   help="a check that the script runs, not a measurement: serve_load.py's --smoke sizes")
    known, rest = p.parse_known_args()
    name = known.model.partition("=")[0]
    load_args = serve_load.parse_args(serve_load.build_parser(),
                                      ["--url", "http://unused", *rest, *(["--smoke"] if known.smoke else [])])
    log = sys.stderr if known.json else sys.stdout

    rows = []
    with serve_load.spawned_server(known.model, known.serve_args, 600) as url:
        rows.append(("gptj serve (1 process)", asyncio.run(serve_load.bench(url, load_args))))
    if importlib.util.find_spec("ray") is None:
        print("ray_serve: skipping the Ray Serve rows: ray is not installed (pip install 'gptj[ray]')", file=sys.stderr)
    else:
        with ray_head() as address:
            ray_args = f"--ray --address {address} --replicas {known.replicas} {known.serve_args}"
            with serve_load.spawned_server(known.model, ray_args, 600) as url:
                rows.append((f"Ray Serve gateway /v1 ({known.replicas} replica(s))",
                             asyncio.run(serve_load.bench(url, load_args))))
                rows.append((f"Ray Serve route /{name}/v1",
                             asyncio.run(serve_load.bench(f"{url}/{name}", load_args))))

    base = {r.rate: r for r in rows[0][1]["results"]}
    print("| server | offered req/s | completed | output tok/s | vs gptj serve | TTFT p50 ms | E2E p50 ms |", file=log)
    print("|---|---|---|---|---|---|---|", file=log)
    for label, report in rows:
        for r in report["results"]:
            rate = "inf" if math.isinf(r.rate) else f"{r.rate:g}"
            ratio = r.output_throughput / base[r.rate].output_throughput if base[r.rate].output_throughput else math.nan
            print(f"| {label} | {rate} | {r.completed}/{r.completed + r.failed} | {r.output_throughput:.1f} | "
                  f"{ratio:.2f}x | {r.ttft_p50_ms:.1f} | {r.e2e_p50_ms:.1f} |", file=log)
    if known.json:
        print(json.dumps({"model": name, "replicas": known.replicas,
                          "servers": [{"server": label, "results": [serve_load.json_safe(r) for r in report["results"]]}
                                      for label, report in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
