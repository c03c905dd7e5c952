"""Shared test helper: a gptj model and an HF transformers GPTJForCausalLM with the same random weights.

    gptj_model, hf_model = make_pair(cfg, seed=0, std=0.5)

Weights are drawn with a large std (not HF's 0.02) so logits are far from flat and ties
between tokens do not happen; layer norm weights are 1 + noise. `eos_bias` is added to the
lm_head bias of EOS (50256) so that generations end after a few tokens.
Both models are float32, eval mode, on CPU.
"""

from __future__ import annotations

import torch
import transformers

from gptj.config import GPTJConfig
from gptj.models.gptj import GPTJForCausalLM, build_model

EOS = 50256

# HF buffers that are not part of the math (older versions had them in the state dict).
_HF_ONLY = ("attn.bias", "attn.masked_bias")


def hf_config(cfg: GPTJConfig) -> transformers.GPTJConfig:
    # to_hf_dict writes rotary_dim = head_dim for gptj's None ("the whole head"): transformers 5
    # rejects None, and its None code path rotates over n_embd, which only works with one head.
    return transformers.GPTJConfig(**cfg.to_hf_dict())


@torch.no_grad()
def make_pair(cfg: GPTJConfig, seed: int = 0, std: float = 0.5, eos_bias: float = 0.0,
              eos_id: int = EOS) -> tuple[GPTJForCausalLM, transformers.GPTJForCausalLM]:
    hf = transformers.GPTJForCausalLM(hf_config(cfg)).float().eval()
    assert hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr(), "lm_head must be untied"
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(hf.named_parameters()):
        noise = torch.randn(p.shape, generator=g) * std
        if ".ln_" in name and name.endswith(".weight") or name.startswith("transformer.ln_f.weight"):
            p.copy_(1.0 + noise)
        else:
            p.copy_(noise)
    hf.lm_head.bias[eos_id] += eos_bias

    sd = {k: v for k, v in hf.state_dict().items() if not k.endswith(_HF_ONLY)}
    ours = build_model(cfg)
    ours.load_state_dict(sd, strict=True)
    ours.eval()
    return ours, hf


def left_pad(prompts: list[list[int]], pad_id: int = EOS) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p)
        mask[b, T - len(p):] = 1
    return ids, mask


def cut_at_eos(tokens: list[int], eos_id: int | None = EOS) -> list[int]:
    """Tokens up to and including the first EOS (HF pads the rest of a finished row)."""
    if eos_id is not None and eos_id in tokens:
        return tokens[: tokens.index(eos_id) + 1]
    return tokens


@torch.no_grad()
def hf_generate(hf: transformers.GPTJForCausalLM, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    """HF generate on the left-padded batch; new tokens per prompt, cut after the first EOS.

    kwargs go to `generate` (pad_token_id and eos_token_id default to 50256; when sampling,
    top_k defaults to 0, since HF's own default is 50).
    """
    kwargs.setdefault("pad_token_id", EOS)
    kwargs.setdefault("eos_token_id", EOS)
    if kwargs.get("do_sample"):
        kwargs.setdefault("top_k", 0)
    ids, mask = left_pad(prompts, kwargs["pad_token_id"])
    out = hf.generate(ids, attention_mask=mask, **kwargs)
    new = out[:, ids.shape[1]:].tolist()
    return [cut_at_eos(row, kwargs["eos_token_id"]) for row in new]
