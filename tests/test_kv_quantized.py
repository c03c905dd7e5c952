"""Quantized KV memory (EngineConfig.kv_dtype "int8" and "fp8"): a scale per token and head, about
twice the sequences in the same memory, the same tokens as float KV on the bundled prompts nearly
everywhere, and batch invariance; the float paths unchanged."""

import pytest
import torch

from gptj.config import GPTJConfig, get_preset
from gptj.decode import GenerationConfig
from gptj.engine import Engine, EngineConfig
from gptj.engine.attention import PagedKV, dequantize_heads, quantize_heads
from gptj.engine.config import kv_bytes_per_token, kv_storage, plan_kv
from gptj.errors import GptjError
from gptj.mlperf.dataset import Dataset
from gptj.quant import fp8_error_bound
from gptj.weights.io import model_from_state_dict, random_state_dict

CFG = GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_inner=128, n_positions=1024)


@pytest.fixture(scope="module")
def model():
    return model_from_state_dict(CFG, random_state_dict(CFG, seed=3, std=0.3, dtype=torch.bfloat16))


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50000, (n,), generator=g).tolist() for n in lengths]


def test_a_head_vector_comes_back_within_half_its_scale():
    x = torch.randn(5, 4, 3, 256) * torch.logspace(-3, 2, 5)[:, None, None, None]
    q, s = quantize_heads(x)
    assert q.dtype == torch.int8 and s.shape == (5, 4, 3) and int(q.abs().max()) <= 127
    assert ((dequantize_heads(q, s, torch.float32) - x).abs() <= s[..., None] / 2 * (1 + 2**-20)).all()


def test_an_fp8_head_vector_comes_back_within_e4m3s_rounding():
    x = torch.randn(5, 4, 3, 256) * torch.logspace(-3, 2, 5)[:, None, None, None]
    x[0, 0, 0] = 0  # a zero head: a tiny scale, zeros back
    q, s = quantize_heads(x, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 4, 3) and float(q.float().abs().max()) == 448
    back = dequantize_heads(q, s, torch.float32)
    # e4m3's rounding of x / s, times s: float32's own roundings add a few ulps of |x|
    assert ((back - x).abs() <= fp8_error_bound(x, s) + 4 * 2**-24 * x.abs()).all()
    assert (back[0, 0, 0] == 0).all()


def test_the_same_memory_holds_at_least_1_8x_the_sequences_at_gptj_6b_shapes():
    cfg = get_preset("gptj-6b")
    budget = 8 * 2**30
    bf16 = plan_kv(cfg, torch.bfloat16, "cpu", EngineConfig(max_seqs=4096), free_bytes=budget)
    int8 = plan_kv(cfg, torch.bfloat16, "cpu", EngineConfig(max_seqs=4096, kv_dtype="int8"), free_bytes=budget)
    # per token and head: 256 int8 values and one float32 scale, against 256 bfloat16 values
    assert kv_bytes_per_token(cfg, torch.int8) * (2 * 256) == kv_bytes_per_token(cfg, torch.bfloat16) * (256 + 4)
    assert int8.n_blocks / bf16.n_blocks >= 1.8
    assert int8.n_blocks // int8.blocks_per_seq >= 1.8 * (bf16.n_blocks // bf16.blocks_per_seq)
    assert kv_storage(torch.bfloat16, "int8") == torch.int8 and kv_storage(torch.float32) == torch.float32
    assert kv_bytes_per_token(cfg, torch.float8_e4m3fn) == kv_bytes_per_token(cfg, torch.int8)
    assert kv_storage(torch.bfloat16, "fp8") == torch.float8_e4m3fn
    with pytest.raises(GptjError, match="kv_dtype must be one of auto, int8, fp8"):
        EngineConfig(kv_dtype="fp16")


@pytest.mark.parametrize("kv_dtype, storage", [("int8", torch.int8), ("fp8", torch.float8_e4m3fn)])
def test_quantized_kv_memory_holds_its_dtype_with_its_scales(model, kernel_path, kv_dtype, storage):
    engine = Engine(model, EngineConfig(max_seqs=4, kv_dtype=kv_dtype))
    kv = engine.runner.kv
    assert isinstance(kv, PagedKV) and kv.quantized and kv.k[0].dtype == storage
    assert kv.k_scale[0].shape == kv.k[0].shape[:3] and kv.compute == torch.bfloat16
    # gptj.native reads int8 blocks too; e4m3 ones go to the reference's forms on CPU
    assert (engine.runner.attention.name == "cpu-native") == (kernel_path != "fallback" and kv_dtype == "int8")


def _top1(model, kv_dtype: str, prompts) -> list[int]:
    """The most likely next token at every position of `prompts`, teacher-forced, on an engine with
    `kv_dtype` KV."""
    engine = Engine(model, EngineConfig(max_seqs=4, max_len=1024, kv_dtype=kv_dtype))
    requests = [engine.add_request(p, GenerationConfig(max_new_tokens=1), prompt_logprobs=1) for p in prompts]
    while engine.has_work:
        engine.step()
    return [t.top[0][0] for r in requests for t in r.prompt_token_logprobs if t is not None]


@pytest.fixture(scope="module")
def teacher_forced():
    """(model, prompts, float32 KV's top-1s, the bfloat16 model's top-1s): the std 0.1 model on the
    bundled prompts, its references computed once for both KV dtypes."""
    sd = random_state_dict(CFG, seed=3, std=0.1)
    model = model_from_state_dict(CFG, sd)
    prompts = Dataset.load(max_examples=12).input_ids
    bf16 = _top1(model_from_state_dict(CFG, {k: v.to(torch.bfloat16) for k, v in sd.items()}), "auto", prompts)
    return model, prompts, _top1(model, "auto", prompts), bf16


@pytest.mark.parametrize("kv_dtype, floor", [("int8", 0.99), ("fp8", None)])
def test_teacher_forced_top1_agrees_with_float_kv_on_the_bundled_prompts(kv_dtype, floor, teacher_forced):
    """Every position of the bundled prompts: the most likely next token with quantized KV against
    the model's own float32 KV (std 0.1 weights), and against the yardstick: the same weights in
    bfloat16 (its KV included) against float32. The per-head scales lose less than bfloat16 does
    (int8 within s / 2 of each value: at least 99 % here; e4m3 within 2**-4 of it, relative)."""
    model, prompts, ref, bf16 = teacher_forced
    got = _top1(model, kv_dtype, prompts)
    assert len(ref) == len(got) == sum(len(p) - 1 for p in prompts)
    agreement = sum(a == b for a, b in zip(ref, got)) / len(ref)
    assert floor is None or agreement >= floor, agreement
    assert agreement >= sum(a == b for a, b in zip(ref, bf16)) / len(ref)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_kv_requests_together_equal_each_alone(model, kernel_path, kv_dtype):
    prompts = prompts_of([5, 40, 1, 23, 9])
    gens = [GenerationConfig(max_new_tokens=12), GenerationConfig.mlperf(max_new_tokens=10, min_new_tokens=4),
            GenerationConfig(max_new_tokens=9, min_new_tokens=9), GenerationConfig(max_new_tokens=14, do_sample=True,
                                                                                     seed=5, top_k=20),
            GenerationConfig(max_new_tokens=10, num_beams=2)]
    engine = Engine(model, EngineConfig(max_seqs=16, kv_dtype=kv_dtype))
    together = engine.generate(prompts, gens)
    assert max(engine.decode_batch_sizes) > 4
    for prompt, gen, got in zip(prompts, gens, together):
        assert got == Engine(model, EngineConfig(max_seqs=4, kv_dtype=kv_dtype)).generate([prompt], gen)[0]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_chunked_prefill_and_a_cached_prefix_read_the_same_quantized_keys(model, kernel_path, kv_dtype):
    prompt = prompts_of([70])[0]
    gen = GenerationConfig(max_new_tokens=10)
    whole = Engine(model, EngineConfig(max_seqs=2, kv_dtype=kv_dtype)).generate([prompt], gen)[0]
    chunked = Engine(model, EngineConfig(max_seqs=2, kv_dtype=kv_dtype, prefill_chunk=16)).generate([prompt], gen)[0]
    assert chunked == whole
    engine = Engine(model, EngineConfig(max_seqs=2, kv_dtype=kv_dtype))
    engine.generate([prompt[:48] + prompts_of([5], seed=9)[0]], gen)  # caches the first 48 tokens' blocks
    assert engine.generate([prompt], gen)[0] == whole
    assert engine.stats().prefix_hit_tokens >= 48
