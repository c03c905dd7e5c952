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

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gptj.beam import BeamSearch
from gptj.device import to_device
from gptj.errors import GptjError
# (GenerationConfig and its constants live in gptj.generation_config; imported from here too)
from gptj.generation_config import (EOS_TOKEN_ID, MAX_INPUT_TOKENS, REPETITION_PENALTY_RANGE,  # noqa: F401
                                    SAMPLING_EPS, GenerationConfig)
from gptj.models.gptj import GPTJForCausalLM

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
    for name, value in [*(("eos_token_id", e) for e in gen.eos_ids), ("pad_token_id", gen.pad_token_id)]:
        if value >= V:
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


def _cut_at_eos(tokens: list[int], eos_ids: tuple[int, ...]) -> list[int]:
    end = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
    return tokens if end is None else tokens[: end + 1]


# --- logits processors (HF's, in HF's order) ----------------------------------------------


def block_eos(scores: torch.Tensor, n_new: int, gen: GenerationConfig) -> torch.Tensor:
    """HF's MinNewTokensLengthLogitsProcessor: EOS gets -inf while fewer than min_new_tokens
    tokens have been generated (`n_new` so far). scores: (N, V)."""
    if gen.eos_ids and n_new < gen.min_new_tokens:
        scores = scores.clone()
        scores[:, list(gen.eos_ids)] = -math.inf
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
    eos = torch.tensor(gen.eos_ids, dtype=torch.long, device=input_ids.device)  # once, not per step
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
        if gen.eos_ids:
            next_tokens = torch.where(unfinished, next_tokens, gen.pad_token_id)
            unfinished &= ~torch.isin(next_tokens, eos)
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
    return [_cut_at_eos(row, gen.eos_ids) for row in out[:, :n].tolist()]


@torch.inference_mode()
def beam_search(model: GPTJForCausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                gen: GenerationConfig) -> tuple[list[list[int]], list[float]]:
    """HF's `_beam_search` for a left-padded batch; the step rule is `BeamSearch` (gptj.beam).

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
