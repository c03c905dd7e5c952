"""The server's request and response schemas: OpenAI's completions and chat completions APIs, plus
vLLM's common extras, and APIError, an error answered in OpenAI's format (torch-free: Ray's gateway
imports it too).

FastAPI publishes these as the server's OpenAPI document (/openapi.json); clients and the
tests' schema fuzzing read them from there. Requests are strict: wrong JSON types are refused
(no "5" for 5), and NaN/Infinity are refused, each with a 400 that names the field. Limits that
depend on the model (context length, vocabulary) are checked by the app against the served model.
Unknown fields: a (chat) completion request's top-level ones are accepted and ignored, as vLLM does
(OpenAI clients send fields such as response_format): completions.plan logs them and names them for the
response's X-Gptj-Ignored-Fields header (Plan.headers); elsewhere (nested objects, the admin API's
bodies) they are refused.

Extras beyond OpenAI's API (vLLM's names): min_tokens, top_k, use_beam_search, length_penalty,
early_stopping, stop_token_ids, ignore_eos, return_token_ids, repetition_penalty (chat: min_tokens,
top_k, stop_token_ids, repetition_penalty); gptj's own: speculate (prompt-lookup speculation, both).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16  # choices (or beams) per prompt
MAX_LOGPROBS = 20  # top alternatives per token
MAX_STOP = 16  # stop strings

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

MAX_PROMPTS = 256  # prompts per request
MAX_BODY_BYTES = 8 * 1024 * 1024  # a request body larger than this is refused (413)

TokenId = Annotated[int, Field(ge=0)]
PromptText = Annotated[str, Field(max_length=1_000_000)]
PromptIds = Annotated[list[TokenId], Field(max_length=1_000_000)]
StopString = Annotated[str, Field(min_length=1, max_length=1000)]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False  # a last chunk with the usage counts (and no choices)


class SamplingRequest(BaseModel):
    """What a completion and a chat completion request share: the model, how to sample, when to stop,
    streaming. Unknown fields are kept in `model_extra` (ignored: `ignored_fields`)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str = Field(min_length=1, max_length=256, description="a served model's name (GET /v1/models)")
    min_tokens: int = Field(0, ge=0, le=1_000_000, description="no end of text (EOS or stop) before this many")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy; > 0 samples")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=1_000_000, description="-1 or 0 = off")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="reproducible sampling (choice i uses seed + i)")
    n: int = Field(1, ge=1, le=MAX_N, description="choices per prompt")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=256)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    # Penalties and biases (gptj.decode.GenerationConfig; vLLM's semantics). Their ranges are checked by
    # completions.check_penalties, which names the field and the value (the schema states them).
    frequency_penalty: float | None = Field(None, json_schema_extra={"minimum": -2.0, "maximum": 2.0},
                                            description="-2 to 2: each new token's logit loses this times its "
                                                        "count in the text generated so far")
    presence_penalty: float | None = Field(None, json_schema_extra={"minimum": -2.0, "maximum": 2.0},
                                           description="-2 to 2: a token's logit loses this once it occurs in the "
                                                       "text generated so far")
    repetition_penalty: float | None = Field(None, json_schema_extra={"minimum": 0.01, "maximum": 100.0},
                                             description="0.01 to 100, 1 = off: the logits of the prompt's and generated "
                                                         "tokens are divided by it (multiplied where negative)")
    logit_bias: dict[str, float] | None = Field(None, description="token id (a string) -> a bias from -100 to 100 "
                                                                  "added to its logit")
    speculate: Literal["ngram", "off"] | None = Field(
        None, description="prompt-lookup speculation (greedy and sampled requests; in float32 the tokens are those without it): "
                          "'ngram' on, 'off' off; default: the server's --speculate")

    def ignored_fields(self) -> list[str]:
        """The body's fields that are not this API's (accepted and ignored), in the order given."""
        return list(self.model_extra or ())


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: PromptText | Annotated[list[PromptText], Field(max_length=MAX_PROMPTS)] | PromptIds | Annotated[
        list[PromptIds], Field(max_length=MAX_PROMPTS)] = Field(
        description="text, texts, token ids, or lists of token ids; each prompt is completed separately")
    max_tokens: int = Field(16, ge=0, le=1_000_000,
                            description="new tokens at most, per choice; 0 with echo scores the prompt only")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="beam search: the beam width (default n)")
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0, description="beam search: score / length ** this")
    early_stopping: bool | Literal["never"] = False
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top alternatives per token")
    echo: bool = Field(False, description="prepend the prompt to the text (and its logprobs)")
    return_token_ids: bool = Field(False, description="add token_ids (and prompt_token_ids) to each choice")
    # OpenAI fields gptj does not implement: accepted only at their neutral values.
    suffix: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    """The response; in a stream, each chunk has this shape with text deltas."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


MAX_MESSAGES = 10_000  # chat messages per request


class ContentPart(BaseModel):
    """One part of a message's content. Only {"type": "text", "text": ...} is served: a part of any
    other type (image_url, input_audio, ...) is refused by gptj.serve.chat with a 400 that names it."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: str = Field(max_length=64)
    text: PromptText | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "tool"]
    content: PromptText | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)] = Field(
        description='a string, or a list of {"type": "text", "text": ...} parts')
    name: str | None = Field(None, max_length=256)
    tool_call_id: str | None = Field(None, max_length=256, description="a tool message: the call it answers")


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions: the messages are rendered with the model's chat template (its
    tokenizer_config.json), and the reply ends at any of the model's end-of-turn tokens."""

    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] = Field(
        description="the conversation so far; the reply is the assistant's next message")
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000,
                                              description="new tokens at most, per choice (default: the rest of "
                                                          "the model's context)")
    max_tokens: int | None = Field(None, ge=1, le=1_000_000, description="max_completion_tokens' older name")
    logprobs: bool = Field(False, description="the log-probability of each token of the reply")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="with logprobs: this many most likely alternatives per token")
    # OpenAI fields gptj does not implement: accepted only at their neutral values (gptj.serve.chat).
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none" is neutral
    functions: list[Any] | None = None
    function_call: Any = None  # "none" is neutral
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatReply(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class _ChatChoiceBase(BaseModel):
    index: int
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatChoice(_ChatChoiceBase):
    message: ChatReply


class ChatChunkChoice(_ChatChoiceBase):
    delta: ChatDelta


class _ChatEnvelope(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list
    usage: Usage | None = None


class ChatCompletionResponse(_ChatEnvelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatCompletionChunk(_ChatEnvelope):
    """One server-sent event of a streamed chat completion."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "gptj"
    root: str  # the checkpoint folder it was loaded from (a LoRA adapter: the adapter's folder)
    parent: str | None = None  # a LoRA adapter: the model it is served over (as vLLM reports it)
    max_model_len: int
    status: Literal["ready", "unloading", "failed"] = "ready"
    error: str | None = None  # failed: why its engine stopped (unpublish it, then publish it again)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 408: "timeout_error", 409: "conflict_error", 413: "invalid_request_error",
             415: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class Health(BaseModel):
    status: Literal["ok", "loading", "draining", "failed"]
    models: list[str]
    failed: dict[str, str] = {}  # a served model whose engine stopped -> why (the server is then "failed": 503)


MODEL_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"  # a served model's name (also checked for --model NAME=)
ModelName = Annotated[str, Field(pattern=f"^{MODEL_NAME}$")]


class LoadModelRequest(BaseModel):
    """POST /admin/models: load a checkpoint (under the server's model root) and serve it as `name`."""

    model_config = _STRICT
    name: ModelName
    path: str = Field(min_length=1, max_length=4096)


class ModelStatus(BaseModel):
    name: str
    status: Literal["ready", "unloaded"]
