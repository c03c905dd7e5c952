"""One chat completion request: the completions machinery (gptj.serve.completions) under OpenAI's
chat API. A chat request becomes a completion request whose prompt is the token ids of the messages
rendered with the model's chat template (gptj.chat_template), tokenized without adding a BOS (the
template writes it), and which stops at any of the model's end-of-turn tokens (the tokenizer's EOS
ids: generation_config.json's eos_token_id list), which the reply leaves out.

    precheck()        what can be refused before rendering and tokenizing: no chat template, no
                      messages, a content part that is not text, fields gptj does not implement
                      (tools, response_format other than text), penalties; the engine requests to admit
    plan()            render, tokenize, check the context length; a ChatPlan (completions.plan's
                      Plan, with the completion request it was made from)
    ChatCompletion    completions.Completion answering chat.completion objects, and chat.completion.chunk
                      events in a stream (first each choice's role, then content deltas, the last with
                      its finish_reason)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gptj.chat_template import ChatTemplateError, compiled, render_chat, template_source
from gptj.serve import completions
from gptj.serve.completions import Completion, Plan, check_capacity, check_penalties
from gptj.serve.protocol import (APIError, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                 ChatLogprobs, CompletionRequest, Usage)
from gptj.serve.registry import ServedModel

# The fields of a chat request that its completion request takes as they are.
SHARED_FIELDS = ("model", "min_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stream",
                 "stream_options", "user", "frequency_penalty", "presence_penalty", "repetition_penalty",
                 "logit_bias", "speculate")


@dataclass
class ChatPlan(Plan):
    request: CompletionRequest | None = None  # what the engine requests were planned from


def _template(served: ServedModel) -> str:
    """The served model's chat template; APIError 400 where it has none (GPT-J) or it does not compile."""
    try:
        source = template_source(served.tokenizer)
        if source is None:
            raise APIError(400, f"model {served.name!r} has no chat template (its tokenizer_config.json names no "
                                "chat_template); use /v1/completions", "model", "no_chat_template")
        compiled(source)
    except ChatTemplateError as e:
        raise APIError(400, f"model {served.name!r}: {e}", "model", "bad_chat_template") from None
    return source


def _check_messages(body: ChatCompletionRequest) -> None:
    if not body.messages:
        raise APIError(400, "messages must not be empty: give at least one message", "messages")
    for i, message in enumerate(body.messages):
        if isinstance(message.content, str):
            continue
        for j, part in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if part.type != "text":
                raise APIError(400, f"{where}: content parts of type {part.type!r} are not supported; this "
                                    'server takes text only ({"type": "text", "text": ...})', "messages")
            if part.text is None:
                raise APIError(400, f"{where}.text: field required", "messages")
            if part.model_extra:
                raise APIError(400, f"unknown field {where + '.' + next(iter(part.model_extra))!r}", "messages")


def _check_unsupported(body: ChatCompletionRequest) -> None:
    """APIError 400 for what gptj does not implement, unless at its neutral value."""
    if body.tools or body.functions:
        name = "tools" if body.tools else "functions"
        raise APIError(400, f"{name} (function calling) is not supported by this server", name)
    for name in ("tool_choice", "function_call"):
        if getattr(body, name) not in (None, "none"):
            raise APIError(400, f"{name} is not supported by this server (no tools)", name)
    kind = (body.response_format or {}).get("type", "text")
    if kind != "text":
        raise APIError(400, f"response_format {kind!r} is not supported; only text", "response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")


def _limit(body: ChatCompletionRequest) -> tuple[int | None, str]:
    """The new tokens asked for at most (None: the rest of the context), and the field that asked."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def precheck(body: ChatCompletionRequest, served: ServedModel) -> int:
    """The checks that need no rendering or tokenizing (APIError 400); else the engine requests to admit."""
    _template(served)
    _check_messages(body)
    _check_unsupported(body)
    check_penalties(body, served.vocab_size)
    limit, name = _limit(body)
    if limit is not None and limit >= served.max_model_len:
        raise APIError(400, f"this model's maximum context length is {served.max_model_len} tokens; "
                            f"{name} {limit} leaves no room for the messages", name, "context_length_exceeded")
    return check_capacity(body.n, served)


def prompt_ids(body: ChatCompletionRequest, served: ServedModel) -> list[int]:
    """The messages rendered with the model's chat template, as token ids (no special tokens added:
    the template writes them). APIError 400 where the template refuses the messages."""
    tok = served.tokenizer
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    try:
        text = render_chat(tok, messages)
    except ChatTemplateError as e:
        raise APIError(400, f"model {served.name!r}: {e}", "messages") from None
    ids = tok.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, f"model {served.name!r}: its chat template made no text of the messages", "messages")
    return ids


def plan(body: ChatCompletionRequest, served: ServedModel) -> ChatPlan:
    """Render and tokenize the messages, then plan them as a completion of those token ids (APIError 400)."""
    ids = prompt_ids(body, served)
    L, (asked, name) = served.max_model_len, _limit(body)
    if len(ids) + (asked or 1) > L:
        raise APIError(400, f"this model's maximum context length is {L} tokens, but the messages make {len(ids)} "
                            f"tokens" + (f" and {name} is {asked}" if asked else "") +
                            "; shorten the messages" + (f" or lower {name}" if asked else ""),
                       "messages" if len(ids) >= L else name, "context_length_exceeded")
    request = CompletionRequest.model_construct(
        **{f: getattr(body, f) for f in SHARED_FIELDS}, prompt=ids, max_tokens=asked or L - len(ids),
        stop_token_ids=list(dict.fromkeys([*(body.stop_token_ids or ()), *served.tokenizer.eos_token_ids])),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None)
    inner = completions.plan(request, served)
    return ChatPlan(inner.prompts, inner.prompt_texts, inner.jobs, inner.n_choices, inner.choice_prompt,
                    completions.ignored_fields(body, served, "chat completion"), request=request)


def _token_json(tok, token: int, logprob: float) -> dict[str, Any]:  # noqa: ANN001
    text = tok.decode([token])
    return {"token": text, "logprob": completions.json_float(logprob), "bytes": list(text.encode("utf-8"))}


class ChatCompletion(Completion):
    """A chat request's engine requests (Completion's), answered in the chat API's shapes."""

    ID_PREFIX = "chatcmpl"

    def __init__(self, body: ChatCompletionRequest, served: ServedModel, the_plan: ChatPlan) -> None:
        super().__init__(the_plan.request, served, the_plan)  # the completion request the chat request made

    def _logprobs(self, c: int, start: int) -> ChatLogprobs | None:
        """The chat API's logprobs of choice c's reply tokens from `start` on (its end-of-turn token left out)."""
        if self.body.logprobs is None:
            return None
        choice = self.choices[c]
        entries = choice.logprobs
        if choice.finish_reason == "stop" and choice.tokens and choice.tokens[-1] in choice.stop_ids:
            entries = entries[:len(choice.tokens) - 1]
        tok = self.served.tokenizer
        return ChatLogprobs(content=[
            {**_token_json(tok, e.token, e.logprob), "top_logprobs": [_token_json(tok, t, lp) for t, lp in e.top or ()]}
            for e in entries[start:]])

    def response(self) -> ChatCompletionResponse:
        choices = [dict(index=c, message={"role": "assistant", "content": choice.text}, logprobs=self._logprobs(c, 0),
                        finish_reason=choice.finish_reason) for c, choice in enumerate(self.choices)]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.served.name, choices=choices,
                                      usage=self.usage())

    def opening(self) -> list[dict[str, Any]]:
        """Each choice's first chunk: the reply's role (and no content yet)."""
        return [dict(index=c, delta={"role": "assistant", "content": ""}) for c in range(len(self.choices))]

    def chunk(self, c: int, first: bool) -> dict[str, Any] | None:
        """The streamed chunk for choice c (None when it has nothing new); the last has its finish_reason."""
        choice = self.choices[c]
        text = choice.delta()
        if not text and not choice.finished:
            return None
        start = choice.sent_tokens
        choice.sent_tokens = len(choice.tokens)
        return dict(index=c, delta={"content": text} if text else {}, logprobs=self._logprobs(c, start),
                    finish_reason=choice.finish_reason)

    def envelope(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        out = ChatCompletionChunk(id=self.id, created=self.created, model=self.served.name, choices=choices,
                                  usage=usage).model_dump(exclude_none=False)
        for choice in out["choices"]:  # a delta names only what it carries ({} on the last chunk)
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return out
