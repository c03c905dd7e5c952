"""Generation with HF transformers' semantics: greedy, sampling and beam search.

Small free functions around `GPTJForCausalLM.forward` and its `KVCache`, meant to give the
same tokens as `transformers.GPTJForCausalLM.generate` (transformers 5.x) for the same
settings. The tests check this against HF itself.

Conventions:
  * Prompts are lists of token ids. Several prompts form one LEFT-padded batch (pad id
    `pad_token_id`, attention mask 0 on pads); positions count real tokens only, as HF does.
  * The result of each prompt is its NEW tokens, up to and including the first EOS if one
    was generated. This is HF's output with the prompt removed and cut after the first EOS
    (HF pads the rest of the row with `pad_token_id`, which for GPT-J is EOS itself).

Shapes: B prompts, T padded prompt length, V vocabulary, K beams, L = max_new_tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gptj.device import to_device
from gptj.errors import GptjError
from gptj.models.gptj import GPTJForCausalLM

EOS_TOKEN_ID = 50256  # <|endoftext|>; GPT-J has no pad token and pads with EOS
# MLPerf inference gptj-99: inputs are truncated to 1919 tokens (the tokenizer's model_max_length
# with truncation=True, which keeps the first 1919), so 1919 + 128 new tokens fit in 2048 positions.
MAX_INPUT_TOKENS = 1919

SAMPLING_EPS = 1e-5  # temperatures below this decode greedily

# HF marks impossible beams with this score instead of -inf, so sums stay finite.
_NEG = -1.0e9


# repetition_penalty's range: it divides (or multiplies) logits, so a value near 0 or near float32's
# largest makes them infinite and the request's sampling fails; far beyond any useful setting (1-2)
REPETITION_PENALTY_RANGE = (0.01, 100.0)


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
    `eos_token_id` None never stops early.

    Penalties and biases act on the raw logits, after min_new_tokens and before the warpers, in
    vLLM's order: `logit_bias` (token id -> a bias added to its logit, -100 to 100 as OpenAI's;
    given as a dict or pairs, kept as sorted pairs so the config stays hashable), then
    `repetition_penalty` (HF's RepetitionPenaltyLogitsProcessor: each token of the prompt and the
    output so far has its logit divided by it when positive, multiplied by it otherwise; 1 is off),
    then `frequency_penalty` and `presence_penalty` (OpenAI's: the logit loses frequency_penalty
    times the token's count in the output so far, then presence_penalty if it occurs there at all;
    output tokens only, as vLLM counts them; -2 to 2 as OpenAI's). Greedy and sampled decoding
    alike; not with beam search.
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
    eos_token_id: int | None = EOS_TOKEN_ID
    pad_token_id: int = EOS_TOKEN_ID
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | None = None

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
        if self.eos_token_id is not None:
            _check_int("eos_token_id", self.eos_token_id, minimum=0)
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


# --- inputs --------------------------------------------------------------------------------


def check_prompts(model: GPTJForCausalLM, prompts: Sequence[Sequence[int]], gen: GenerationConfig) -> None:
    """GptjError unless `prompts` is a non-empty list of non-empty lists of in-vocabulary ids
    whose longest one leaves room for max_new_tokens within n_positions."""
    config = model.config
    V = config.vocab_size
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise GptjError("prompts must be a non-empty list of token id lists")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise GptjError(f"prompt {i} must be a list of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise GptjError(f"prompt {i} is empty; every prompt needs at least one token")
        for t in prompt:
            if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < V:
                raise GptjError(f"prompt {i} has token id {t!r} outside the vocabulary [0, {V})")
    for name in ("eos_token_id", "pad_token_id"):
        value = getattr(gen, name)
        if value is not None and value >= V:
            raise GptjError(f"{name} {value} is outside the vocabulary [0, {V})")
    for token, _ in gen.logit_bias or ():
        if token >= V:
            raise GptjError(f"logit_bias token id {token} is outside the vocabulary [0, {V})")
    longest = max(len(p) for p in prompts)
    if longest + gen.max_new_tokens > config.n_positions:
        raise GptjError(f"prompt of {longest} tokens + max_new_tokens {gen.max_new_tokens} exceeds the model's "
                        f"{config.n_positions} positions; shorten the prompt (MLPerf truncates to "
                        f"{MAX_INPUT_TOKENS}) or lower max_new_tokens")


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids (B, T) and attention_mask (B, T) int64, prompts right-aligned, pads masked with 0."""
    T = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        input_ids[b, T - len(prompt):] = torch.tensor([int(t) for t in prompt], dtype=torch.long)
        attention_mask[b, T - len(prompt):] = 1
    return input_ids.to(device), attention_mask.to(device)


def _cut_at_eos(tokens: list[int], eos_token_id: int | None) -> list[int]:
    if eos_token_id is not None and eos_token_id in tokens:
        return tokens[: tokens.index(eos_token_id) + 1]
    return tokens


# --- logits processors (HF's, in HF's order) ----------------------------------------------


def block_eos(scores: torch.Tensor, n_new: int, gen: GenerationConfig) -> torch.Tensor:
    """HF's MinNewTokensLengthLogitsProcessor: EOS gets -inf while fewer than min_new_tokens
    tokens have been generated (`n_new` so far). scores: (N, V)."""
    if gen.eos_token_id is not None and n_new < gen.min_new_tokens:
        scores = scores.clone()
        scores[:, gen.eos_token_id] = -math.inf
    return scores


def penalize(scores: torch.Tensor, *, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             repetition: torch.Tensor | None = None, frequency: torch.Tensor | None = None,
             presence: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
             counts: torch.Tensor | None = None) -> torch.Tensor:
    """GenerationConfig's logit bias and penalties on scores (N, V) float32, in vLLM's order; a new
    tensor (scores is not written). Each setting is per row (the engine's rows are different
    requests'); a neutral value (bias 0, repetition 1, frequency and presence 0) leaves a row's
    logits as they were.

      bias        (rows, token ids, values float32): scores[rows, ids] += values (each pair once)
      tokens      (N, S) long: each row's prompt and output tokens, repeats allowed (a row shorter
                  than S repeats one of its own tokens): the only logits the penalties change
      repetition  (N, 1) float32: a token's logit / p where it is > 0, * p otherwise (HF's rule)
      frequency   (N, 1) float32, with counts (N, V) float32 (each token's count in the output):
                  logit -= frequency * count
      presence    (N, 1) float32, with counts: logit -= presence where count > 0

    The penalties act on the logits of `tokens` only, gathered, changed and scattered back: a few
    hundred columns of a row instead of every one of V (a token that occurs twice is written twice
    with the same value). Frequency and presence change nothing where the count is 0 (a prompt
    token not in the output; the tokens outside `tokens` have count 0)."""
    if bias is not None:
        rows, ids, values = bias
        scores = scores.index_put((rows, ids), values, accumulate=True)
    else:
        scores = scores.clone()
    if repetition is None and frequency is None and presence is None:
        return scores
    x = scores.gather(1, tokens)
    if repetition is not None:
        x = torch.where(x > 0, x / repetition, x * repetition)
    if frequency is not None or presence is not None:
        c = counts.gather(1, tokens)
        if frequency is not None:
            x = x - frequency * c
        if presence is not None:
            x = x - presence * (c > 0)
    return scores.scatter_(1, tokens, x)


def penalty_args(gens: Sequence[GenerationConfig], device: torch.device | str,
                 tokens: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> dict[str, Any]:
    """`penalize`'s keyword arguments for rows decoded with gens (one each): only the operations
    some row needs, each as a per-row column (scalars rounded to float32, as torch rounds a Python
    scalar). tokens and counts: the rows' token state (needed when some row has a penalty)."""

    def column(values: list[float]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.float32), device)[:, None]

    args: dict[str, Any] = {}
    pairs = [(r, token, value) for r, g in enumerate(gens) for token, value in g.logit_bias or ()]
    if pairs:
        rows, ids, values = zip(*pairs)
        args["bias"] = (to_device(torch.tensor(rows, dtype=torch.long), device),
                        to_device(torch.tensor(ids, dtype=torch.long), device),
                        to_device(torch.tensor(values, dtype=torch.float32), device))
    if any(g.penalties for g in gens):
        args["tokens"] = tokens
    if any(g.repetition_penalty != 1.0 for g in gens):
        args["repetition"] = column([g.repetition_penalty for g in gens])
    if any(g.frequency_penalty != 0.0 for g in gens):
        args.update(frequency=column([g.frequency_penalty for g in gens]), counts=counts)
    if any(g.presence_penalty != 0.0 for g in gens):
        args.update(presence=column([g.presence_penalty for g in gens]), counts=counts)
    return args


def top_k_filter(scores: torch.Tensor, k: int) -> torch.Tensor:
    """HF's TopKLogitsWarper: -inf below the k-th largest score (ties with it are kept)."""
    k = min(k, scores.shape[-1])
    kth = torch.topk(scores, k).values[..., -1:]  # (N, 1)
    return scores.masked_fill(scores < kth, -math.inf)


def top_p_filter(scores: torch.Tensor, p: float) -> torch.Tensor:
    """HF's TopPLogitsWarper: keep the smallest set of top tokens whose probability reaches p.

    Sorted ascending, a token is dropped when the cumulative probability up to and including it
    is <= 1 - p; the most likely token is always kept.
    """
    sorted_scores, order = torch.sort(scores, descending=False)  # (N, V)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= (1 - p)
    drop_sorted[..., -1:] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return scores.masked_fill(drop, -math.inf)


def warp(scores: torch.Tensor, gen: GenerationConfig) -> torch.Tensor:
    """Sampling warpers in HF's order: temperature → top_k → top_p. scores: (N, V) float32."""
    if gen.temperature != 1.0:
        scores = scores / gen.temperature
    if gen.top_k:
        scores = top_k_filter(scores, gen.top_k)
    if gen.top_p < 1.0:
        scores = top_p_filter(scores, gen.top_p)
    return scores


def _make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None  # torch's global RNG, as HF
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


# --- decoding --------------------------------------------------------------------------------


def generate(model: GPTJForCausalLM, prompts: Sequence[Sequence[int]],
             gen: GenerationConfig | None = None,
             on_first_token: Callable[[list[int]], None] | None = None) -> list[list[int]]:
    """New tokens for each prompt (up to and including the first EOS), decoded as one batch.

    on_first_token: called once with each prompt's first new token as soon as it is final
    (greedy and sampling only: a beam's first token is final only when the search ends).
    """
    gen = gen if gen is not None else GenerationConfig()
    check_prompts(model, prompts, gen)
    device = model.transformer.wte.weight.device
    input_ids, attention_mask = left_pad(prompts, gen.pad_token_id, device)
    if gen.num_beams > 1:
        return beam_search(model, input_ids, attention_mask, gen)[0]
    return greedy_or_sample(model, input_ids, attention_mask, gen, on_first_token)


@torch.inference_mode()
def greedy_or_sample(model: GPTJForCausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     gen: GenerationConfig,
                     on_first_token: Callable[[list[int]], None] | None = None) -> list[list[int]]:
    """HF's `_sample`: one token per step for every row; rows that have emitted EOS keep emitting
    pad (and keep being computed, so sampling draws the same random numbers as HF)."""
    B, T = input_ids.shape
    L = gen.max_new_tokens
    sampling = gen.sampling
    generator = _make_generator(gen.seed, input_ids.device) if sampling else None
    cache = model.new_cache(B, T + L)

    logits = model(input_ids, attention_mask=attention_mask, cache=cache, logits_to_keep=1)[:, -1]  # (B, V)
    out = torch.full((B, L), gen.pad_token_id, dtype=torch.long, device=input_ids.device)
    unfinished = torch.ones(B, dtype=torch.bool, device=input_ids.device)
    counts = prompt_tokens = None
    if gen.penalties:  # each row's output counts, and its prompt's tokens (a pad stands for its first)
        counts = torch.zeros((B, logits.shape[-1]), dtype=torch.float32, device=input_ids.device)
        first = input_ids.gather(1, (T - attention_mask.sum(dim=1, keepdim=True)).clamp(max=T - 1))
        prompt_tokens = torch.where(attention_mask.bool(), input_ids, first)
    n = 0
    for step in range(L):
        scores = block_eos(logits, step, gen)  # min_new_tokens acts before the warpers, on raw logits
        if gen.penalized:  # then the logit bias and penalties, still before the warpers (vLLM's order)
            tokens = torch.cat([prompt_tokens, out[:, :step]], dim=1) if prompt_tokens is not None else None
            scores = penalize(scores, **penalty_args([gen] * B, scores.device, tokens, counts))
        if sampling:
            probs = torch.softmax(warp(scores, gen), dim=-1)
            next_tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)  # (B,)
        else:
            next_tokens = torch.argmax(scores, dim=-1)  # first index on ties, as HF
        if gen.eos_token_id is not None:
            next_tokens = torch.where(unfinished, next_tokens, gen.pad_token_id)
            unfinished &= next_tokens != gen.eos_token_id
        out[:, step] = next_tokens
        if counts is not None:
            counts.scatter_add_(1, next_tokens[:, None], torch.ones_like(counts[:, :1]))
        if step == 0 and on_first_token is not None:
            on_first_token(next_tokens.tolist())
        n = step + 1
        if n == L or not bool(unfinished.any()):
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=1)
        logits = model(next_tokens[:, None], attention_mask=attention_mask, cache=cache)[:, -1]
    return [_cut_at_eos(row, gen.eos_token_id) for row in out[:, :n].tolist()]


@torch.inference_mode()
def beam_search(model: GPTJForCausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                gen: GenerationConfig) -> tuple[list[list[int]], list[float]]:
    """HF's `_beam_search` for a left-padded batch; the step rule is `BeamSearch` (below).

    Returns the best hypothesis's new tokens per prompt and its score,
    sum(log p of its new tokens) / len(new tokens) ** length_penalty (HF's `sequences_scores`).
    """
    B, T = input_ids.shape
    K, L = gen.num_beams, gen.max_new_tokens

    # Prefill each prompt once, then copy its cache rows to its K beams: row b * K + k.
    cache = model.new_cache(B, T + L)
    logits = model(input_ids, attention_mask=attention_mask, cache=cache, logits_to_keep=1)[:, -1]  # (B, V)
    rows = torch.arange(B, device=input_ids.device).repeat_interleave(K)  # (B*K,)
    cache.reorder(rows)
    logits = logits[rows]  # (B*K, V)
    attention_mask = attention_mask[rows]  # (B*K, T); beams never change prompt, so never reordered

    search = BeamSearch(B, gen, input_ids.device)
    identity = torch.arange(B * K, device=input_ids.device)
    while True:
        source_rows, next_tokens = search.step(logits)
        if search.finished:
            break
        if not torch.equal(source_rows, identity):  # reordering copies the whole cache; skip a no-op
            cache.reorder(source_rows)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B * K, 1)], dim=1)
        logits = model(next_tokens[:, None], attention_mask=attention_mask, cache=cache)[:, -1]
    return search.best()


class BeamSearch:
    """Beam search state of B prompts x K beams, advanced one token per `step` (HF semantics).

    The caller runs the model: it feeds the logits of the K running beams of every prompt (row
    b * K + k), and gets back which row each new running beam continues (reorder the KV cache
    accordingly) and its new token. Used by `beam_search` above and by the engine, so both follow
    exactly the same rule.

    Per step and prompt, HF's semantics:
      1. log_softmax the logits of each running beam, THEN apply min_new_tokens (EOS -> -inf; the
         other tokens are not renormalized), add the beam's running score.
      2. Take the top 2K candidates over all K beams x V tokens (sorted, best first).
      3. A candidate "ends" if its token is EOS or it reaches max_new_tokens. Ending candidates
         among the top K (by rank among the 2K, not by beam) become finished hypotheses, scored
         with the length penalty where the length counts the new tokens including EOS, unless
         the prompt is already done (see 5). Finished hypotheses keep the best K.
      4. The K best non-ending candidates are the next running beams.
      5. A prompt is done when early_stopping is True and it has K finished hypotheses, or when
         it has K and HF's heuristic says no running beam can beat the worst of them:
         best running score / n ** length_penalty <= worst finished score, where n is the new
         length so far (max_new_tokens with early_stopping="never" and length_penalty > 0).
      Decoding stops when every prompt is done or at max_new_tokens, when the top K candidates
      all end and so become hypotheses.
    """

    # The state's tensors, each with a row per prompt: a search's own (after __init__), or its rows of
    # the stack that the last step_all left for all the searches it advanced (see `_Stack`).
    STATE = ("run_tokens", "run_scores", "fin_tokens", "fin_scores", "fin_lens", "fin_valid", "improvable")

    def __init__(self, batch_size: int, gen: GenerationConfig, device: torch.device | str) -> None:
        B, K, L = batch_size, gen.num_beams, gen.max_new_tokens
        self.gen, self.B, self.K, self.L = gen, B, K, L
        self.n_steps = 0
        dev = device
        self._stack: _Stack | None = None
        self._at = 0  # with a stack: this search's first row there
        self._index = 0  # and its place among the stack's searches (its done flag's)
        self._done_now = torch.zeros((), dtype=torch.bool, device=dev)  # every prompt done (on the device)
        own = self._own = {}
        # Running beams. All K start as the prompt; only beam 0 is live at first (the others score
        # -1e9) so the first step does not pick the same token K times.
        own["run_tokens"] = torch.full((B, K, L), gen.pad_token_id, dtype=torch.long, device=dev)
        own["run_scores"] = torch.zeros((B, K), dtype=torch.float32, device=dev)
        own["run_scores"][:, 1:] = _NEG
        # Finished hypotheses, best first; `fin_valid` False marks an empty slot (score -inf).
        own["fin_tokens"] = torch.full((B, K, L), gen.pad_token_id, dtype=torch.long, device=dev)
        own["fin_scores"] = torch.full((B, K), -math.inf, dtype=torch.float32, device=dev)
        own["fin_lens"] = torch.zeros((B, K), dtype=torch.long, device=dev)
        own["fin_valid"] = torch.zeros((B, K), dtype=torch.bool, device=dev)
        own["improvable"] = torch.ones(B, dtype=torch.bool, device=dev)  # HF: is_early_stop_heuristic_unsatisfied
        self.beam_offset = torch.arange(B, device=dev)[:, None] * K  # (B, 1): row of beam 0 of each prompt

    def __getattr__(self, name: str) -> torch.Tensor:  # the state's tensors (STATE): this search's rows
        if name in BeamSearch.STATE:
            stack = self.__dict__["_stack"]
            if stack is None:
                return self.__dict__["_own"][name]
            return stack.state[name][self._at:self._at + self.B]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def done_now(self) -> torch.Tensor:
        """Every prompt of this search is done: a device tensor (reading it syncs)."""
        return self._done_now if self._stack is None else self._stack.done[self._index]

    def step(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (B*K, V) of the running beams -> (source_rows (B*K,), next_tokens (B*K,))."""
        return BeamSearch.step_all([self], [logits])[0]

    @staticmethod
    def step_all(searches: Sequence[BeamSearch], logits: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Advance searches of one GenerationConfig by a token each, in one batched pass: their
        prompts stacked as rows, each row at its own step (the engine's requests start at different
        times). logits[i]: search i's (B_i*K, V). -> each search's (source_rows, next_tokens), as
        `step`. No device-to-host sync: each search's `done_now` stays on the device."""
        source_rows, next_tokens, _, _ = BeamSearch.advance(searches, logits)
        out, at = [], 0
        for s in searches:
            n = s.B * s.K
            out.append((source_rows[at:at + n], next_tokens[at:at + n]))
            at += n
        return out

    @staticmethod
    def advance(searches: Sequence[BeamSearch], logits: Sequence[torch.Tensor], reuse_logits: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """step_all's pass, its results flat: (source_rows, next_tokens), each search's B*K in turn
        (source_rows within the search's own rows, as `step`), done (len(searches),) bool, each
        search's done_now, and finite (len(searches),) bool, False where a search's scores went NaN or
        infinite this step (its tokens are then meaningless): device tensors, for the engine's one
        copy to the host.

        The searches' state stays stacked between steps (`_Stack`): a step of the searches the last
        one advanced, in the same order, reads the stack as it is; others gather their rows (a few
        kernels whatever the number of searches, not a few per search).

        reuse_logits: the caller reads the logits no more (the engine's), so the log-probabilities
        may be written over them. Each full-vocabulary pass is one read and one write of (B*K, V)
        float32; a new such tensor costs the CPU its page faults too (103 MB at 512 rows)."""
        gen = searches[0].gen
        K, L = gen.num_beams, searches[0].L
        if any(s.gen != gen for s in searches):
            raise ValueError("BeamSearch.step_all advances searches of one GenerationConfig")
        state = _Stack.gather(searches)
        run_tokens, run_scores = state["run_tokens"], state["run_scores"]
        fin_tokens, fin_scores, fin_lens = state["fin_tokens"], state["fin_scores"], state["fin_lens"]
        fin_valid, improvable = state["fin_valid"], state["improvable"]
        x = stacked_rows(logits)  # (B*K, V): a view of the caller's logits or a copy of them
        reuse_logits = reuse_logits or not any(x.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                                               for t in logits)
        B, V, dev = run_scores.shape[0], x.shape[-1], x.device
        steps = [s.n_steps for s in searches for _ in range(s.B)]  # each row's step (its new tokens so far)
        n_new = [t + 1 for t in steps]  # new tokens of each candidate, this one included
        eos = gen.eos_token_id

        def per_row(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype), dev)

        # length ** penalty in double on the host, rounded to float32: as a Python scalar divides a tensor
        norm = per_row([n ** gen.length_penalty for n in n_new], torch.float32)
        best_len = [L if gen.early_stopping == "never" and gen.length_penalty > 0.0 else n for n in n_new]
        best_norm = per_row([n ** gen.length_penalty for n in best_len], torch.float32)
        at = per_row(steps, torch.long)[:, None, None]  # (B, 1, 1): where this step's token goes
        last = per_row([n == L for n in n_new], torch.bool)  # (B,)

        if reuse_logits and x.is_contiguous() and not x.requires_grad:  # (a backward reads log_softmax's output)
            # the same kernel, its output over its input: each element written after its row's max and sum
            log_probs = torch.log_softmax(x, dim=-1, out=x)
        else:
            log_probs = F.log_softmax(x, dim=-1)  # (B*K, V)
        short = [beam for p, t in enumerate(steps) if t < gen.min_new_tokens for beam in range(p * K, p * K + K)]
        if eos is not None and short:  # min_new_tokens after the log_softmax (HF): EOS -inf, no renormalizing
            log_probs[per_row(short, torch.long), eos] = -math.inf
        scores = log_probs.view(B, K, V).add_(run_scores[:, :, None]).view(B, K * V)  # in place: log_probs is ours

        cand_scores, flat = torch.topk(scores, 2 * K, dim=1)  # (B, 2K), best first
        cand_beam = flat // V  # (B, 2K) which running beam it extends
        cand_token = flat % V
        cand_tokens = torch.take_along_dim(run_tokens, cand_beam[:, :, None], dim=1)  # (B, 2K, L)
        cand_tokens.scatter_(2, at.expand(B, 2 * K, 1), cand_token[:, :, None])
        ends = cand_token == eos if eos is not None else torch.zeros_like(cand_token, dtype=torch.bool)
        ends = ends | last[:, None]

        # Finished hypotheses: merge the accepted candidates into the K best so far. Ties keep the
        # older hypothesis first (same layout as HF's merge: old slots, then candidates). Done every
        # step, though most accept nothing (the valid ones then stay as they were): asking would
        # cost a device-to-host sync per step.
        in_top_k = torch.arange(2 * K, device=dev) < K  # (2K,) rank of a candidate among the 2K
        full = fin_valid.all(dim=1) & (gen.early_stopping is True)  # (B,)
        accept = ends & in_top_k[None, :] & (improvable & ~full)[:, None]  # (B, 2K)
        normalized = cand_scores / norm[:, None]  # float32, as HF
        merged_scores = torch.cat([fin_scores, normalized.masked_fill(~accept, -math.inf)], dim=1)  # (B, 3K)
        best = torch.topk(merged_scores, K, dim=1).indices  # (B, K)
        fin_scores = torch.take_along_dim(merged_scores, best, dim=1)
        fin_tokens = torch.take_along_dim(torch.cat([fin_tokens, cand_tokens], dim=1), best[:, :, None], dim=1)
        cand_lens = (at[:, :, 0] + 1).expand(B, 2 * K)
        fin_lens = torch.take_along_dim(torch.cat([fin_lens, cand_lens], dim=1), best, dim=1)
        fin_valid = torch.take_along_dim(torch.cat([fin_valid, accept], dim=1), best, dim=1)

        # Next running beams: the K best candidates that did not end (HF: ended ones get -1e9).
        penalized = cand_scores + ends.float() * _NEG
        keep = torch.topk(penalized, K, dim=1).indices  # (B, K)
        run_scores = torch.take_along_dim(penalized, keep, dim=1)
        run_tokens = torch.take_along_dim(cand_tokens, keep[:, :, None], dim=1)
        source = torch.take_along_dim(cand_beam, keep, dim=1)  # (B, K): the beam of its prompt it continues
        next_tokens = torch.take_along_dim(run_tokens, at.expand(B, K, 1), dim=2)[:, :, 0]  # (B, K)
        # Can a running beam still beat the worst finished hypothesis? (HF's heuristic; it only
        # matters once all K slots are full: before that, improvable stays True.)
        best_possible = run_scores[:, 0] / best_norm  # (B,)
        worst_finished = fin_scores.min(dim=1).values
        improvable = improvable & (~fin_valid.all(dim=1) | (best_possible > worst_finished))
        done = ~improvable | (fin_valid.all(dim=1) & (gen.early_stopping is True)) | last  # (B,)

        # The next state, stacked for the next step; each search's rows and results are views of it.
        one_row_each = all(s.B == 1 for s in searches)
        starts = list(itertools.accumulate((s.B for s in searches), initial=0))
        # A row's numbers went non-finite (NaN or infinite logits make its log-probabilities NaN, and
        # topk ranks NaN first; all -inf leaves no candidate): its best candidate's score says so.
        finite = torch.isfinite(cand_scores[:, 0])  # (B,)
        if one_row_each:  # a search's beams are its rows 0..K-1: source as it is
            done_each, finite_each = done, finite
        elif len(searches) == 1:
            source, done_each, finite_each = source + searches[0].beam_offset, done.all()[None], finite.all()[None]
        else:  # each row's beam 0 within its own search: (row - its search's first row) * K
            source = source + per_row([(b - first) * K for s, first in zip(searches, starts) for b in
                                       range(first, first + s.B)], torch.long)[:, None]
            done_each = torch.stack([done[first:first + s.B].all() for s, first in zip(searches, starts)])
            finite_each = torch.stack([finite[first:first + s.B].all() for s, first in zip(searches, starts)])
        stack = _Stack(dict(run_tokens=run_tokens, run_scores=run_scores, fin_tokens=fin_tokens, fin_scores=fin_scores,
                            fin_lens=fin_lens, fin_valid=fin_valid, improvable=improvable), done_each)
        for i, (s, first) in enumerate(zip(searches, starts)):
            s._stack, s._own, s._at, s._index = stack, None, first, i
            s.n_steps += 1
        return source.reshape(-1), next_tokens.reshape(-1), done_each, finite_each

    @property
    def finished(self) -> bool:
        """Every prompt is done (reads the device's flag: a sync; the engine reads done_now with the
        rest of its step instead)."""
        return self.n_steps == self.L or bool(self.done_now)

    def ranked(self, b: int) -> list[tuple[list[int], float]]:
        """Prompt b's finished hypotheses, best first: (new tokens, score) each."""
        valid, lens = self.fin_valid[b].tolist(), self.fin_lens[b].tolist()
        return [(row[:n], score) for row, n, score, ok in
                zip(self.fin_tokens[b].tolist(), lens, self.fin_scores[b].tolist(), valid) if ok]

    def best(self) -> tuple[list[list[int]], list[float]]:
        """The best finished hypothesis of each prompt: its new tokens and its score."""
        lens = self.fin_lens[:, 0].tolist()
        tokens = [row[:n] for row, n in zip(self.fin_tokens[:, 0].tolist(), lens)]
        return tokens, self.fin_scores[:, 0].tolist()


def stacked_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """parts (n_i, V) stacked (sum n_i, V): a view when they lie one after another in one storage (the
    engine's rows of one forward's logits, in order), else a copy (torch.cat). A copy of the MLPerf
    step's logits (512 rows x 50,400 float32: 103 MB) cost the CPU more than the forward of a small
    model: a fresh allocation's page faults, then the write."""
    first = parts[0]
    if len(parts) == 1:
        return first
    V, storage = first.shape[-1], first.untyped_storage().data_ptr()
    rows, at = 0, first.data_ptr()
    for t in parts:
        if (t.dim() != 2 or t.shape[1] != V or not t.is_contiguous() or t.dtype != first.dtype
                or t.data_ptr() != at or t.untyped_storage().data_ptr() != storage):
            return torch.cat(list(parts))
        rows += t.shape[0]
        at += t.numel() * t.element_size()
    return first.as_strided((rows, V), (V, 1))  # (a 1-row part's row stride can be anything)


class _Stack:
    """The state of the searches one BeamSearch.advance advanced, row by row (search i's B rows from
    its `_at`), and each one's done flag: what the next step starts from. Each search reads its own
    rows as views; a search holds the stack it was last advanced in (its result, after it ends). The
    stack does not hold its searches (no reference cycle: a step's old stack is freed at once)."""

    __slots__ = ("state", "done")

    def __init__(self, state: dict[str, torch.Tensor], done: torch.Tensor) -> None:
        self.state, self.done = state, done

    @staticmethod
    def gather(searches: Sequence[BeamSearch]) -> dict[str, torch.Tensor]:
        """The searches' rows of each state tensor, stacked in their order: the last stack itself
        when it holds exactly these searches in this order (a step where none joined or ended);
        else its rows and any other search's, in one gather per tensor."""
        first = searches[0]._stack
        # exactly the stack's searches, in order: each of its places is one search's, so it is enough
        # that all point to it, each at its own place, and that there are as many as it has places
        if first is not None and len(searches) == first.done.shape[0] and all(
                s._stack is first and s._index == i for i, s in enumerate(searches)):
            return first.state
        if len(searches) == 1 and first is None:
            return dict(searches[0]._own)
        sources: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}  # id -> (first row in `pool`, tensors)
        rows, size = [], 0
        for s in searches:
            tensors = s._own if s._stack is None else s._stack.state
            key = id(s) if s._stack is None else id(s._stack)
            if key not in sources:
                sources[key] = (size, tensors)
                size += tensors["run_scores"].shape[0]
            base = sources[key][0] + (0 if s._stack is None else s._at)
            rows.extend(range(base, base + s.B))
        parts = [tensors for _, tensors in sources.values()]
        dev = searches[0].beam_offset.device
        index = to_device(torch.tensor(rows, dtype=torch.long), dev)
        out = {}
        for name in BeamSearch.STATE:
            pool = parts[0][name] if len(parts) == 1 else torch.cat([p[name] for p in parts])
            out[name] = pool.index_select(0, index)
        return out
