"""The MLPerf SUT's backend over the network: each sample is one request to a gptj server.

`HTTPBackend` speaks the server's OpenAI-compatible API (POST /v1/completions with token-id
prompts and `return_token_ids`), many requests at once, as SAX's client threads do: a pool of
`concurrency` worker threads, each with its own keep-alive HTTP/1.1 connection (stdlib
http.client). The server does the batching; the SUT only issues.

    GenerationConfig              request body
    num_beams K > 1               use_beam_search, best_of K, n 1, temperature 0, length_penalty, early_stopping
    greedy                        temperature 0
    sampling                      temperature, top_k, top_p, seed
    min/max_new_tokens            min_tokens / max_tokens
    eos_token_id None             ignore_eos

A 429 (the server's queue is full) is retried after its Retry-After, a bounded number of times
and never waiting more than `max_retry_wait_s` at once; any other failure ends the sample with
`on_done([], "one line")`. With `on_first_token` (greedy/sampled samples, for LoadGen's token
latencies) the request streams and the first streamed token is reported as it arrives.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from gptj.decode import GenerationConfig
from gptj.errors import GptjError

DEFAULT_TIMEOUT_S = 600.0  # per socket operation: a long beam search answers only at its end
DEFAULT_MAX_RETRIES = 100  # 429s in a row before a sample fails
DEFAULT_MAX_RETRY_WAIT_S = 30.0  # the longest single wait, whatever Retry-After says
API_KEY_ENV = "GPTJ_SERVER_API_KEY"  # where `gptj mlperf --server` reads the server's --api-key from


class _HTTPFailure(Exception):
    """A request that failed for good: its message is the sample's one-line error."""


def parse_server_url(url: str) -> tuple[str, str, int, str]:
    """'http://host:port[/prefix]' -> (scheme, host, port, prefix without trailing slash)."""
    text = (url or "").strip()
    if "://" not in text:
        text = "http://" + text  # "127.0.0.1:8000" is taken as http
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError as e:
        raise GptjError(f"bad server URL {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise GptjError(f"bad server URL {url!r}: expected http://HOST:PORT")
    if parts.query or parts.fragment:
        raise GptjError(f"bad server URL {url!r}: expected http://HOST:PORT (no query or fragment)")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), parts.path.rstrip("/")


def request_body(model: str, prompt: Sequence[int], gen: GenerationConfig, stream: bool = False) -> dict:
    """The /v1/completions body that asks the server for exactly what `gen` asks of the engine."""
    body: dict = {"model": model, "prompt": [int(t) for t in prompt], "max_tokens": gen.max_new_tokens,
                  "min_tokens": gen.min_new_tokens, "return_token_ids": True}
    if gen.num_beams > 1:
        body.update(use_beam_search=True, best_of=gen.num_beams, n=1, temperature=0,
                    length_penalty=gen.length_penalty, early_stopping=gen.early_stopping)
    elif gen.sampling:
        body.update(temperature=gen.temperature, top_k=gen.top_k or 0, top_p=gen.top_p)
        if gen.seed is not None:
            body["seed"] = gen.seed
    else:
        body["temperature"] = 0
    if gen.eos_token_id is None:
        body["ignore_eos"] = True
    if stream:
        body["stream"] = True
    return body


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _error_message(status: int, reason: str, raw: bytes) -> str:
    """'HTTP 400 Bad Request: <the server's error message>' in one line."""
    detail = ""
    try:
        err = json.loads(raw.decode("utf-8", "replace"))
        if isinstance(err, dict) and isinstance(err.get("error"), dict):
            detail = str(err["error"].get("message") or "")
        elif isinstance(err, dict) and "detail" in err:
            detail = str(err["detail"])
    except ValueError:
        detail = raw.decode("utf-8", "replace")
    return _one_line(f"HTTP {status} {reason}".rstrip() + (f": {detail}" if detail.strip() else ""))


def _retry_after(value: str | None, default: float) -> float:
    """Seconds from a Retry-After header (delta-seconds; an HTTP date or junk gives `default`)."""
    if value is None:
        return default
    try:
        seconds = float(value.strip())
    except ValueError:
        return default
    return seconds if seconds >= 0 and seconds == seconds else default


class HTTPBackend:
    """The SUT's `Backend` on a gptj server: one HTTP request per sample, `concurrency` at once."""

    def __init__(self, url: str, model_name: str | None = None, concurrency: int = 64,
                 timeout_s: float = DEFAULT_TIMEOUT_S, max_retries: int = DEFAULT_MAX_RETRIES,
                 max_retry_wait_s: float = DEFAULT_MAX_RETRY_WAIT_S, api_key: str | None = None) -> None:
        if not isinstance(concurrency, int) or concurrency < 1:
            raise GptjError(f"concurrency must be an integer >= 1, got {concurrency!r}")
        self.scheme, self.host, self.port, self.prefix = parse_server_url(url)
        self.url = f"{self.scheme}://{self.host}:{self.port}{self.prefix}"
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.max_retries, self.max_retry_wait_s = max_retries, max_retry_wait_s
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._has_key = bool(api_key)
        self._sleep = time.sleep  # tests replace it to see the waits without waiting
        self._local = threading.local()
        self._conns: list[http.client.HTTPConnection] = []
        self._conns_lock = threading.Lock()
        self._closed = False
        self.retries = 0  # 429s retried, over all samples
        self.models = self._list_models()
        names = [m.get("id") for m in self.models]
        if model_name is None:
            if len(names) != 1:
                raise GptjError(f"the server at {self.url} serves {len(names)} models ({', '.join(map(str, names))}); "
                                "name one with --server-model")
            model_name = names[0]
        elif model_name not in names:
            raise GptjError(f"the server at {self.url} does not serve a model {model_name!r} "
                            f"(it serves: {', '.join(map(str, names)) or 'none'})")
        self.model = str(model_name)
        card = self.models[names.index(model_name)]
        self.max_model_len: int | None = card.get("max_model_len") if isinstance(card.get("max_model_len"), int) \
            else None
        self.model_card: dict = card
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="gptj-http")

    # --- connections ---

    def _new_connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout_s)

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's keep-alive connection, and whether it was used before."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        conn = self._new_connection()
        self._local.conn = conn
        with self._conns_lock:
            self._conns.append(conn)
        return conn, False

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
            with self._conns_lock:
                if conn in self._conns:
                    self._conns.remove(conn)

    def _list_models(self) -> list[dict]:
        conn = self._new_connection()
        conn.timeout = min(self.timeout_s, 30.0)
        try:
            conn.request("GET", self.prefix + "/v1/models", headers={"Accept": "application/json", **self._auth})
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise GptjError(f"cannot reach the server at {self.url}: {_one_line(self._reason(e))}") from None
        finally:
            conn.close()
        if resp.status != 200:
            raise GptjError(f"GET {self.url}/v1/models: {_error_message(resp.status, resp.reason, raw)}"
                            + self._auth_hint(resp.status))
        try:
            data = json.loads(raw)
            models = data["data"]
            if not isinstance(models, list) or not all(isinstance(m, dict) and "id" in m for m in models):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise GptjError(f"GET {self.url}/v1/models: not an OpenAI model list; is this a gptj server?") from None
        return models

    def _auth_hint(self, status: int) -> str:
        """What to do about a 401/403: the key comes from $GPTJ_SERVER_API_KEY (never a flag, kept out of logs)."""
        if status not in (401, 403):
            return ""
        if self._has_key:
            return f" (the key in ${API_KEY_ENV} was refused: set it to the server's --api-key)"
        return f" (the server requires an API key: set ${API_KEY_ENV} to its --api-key)"

    @staticmethod
    def _reason(e: BaseException) -> str:
        if isinstance(e, socket.gaierror):
            return f"unknown host ({e.strerror or e})"
        if isinstance(e, ConnectionRefusedError):
            return "connection refused (is the server running?)"
        if isinstance(e, TimeoutError | socket.timeout):
            return "timed out"
        if isinstance(e, OSError) and e.strerror:
            return e.strerror
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__

    # --- Backend ---

    def submit(self, prompt: Sequence[int], gen: GenerationConfig,
               on_done: Callable[[list[int], str | None], None],
               on_first_token: Callable[[int], None] | None = None) -> None:
        if self._closed:
            raise GptjError("the HTTP backend is closed")
        stream = on_first_token is not None and gen.num_beams == 1
        body = json.dumps(request_body(self.model, prompt, gen, stream=stream)).encode()
        self._pool.submit(self._run, body, gen, on_done, on_first_token if stream else None)

    def cancel_all(self) -> None:
        """Drop the queued requests and cut the ones in flight (their samples end with an error)."""
        self._closed = True
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading the answer
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()

    # --- one request ---

    def _run(self, body: bytes, gen: GenerationConfig, on_done: Callable[[list[int], str | None], None],
             on_first_token: Callable[[int], None] | None) -> None:
        try:
            tokens, error = self._complete(body, gen, on_first_token), None
        except _HTTPFailure as e:
            tokens, error = [], str(e)
        except Exception as e:  # noqa: BLE001 - LoadGen must get an answer for every sample
            self._drop_connection()
            tokens, error = [], _one_line(f"{type(e).__name__}: {e}")
        on_done(tokens, error)

    def _complete(self, body: bytes, gen: GenerationConfig, on_first_token: Callable[[int], None] | None) -> list[int]:
        path = self.prefix + "/v1/completions"
        headers = {"Content-Type": "application/json", **self._auth,
                   "Accept": "text/event-stream" if on_first_token else "application/json"}
        retries = 0
        while True:
            if self._closed:
                raise _HTTPFailure("cancelled")
            conn, reused = self._connection()
            try:
                conn.request("POST", path, body=body, headers=headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                self._drop_connection()
                # A keep-alive connection the server closed while idle fails on first use: once more, fresh.
                if reused and isinstance(e, http.client.RemoteDisconnected | ConnectionResetError | BrokenPipeError):
                    continue
                raise _HTTPFailure(f"POST {self.url}/v1/completions: {_one_line(self._reason(e))}") from None
            try:
                if resp.status == 429:
                    resp.read()
                    if resp.will_close:
                        self._drop_connection()
                    if retries >= self.max_retries:
                        raise _HTTPFailure(f"the server stayed busy (HTTP 429) through {retries} retries")
                    retries += 1
                    self.retries += 1
                    self._sleep(min(_retry_after(resp.getheader("Retry-After"), 1.0), self.max_retry_wait_s))
                    continue
                if not 200 <= resp.status < 300:
                    raw = resp.read()
                    if resp.will_close:
                        self._drop_connection()
                    raise _HTTPFailure(_error_message(resp.status, resp.reason, raw) + self._auth_hint(resp.status))
                if on_first_token is not None and "text/event-stream" in (resp.getheader("Content-Type") or ""):
                    tokens, finish = self._read_stream(resp, on_first_token)
                else:
                    tokens, finish = self._read_json(resp.read())
                if resp.will_close:
                    self._drop_connection()
            except (OSError, http.client.HTTPException) as e:
                self._drop_connection()
                raise _HTTPFailure(f"POST {self.url}/v1/completions: {_one_line(self._reason(e))}") from None
            except _HTTPFailure:
                if not resp.isclosed() or resp.will_close:  # unread answer left on the connection
                    self._drop_connection()
                raise
            # The engine's output ends with the EOS that stopped it; keep that so the accuracy log's
            # token ids are the in-process ones whether or not the server lists the EOS (with several EOS ids,
            # as Llama 3.1's, only a server that lists it says which one: gptj's does).
            eos = gen.eos_ids
            if finish == "stop" and len(eos) == 1 and (not tokens or tokens[-1] != eos[0]):
                tokens.append(eos[0])
            return tokens

    @staticmethod
    def _choice(data: object) -> dict:
        if isinstance(data, dict) and isinstance(data.get("error"), dict):
            raise _HTTPFailure(_one_line(f"server error: {data['error'].get('message', data['error'])}"))
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            raise _HTTPFailure("the server's answer has no choices")
        return data["choices"][0] if data["choices"] else {}

    def _read_json(self, raw: bytes) -> tuple[list[int], str | None]:
        try:
            data = json.loads(raw)
        except ValueError:
            raise _HTTPFailure(_one_line(f"the server's answer is not JSON: {raw[:80]!r}")) from None
        choice = self._choice(data)
        ids = choice.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise _HTTPFailure("the server's answer has no token_ids (does it support return_token_ids?)")
        return list(ids), choice.get("finish_reason")

    def _read_stream(self, resp: http.client.HTTPResponse,
                     on_first_token: Callable[[int], None]) -> tuple[list[int], str | None]:
        """Server-sent events: `data: {chunk}` lines, the last `data: [DONE]`."""
        tokens: list[int] = []
        finish = None
        done = False
        data_lines: list[str] = []
        while True:
            line = resp.readline()
            if not line:
                break
            text = line.decode("utf-8", "replace").rstrip("\r\n")
            if text:
                if text.startswith("data:"):
                    value = text[5:]
                    data_lines.append(value[1:] if value.startswith(" ") else value)
                continue  # comments (":") and other fields are ignored
            if not data_lines:
                continue
            payload, data_lines = "\n".join(data_lines), []
            if payload.strip() == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(payload)
            except ValueError:
                raise _HTTPFailure(_one_line(f"a streamed chunk is not JSON: {payload[:80]!r}")) from None
            if isinstance(chunk, dict) and not chunk.get("choices") and "error" not in chunk:
                continue  # the usage-only chunk
            choice = self._choice(chunk)
            ids = choice.get("token_ids") or []
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise _HTTPFailure("a streamed chunk's token_ids are not a list of ids")
            if ids and not tokens:
                on_first_token(ids[0])
            tokens.extend(ids)
            finish = choice.get("finish_reason") or finish
        if not done:
            resp.close()
            raise _HTTPFailure("the stream ended before [DONE]")
        resp.read()  # the end of the chunked body, so the connection can be reused
        return tokens, finish
