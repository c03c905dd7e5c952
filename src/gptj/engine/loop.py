"""The engine on a background thread: submit from any thread, get a handle to wait on or cancel.

Submissions and cancellations go through an inbox the loop drains before every step, so a
request that arrives while others run joins at the next step — it never waits for a batch to
drain. The engine itself is only touched from the loop's thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from gptj.decode import GenerationConfig
from gptj.engine.core import FAILED, Engine
from gptj.engine.request import AbortRequest, AddRequest, Operation, Request
from gptj.errors import GptjError
from gptj.threads import name_os_thread, release_openmp_threads


HEARTBEAT_S = 5.0  # an idle leader still tells its followers it is there this often


class EngineStopped(GptjError):
    """The loop takes no more requests: it was shut down, or it stopped on an error (`EngineLoop.error`)."""


class RequestHandle:
    """A submitted request: `result()` waits for its new tokens; `cancel()` stops it and frees its KV."""

    def __init__(self, loop: EngineLoop, request_id: str) -> None:
        self.loop, self.request_id = loop, request_id
        self.future: Future[Request] = Future()

    def result(self, timeout: float | None = None) -> list[int]:
        req = self.future.result(timeout)
        if req.error is not None:
            raise GptjError(f"request {req.request_id} failed: {req.error}")
        return req.output

    def request(self, timeout: float | None = None) -> Request:
        return self.future.result(timeout)

    def cancel(self) -> None:
        self.loop.cancel(self.request_id)

    def done(self) -> bool:
        return self.future.done()


class EngineLoop:
    """`batch_wait_ms`: when the engine is idle and a request arrives, wait up to this long for more
    (up to a full batch) before the first step, so that a burst starts as one batch."""

    def __init__(self, engine: Engine | Callable[[], Engine], batch_wait_ms: float = 0.0,
                 leader: Any = None) -> None:
        """`engine`, or a function that builds one (loads the model...) on the loop's own thread.

        Prefer the function. An engine built on the calling thread leaves that thread an OpenMP team
        (torch's, from loading and preparing the model), and while two teams live libgomp lets their
        workers spin only briefly, so each parallel region of the loop's steps pays a wake-up: steps ran
        a quarter slower on a 2-core CPU (docs/PERFORMANCE.md, "Which thread runs the engine"). So once
        the engine is up, the constructor lets the calling thread's team go (gptj.threads.
        release_openmp_threads); it waits for the build and raises its error.

        `leader` (gptj.parallel.lockstep.Leader): the engine runs on several ranks; before each step
        the leader hands the other ranks what this loop applied since the last one."""
        self.leader = leader
        self._ops: list[Operation] = []  # applied since the leader's last sync
        self._synced = time.monotonic()
        factory = None if isinstance(engine, Engine) else engine
        self.engine: Engine = engine if factory is None else None  # type: ignore[assignment]
        self.batch_wait_s = max(0.0, batch_wait_ms) / 1000
        # (operation, on_token, on_finish): the callbacks stay on this rank
        self._inbox: queue.Queue[tuple[Operation, Callable | None, Callable | None]] = queue.Queue()
        self._stop = threading.Event()
        self._ids = 0
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self.threads = 0  # torch compute threads on the loop's thread, once the engine is built
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(factory,), name="gptj-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        release_openmp_threads()  # the caller's team, if it built an engine, would throttle the loop's

    def submit(self, prompt: Sequence[int], gen: GenerationConfig,
               on_token: Callable[[Request, int], None] | None = None,
               on_finish: Callable[[Request], None] | None = None,
               logprobs: int | None = None, prompt_logprobs: int | None = None,
               adapter: str | None = None) -> RequestHandle:
        """Queue a request (validated now: a bad one raises GptjError here, in the caller's thread);
        `adapter`: a LoRA adapter of the engine's to run it with."""
        if self.error is not None:
            raise EngineStopped(f"the engine stopped: {self.failure}")
        if self._stop.is_set():
            raise EngineStopped("the engine is shut down")
        self.engine.validate(prompt, gen, logprobs, adapter)
        with self._lock:
            self._ids += 1
            rid = f"loop-{self._ids}"
        handle = RequestHandle(self, rid)

        def finished(req: Request) -> None:
            if on_finish is not None:
                on_finish(req)
            handle.future.set_result(req)

        self._inbox.put((AddRequest(rid, list(prompt), gen, logprobs, prompt_logprobs, adapter), on_token, finished))
        if self.error is not None:  # the loop stopped after the check above: nothing will drain the inbox
            self._fail_inbox(f"engine loop stopped: {self.failure}")
        return handle

    def cancel(self, request_id: str) -> None:
        self._inbox.put((AbortRequest(request_id), None, None))

    @property
    def pending(self) -> int:
        """Requests submitted but not yet handed to the engine."""
        return self._inbox.qsize()

    def _drain(self, block: bool, timeout: float = 0.05) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            op, on_token, on_finish = item
            if self.leader is not None and isinstance(op, AddRequest):
                op = self.leader.add(op)
            self.engine.apply(op, on_token, on_finish)
            if self.leader is not None:
                self._ops.append(op)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self, factory: Callable[[], Engine] | None) -> None:
        name_os_thread(self._thread.name)  # before its OpenMP team starts: the workers take the name too
        try:
            if factory is not None:
                self.engine = factory()
            self.threads = torch.get_num_threads()  # this thread's count, which the steps run with
        except BaseException as e:  # noqa: BLE001 - handed to the constructor, which raises it
            self._build_error = e
            if self.leader is not None:
                self.leader.stop()
            return
        finally:
            self._built.set()
        try:
            while not self._stop.is_set():
                idle = not self.engine.has_work
                self._drain(block=idle)
                if idle and self.engine.has_work and self.batch_wait_s > 0:
                    self._gather()
                if self.engine.has_work:
                    self._sync(step=True)
                    self.engine.step()
                elif self.leader is not None and (self._ops or time.monotonic() - self._synced > HEARTBEAT_S):
                    self._sync(step=False)
        except BaseException as e:  # noqa: BLE001 - a bug in the loop, or out of memory: fail what is pending, loudly
            self.error = e
            message = f"engine loop stopped: {self.failure}"
            for req in list(self.engine.requests.values()):
                req.error = message
                req.status, req.finish_reason = FAILED, "error"
                if req.on_finish is not None:
                    req.on_finish(req)
            self._fail_inbox(message)
        finally:
            if self.leader is not None:
                self.leader.stop()

    @property
    def failure(self) -> str | None:
        """Why the loop stopped on an error, in one line (None while it runs, or after a shutdown)."""
        if self.error is None:
            return None
        text = str(self.error).strip().splitlines()
        return f"{type(self.error).__name__}: {text[0]}" if text else type(self.error).__name__

    def _fail_inbox(self, message: str) -> None:
        """Requests submitted but never handed to the engine: they fail too (their handles complete)."""
        while True:
            try:
                op, _, on_finish = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(op, AddRequest) and on_finish is not None:
                req = Request(op.request_id, list(op.prompt), op.gen, status=FAILED, finish_reason="error",
                              error=message)
                on_finish(req)

    def _sync(self, step: bool) -> None:
        if self.leader is not None:
            self.leader.sync(self._ops, step)
            self._ops = []
            self._synced = time.monotonic()

    def _gather(self) -> None:
        """Wait up to batch_wait_s for more requests, or until a full batch is waiting."""
        deadline = time.monotonic() + self.batch_wait_s
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or sum(r.n_seqs for r in self.engine.waiting) >= self.engine.plan.max_seqs:
                return
            self._drain(block=True, timeout=left)

    def shutdown(self, cancel_pending: bool = True) -> None:
        """Stop the loop; requests still pending are aborted (their handles complete)."""
        if cancel_pending:
            for rid in list(self.engine.requests):
                self.cancel(rid)
            while not self._inbox.empty() and self._thread.is_alive():
                self._stop.wait(0.01)
            # one last drain + step so the aborts are applied by the loop's own thread
        self._stop.set()
        self._thread.join()
        self._drain(block=False)
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
