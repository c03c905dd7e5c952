"""Replicas across machines with Ray Serve: gptj's server as Ray Serve applications.

SAX's model management maps onto Ray Serve applications:

* every published model is one application, named after the model, whose ingress deployment
  (`GPTJModel`) has N replicas. Each replica is a whole single-machine gptj server — the same
  FastAPI app (`gptj.serve.app.create_app`), schemas, errors, backpressure and metrics — serving one
  model, reachable directly at `/NAME/v1/completions` (and `/NAME/v1/chat/completions`);
* one gateway application (`gptj-gateway`, at `/`) answers the OpenAI routes at the root
  (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`) and routes each request by
  its `model` field to that model's application through a Ray Serve handle, streaming the answer
  back as it comes. Ray Serve balances over the replicas and routes around dead ones; the gateway
  also retries a request once when the replica it was sent to died before answering.

`publish` deploys a model application, `unpublish` deletes it, `list_models` reads the Serve
controller (name, replicas, status, route). Ray and Ray Serve are the engine here: gptj never starts
or watches processes itself. This module imports Ray: import it only when Ray is wanted
(`gptj.serve.ray_api()` turns a missing Ray into a one-line GptjError). It does not import torch
(the server's modules are imported where a replica or the gateway needs them), so `gptj ls` and
`gptj unpublish` on a cluster skip torch's import (about 1.2 s of the 2.8 s this import took).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import RayServeException

from gptj.errors import GptjError
from gptj.serve.protocol import MAX_BODY_BYTES, APIError, ModelCard, ModelList
from gptj.serve.registry import ServerConfig, check_model_name

log = logging.getLogger("gptj.serve.ray")

GATEWAY = "gptj-gateway"  # the application at "/" (a reserved model name)
DEPLOYMENT = "GPTJModel"  # the ingress deployment of every model application
_REPLICA_DIED = (ActorDiedError, ActorUnavailableError, RayActorError)
HEAD_NODE = "node:__internal_head__"  # the resource Ray gives the head node only


@serve.deployment(name=DEPLOYMENT)
@serve.ingress()
class GPTJModel:
    """One replica: a gptj server with one model, built when Ray starts the replica."""

    async def __init__(self, name: str, path: str, cfg: ServerConfig, threads: int, tp: int = 1, pp: int = 1) -> None:
        import torch

        share = max(1, threads // (tp * pp)) if threads > 0 else 0  # the replica's threads, split over its ranks
        if share:
            torch.set_num_threads(share)
        self.name = name
        # the replica's threads: its engine's build splits them over its ranks (see build_served_engine)
        self.cfg = dataclasses.replace(cfg, models=((name, path),), threads=threads or cfg.threads)
        self.ranks = self.ctx = None
        if tp * pp > 1:  # this replica is rank 0 of tp x pp ranks, the others its child processes
            from gptj.parallel import lockstep
            from gptj.parallel.context import ParallelContext
            from gptj.parallel.launch import LeadRanks

            self.ranks = await asyncio.to_thread(LeadRanks, lockstep.follower_job, tp * pp,
                                                 {"tp": tp, "pp": pp, "threads": share}, cfg.model.device)
            self.ctx = await asyncio.to_thread(ParallelContext.join, tp, pp)
        from gptj.serve.state import ServerState

        self.state = ServerState(self.cfg, self.ctx)
        await self.state.load_startup_models()
        if self.state.status != "ok":  # Ray reports the replica's constructor error to `publish`
            self._stop_ranks()
            raise GptjError(f"model {name!r} failed to load: {self.state.load_error}")

    def _stop_ranks(self) -> None:
        """Tell the other ranks to stop, and wait for them (a replica over several ranks)."""
        if self.ranks is not None:
            from gptj.parallel import lockstep

            with contextlib.suppress(Exception):  # a rank that died cannot be told
                lockstep.finish(self.ctx)
            error = self.ranks.close()
            self.ranks = None
            if error:
                log.warning("model %s: a rank reported: %s", self.name, error)

    def __del__(self) -> None:
        """Ray Serve calls this when it shuts the replica down (after draining its requests)."""
        with contextlib.suppress(Exception):
            self._stop_ranks()

    def __serve_build_asgi_app__(self) -> FastAPI:
        from gptj.serve.app import create_app

        self._gptj_app = create_app(self.cfg, self.state)  # (`app` is the wrapper's own property)
        return self._gptj_app

    def check_health(self) -> None:
        """Ray Serve calls this periodically; a replica whose engine stopped is replaced."""
        served = self.state.models.get(self.name)
        if served is None or served.loop.error is not None:
            raise RuntimeError(f"model {self.name!r}: engine stopped ({served.loop.error if served else 'unloaded'})")
        if self.ranks is not None and not self.ranks.alive():
            raise RuntimeError(f"model {self.name!r}: one of the replica's ranks died")

    async def forward(self, method: str, path: str, headers: list[tuple[str, str]],
                      body: bytes) -> AsyncIterator[dict | bytes]:
        """Run one HTTP request through this replica's app: yields {"status", "headers"}, then the
        body in chunks as the app sends them (a stream of events stays a stream). If the caller
        goes away (the generator is closed), the app sees the client disconnect."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
                 "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
                 "client": ("gateway", 0), "server": ("gptj", 0)}
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            messages.put_nowait(message)

        async def run() -> None:
            try:
                await self._gptj_app(scope, receive, send)
            finally:
                messages.put_nowait(None)

        task = asyncio.create_task(run())
        try:
            ended = False
            while not ended and (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    yield {"status": message["status"],
                           "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]]}
                    continue
                # Body: this chunk and every one already queued behind it, as one item. Each item
                # is one Ray message, so a busy stream sends fewer, larger ones; a quiet stream
                # still sends each chunk at once.
                chunks = []
                while True:
                    if message is None or message["type"] != "http.response.body":
                        ended = True
                        break
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        ended = True
                        break
                    if messages.empty():
                        break
                    message = messages.get_nowait()
                if any(chunks):
                    yield b"".join(chunks)
        finally:
            gone.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, timeout=self.cfg.request_timeout_s)


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    e = APIError(status, message, param, code)
    return JSONResponse(e.body(), status_code=status)


def _model_apps(running: bool = False) -> list[str]:
    """Names of the Serve applications that are gptj models, or only those running (a controller
    call: off the event loop)."""
    apps = serve.status().applications
    return sorted(name for name, app in apps.items() if DEPLOYMENT in app.deployments and name != GATEWAY
                  and (not running or _plain(app.status) == "RUNNING"))


def build_gateway_app() -> FastAPI:
    """The OpenAI routes at "/", routed by model name to the model applications."""
    app = FastAPI(title="gptj gateway (Ray Serve)",
                  description="OpenAI-compatible completions, routed to gptj model applications on Ray Serve.")
    handles: dict[str, Any] = {}
    live: dict[str, Any] = {"names": set(), "at": 0.0}

    async def known_models(fresh: bool = False) -> set[str]:
        """The published models, as of at most 1 s ago (`fresh`: 0.25 s, so that requests naming
        unknown models cannot flood the Serve controller)."""
        if time.monotonic() - live["at"] > (0.25 if fresh else 1.0):
            live["names"] = set(await asyncio.to_thread(_model_apps))
            live["at"] = time.monotonic()
        return live["names"]

    async def handle_for(name: str) -> Any:
        if name not in await known_models() and name not in await known_models(fresh=True):
            handles.pop(name, None)
            known = ", ".join(sorted(live["names"])) or "none"
            raise APIError(404, f"model {name!r} does not exist (served: {known})", "model", "model_not_found")
        if name not in handles:
            handles[name] = await asyncio.to_thread(serve.get_app_handle, name)
        return handles[name]

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when every published model runs; 503 ("loading") while one deploys or recovers."""
        models, running = await asyncio.gather(asyncio.to_thread(_model_apps), asyncio.to_thread(_model_apps, True))
        ok = models == running
        return JSONResponse({"status": "ok" if ok else "loading", "models": running}, status_code=200 if ok else 503)

    async def call(model: str, method: str, path: str, headers: list[tuple[str, str]], body: bytes
                   ) -> tuple[dict, Any]:
        """Send a request to one of `model`'s replicas: (its response start, the rest of the stream)."""
        for attempt in range(2):
            stream = (await handle_for(model)).options(stream=True).forward.remote(method, path, headers, body)
            try:
                return await stream.__anext__(), stream
            except _REPLICA_DIED as e:  # died before answering: nothing was sent, so try another replica
                log.warning("a replica of %s died before answering (%s); retrying", model, type(e).__name__)
                if attempt == 1:
                    raise APIError(503, f"model {model!r}: no replica answered", code="replica_unavailable",
                                   headers={"Retry-After": "1"}) from None  # Serve replaces it meanwhile
        raise AssertionError("unreachable")

    def passed(request: Request) -> list[tuple[str, str]]:
        return [(k, v) for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")]

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        """Every model's own /v1/models, merged: the models this caller may use (each checks its
        API key; one the caller lacks the key for is left out)."""
        cards = []
        for name in sorted(await known_models(fresh=True)):
            with contextlib.suppress(APIError, RayServeException, *_REPLICA_DIED):  # unpublished meanwhile
                start, stream = await call(name, "GET", "/v1/models", passed(request), b"")
                body = b"".join([chunk async for chunk in stream])
                if start["status"] == 200:
                    cards += [ModelCard(**card) for card in json.loads(body)["data"]]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    async def forward(request: Request, path: str) -> Response:
        """A (chat) completion request, sent to the application of its `model` and answered as it comes."""
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return _error(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return _error(400, f"malformed JSON: {e}")
        model = payload.get("model") if isinstance(payload, dict) else None
        if not isinstance(model, str):
            return _error(400, "model: field required (a string)", "model")
        start, stream = await call(model, "POST", path, passed(request), body)

        async def rest() -> AsyncIterator[bytes]:
            async for chunk in stream:
                yield chunk

        keep = {k: v for k, v in start["headers"] if k.lower() not in ("content-length", "transfer-encoding")}
        return StreamingResponse(rest(), status_code=start["status"], headers=keep)

    return app


# A router only: it holds each request while a model replica works on it, so it must take many at
# once (Ray Serve's default is 5 per replica; the model replicas apply gptj's own limits and 429s).
# It runs on the head node, beside Serve's controller: a worker node that goes away then takes no
# gateway with it (Serve's HTTP proxy answers 500 for every request the dead gateway held, and
# queues the next ones until Serve has started another), only model replicas, which the gateway
# routes around.
@serve.deployment(name="Gateway", max_ongoing_requests=4096,
                  ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE: 0.001}})
@serve.ingress(build_gateway_app)
class Gateway:
    pass


# --- control: what the CLI calls (on the machine that runs `gptj`, connected to the cluster) ---

def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` ("auto", "HOST:PORT", "ray://HOST:PORT"), or start a local
    one when it is None."""
    if ray.is_initialized():
        return
    _check_reachable(address)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # gptj says what it did, in one line
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False,
                 **({} if address else {"include_dashboard": False}))
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GptjError(f"cannot reach the Ray cluster at {address or 'a new local instance'}: {first}") from None


REACH_TIMEOUT_S = 5.0


def _check_reachable(address: str | None) -> None:
    """For an address of a host and port: something listens there, else one line now. Ray itself
    retries an unreachable cluster for minutes, printing its own warnings meanwhile."""
    if not address or address == "auto":
        return
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return  # not HOST:PORT: Ray's own error says what is wrong with it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__).lower()
        raise GptjError(f"cannot reach the Ray cluster at {address}: {why} (is `ray start --head` running "
                        "there, and is that its GCS port?)") from None


def start_http(host: str, port: int) -> None:
    """Start Serve with its HTTP proxy on host:port, unless Serve already runs on this cluster."""
    from ray.serve.context import _get_global_client

    try:
        _get_global_client()
    except RayServeException:  # no Serve instance yet
        serve.start(http_options={"host": host, "port": port})


def deploy_gateway() -> None:
    serve.run(Gateway.bind(), name=GATEWAY, route_prefix="/")


def ensure_gateway() -> bool:
    """Deploy the gateway unless the cluster has one; True if this deployed it."""
    if GATEWAY in serve.status().applications:
        return False
    deploy_gateway()
    return True


def check_publishable(name: str, replicas: int) -> None:
    """What can be checked before reaching the cluster."""
    check_model_name(name)
    if name == GATEWAY:
        raise GptjError(f"{GATEWAY!r} is reserved for gptj's gateway; choose another name")
    if replicas < 1:
        raise GptjError(f"--replicas must be at least 1, got {replicas}")


def publish(name: str, path: str, cfg: ServerConfig, replicas: int = 1, cpus: float = 1.0, gpus: float = 0.0,
            threads: int | None = None, tp: int = 1, pp: int = 1, timeout_s: float | None = None) -> None:
    """Deploy `path` as application `name` at /NAME with `replicas` replicas; returns when all run.
    `path` is read by the replicas, so it must exist on every node that may host one. With `tp` x
    `pp` > 1, each replica runs the model over that many ranks on its node (the replica is rank 0,
    the others its child processes); `cpus` and `gpus` are the whole replica's (GPUs: one per rank).
    Past `timeout_s` without every replica running (the cluster lacks the resources, or a replica
    loads slowly), the application is deleted and GptjError says what was asked for and what is free."""
    check_publishable(name, replicas)
    if name in serve.status().applications:
        raise GptjError(f"model {name!r} is already published; unpublish it first")
    from gptj.engine.config import DEFAULT_MAX_SEQS

    # --threads (cfg.threads) overrides the threads --cpus-per-replica implies (Ray still reserves `cpus`)
    threads = threads if threads is not None else cfg.threads if cfg.threads is not None else max(1, int(cpus))
    deployment = GPTJModel.options(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus, "num_gpus": gpus},
        # beyond that the replica answers 429 (its engine's running sequences, if not asked, are sized
        # from memory on the node: the engine's largest default bounds them)
        max_ongoing_requests=(cfg.engine.max_seqs or DEFAULT_MAX_SEQS) + cfg.max_queue,
        health_check_period_s=2.0, health_check_timeout_s=60.0,
        max_constructor_retry_count=replicas,  # a folder that does not load will not load on a retry either
        graceful_shutdown_timeout_s=cfg.drain_timeout_s)
    outcome: dict[str, BaseException] = {}

    def deploy() -> None:  # serve.run returns once the application runs, or raises if it fails
        try:
            serve.run(deployment.bind(name, path, cfg, threads, tp, pp), name=name, route_prefix=f"/{name}")
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            outcome["error"] = e

    deploying = threading.Thread(target=deploy, name=f"gptj-publish-{name}", daemon=True)
    deploying.start()
    deploying.join(timeout_s)
    if deploying.is_alive():  # still pending: say why, and leave nothing half-published
        why = _pending_reason(name, replicas, cpus, gpus)
        _stop_replicas(name)
        with contextlib.suppress(Exception):
            serve.delete(name)
        raise GptjError(f"publishing {name!r}: its {replicas} replica(s) were not running within {timeout_s:g} s "
                        f"({why}); the application was removed")
    if "error" in outcome:
        e = outcome["error"]
        if not isinstance(e, RuntimeError | RayServeException):
            raise e
        message = str(e)
        with contextlib.suppress(Exception):  # the replicas' own error, with their traceback
            message = serve.status().applications[name].deployments[DEPLOYMENT].message + "\n" + message
        _stop_replicas(name)  # leave nothing half-published
        with contextlib.suppress(Exception):
            serve.delete(name)
        raise GptjError(f"publishing {name!r} failed: {_deploy_error(message)}") from None


def _pending_reason(name: str, replicas: int, cpus: float, gpus: float) -> str:
    """Why an application's replicas are not running yet: the resources asked for and free, and Ray
    Serve's own word on the deployment (it says when a replica cannot be scheduled)."""
    asked = f"each of {replicas} replica(s) asks for {cpus:g} CPU" + (f" and {gpus:g} GPU" if gpus else "")
    try:
        free, total = ray.available_resources(), ray.cluster_resources()
        have = f"the cluster has {free.get('CPU', 0):g} of {total.get('CPU', 0):g} CPUs free"
        if gpus:
            have += f", {free.get('GPU', 0):g} of {total.get('GPU', 0):g} GPUs"
    except Exception:  # noqa: BLE001 - the reason is best-effort; the timeout stands either way
        have = "the cluster's free resources could not be read"
    said = ""
    with contextlib.suppress(Exception):
        said = serve.status().applications[name].deployments[DEPLOYMENT].message.strip()
    return f"{asked}; {have}" + (f"; Ray Serve: {' '.join(said.split())}" if said else "")


def _stop_replicas(name: str) -> None:
    """Kill application `name`'s replica actors, so that deleting a half-made application takes a
    second: Ray Serve otherwise gives a replica still waiting for resources (or one that failed) its
    whole graceful shutdown time (the drain timeout, 30 s by default) before removing it. None of them was
    published, so nothing is drained. Ray Serve names replicas SERVE_REPLICA::APP#DEPLOYMENT#ID in its
    namespace; where it names them otherwise, nothing is killed and the delete takes its time."""
    with contextlib.suppress(Exception):
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor["namespace"] == "serve" and actor["name"].startswith(f"SERVE_REPLICA::{name}#"):
                ray.kill(ray.get_actor(actor["name"], namespace="serve"), no_restart=True)


def _deploy_error(text: str) -> str:
    """The useful line of a failed deployment's message (Ray includes the replica's traceback)."""
    for line in text.splitlines():
        if "GptjError:" in line:
            return line.split("GptjError:", 1)[1].strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "unknown error"


def unpublish(name: str) -> None:
    if name == GATEWAY or name not in serve.status().applications:
        raise GptjError(f"model {name!r} is not published (published: {', '.join(_model_apps()) or 'none'})")
    serve.delete(name)


def list_models() -> list[dict[str, Any]]:
    """One row per published model: name, replicas (running / target), status, route, and each
    replica's state, node (Ray's node id, and its IP) and process id; none on a cluster where Serve
    has not been started."""
    from ray.serve.context import _get_global_client

    try:
        client = _get_global_client()
    except RayServeException:  # Serve was never started on this cluster: nothing is published
        return []
    details = client.get_serve_details()
    rows = []
    for name, app in sorted(details.get("applications", {}).items()):
        dep = app.get("deployments", {}).get(DEPLOYMENT)
        if dep is None or name == GATEWAY:
            continue
        # node_id tells nodes apart where node_ip cannot (several nodes on one machine share its IP)
        replicas = [{"state": _plain(r.get("state")), "pid": r.get("pid"), "node_id": r.get("node_id"),
                     "node_ip": r.get("node_ip"), "replica_id": r.get("replica_id")} for r in dep.get("replicas", [])]
        rows.append({"name": name, "status": _plain(app.get("status")), "route": app.get("route_prefix"),
                     "replicas_running": sum(r["state"] == "RUNNING" for r in replicas),
                     "replicas_target": dep.get("target_num_replicas", len(replicas)), "replicas": replicas})
    return rows


def _plain(value: Any) -> Any:
    """Ray's status enums as their plain names."""
    return getattr(value, "value", value)


def run_server(cfg: ServerConfig, address: str | None, replicas: int, cpus: float, gpus: float, tp: int = 1,
               pp: int = 1) -> None:
    """`gptj serve --ray`: Serve's HTTP proxy on cfg.host:cfg.port, the gateway at "/", each of
    cfg.models with `replicas` replicas; blocks until SIGINT/SIGTERM, then deletes what it deployed
    (and stops the local Ray instance if it started one)."""
    stop = threading.Event()
    connect(address)
    for sig in (signal.SIGINT, signal.SIGTERM):  # after connecting: Ray's core worker installs its own
        signal.signal(sig, lambda *_: stop.set())
    deployed: list[str] = []
    try:
        start_http(cfg.host, cfg.port)
        for name, path in cfg.models:
            publish(name, path, cfg, replicas=replicas, cpus=cpus, gpus=gpus, tp=tp, pp=pp)
            deployed.append(name)
        if ensure_gateway():  # last: its /health answers once the models above run
            deployed.append(GATEWAY)
        print(f"gptj serve: Ray Serve on http://{cfg.host}:{cfg.port} — "
              + ", ".join(f"{n} ({replicas} replica{'s' * (replicas > 1)}, /{n})" for n, _ in cfg.models)
              + f"; the OpenAI routes at /v1 (Ray cluster {ray.get_runtime_context().gcs_address})", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        for name in reversed(deployed):
            with contextlib.suppress(Exception):
                serve.delete(name)
        if address is None:  # the local instance this started (its applications are deleted above)
            ray.shutdown()
