"""`gptj serve`, `gptj publish`, `gptj unpublish` and `gptj ls`: the HTTP server (on this machine,
over tensor-parallel ranks, or on Ray Serve) and the commands that load, unload and list its models."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gptj.cli.common import check_parallel, warn_lora_base
from gptj.errors import GptjError
from gptj.runtime import flags

if TYPE_CHECKING:
    from gptj.serve import ServerConfig


def _server_config(args: argparse.Namespace, models: tuple[tuple[str, str], ...] = (),
                   adapters: tuple[tuple[str, str], ...] = ()) -> ServerConfig:
    from gptj.serve import ServerConfig

    return ServerConfig(models=models, lora=adapters, host=args.host, port=args.port, model=flags.model_spec(args),
                        engine=flags.engine_config(args), batch_wait_ms=args.batch_wait_ms, max_queue=args.max_queue,
                        request_timeout_s=args.request_timeout_s, drain_timeout_s=args.drain_timeout_s,
                        read_timeout_s=getattr(args, "read_timeout_s", 30.0),
                        max_connections=getattr(args, "max_connections", 512), api_key=args.api_key,
                        public_metrics=getattr(args, "public_metrics", False),
                        public_docs=getattr(args, "public_docs", False), admin_token=getattr(args, "admin_token", None),
                        model_root=getattr(args, "model_root", None), threads=getattr(args, "threads", None),
                        **_speculation(args),
                        access_log=getattr(args, "access_log", True))


def _speculation(args: argparse.Namespace) -> dict[str, Any]:
    """ServerConfig's speculate_tokens / speculate_ngram from --speculate and its settings."""
    settings = flags.speculation(args)
    if not settings:
        return {}
    return {"speculate_tokens": settings["prompt_lookup_num_tokens"],
            "speculate_ngram": settings["max_matching_ngram_size"]}


def cmd_serve(args: argparse.Namespace) -> int:
    """An OpenAI-compatible server (POST /v1/completions, GET /v1/models, /health, /metrics) on gptj's engine.
    SIGTERM drains running requests, then exits."""
    from gptj.parallel.launch import run_parallel, under_torchrun
    from gptj.serve.registry import parse_model_arg
    from gptj.serve.server import serve

    if not args.ray:
        for flag in ("replicas", "address", "cpus_per_replica", "gpus_per_replica"):
            if getattr(args, flag) is not None:
                raise GptjError(f"--{flag.replace('_', '-')} needs --ray")
    models = tuple(parse_model_arg(m) for m in args.model)
    for name, path in models:
        if not Path(path).is_dir():
            raise GptjError(f"--model {name}={path}: no such model folder")
    adapters = tuple(parse_model_arg(a, "--lora") for a in args.lora_adapters)
    if adapters and (len(models) != 1 or args.ray or args.tp > 1 or args.pp > 1 or under_torchrun()):
        raise GptjError("--lora serves adapters over one --model, on one machine (not with --ray, --tp or --pp)")
    for name, path in adapters:
        from gptj.lora import read_config

        read_config(path)  # a folder that is not an adapter: one line now, before the base loads
        warn_lora_base("serve", path, models[0][1])
    if args.ray:  # replicas resolve the folder themselves, on whichever node hosts them
        models = tuple((name, str(Path(path).resolve())) for name, path in models)
    cfg = _server_config(args, models, adapters)
    if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
        print(f"gptj serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    if not under_torchrun() and not (args.ray and args.address):  # (a joined cluster's proxy may hold it)
        from gptj.serve.server import check_port

        check_port(args.host, args.port)  # before anything loads: a port in use is one line
    if args.ray:
        _check_replica_ranks(args, [path for _, path in models])
    elif args.tp > 1 or args.pp > 1 or under_torchrun():
        if len(models) != 1 or args.admin_token:
            raise GptjError("--tp / --pp serve one model, given at start (no --admin-token)")
        check_parallel(args.tp, args.pp, models[0][1])
        run_parallel(_serve_job, args.tp * args.pp, {"cfg": cfg, "tp": args.tp, "pp": args.pp,
                                                     "log_level": args.log_level, "debug": args.debug},
                     device=args.device)
        return 0
    if args.ray:
        from gptj.serve import ray_api

        if args.admin_token:
            raise GptjError("--admin-token is for the single-machine server; with --ray, use gptj publish "
                            "--ray-address")
        ray_api().run_server(cfg, args.address, replicas=args.replicas or 1, cpus=args.cpus_per_replica or 1.0,
                             gpus=args.gpus_per_replica or 0.0, tp=args.tp, pp=args.pp)
        return 0
    from dataclasses import replace

    from gptj.threads import RESERVED_CORES, compute_threads

    serve(replace(cfg, threads=compute_threads(args.threads, reserve=RESERVED_CORES)), log_level=args.log_level)
    return 0


def _check_replica_ranks(args: argparse.Namespace, paths: list[str]) -> None:
    """--tp / --pp inside Ray Serve replicas: each replica runs tp x pp ranks on its node."""
    world = args.tp * args.pp
    if world == 1:
        return
    for path in paths:
        if Path(path).is_dir():  # (a folder only the nodes have is checked there)
            check_parallel(args.tp, args.pp, path)
    if args.device.startswith("cuda") and (args.gpus_per_replica or 0) < world:
        raise GptjError(f"--tp {args.tp} --pp {args.pp} on CUDA needs --gpus-per-replica {world} (one GPU per rank)")


def _serve_job(rank: int, world: int, payload: dict) -> None:
    """gptj serve --tp/--pp on one rank: rank 0 serves HTTP and leads; the others follow its engine
    (and leave signals to rank 0, which tells them to stop once it has drained)."""
    from gptj.parallel import lockstep
    from gptj.parallel.context import ParallelContext
    from gptj.serve.server import serve

    if rank > 0:
        return lockstep.follower_job(rank, world, payload)
    ctx = ParallelContext.join(payload["tp"], payload["pp"])
    try:
        serve(payload["cfg"], log_level=payload["log_level"], ctx=ctx)
    finally:
        lockstep.finish(ctx)
    return None


def _admin_call(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict:
    from gptj.serve.client import request_json

    return request_json(args.server, method, path, body, token=args.admin_token, timeout=args.timeout,
                        token_source="--admin-token or $GPTJ_ADMIN_TOKEN")


def _ray(args: argparse.Namespace):  # noqa: ANN202 - gptj.serve.ray_serve, connected
    from gptj.serve import ray_api

    module = ray_api()
    module.connect(args.ray_address)
    return module


_RAY_ONLY = ("replicas", "cpus_per_replica", "gpus_per_replica")


def cmd_publish(args: argparse.Namespace) -> int:
    if args.ray_address is None:
        for flag in _RAY_ONLY:
            if getattr(args, flag) is not None:
                raise GptjError(f"--{flag.replace('_', '-')} needs --ray-address (a single server has one engine "
                                f"per model)")
        if args.tp > 1 or args.pp > 1:
            raise GptjError("--tp / --pp need --ray-address (a running server keeps the plan it started with)")
        out = _admin_call(args, "POST", "/admin/models", {"name": args.name, "path": args.path})
        print(f"published {out['name']} ({out['status']})")
        return 0
    from gptj.serve import ray_api

    replicas = args.replicas or 1
    ray_api().check_publishable(args.name, replicas)
    _check_replica_ranks(args, [args.path])
    ray_serve = _ray(args)
    cfg = _server_config(args)
    path = str(Path(args.path).resolve()) if Path(args.path).is_dir() else args.path  # else: on the nodes only
    ray_serve.start_http(args.host, args.port)  # Serve's HTTP proxy, if it is not running yet
    ray_serve.ensure_gateway()
    ray_serve.publish(args.name, path, cfg, replicas=replicas, cpus=args.cpus_per_replica or 1.0,
                      gpus=args.gpus_per_replica or 0.0, tp=args.tp, pp=args.pp, timeout_s=args.timeout)
    print(f"published {args.name} ({replicas} replica{'s' * (replicas > 1)}, route /{args.name})")
    return 0


def cmd_unpublish(args: argparse.Namespace) -> int:
    if args.ray_address is not None:
        _ray(args).unpublish(args.name)
        print(f"unpublished {args.name}")
        return 0
    out = _admin_call(args, "DELETE", f"/admin/models/{args.name}")
    print(f"unpublished {out['name']}")
    return 0


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])


def cmd_ls(args: argparse.Namespace) -> int:
    from gptj.serve.client import request_json

    if args.ray_address is not None:
        models = _ray(args).list_models()
        if args.json:
            print(json.dumps(models, indent=2))
            return 0
        _print_table([("NAME", "REPLICAS", "STATUS", "ROUTE")] + [
            (m["name"], f"{m['replicas_running']}/{m['replicas_target']}", str(m["status"]), str(m["route"]))
            for m in models])
        return 0
    models = request_json(args.server, "GET", "/v1/models", token=args.api_key, timeout=args.timeout,
                          token_source="--api-key or $GPTJ_SERVER_API_KEY")["data"]
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    _print_table([("NAME", "STATUS", "MAX_LEN", "PATH")] + [
        (m["id"], m.get("status", "ready") + (f" ({m['error']})" if m.get("error") else ""),
         str(m.get("max_model_len", "")), m.get("root", "")) for m in models])
    return 0


def _add_serving_flags(p) -> None:  # noqa: ANN001 - a parser or a group
    """What a served model runs with: gptj serve, and gptj publish on a Ray cluster."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=flags.nonnegative, default=8000)
    p.add_argument("--batch-wait-ms", type=flags.nonnegative_float, default=0.0,
                   help="an idle engine waits this long for more requests before starting (default 0)")
    p.add_argument("--max-queue", type=flags.nonnegative, default=64,
                   help="requests queued beyond a full batch; more are refused with 429 (default 64)")
    p.add_argument("--request-timeout-s", type=flags.positive_float, default=600.0, help="per request (default 600)")
    p.add_argument("--drain-timeout-s", type=flags.positive_float, default=30.0,
                   help="on SIGTERM, how long running requests may finish (default 30)")
    p.add_argument("--read-timeout-s", type=flags.positive_float, default=30.0,
                   help="a connection must send each request's headers, then its body, within this; else it is "
                        "closed (a late body: 408) (default 30)")
    p.add_argument("--max-connections", type=flags.positive, default=512,
                   help="open connections (and running requests) at most; beyond, 503 (default 512)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes, /metrics and the API "
                                      "documents (/docs, /redoc, /openapi.json) (default: $GPTJ_SERVER_API_KEY "
                                      "if set; never empty)")
    p.add_argument("--public-metrics", action="store_true",
                   help="with --api-key: serve /metrics without the key (a Prometheus scraper)")
    p.add_argument("--public-docs", action="store_true",
                   help="with --api-key: serve /docs, /redoc and /openapi.json without the key")
    flags.add_speculate_flags(p)
    flags.add_engine_flags(p, batch_alias=True, prefill_chunk=flags.SERVE_PREFILL_CHUNK,
                           max_seqs_help="sequences running at once, beams counted each (default: as many as the "
                                         "KV memory holds, at most 256)")
    # --dtype auto (every command's default): each model's checkpoint dtype, so a served answer is
    # `gptj generate`'s; --dtype fast serves bfloat16 where it runs fast (docs/PERFORMANCE.md)
    flags.add_model_flags(p, quantize_help="quantize the models' linears on load (weight-only)")
    flags.add_threads_flag(p, help="torch compute threads (default: the usable cores; on cores shared with other "
                        "work, fewer leave room for the event loop: docs/PERFORMANCE.md); "
                        "with --tp/--pp, split over the ranks (default: the cores split); with Ray, each "
                        "replica's (default: --cpus-per-replica)")


def _add_replica_flags(p) -> None:  # noqa: ANN001 - a parser or a group
    p.add_argument("--replicas", type=flags.positive, help="replicas of each model (default 1)")
    p.add_argument("--cpus-per-replica", type=flags.positive_float,
                   help="Ray CPUs per replica, and its torch threads unless --threads (default 1)")
    p.add_argument("--gpus-per-replica", type=flags.nonnegative_float, help="Ray GPUs per replica (default 0)")


def register(sub: Any) -> None:  # argparse's _SubParsersAction (a private type)
    """Add `serve`, `publish`, `unpublish` and `ls` to `sub`."""
    p = sub.add_parser("serve", help="serve models over HTTP (OpenAI completions API)", description=cmd_serve.__doc__)
    p.add_argument("--model", action="append", required=True, metavar="[NAME=]DIR",
                   help="a model folder to serve as NAME (default: the folder's name); repeatable")
    flags.add_lora_flag(p, served=True)
    _add_serving_flags(p)
    p.add_argument("--admin-token", help="enable POST/DELETE /admin/models with this bearer token (default: "
                                         "$GPTJ_ADMIN_TOKEN if set; never empty)")
    p.add_argument("--model-root", help="admin loads must lie under this folder (default: the working directory)")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no log line per request (by default each request logs its status, latency and tokens)")
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info")
    flags.add_parallel_flags(p)
    g = p.add_argument_group("Ray Serve (pip install -e \".[ray]\")")
    g.add_argument("--ray", action="store_true",
                   help="serve on Ray Serve: each model an application of --replicas replicas at /NAME, and the "
                        "OpenAI routes at /v1 routed by model name; Ctrl-C or SIGTERM removes them")
    g.add_argument("--address", help="the Ray cluster to join (HOST:PORT or auto; default: start a local one)")
    _add_replica_flags(g)
    p.set_defaults(func=cmd_serve)

    # publish, unpublish and ls: a running server's models (its admin API), or a Ray cluster's.
    for name, what in (("publish", "load a model on a running server, or publish it on a Ray cluster"),
                       ("unpublish", "unload a model from a running server, or delete it from a Ray cluster"),
                       ("ls", "list the models of a running server or of a Ray cluster")):
        p = sub.add_parser(name, help=what, description=f"{what[0].upper()}{what[1:]}. With --server: the "
                           "server's admin API (ls: GET /v1/models). With --ray-address: Ray Serve applications.")
        where = p.add_mutually_exclusive_group(required=True)
        where.add_argument("--server", help="a gptj server's base URL, e.g. http://127.0.0.1:8000")
        where.add_argument("--ray-address", help="a Ray cluster (HOST:PORT, or auto for the one on this machine)")
        p.add_argument("--timeout", type=flags.positive_float, default=600.0, help="seconds to wait (default 600)")
        if name == "ls":
            p.add_argument("--api-key", help="the server's --api-key, if it has one (default: $GPTJ_SERVER_API_KEY)")
            p.add_argument("--json", action="store_true")
            p.set_defaults(func=cmd_ls)
            continue
        p.add_argument("name", help="the model's name")
        if name == "publish":
            p.add_argument("path", help="its checkpoint folder, on the server's machine (under its --model-root); "
                                        "on a Ray cluster, on every node that may host a replica")
            g = p.add_argument_group("with --ray-address: the replicas' settings (a --server uses its own)")
            _add_serving_flags(g)
            _add_replica_flags(g)
            flags.add_parallel_flags(g)
        p.add_argument("--admin-token", help="the server's --admin-token (default: $GPTJ_ADMIN_TOKEN)")
        p.set_defaults(func=cmd_publish if name == "publish" else cmd_unpublish)
