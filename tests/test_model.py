"""The model against HF transformers' GPTJForCausalLM: logits, KV cache, left padding."""

import pytest
import torch

from gptj.config import GPTJConfig, get_preset
from gptj.models.base import position_ids_from_mask
from gptj.models.gptj import build_model, count_parameters
from hf_ref import make_pair

CONFIGS = [
    GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_inner=128),
    GPTJConfig(n_layer=3, n_embd=96, n_head=3, rotary_dim=16),  # n_inner None -> 4 * n_embd
    GPTJConfig(n_layer=1, n_embd=128, n_head=8, rotary_dim=None, n_inner=256),  # rotary over the whole head
    GPTJConfig(n_layer=4, n_embd=64, n_head=2, rotary_dim=32, n_inner=64, layer_norm_epsilon=1e-6),
]


def test_gptj_6b_parameter_count_on_meta():
    model = build_model(get_preset("gptj-6b"), device="meta")
    assert count_parameters(model) == 6_050_882_784
    assert model.lm_head.weight.is_meta


def test_a_meta_model_is_built_without_torchs_python_kernels():
    """Building on the meta device (every load starts there) runs no math on meta tensors: torch
    would import its Python meta kernels and torch._dynamo for it, over a second per process. A CPU
    model's embedding draws what nn.Embedding's own init draws."""
    import subprocess
    import sys

    probe = ("import sys, torch\n"
             "from gptj.config import get_preset\n"
             "from gptj.models.gptj import build_model\n"
             "m = build_model(get_preset('tiny'), 'meta', torch.bfloat16)\n"
             "assert m.rope.is_meta and m.rope.shape == (2048, 8) and m.transformer.wte.weight.is_meta\n"
             "print('torch._dynamo' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["False"], proc.stderr
    cfg = get_preset("tiny")
    torch.manual_seed(0)
    ours = build_model(cfg).transformer.wte.weight
    torch.manual_seed(0)
    assert torch.equal(ours, torch.nn.Embedding(cfg.vocab_size, cfg.n_embd).weight) and ours.requires_grad


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"L{c.n_layer}E{c.n_embd}H{c.n_head}R{c.rotary_dim}")
def test_logits_match_hf(cfg):
    ours, hf = make_pair(cfg, std=0.3)
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_kv_cache_matches_full_forward():
    cfg = CONFIGS[0]
    ours, _ = make_pair(cfg, std=0.3)
    ids = torch.randint(0, cfg.vocab_size, (3, 12))
    with torch.no_grad():
        full = ours(ids)
        cache = ours.new_cache(3, 16)
        parts = [ours(ids[:, :5], cache=cache)]
        for t in range(5, 12):  # token by token, as decoding does
            parts.append(ours(ids[:, t:t + 1], cache=cache))
    assert cache.length == 12
    # Float32 summed in another order: each side within ~20 chained sums of <= 256 terms, each
    # <= sqrt(n) u of its terms' size w.h.p. (Higham & Mary 2019): 2e-5 of the logits' scale; 1e-4 for both.
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-4 * float(full.abs().max()))


def test_left_padded_batch_matches_each_prompt_alone_and_hf():
    cfg = CONFIGS[1]
    ours, hf = make_pair(cfg, std=0.3)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [300, 301, 302], [40000, 7]]
    width = max(map(len, prompts))
    ids = torch.tensor([[50256] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        batch = ours(ids, attention_mask=mask)
        pos = position_ids_from_mask(mask, width)
        hf_batch = hf(ids, attention_mask=mask, position_ids=pos).logits
        for i, p in enumerate(prompts):
            alone = ours(torch.tensor([p]))
            torch.testing.assert_close(batch[i, width - len(p):], alone[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(batch[i, width - len(p):], hf_batch[i, width - len(p):], rtol=1e-4, atol=1e-4)


def test_position_ids_follow_the_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask, 5).tolist() == [[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert position_ids_from_mask(mask, 2).tolist() == [[1, 2], [3, 4]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_runs_and_stays_close(dtype):
    cfg = CONFIGS[0]
    ours, _ = make_pair(cfg, std=0.1)
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    with torch.no_grad():
        ref = ours(ids)
        low = ours.to(dtype)(ids)
    assert low.dtype == torch.float32  # logits are always float32
    assert ours.rope.dtype == torch.float32  # the rotary table is not cast with the weights
    assert (low - ref).abs().max() < 0.05 * ref.abs().max()


def test_logits_to_keep_and_position_limit():
    cfg = CONFIGS[0].replace(n_positions=8)
    model = build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, logits_to_keep=1), model(ids)[:, -1:])
        with pytest.raises(ValueError, match="n_positions"):
            model(torch.randint(0, cfg.vocab_size, (1, 9)))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu(dtype):
    cfg = CONFIGS[0]
    ours, _ = make_pair(cfg, std=0.1)
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    with torch.no_grad():
        ref = ours(ids)
        ours = ours.to("cuda", dtype)
        got = ours(ids.cuda()).cpu()
    assert (got - ref).abs().max() < (1e-4 if dtype == torch.float32 else 0.05) * ref.abs().max()


def test_low_precision_attention_fast_path_matches_exact_math():
    """bf16/fp16 attention runs torch's fused SDPA; float32 runs the exact HF math. They agree."""
    from gptj.models.base import attention, causal_mask

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 16, generator=g) for n in (5, 9, 9))
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[1, :3] = 0  # a left-padded row, including padding queries that see nothing
    mask = causal_mask(pad, 5)
    exact = attention(q, k, v, mask)
    for dtype in (torch.bfloat16, torch.float16):
        fast = attention(q.to(dtype), k.to(dtype), v.to(dtype), mask)
        assert fast.dtype == dtype and not fast.isnan().any()
        assert (fast.float() - exact).abs().max() < 0.03
