"""What Ray Serve costs and gives: the same load against `gptj serve` (one process) and against
`gptj serve --ray` (through the gateway at /v1 and through the model's own route /NAME/v1).

Everything runs on this machine, one configuration after the other, with the same prompts and the
same offered loads (benchmarks/serve_load.py does the measuring). It starts its own Ray instance
(`ray start --head` on loopback, with Ray's token authentication and a token of its own) and stops it.

    python benchmarks/ray_serve.py --model tiny=/tmp/tiny --replicas 1 --rates inf,4 --num-prompts 32 \\
        --max-tokens 32 --ignore-eos --dataset random --input-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import serve_load  # noqa: E402


@contextlib.contextmanager
def ray_head():  # noqa: ANN201 - yields the cluster's address
    folder = Path(tempfile.mkdtemp(prefix="gptj-ray-"))
    (folder / "token").write_text(secrets.token_hex(32))
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(folder / "token"), RAY_USAGE_STATS_ENABLED="0")
    ray = str(Path(sys.executable).parent / "ray")
    port = serve_load.free_port()
    subprocess.run([ray, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                    "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={folder / 'ray'}"],
                   check=True, capture_output=True)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray, "stop", "--force"], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="NAME=DIR")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--serve-args", default="", help="more gptj serve flags for both servers")
    known, rest = p.parse_known_args()
    name = known.model.partition("=")[0]
    load_args = serve_load.build_parser().parse_args(["--url", "http://unused", *rest])

    rows = []
    with serve_load.spawned_server(known.model, known.serve_args, 600) as url:
        rows.append(("gptj serve (1 process)", asyncio.run(serve_load.bench(url, load_args))))
    with ray_head() as address:
        ray_args = f"--ray --address {address} --replicas {known.replicas} {known.serve_args}"
        with serve_load.spawned_server(known.model, ray_args, 600) as url:
            rows.append((f"Ray Serve gateway /v1 ({known.replicas} replica(s))",
                         asyncio.run(serve_load.bench(url, load_args))))
            rows.append((f"Ray Serve route /{name}/v1", asyncio.run(serve_load.bench(f"{url}/{name}", load_args))))

    base = {r.rate: r for r in rows[0][1]["results"]}
    print(f"| server | offered req/s | completed | output tok/s | vs gptj serve | TTFT p50 ms | E2E p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for label, report in rows:
        for r in report["results"]:
            rate = "inf" if math.isinf(r.rate) else f"{r.rate:g}"
            ratio = r.output_throughput / base[r.rate].output_throughput
            print(f"| {label} | {rate} | {r.completed}/{r.completed + r.failed} | {r.output_throughput:.1f} | "
                  f"{ratio:.2f}x | {r.ttft_p50_ms:.1f} | {r.e2e_p50_ms:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
