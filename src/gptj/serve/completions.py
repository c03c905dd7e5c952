"""One completion request, from its validated body to the engine and back to choices.

    precheck()   what can be refused without tokenizing (size, count); the engine requests to admit
    plan()       body -> engine jobs (token ids + GenerationConfig each); every check that can
                 fail on input happens here, so a bad request is a 400 before anything runs
    Completion   submits the jobs to the model's EngineLoop, turns the engine's callbacks (on
                 its thread) into events on the event loop, and keeps per-choice state: new
                 tokens, incremental text, stop strings / stop token ids, logprobs

The handlers only see token ids, strings and floats; tensors stay in the engine.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import secrets
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from gptj.decode import REPETITION_PENALTY_RANGE, SAMPLING_EPS, GenerationConfig
from gptj.engine.loop import EngineStopped
from gptj.errors import GptjError
from gptj.serve.protocol import (APIError, CompletionLogprobs, CompletionRequest, CompletionResponse, SamplingRequest,
                                 Usage)
from gptj.serve.registry import ServedModel

log = logging.getLogger("gptj.serve")

IGNORED_HEADER = "X-Gptj-Ignored-Fields"  # a response's header naming the request's fields it ignored
MAX_LOGIT_BIAS = 1024  # logit_bias entries at most (OpenAI's limit is 300)


@dataclass
class Job:
    """One engine request: a prompt and how to decode it, feeding choices `first .. first + n - 1`."""

    prompt: list[int]
    gen: GenerationConfig
    first: int  # index of its first choice
    n: int  # choices it feeds: 1, or the n best beams


@dataclass
class Plan:
    prompts: list[list[int]]
    prompt_texts: list[str | None]  # the prompt as given, when it was text (for echo)
    jobs: list[Job]
    n_choices: int
    choice_prompt: list[int]  # prompt index of each choice
    ignored: list[str] = field(default_factory=list)  # the body's unknown fields (accepted, ignored)

    @property
    def headers(self) -> dict[str, str]:
        """The response's own headers: X-Gptj-Ignored-Fields when the body had fields this API has not."""
        return {IGNORED_HEADER: ",".join(field_names(self.ignored))} if self.ignored else {}


MAX_NAMED_FIELDS = 16  # ignored fields named in the header and the log line; the rest are counted


def ignored_fields(body: SamplingRequest, served: ServedModel, what: str) -> list[str]:
    """The body's unknown fields: accepted, as vLLM does, and said: in the log and in the response's header."""
    ignored = body.ignored_fields()
    if ignored:
        log.warning("model %s: a %s request's unknown fields are ignored: %s", served.name, what,
                    ", ".join(field_names(ignored)))
    return ignored


def field_names(names: list[str]) -> list[str]:
    """Client-sent field names as a header and a log line can carry them: percent-encoded outside
    letters, digits and `_-.` (no control characters, nothing beyond Latin-1), at most
    MAX_NAMED_FIELDS of them and 64 characters each."""
    shown = [quote(n[:64], safe="_-.") for n in names[:MAX_NAMED_FIELDS]]
    return shown + ([f"(+{len(names) - MAX_NAMED_FIELDS} more)"] if len(names) > MAX_NAMED_FIELDS else [])


def precheck(body: CompletionRequest, served: ServedModel) -> int:
    """The checks that need no tokenizing, run on the event loop before a request is admitted:
    APIError 400 for a request too big for the model whatever its tokens; else the number of
    engine requests it will need (what admission counts). A text prompt is measured in UTF-8 bytes
    against the least number of tokens they can make (registry.token_bytes_bound): a 7.8 MB prompt is
    refused in microseconds instead of after seconds of tokenizing."""
    if body.suffix is not None:
        raise APIError(400, "suffix is not supported", "suffix")
    check_penalties(body, served.vocab_size)
    prompt, L = body.prompt, served.max_model_len
    if not isinstance(prompt, str) and len(prompt) == 0:
        raise APIError(400, "prompt must not be empty", "prompt")
    several = not isinstance(prompt, str) and not isinstance(prompt[0], int)
    n_jobs = check_capacity((len(prompt) if several else 1) * (1 if body.use_beam_search else body.n), served)
    for i, p in enumerate([prompt] if not several else prompt):
        if isinstance(p, str):
            if served.max_token_bytes is None:
                continue
            size = len(p.encode("utf-8", "surrogatepass"))
            least = -(-size // served.max_token_bytes)  # ceil: tokens >= bytes / (bytes per token at most)
            if least + body.max_tokens > L:
                raise APIError(400, f"this model's maximum context length is {L} tokens, but prompt {i} has "
                                    f"{size} bytes of text (at least {least} tokens) and max_tokens is "
                                    f"{body.max_tokens}; shorten the prompt or lower max_tokens",
                               "prompt" if least >= L else "max_tokens", "context_length_exceeded")
        elif len(p) + body.max_tokens > L:
            raise APIError(400, f"this model's maximum context length is {L} tokens, but prompt {i} has {len(p)} "
                                f"tokens and max_tokens is {body.max_tokens} ({len(p) + body.max_tokens} in total); "
                                "shorten the prompt or lower max_tokens",
                           "prompt" if len(p) >= L else "max_tokens", "context_length_exceeded")
    return n_jobs


def speculation(body: SamplingRequest, served: ServedModel) -> dict[str, Any]:
    """GenerationConfig's prompt-lookup fields for a request: its `speculate` field, else the server's
    --speculate (ServerConfig.speculate_tokens; the request's 'ngram' with the server's setting or
    the default number of tokens)."""
    from gptj.generation_config import SPECULATE_TOKENS

    tokens, ngram = served.speculate
    if body.speculate == "off" or (body.speculate is None and tokens is None):
        return {}
    return {"prompt_lookup_num_tokens": tokens or SPECULATE_TOKENS, "max_matching_ngram_size": ngram}


def check_capacity(n_jobs: int, served: ServedModel) -> int:
    """n_jobs, the engine requests a request needs; APIError 400 where the server never admits that many."""
    if n_jobs > served.capacity:
        raise APIError(400, f"the request needs {n_jobs} engine requests; this server admits at most "
                            f"{served.capacity} at once", "n")
    return n_jobs


def check_penalties(body: SamplingRequest, V: int) -> dict[str, Any]:
    """APIError 400 naming the field (and the key) unless the penalties and logit_bias are in range
    (OpenAI's: penalties -2 to 2, biases -100 to 100, keys token ids of the vocabulary; vLLM's:
    repetition_penalty > 0) and usable with the decoding asked for; else GenerationConfig's settings."""
    settings: dict[str, Any] = {}
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(body, name)
        if value is not None:
            if not -2.0 <= value <= 2.0:
                raise APIError(400, f"{name} must be from -2 to 2, got {value!r}", name)
            settings[name] = float(value)
    if body.repetition_penalty is not None:
        low, high = REPETITION_PENALTY_RANGE
        if not low <= body.repetition_penalty <= high:
            raise APIError(400, f"repetition_penalty must be from {low:g} to {high:g} (1 is off), got "
                                f"{body.repetition_penalty!r}", "repetition_penalty")
        settings["repetition_penalty"] = float(body.repetition_penalty)
    if body.logit_bias:
        if len(body.logit_bias) > MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias has {len(body.logit_bias)} entries; at most {MAX_LOGIT_BIAS}",
                           "logit_bias")
        bias = {}
        for key, value in body.logit_bias.items():
            token = int(key) if key.isascii() and key.isdigit() else None
            if token is None or token >= V:
                raise APIError(400, f"logit_bias key {key!r} is not a token id of the vocabulary [0, {V})",
                               "logit_bias")
            if not -100.0 <= value <= 100.0:
                raise APIError(400, f"logit_bias[{key!r}] must be from -100 to 100, got {value!r}", "logit_bias")
            if token in bias:
                raise APIError(400, f"logit_bias names token id {token} twice ({key!r})", "logit_bias")
            bias[token] = float(value)
        settings["logit_bias"] = bias
    if getattr(body, "use_beam_search", False) and GenerationConfig(**settings).penalized:
        name = next(iter(settings))
        raise APIError(400, f"{name} is not supported with use_beam_search (frequency_penalty, presence_penalty, "
                            "repetition_penalty and logit_bias apply to greedy and sampled decoding)", name)
    return settings


def plan(body: CompletionRequest, served: ServedModel) -> Plan:
    """Validate a request against the served model and cut it into engine jobs (APIError 400)."""
    tok = served.tokenizer
    if body.suffix is not None:
        raise APIError(400, "suffix is not supported", "suffix")
    penalties = check_penalties(body, served.vocab_size)
    ignored = ignored_fields(body, served, "completion")
    prompt = body.prompt
    if isinstance(prompt, str):
        texts: list[str | None] = [prompt]
    elif len(prompt) == 0:
        raise APIError(400, "prompt must not be empty", "prompt")
    elif isinstance(prompt[0], str):
        texts = list(prompt)
    else:
        texts = [None] if isinstance(prompt[0], int) else [None] * len(prompt)
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        ids = tok.encode_batch(texts)
    elif isinstance(prompt[0], int):
        ids = [list(prompt)]
    else:
        ids = [list(p) for p in prompt]
    V, L = served.vocab_size, served.max_model_len
    for i, p in enumerate(ids):
        if not p:
            raise APIError(400, f"prompt {i} is empty; every prompt needs at least one token", "prompt")
        bad = next((t for t in p if t >= V), None)
        if bad is not None:
            raise APIError(400, f"prompt {i} has token id {bad} outside the vocabulary [0, {V})", "prompt")
        if len(p) + body.max_tokens > L:
            raise APIError(400, f"this model's maximum context length is {L} tokens, but prompt {i} has {len(p)} "
                                f"tokens and max_tokens is {body.max_tokens} ({len(p) + body.max_tokens} in total); "
                                "shorten the prompt or lower max_tokens",
                           "prompt" if len(p) >= L else "max_tokens", "context_length_exceeded")
    bad = next((t for t in body.stop_token_ids or () if t >= V), None)
    if bad is not None:
        raise APIError(400, f"stop_token_ids has token id {bad} outside the vocabulary [0, {V})", "stop_token_ids")
    if body.max_tokens == 0 and not (body.echo and body.logprobs is not None and not body.use_beam_search):
        raise APIError(400, "max_tokens 0 only scores the prompt: it needs echo and logprobs (and no beam search)",
                       "max_tokens")
    if body.min_tokens > body.max_tokens:
        raise APIError(400, f"min_tokens {body.min_tokens} exceeds max_tokens {body.max_tokens}", "min_tokens")
    eos = None if body.ignore_eos else tok.eos_token_ids
    try:
        if body.use_beam_search:
            width = body.best_of if body.best_of is not None else body.n
            if body.n > width:
                raise APIError(400, f"n {body.n} exceeds best_of {width}, the beam width", "n")
            if body.logprobs is not None:
                raise APIError(400, "logprobs are not available with use_beam_search", "logprobs")
            gen = GenerationConfig(max_new_tokens=body.max_tokens, min_new_tokens=body.min_tokens, num_beams=width,
                                   length_penalty=body.length_penalty, early_stopping=body.early_stopping,
                                   eos_token_id=eos, pad_token_id=tok.pad_token_id)
            jobs = [Job(p, gen, i * body.n, body.n) for i, p in enumerate(ids)]
        else:
            if body.best_of is not None and body.best_of != body.n:
                raise APIError(400, "best_of other than n needs use_beam_search", "best_of")
            sample = body.temperature >= SAMPLING_EPS
            # max_tokens 0 (scoring the prompt): the engine makes one token, which is dropped
            base = GenerationConfig(max_new_tokens=max(1, body.max_tokens), min_new_tokens=body.min_tokens,
                                    do_sample=sample,
                                    temperature=body.temperature if sample else 1.0,
                                    top_k=min(body.top_k, V) if body.top_k > 0 else None, top_p=body.top_p,
                                    eos_token_id=eos, pad_token_id=tok.pad_token_id, **penalties,
                                    **speculation(body, served))
            jobs = []
            for i, p in enumerate(ids):
                for j in range(body.n):
                    seed = None if body.seed is None else body.seed + j
                    jobs.append(Job(p, base.replace(seed=seed) if sample else base, i * body.n + j, 1))
    except GptjError as e:
        raise APIError(400, str(e)) from None
    n_choices = len(ids) * body.n
    check_capacity(len(jobs), served)
    # the engine's own limits (beam width, KV blocks) are checked once, where each job is submitted
    return Plan(ids, texts, jobs, n_choices, [c // body.n for c in range(n_choices)], ignored)


class _Choice:
    """One choice's new tokens and text, decoded incrementally (a window of tokens per step, so a
    character split over tokens is emitted whole), cut at a stop string or stop token."""

    def __init__(self, tok, stop: list[str], stop_ids: set[int], min_tokens: int) -> None:  # noqa: ANN001
        self.tok, self.stop, self.stop_ids, self.min_tokens = tok, stop, stop_ids, min_tokens
        self.tokens: list[int] = []
        self.logprobs: list = []  # TokenLogprob per new token, when asked for
        self.text = ""
        self.sent = 0  # characters of text already streamed
        self.sent_tokens = 0  # tokens already streamed
        self.lp_offset = 0  # streamed logprobs: text offset of the next token
        self._text_tokens: list[int] = []  # tokens that make up the text (a stop token is not shown)
        self._prefix = self._read = 0  # decoding window over _text_tokens
        self.finish_reason: str | None = None
        self.hold = max((len(s) for s in stop), default=1) - 1  # a stop string may still be completing

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int, logprob: Any = None) -> None:
        if self.finished:
            return
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if token in self.stop_ids and len(self.tokens) > self.min_tokens:
            self._flush()
            self.finish_reason = "stop"
            return
        self._text_tokens.append(token)
        self._decode(final=False)

    def _decode(self, final: bool) -> None:
        window = self._text_tokens[self._prefix:]
        before = self.tok.decode(self._text_tokens[self._prefix:self._read], skip_special_tokens=True)
        after = self.tok.decode(window, skip_special_tokens=True)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            start = len(self.text)
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._text_tokens)
            self._check_stop(start)
        elif final:
            self._prefix = self._read = len(self._text_tokens)

    def _check_stop(self, new_from: int) -> None:
        if not self.stop or len(self.tokens) < max(1, self.min_tokens):
            return
        search_from = max(0, new_from - self.hold)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.sent = min(self.sent, len(self.text))
            self.finish_reason = "stop"

    def _flush(self) -> None:
        if self._read < len(self._text_tokens):
            self._decode(final=True)

    def finish(self, reason: str) -> None:
        """The engine finished this choice ("stop": EOS, "length": max_tokens)."""
        if self.finished:
            return
        self._flush()
        if not self.finished:
            self.finish_reason = reason

    def delta(self) -> str:
        """Text not yet streamed, holding back what a stop string might still claim."""
        end = len(self.text) if self.finished else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out


def json_float(x: float) -> float | None:
    """A log-probability as JSON can carry it: NaN and infinities (no JSON number) become null."""
    return x if math.isfinite(x) else None


def _logprobs_json(tok, entries: list, offset: int) -> CompletionLogprobs:  # noqa: ANN001
    """OpenAI's legacy logprobs object for TokenLogprob entries; a bare int is a token without a
    log-probability (the prompt's first). A log-probability that is not finite is null."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        token = e if isinstance(e, int) else e.token
        piece = tok.decode([token])
        tokens.append(piece)
        offsets.append(offset)
        lps.append(None if isinstance(e, int) else json_float(e.logprob))
        tops.append({tok.decode([t]): json_float(lp) for t, lp in e.top} if not isinstance(e, int) and e.top
                    else None)
        offset += len(piece)
    return CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=offsets)


class Mailbox:
    """Calls from the engine's thread to an event loop, with one wake-up for those that arrive together.

    `loop.call_soon_threadsafe` wakes the event loop (a write to its self-pipe, then a pass of its
    selector) for every call: a step that makes a token for each of 32 streams would wake it 32 times,
    each time taking a core from the engine's compute threads. Here the calls are queued, and only the
    first since the loop last drained the queue schedules a drain, which runs them all, in order.
    `for_loop` gives each event loop its one mailbox, shared by every request on it."""

    _by_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.calls: collections.deque[tuple[Callable[..., None], tuple]] = collections.deque()
        self.scheduled = False
        self.wakeups = 0  # drains scheduled (tests, profiles)

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> Mailbox:
        box = cls._by_loop.get(loop)
        if box is None:
            box = cls._by_loop[loop] = cls(loop)
        return box

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """From any thread: run fn(*args) on the event loop, after every call posted before it. Dropped
        when the loop is closed (the server is gone)."""
        self.calls.append((fn, args))
        if not self.scheduled:  # (appended first: a drain that starts now takes this call too)
            self.scheduled = True
            self.wakeups += 1
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nothing will drain, so nothing is kept
                self.calls.clear()
                self.scheduled = False

    def _drain(self) -> None:
        self.scheduled = False  # before taking calls: one posted from now on schedules a drain of its own
        while self.calls:
            fn, args = self.calls.popleft()
            try:
                fn(*args)
            except Exception:  # one call's bug must not strand the calls after it
                log.exception("a call from the engine's thread failed on the event loop")


@dataclass
class _Event:
    kind: str  # "token" | "finish" | "wake" (see Completion.end)
    job: int
    token: int = 0
    logprob: Any = None
    status: str = ""
    reason: str | None = None
    error: str | None = None
    hypotheses: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    time: float = 0.0


class Completion:
    """A planned request running on a served model. Iterate `events()` until `done`. The response's
    shape (response, chunk, envelope, opening) is the completions API's; gptj.serve.chat's subclass
    gives the chat API's over the same engine requests and choices."""

    ID_PREFIX = "cmpl"

    def __init__(self, body: CompletionRequest, served: ServedModel, the_plan: Plan) -> None:
        self.body, self.served, self.plan = body, served, the_plan
        self.id = f"{self.ID_PREFIX}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.start = time.perf_counter()
        self.first_token: float | None = None
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stop_ids = set(body.stop_token_ids or [])
        self.choices = [_Choice(served.tokenizer, stop, stop_ids, body.min_tokens) for _ in range(the_plan.n_choices)]
        self.prompt_logprobs: dict[int, list] = {}  # job -> the prompt's TokenLogprobs (echo + logprobs)
        self.error: str | None = None
        self.ended: str | None = None  # why the server ended it early (a drain that timed out): a 503
        self.on_tokens: Callable[[int], None] = lambda n: None  # new tokens as the engine makes them (metrics)
        self._events: asyncio.Queue[_Event] = asyncio.Queue()
        self._handles: list = []
        self._jobs_done = [False] * len(the_plan.jobs)

    # --- engine side (callbacks run on the engine's thread) ---

    def submit(self) -> None:
        mailbox = Mailbox.for_loop(asyncio.get_running_loop())
        served = self.served
        logprobs = self.body.logprobs
        want_prompt = logprobs if (self.body.echo and logprobs is not None) else None

        def post(event: _Event) -> None:
            mailbox.post(self._events.put_nowait, event)

        def release() -> None:
            mailbox.post(served.finished, 1)

        for j, job in enumerate(self.plan.jobs):
            def on_token(req, token, j=j):  # noqa: ANN001
                first = req.prompt_logprobs is not None and len(req.output) == 1
                post(_Event("token", j, token, req.token_logprobs[-1] if req.logprobs is not None else None,
                            prompt_logprobs=list(req.prompt_token_logprobs) if first else [],
                            time=time.perf_counter()))

            def on_finish(req, j=j):  # noqa: ANN001
                release()
                post(_Event("finish", j, status=req.status, reason=req.finish_reason, error=req.error,
                            hypotheses=list(req.hypotheses), prompt_logprobs=list(req.prompt_token_logprobs),
                            time=time.perf_counter()))

            try:
                handle = served.loop.submit(job.prompt, job.gen, on_token=on_token if job.n == 1 and
                                            job.gen.num_beams == 1 else None, on_finish=on_finish,
                                            logprobs=logprobs, prompt_logprobs=want_prompt, adapter=served.adapter)
            except EngineStopped as e:  # shut down, or stopped on an error: not the request's fault
                served.release(len(self.plan.jobs) - j)
                self.cancel()
                raise APIError(503, f"model {served.name!r}: {e}", code="model_failed" if served.failure else
                               "shutting_down") from None
            except GptjError as e:
                served.release(len(self.plan.jobs) - j)
                self.cancel()
                raise APIError(400, str(e)) from None
            self._handles.append(handle)

    def cancel(self) -> None:
        """Stop every job still running (their KV is freed at the engine's next step)."""
        for j, handle in enumerate(self._handles):
            if not self._jobs_done[j]:
                handle.cancel()

    # --- event loop side ---

    def end(self, message: str) -> None:
        """Stop waiting for the engine: the request is answered 503 with `message` (its jobs are
        cancelled when the handler finishes). On the event loop's thread."""
        if not self.done:
            self.ended = message
            self._events.put_nowait(_Event("wake", -1))

    @property
    def done(self) -> bool:
        return self.error is not None or self.ended is not None or all(c.finished for c in self.choices)

    async def next_event(self) -> list[int]:
        """Wait for the engine and apply what it did; the indices of the choices that changed."""
        event = await self._events.get()
        changed = self._apply(event)
        while not self._events.empty():  # take everything that is ready: fewer, larger chunks
            changed |= self._apply(self._events.get_nowait())
        return sorted(changed)

    def _apply(self, e: _Event) -> set[int]:
        if e.kind == "wake":
            return set()
        job = self.plan.jobs[e.job]
        if e.prompt_logprobs:
            self.prompt_logprobs[e.job] = e.prompt_logprobs
        if e.kind == "token" and self.body.max_tokens == 0:  # scoring the prompt: the token is not returned
            return set()
        if e.kind == "token":
            self.first_token = self.first_token or e.time
            choice = self.choices[job.first]
            was = choice.finished
            choice.add(e.token, e.logprob)
            self.on_tokens(1)
            if choice.finished and not was:
                self._handles[e.job].cancel()  # a stop string or token: the engine can stop
            return {job.first}
        self._jobs_done[e.job] = True
        if e.status == "failed":
            self.error = e.error or "the engine failed"
            return set()
        if e.status == "aborted":  # cancelled by us (stop string, disconnect, timeout)
            for c in range(job.first, job.first + job.n):
                self.choices[c].finish("stop")
            return set(range(job.first, job.first + job.n))
        if e.hypotheses:  # beam search: the n best, whole
            self.first_token = self.first_token or e.time
            for k, (tokens, _score) in enumerate(e.hypotheses[:job.n]):
                choice = self.choices[job.first + k]
                for t in tokens:
                    choice.add(t)
                self.on_tokens(len(tokens))
                choice.finish(self._reason(tokens, job))
            return set(range(job.first, job.first + job.n))
        choice = self.choices[job.first]
        choice.finish("length" if self.body.max_tokens == 0 else e.reason if e.reason in ("stop", "length") else "stop")
        return {job.first}

    @staticmethod
    def _reason(tokens: list[int], job: Job) -> str:
        return "stop" if tokens[-1:] and tokens[-1] in job.gen.eos_ids else "length"

    # --- the response ---

    def _prompt_of(self, c: int) -> tuple[int, list[int]]:
        i = self.plan.choice_prompt[c]
        return i, self.plan.prompts[i]

    def echo_text(self, c: int) -> str:
        i, ids = self._prompt_of(c)
        text = self.plan.prompt_texts[i]
        return text if text is not None else self.served.tokenizer.decode(ids, skip_special_tokens=True)

    def logprobs_for(self, c: int, entries: list, offset: int, with_prompt: bool) -> CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        if with_prompt:
            job = next(j for j, job in enumerate(self.plan.jobs) if job.first <= c < job.first + job.n)
            prompt = self._prompt_of(c)[1]
            entries = [prompt[0], *self.prompt_logprobs.get(job, [None])[1:]] + entries
        return _logprobs_json(self.served.tokenizer, entries, offset)

    def usage(self) -> Usage:
        prompt = sum(len(p) for p in self.plan.prompts)
        completion = sum(len(c.tokens) for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def response(self) -> CompletionResponse:
        choices = []
        for c, choice in enumerate(self.choices):
            echo = self.echo_text(c) if self.body.echo else ""
            choices.append(dict(index=c, text=echo + choice.text, finish_reason=choice.finish_reason,
                                logprobs=self.logprobs_for(c, choice.logprobs, 0, self.body.echo),
                                **self._ids(c, choice.tokens)))
        return CompletionResponse(id=self.id, created=self.created, model=self.served.name, choices=choices,
                                  usage=self.usage())

    def _ids(self, c: int, tokens: list[int]) -> dict[str, Any]:
        if not self.body.return_token_ids:
            return {}
        return {"token_ids": list(tokens), "prompt_token_ids": self._prompt_of(c)[1]}

    def chunk(self, c: int, first: bool) -> dict[str, Any] | None:
        """The streamed chunk for choice c (None when it has nothing new)."""
        choice = self.choices[c]
        text = choice.delta()
        new_tokens = choice.tokens[choice.sent_tokens:]
        new_lps = choice.logprobs[choice.sent_tokens:]
        if first and self.body.echo:
            text = self.echo_text(c) + text
        if not text and not choice.finished and not (self.body.return_token_ids and new_tokens):
            return None
        start = choice.sent_tokens
        choice.sent_tokens = len(choice.tokens)
        out: dict[str, Any] = dict(index=c, text=text, finish_reason=choice.finish_reason,
                                   logprobs=self.logprobs_for(c, new_lps, choice.lp_offset, first and self.body.echo))
        if out["logprobs"] is not None and out["logprobs"].tokens:  # offsets run over the whole streamed text
            choice.lp_offset = out["logprobs"].text_offset[-1] + len(out["logprobs"].tokens[-1])
        if self.body.return_token_ids:
            out["token_ids"] = new_tokens
            if start == 0:
                out["prompt_token_ids"] = self._prompt_of(c)[1]
        return out

    def opening(self) -> list[dict[str, Any]]:
        """The chunks a stream starts with, before the engine makes a token (none here)."""
        return []

    def envelope(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        return CompletionResponse(id=self.id, created=self.created, model=self.served.name, choices=choices,
                                  usage=usage).model_dump(exclude_none=False)

    @property
    def new_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.choices)
