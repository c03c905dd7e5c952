"""Serving kernels: fused blocks and oneDNN-packed bfloat16 linears compute what the plain model does."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gptj import kernels, policy
from gptj.config import GPTJConfig
from gptj.quant import Int4Linear, Int8Linear
from gptj.weights.io import model_from_state_dict, random_state_dict

CFGS = {
    "partial-rotary": GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_inner=128, n_positions=64),
    "full-rotary": GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=None, n_inner=256, n_positions=64),
}

NO_BF16_PACKING = "no oneDNN bfloat16 on this CPU (torch packs it for AVX-512 CPUs: policy.can_pack)"


def random_model(cfg: GPTJConfig, dtype=torch.float32, seed=0):
    sd = random_state_dict(cfg, seed=seed, dtype=dtype, std=0.2)
    g = torch.Generator().manual_seed(seed + 100)
    for name in sd:  # non-zero biases, so that fusing them is checked too
        if name.endswith(("fc_in.bias", "fc_out.bias", "lm_head.bias")):
            sd[name] = (0.1 * torch.randn(sd[name].shape, generator=g)).to(dtype)
    return model_from_state_dict(cfg, sd).eval()


def prefill_then_decode(model, ids):
    """Logits of a prefill of ids[:, :-2] and two single-token decode steps through a KV cache."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    with torch.inference_mode():
        out = [model(ids[:, :-2], cache=cache)]
        for t in (-2, -1):
            mask = torch.ones(ids.shape[0], cache.length + 1, dtype=torch.long)
            out.append(model(ids[:, t:t + 1 if t != -1 else None], attention_mask=mask, cache=cache))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("name", list(CFGS))
def test_fused_block_computes_the_block_in_float32(name):
    model = random_model(CFGS[name])
    fused = copy.deepcopy(model)
    for block in fused.transformer.h:
        kernels.fuse_block(block)
    assert all(b.w_in is not None and b.w_out is not None for b in fused.transformer.h)
    ids = torch.randint(0, CFGS[name].vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    want, got = prefill_then_decode(model, ids), prefill_then_decode(fused, ids)
    assert got.shape == want.shape == (2, 9, CFGS[name].vocab_size)
    # Float32 in other orders (concatenated weights): each side is off the exact logits by <= ~20
    # chained sums of <= 256 terms, each <= sqrt(n) u of its terms' size with high probability
    # (Higham & Mary 2019): 20 * 16 * 2**-24 = 2e-5 of the logits' scale; both sides, 4e-5.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))


def test_float32_models_stay_unfused_and_bad_modes_are_refused():
    model = random_model(CFGS["partial-rotary"])
    assert kernels.prepare_for_serving(model) == {"fused_blocks": 0, "packed_linears": 0}
    assert all(type(b).__name__ == "Block" for b in model.transformer.h)
    with pytest.raises(ValueError, match="one of auto, off"):
        kernels.fuse_model(model, "fast")
    bf16 = random_model(CFGS["partial-rotary"], torch.bfloat16)
    assert kernels.fuse_model(bf16, "off") == 0 and kernels.pack_model(bf16, "off") == 0


@pytest.mark.parametrize("name", list(CFGS))
def test_bfloat16_fused_and_packed_model_stays_as_close_to_float32_as_the_plain_one(kernel_path, name):
    """At most 2 rows per decode step: gptj.native's GEMV layout where available, else oneDNN's;
    GELU by gptj.native or torch, rotary too where its width is a multiple of 16 (full-rotary)."""
    cfg = CFGS[name]
    ref = random_model(cfg)
    plain = random_model(cfg, torch.bfloat16)
    served = random_model(cfg, torch.bfloat16)
    counts = kernels.prepare_for_serving(served, max_rows=2)
    if kernels.can_pack(torch.bfloat16, "cpu"):
        assert served.lm_head.layout == ("native" if kernel_path != "fallback" else "onednn")
    assert counts["fused_blocks"] == cfg.n_layer
    if kernels.can_pack(torch.bfloat16, "cpu"):  # w_in, w_out per layer and lm_head
        assert counts["packed_linears"] == 2 * cfg.n_layer + 1
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    want = prefill_then_decode(ref, ids)
    err_plain = (prefill_then_decode(plain, ids) - want).abs().max().item()
    err_served = (prefill_then_decode(served, ids) - want).abs().max().item()
    assert err_served <= 2 * err_plain + 1e-3, (err_served, err_plain)


def _layouts():
    from gptj import native

    reason = native.unavailable_reason()
    return ["onednn", pytest.param("native", marks=pytest.mark.skipif(
        reason is not None, reason=f"native kernels unavailable: {reason}"))]


@pytest.mark.skipif(not kernels.can_pack(torch.bfloat16, "cpu"), reason=NO_BF16_PACKING)
@pytest.mark.parametrize("layout", _layouts())
def test_packed_linear_equals_f_linear_and_is_not_saved_or_moved(layout):
    torch.manual_seed(0)
    lin = nn.Linear(256, 96).to(torch.bfloat16)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    packed = kernels.PackedLinear(lin, layout)
    for rows in (1, 5, 8, 9, 70):  # native layout: its GEMV up to 8 rows, F.linear above
        x = torch.randn(rows, 256).to(torch.bfloat16)
        torch.testing.assert_close(packed(x).float(), F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2)
    x3 = torch.randn(2, 3, 256).to(torch.bfloat16)
    assert packed(x3).shape == (2, 3, 96)
    assert "packed" not in packed.state_dict()
    with pytest.raises(RuntimeError, match="cannot be moved"):
        packed.float()
    with pytest.raises(RuntimeError, match="bfloat16 CPU input"):
        packed(torch.randn(1, 256))


@pytest.mark.parametrize("cls, kwargs", [(Int8Linear, {}), (Int4Linear, {"group_size": 32})])
def test_concatenated_quantized_linears_equal_each_part(cls, kwargs):
    torch.manual_seed(0)
    parts = [cls.from_float(nn.Linear(64, n, bias=bias), **kwargs) for n, bias in ((32, False), (48, True))]
    fused = kernels.concat_out_features(parts)
    assert isinstance(fused, cls) and fused.out_features == 80
    for rows in (1, 3, 600):  # kernel and dequantized paths
        x = torch.randn(rows, 64)
        want = torch.cat([p(x) for p in parts], dim=-1)
        # the same sums of 64 terms, maybe by another kernel: <= 64 u of the terms' size each side
        torch.testing.assert_close(fused(x), want, rtol=0, atol=1e-4 * float(want.abs().max()))


def test_fusing_refuses_mixed_linears():
    with pytest.raises(TypeError, match="share type"):
        kernels.concat_out_features([nn.Linear(8, 8), Int8Linear.from_float(nn.Linear(8, 8))])


def test_packed_model_runs_the_exact_decode_path_too(kernel_path):
    from gptj.decode import GenerationConfig, generate

    model = random_model(CFGS["partial-rotary"], torch.bfloat16, seed=3)
    kernels.prepare_for_serving(model, max_rows=1)
    out = generate(model, [[1, 2, 3]], GenerationConfig(max_new_tokens=4, min_new_tokens=4))
    assert len(out[0]) == 4


@pytest.mark.skipif(not kernels.can_pack(torch.bfloat16, "cpu"), reason=NO_BF16_PACKING)
def test_pack_layout_follows_the_rows_a_step_can_have(kernel_path):
    few = random_model(CFGS["partial-rotary"], torch.bfloat16)
    kernels.pack_model(few, max_rows=1)
    many = random_model(CFGS["partial-rotary"], torch.bfloat16)
    kernels.pack_model(many, max_rows=64)
    assert few.lm_head.layout == ("native" if kernel_path != "fallback" else "onednn")
    # many rows: oneDNN's packed bfloat16 where the CPU computes bfloat16; on AVX-512 without BF16
    # (oneDNN emulates it there) gptj.native's layout, as for few
    emulated = kernel_path != "fallback" and not policy.cpu_bf16()
    assert many.lm_head.layout == ("native" if emulated else "onednn")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        torch.testing.assert_close(few(ids), many(ids), rtol=2e-2, atol=2e-2)


def test_each_kernel_choice_follows_native_availability(kernel_path):
    """What picks gptj.native (int8 linears, decode attention) sees it switched off or on."""
    from gptj import native, quant
    from gptj.policy import CPU_NATIVE, attention_path

    on = kernel_path != "fallback"
    assert native.available() is on and (native.unavailable_reason() is None) is on
    assert (quant._native() is not None) is on
    assert (attention_path("cpu", torch.bfloat16, "auto", "off").backend == CPU_NATIVE) is on
    assert attention_path("cpu", torch.float32, "auto", "off").backend != CPU_NATIVE  # a bfloat16 model only
    assert attention_path("cpu", torch.bfloat16, "off", "off").backend != CPU_NATIVE
    lin = Int8Linear.from_float(nn.Linear(64, 48).to(torch.bfloat16))
    x = torch.randn(2, 64).to(torch.bfloat16)
    want = F.linear(x.float(), lin.weight.float() * lin.weight_scale.float()[:, None], lin.bias.float())
    torch.testing.assert_close(lin(x).float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
