"""GenerationConfig: how a request decodes (greedy, sampling, beam search; penalties, stop rules),
with HF transformers' names and defaults, each field checked at construction (GptjError naming it).
gptj.decode generates with it; gptj.beam and the engine read it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from gptj.errors import GptjError

EOS_TOKEN_ID = 50256  # <|endoftext|>; GPT-J has no pad token and pads with EOS
# MLPerf inference gptj-99: inputs are truncated to 1919 tokens (the tokenizer's model_max_length
# with truncation=True, which keeps the first 1919), so 1919 + 128 new tokens fit in 2048 positions.
MAX_INPUT_TOKENS = 1919

SAMPLING_EPS = 1e-5  # temperatures below this decode greedily

# repetition_penalty's range: it divides (or multiplies) logits, so a value near 0 or near float32's
# largest makes them infinite and the request's sampling fails; far beyond any useful setting (1-2)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
SPECULATE_TOKENS = 5  # --speculate ngram's default prompt_lookup_num_tokens
SPECULATE_NGRAM = 3  # and max_matching_ngram_size


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode. Field names and meanings are HF's `GenerationConfig` ones.

    Decoding: greedy by default; `do_sample=True` samples (temperature → top_k → top_p, in HF's
    order; temperature 0 means greedy); `num_beams > 1` is beam search (sampling with beams is
    not supported). `min_new_tokens` forbids EOS before that many new tokens.
    `top_k` None or 0 and `top_p` 1.0 disable those filters (note HF's own default top_k is 50).
    `seed` makes sampling reproducible (a private torch.Generator); None uses torch's global RNG,
    so `torch.manual_seed(s)` then sampling gives the same tokens as HF's generate after it.
    Beam search: a hypothesis scores sum(log p) / new_len ** length_penalty; `early_stopping`
    True stops a prompt once it has num_beams finished hypotheses, False/"never" as in HF.
    `eos_token_id`: one id, or several (a tuple; HF's list: Llama 3.1 Instruct ends a turn with any of
    three), each of which ends a sequence; None never stops early.

    Penalties and biases act on the raw logits, after min_new_tokens and before the warpers, in
    vLLM's order: `logit_bias` (token id -> a bias added to its logit, -100 to 100 as OpenAI's;
    given as a dict or pairs, kept as sorted pairs so the config stays hashable), then
    `repetition_penalty` (HF's RepetitionPenaltyLogitsProcessor: each token of the prompt and the
    output so far has its logit divided by it when positive, multiplied by it otherwise; 1 is off),
    then `frequency_penalty` and `presence_penalty` (OpenAI's: the logit loses frequency_penalty
    times the token's count in the output so far, then presence_penalty if it occurs there at all;
    output tokens only, as vLLM counts them; -2 to 2 as OpenAI's). Greedy and sampled decoding
    alike; not with beam search.

    Prompt-lookup speculation (HF's names): `prompt_lookup_num_tokens` tokens at most are drafted
    per step from the prompt and the output so far (the longest suffix of up to
    `max_matching_ngram_size` tokens that occurred before: gptj.engine.draft) and verified in the
    engine's step; None or 0 is off. The tokens are those without it (sampled: with a seed; the
    same distribution without one) in float32; in bfloat16 a draft's rows run other kernels than a
    decode row (the prefill path), so a near-tie may round the other way. The engine drafts for greedy and sampled requests without
    penalties or a logit bias (`speculates`); beam search ignores it.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    num_beams: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = True
    eos_token_id: int | tuple[int, ...] | None = EOS_TOKEN_ID
    pad_token_id: int = EOS_TOKEN_ID
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | None = None
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int = SPECULATE_NGRAM

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        _check_int("min_new_tokens", self.min_new_tokens, minimum=0)
        _check_int("num_beams", self.num_beams, minimum=1)
        if not isinstance(self.do_sample, bool):
            raise GptjError(f"do_sample must be true or false, got {self.do_sample!r}")
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise GptjError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, minimum=0)
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise GptjError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        _check_float("length_penalty", self.length_penalty)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise GptjError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if isinstance(self.eos_token_id, list | tuple):
            if not self.eos_token_id:
                raise GptjError("eos_token_id must be an id or a non-empty list of ids")
            ids = tuple(self.eos_token_id)
            object.__setattr__(self, "eos_token_id", ids[0] if len(ids) == 1 else ids)  # one id: as an int
        for eos in self.eos_ids:
            _check_int("eos_token_id", eos, minimum=0)
        _check_int("pad_token_id", self.pad_token_id, minimum=0)
        for name in ("frequency_penalty", "presence_penalty"):
            _check_float(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise GptjError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        _check_float("repetition_penalty", self.repetition_penalty)
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise GptjError(f"repetition_penalty must be from {low:g} to {high:g} (1 is off), got "
                            f"{self.repetition_penalty!r}")
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if self.prompt_lookup_num_tokens is not None:
            _check_int("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens, minimum=0)
        _check_int("max_matching_ngram_size", self.max_matching_ngram_size, minimum=1)
        if self.num_beams > 1 and self.penalized:
            raise GptjError("frequency_penalty, presence_penalty, repetition_penalty and logit_bias are not "
                            f"supported with beam search (num_beams={self.num_beams}); use num_beams=1")
        if self.do_sample and self.num_beams > 1:
            raise GptjError(f"sampling with beam search (do_sample=True, num_beams={self.num_beams}) is not "
                            "supported; use num_beams=1 to sample or do_sample=False for beam search")

    @classmethod
    def mlperf(cls, **overrides: Any) -> GenerationConfig:
        """MLPerf inference gptj-99 (CNN/DailyMail summarization): beam search, 4 beams,
        30 to 128 new tokens, early stopping. Inputs are truncated to MAX_INPUT_TOKENS."""
        settings: dict[str, Any] = dict(num_beams=4, min_new_tokens=30, max_new_tokens=128, early_stopping=True)
        settings.update(overrides)
        return cls(**settings)

    def replace(self, **changes: Any) -> GenerationConfig:
        return dataclasses.replace(self, **changes)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The ids that end a sequence (none when eos_token_id is None)."""
        eos = self.eos_token_id
        return () if eos is None else eos if isinstance(eos, tuple) else (eos,)

    @property
    def sampling(self) -> bool:
        """True when tokens are drawn at random. Temperature 0 is greedy, the limit it tends to, and
        so is any below SAMPLING_EPS (as vLLM): logits / 1e-308 overflow to inf, and softmax to NaN."""
        return self.do_sample and self.temperature >= SAMPLING_EPS

    @property
    def penalties(self) -> bool:
        """A repetition, frequency or presence penalty is on (they count the tokens so far)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def penalized(self) -> bool:
        """A penalty or a logit bias changes the logits before the warpers."""
        return self.penalties or self.logit_bias is not None

    @property
    def speculates(self) -> bool:
        """Drafts are proposed and verified for this request (the kinds the engine verifies so far)."""
        return bool(self.prompt_lookup_num_tokens) and self.method != "beam" and not self.penalized

    @property
    def method(self) -> str:
        return "beam" if self.num_beams > 1 else "sample" if self.sampling else "greedy"


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise GptjError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_float(name: str, value: Any) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise GptjError(f"{name} must be a finite number, got {value!r}")


def _logit_bias_pairs(bias: Any) -> tuple[tuple[int, float], ...] | None:
    """logit_bias as sorted (token id, bias) pairs, None when empty; GptjError naming a bad entry."""
    if bias is None:
        return None
    if isinstance(bias, dict):
        items = list(bias.items())
    elif isinstance(bias, (str, bytes)) or not isinstance(bias, (list, tuple)):
        raise GptjError(f"logit_bias must map token ids to biases, got {type(bias).__name__}")
    else:
        items = list(bias)
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise GptjError(f"logit_bias entries are (token id, bias) pairs, got {item!r}")
        token, value = item
        _check_int("logit_bias token id", token, minimum=0)
        _check_float(f"logit_bias[{token}]", value)
        if not -100.0 <= value <= 100.0:
            raise GptjError(f"logit_bias[{token}] must be in [-100, 100], got {value!r}")
        if int(token) in pairs:
            raise GptjError(f"logit_bias names token id {int(token)} twice")
        pairs[int(token)] = float(value)
    return tuple(sorted(pairs.items())) or None
