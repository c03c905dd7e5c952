"""W8A8 (int8 activations x int8 weights, SmoothQuant factors): the layer against its dequantized
reference within int8 rounding, exact integer sums on every path, batch invariance, calibration,
the calibrated and the quantized checkpoints, and refusals."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpu_kinds import fake_cpu

from gptj import cpu, native, policy, quant
from gptj.cli import main
from gptj.config import GPTJConfig
from gptj.decode import GenerationConfig, generate
from gptj.engine import Engine, EngineConfig
from gptj.errors import GptjError
from gptj.kernels import fused, prepare_for_serving
from gptj.quant import calibrate as cal
from gptj.quant import linear as qlinear
from gptj.quant.base import pin_path
from gptj.weights.io import calibrate, convert, load_model, random_state_dict, save_checkpoint

CFG = GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_inner=256)


def make_linear(n_in, n_out, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n_out, generator=g) * 0.1)
    return lin


def outlier_input(rows, n_in, seed=1):
    """Activations with two outlier channels (x40), as LLM activations have (SmoothQuant's premise)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_in, generator=g)
    x[:, 5] *= 40
    x[:, 17] *= 40
    return x


def test_a_w8a8_layer_is_its_dequantized_weight_within_the_activation_rounding():
    lin = make_linear(256, 96)
    x = outlier_input(7, 256)
    smooth = quant.smoothing_factors(x.abs().amax(0), lin.weight.abs().amax(0))
    m = quant.W8A8Linear.from_float(lin, smooth)
    y = m(x)
    # y - x @ W~.T = sum_k (qx*sx - x/s)_k * (qw*sw)_nk, and |qx*sx - x/s| <= sx / 2 per element
    _, sx = quant.quantize_rows_int8(x / m.input_smooth.float())
    w_q = m.weight.float() * m.weight_scale.float()[:, None]  # (out, in): the smoothed weight as stored
    bound = sx / 2 * w_q.abs().sum(1)[None, :]
    ref = F.linear(x, m.dequantized_weight(), lin.bias)
    fp32 = 256 * 2**-24 * (x.abs() / m.input_smooth.float()) @ w_q.abs().t()  # float32 sums: K ulps of their terms
    assert ((y - ref).abs() <= bound + fp32).all()
    # ... and the dequantized weight is the float one within int8 weight rounding (scale / 2 per element)
    assert ((m.dequantized_weight() - lin.weight).abs()
            <= (m.weight_scale.float()[:, None] / 2 + 1e-7) / m.input_smooth.float()[None, :] * 1.0001).all()


def test_smoothing_moves_the_outliers_into_the_weights():
    """The point of calibration: with outlier channels, smoothed W8A8 is several times closer to the float layer."""
    lin = make_linear(256, 96, seed=3)
    x = outlier_input(32, 256, seed=4)
    ref = lin(x)
    plain = quant.W8A8Linear.from_float(lin)  # no smoothing (factors 1)
    smooth = quant.smoothing_factors(x.abs().amax(0), lin.weight.abs().amax(0))
    smoothed = quant.W8A8Linear.from_float(lin, smooth)
    err_plain = (plain(x) - ref).abs().mean()
    err_smooth = (smoothed(x) - ref).abs().mean()
    assert err_smooth < err_plain / 3


@pytest.mark.parametrize("path", [policy.INT_MM, policy.DEQUANTIZE])
@pytest.mark.parametrize("n_in", [64, 2048])
def test_the_integer_sums_are_exact_on_every_path(path, n_in, monkeypatch):
    """torch._int_mm (CPUs with VNNI) and the float32 sums (CPUs without, CUDA's few rows): the int32
    sums, rounded once to float32, also where they pass 2**24 (2048 inputs of +-127)."""
    if path == policy.INT_MM and not cpu.int8_sums_exact():
        pytest.skip(f"torch._int_mm's int8 sums saturate on this {cpu.describe()} CPU (no AVX-512 VNNI)")
    lin = make_linear(n_in, 48)
    x = outlier_input(9, n_in)
    x[0] = 1.0  # a row of +127 against the weight's +-127 rows below: sums of 2048 * 127**2 > 2**24
    m = quant.W8A8Linear.from_float(lin, quant.smoothing_factors(x.abs().amax(0), lin.weight.abs().amax(0)))
    m.weight[0], m.weight[1] = 127, -127
    pin_path(m, path, x.dtype)
    qx, sx = m.quantize_input(x)
    truth = (qx.long() @ m.weight.long().t()).float()
    assert torch.equal(m(x), (truth * m.weight_scale.float() * sx).to(x.dtype) + m.bias)
    assert n_in == 64 or truth.abs().max() > 2**24


def test_each_row_is_the_same_whatever_rows_share_the_call():
    lin = make_linear(128, 64)
    x = outlier_input(13, 128)
    m = quant.W8A8Linear.from_float(lin, quant.smoothing_factors(x.abs().amax(0), lin.weight.abs().amax(0)))
    together = m(x)
    for i in range(13):
        assert torch.equal(m(x[i:i + 1]), together[i:i + 1])
    assert torch.equal(m(x[3:11]), together[3:11])


def test_policy_sends_w8a8_to_int_mm_on_cpu_and_cuda_only_where_it_takes_the_shape(monkeypatch):
    fake_cpu(monkeypatch, cpu.AVX512_VNNI)  # (CPUs without VNNI: tests/test_cpu.py)
    assert policy.linear_path("cpu", torch.bfloat16, 1, "w8a8") == policy.INT_MM
    assert policy.linear_path("cuda", torch.bfloat16, 64, "w8a8", (4096, 4096)) == policy.INT_MM
    # decode's few rows too: padded up to _int_mm's 17 (int_mm_min_rows), the weight read as int8
    assert policy.linear_path("cuda", torch.bfloat16, 1, "w8a8", (4096, 4096)) == policy.INT_MM
    assert policy.linear_path("cuda", torch.bfloat16, 64, "w8a8", (4096, 4100)) == policy.DEQUANTIZE
    assert policy.int_mm_min_rows("cuda") == policy.INT_MM_CUDA_MIN_ROWS == 17 and policy.int_mm_min_rows("cpu") == 1


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 20])
def test_int_mm_pads_few_rows_and_keeps_each_rows_exact_sums(rows):
    """The padded call (CUDA's minimum of 17 rows, here on CPU's _int_mm): each row's int32 sums are
    its exact sums, as unpadded; the padding rows are dropped."""
    g = torch.Generator().manual_seed(rows)  # small values: exact on every CPU's _int_mm (no 16-bit saturation)
    qx = torch.randint(-8, 9, (rows, 64), dtype=torch.int8, generator=g)
    w = torch.randint(-8, 9, (24, 64), dtype=torch.int8, generator=g)
    got = qlinear.int_mm(qx, w, min_rows=17)
    assert got.shape == (rows, 24) and got.dtype == torch.int32
    assert torch.equal(got.long(), qx.long() @ w.long().t())


# --- the model -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A float checkpoint (std 0.3: logits far apart), calibrated on 6 prompts of the bundled set."""
    folder = save_checkpoint(random_state_dict(CFG, seed=7, std=0.3), CFG, tmp_path_factory.mktemp("w") / "float")
    prompts = [torch.randint(0, 50000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (40, 25, 60, 33, 12, 50)]
    record = calibrate(folder, prompts, "test prompts", dtype=torch.float32)
    return folder, record


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50000, (n,), generator=g).tolist() for n in lengths]


def test_calibration_is_recorded_and_its_factors_are_shared_by_the_linears_of_one_input(calibrated):
    folder, record = calibrated
    config = json.loads((folder / "config.json").read_text())
    assert config["calibration"] == record and record["tokens"] == 40 + 25 + 60 + 33 + 12 + 50
    model = load_model(folder, quantize="w8a8")
    block = model.transformer.h[1]
    smooth = block.attn.q_proj.input_smooth
    for m in (block.attn.k_proj, block.attn.v_proj, block.mlp.fc_in):
        assert torch.equal(m.input_smooth, smooth)  # they read ln_1's output: one factor vector
    assert not torch.equal(block.mlp.fc_out.input_smooth, torch.ones_like(block.mlp.fc_out.input_smooth))
    assert model.config.quantization["calibration"] == record and model.config.calibration is None


def test_a_quantized_checkpoint_round_trips_and_gives_the_same_tokens(calibrated, tmp_path):
    folder, record = calibrated
    on_load = load_model(folder, quantize="w8a8")
    out = convert(folder, tmp_path / "q", quantize="w8a8")
    saved = load_model(out)
    assert saved.config.quantization["mode"] == "w8a8" and saved.config.quantization["calibration"] == record
    a, b = on_load.state_dict(), saved.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    gen = GenerationConfig(max_new_tokens=10)
    prompts = prompts_of([9, 21])
    assert generate(on_load, prompts, gen) == generate(saved, prompts, gen)
    again = save_checkpoint(saved.state_dict(), saved.config, tmp_path / "again")
    assert generate(load_model(again), prompts, gen) == generate(saved, prompts, gen)
    # a plain (float) convert keeps the calibration with its factors
    kept = convert(folder, tmp_path / "float-copy")
    assert (kept / cal.CALIBRATION_FILE).read_bytes() == (folder / cal.CALIBRATION_FILE).read_bytes()
    assert generate(load_model(kept, quantize="w8a8"), prompts, gen) == generate(saved, prompts, gen)


@pytest.fixture(params=[policy.AMX, policy.SHIFTED, policy.NATIVE, policy.SPLIT, "plain"])
def w8a8_kernel(request, monkeypatch):
    """Serving's kernel for W8A8 layers: gptj.native's AMX-INT8 GEMM (AMX: skips where the CPU has no
    AMX); oneDNN's packed int8 GEMM in the form of a CPU with VNNI (SHIFTED: skips where this CPU lacks
    it, as its sums would saturate); on a CPU without (AVX2's flags faked: on every machine) gptj.native's
    GEMM (NATIVE, where it loads) or, without gptj.native, oneDNN's in the SPLIT form; or, as where
    neither is there, the layer as loaded (torch._int_mm with VNNI, the exact float32 sums without)."""
    if request.param == policy.AMX and not policy.native_amx_available():
        pytest.skip(f"gptj.native's AMX kernels do not run on this CPU ({cpu.describe()})")
    if request.param != policy.AMX:
        monkeypatch.setattr(policy, "native_amx_available", lambda: False)
    if request.param in (policy.SHIFTED, policy.SPLIT) and not policy.onednn_int8("cpu"):
        pytest.skip("oneDNN's int8 GEMM (torch.ops.onednn.qlinear_prepack) is not available here")
    if request.param == policy.SHIFTED and not cpu.int8_sums_exact():
        pytest.skip(f"the SHIFTED form needs AVX-512 VNNI: its int8 sums saturate on this {cpu.describe()} CPU")
    if request.param == policy.NATIVE and not policy.native_gemv_available():
        pytest.skip(f"gptj.native is not available here: {native.unavailable_reason()}")
    if request.param in (policy.NATIVE, policy.SPLIT):
        fake_cpu(monkeypatch, cpu.AVX2)
    if request.param == policy.SPLIT:
        monkeypatch.setattr(policy, "native_gemv_available", lambda: False)
    if request.param == "plain":
        monkeypatch.setattr(fused, "can_pack_int8", lambda device: False)
    return request.param


def test_the_packed_layer_gives_the_plain_layers_numbers(w8a8_kernel):
    lin = make_linear(256, 96)
    x = outlier_input(7, 256)
    m = quant.W8A8Linear.from_float(lin, quant.smoothing_factors(x.abs().amax(0), lin.weight.abs().amax(0)))
    holder = nn.Sequential(m)
    assert fused.pack_model(holder) == (0 if w8a8_kernel == "plain" else 1)
    assert w8a8_kernel == "plain" or holder[0].form == w8a8_kernel
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(holder(x.to(dtype)), m(x.to(dtype)))
    rows = torch.cat([holder(x[i:i + 1]) for i in range(7)])
    assert torch.equal(rows, holder(x))
    # a prefill's rows: more than one block of rows of gptj.native's GEMM (510 a block at K = 256)
    many = outlier_input(600, 256).bfloat16()
    assert torch.equal(holder(many), m(many))
    if w8a8_kernel == policy.NATIVE:  # one packed copy of the weight: gptj.native's panels
        assert holder[0].packed.dtype == torch.int8 and holder[0].packed.numel() == 96 * 256
    if w8a8_kernel == policy.AMX:  # the plain weight itself
        assert holder[0].packed.data_ptr() == m.weight.data_ptr()
        odd = quant.W8A8Linear.from_float(make_linear(96, 32), torch.ones(96))  # 96 inputs: not in steps of 64
        assert fused.PackedW8A8Linear(odd).form == policy.SHIFTED


def test_the_packed_layer_runs_its_rows_in_chunks_on_both_kernel_paths(kernel_path, monkeypatch):
    """bfloat16 with gptj.native: one-pass rounding and scaling around the GEMM, CHUNK_ROWS rows at a
    time; without: torch's ops over the whole call. Both are the plain layer's numbers."""
    if not policy.can_pack_int8("cpu"):
        pytest.skip("oneDNN's int8 GEMM (torch.ops.onednn.qlinear_prepack) is not available here")
    lin = make_linear(256, 96)
    x = outlier_input(7, 256).bfloat16()
    m = quant.W8A8Linear.from_float(lin, quant.smoothing_factors(x.float().abs().amax(0), lin.weight.abs().amax(0)))
    packed = fused.PackedW8A8Linear(m)
    monkeypatch.setattr(packed, "CHUNK_ROWS", 3)  # three chunks, the last one short
    assert torch.equal(packed(x), m(x)) and torch.equal(packed(x.view(7, 1, 256)), m(x).view(7, 1, 96))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_requests_together_equal_each_alone_on_the_engine(calibrated, dtype, w8a8_kernel):
    folder, _ = calibrated
    model = load_model(folder, dtype=dtype, quantize="w8a8")
    prepare_for_serving(model)  # fused q|k|v|fc_in: their input quantized once, with their shared factors
    want = quant.W8A8Linear if w8a8_kernel == "plain" else fused.PackedW8A8Linear
    assert isinstance(model.transformer.h[0].w_in, want) and isinstance(model.lm_head, want)
    prompts = prompts_of([5, 17, 1, 30, 8])
    gens = [GenerationConfig(max_new_tokens=12), GenerationConfig.mlperf(max_new_tokens=10, min_new_tokens=4),
            GenerationConfig(max_new_tokens=9, min_new_tokens=9), GenerationConfig(max_new_tokens=14),
            GenerationConfig(max_new_tokens=10, num_beams=2)]
    engine = Engine(model, EngineConfig(max_seqs=16))
    together = engine.generate(prompts, gens)
    assert max(engine.decode_batch_sizes) > 4
    for prompt, gen, got in zip(prompts, gens, together):
        assert got == Engine(model, EngineConfig(max_seqs=4)).generate([prompt], gen)[0]


@pytest.fixture(scope="module")
def calibrated_llama(tmp_path_factory):
    """gptj init's llama-tiny, calibrated on 3 prompts."""
    folder = tmp_path_factory.mktemp("w8a8-llama") / "m"
    assert main(["init", "--preset", "llama-tiny", "--out", str(folder)]) == 0
    calibrate(folder, [[(7 * i + n) % 500 for i in range(n)] for n in (30, 12, 21)], "test prompts")
    return folder


def test_a_llama_serves_w8a8_on_each_kernel_form(calibrated_llama, w8a8_kernel):
    """Llama's seven linears (fused: q|k|v and gate|up, on one set of smoothing factors each) and its
    head on the serving kernels' packed W8A8 layers (each form: as on the CPU kinds the fixture fakes),
    which give the plain layers' numbers: the model's logits equal the plain W8A8 model's, and requests
    batched together get each one's tokens alone."""
    plain = load_model(calibrated_llama, dtype=torch.bfloat16, quantize="w8a8")
    model = load_model(calibrated_llama, dtype=torch.bfloat16, quantize="w8a8")
    assert prepare_for_serving(model)["fused_blocks"] == len(model.transformer.h)
    want = quant.W8A8Linear if w8a8_kernel == "plain" else fused.PackedW8A8Linear
    layers = [m for b in model.transformer.h for m in (b.w_qkv, b.attn.o_proj, b.w_gate_up, b.mlp.down_proj)]
    assert all(isinstance(m, want) for m in layers + [model.lm_head])
    ids = torch.tensor([[(5 * i) % 500 for i in range(1, 20)]])
    with torch.no_grad():
        assert torch.equal(model(ids), plain(ids))
    gen = GenerationConfig(max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    prompts = [[(3 * i + n) % 500 for i in range(n)] for n in (5, 17, 9)]
    together = Engine(model, EngineConfig(max_seqs=8)).generate(prompts, gen)
    assert together == [Engine(model, EngineConfig(max_seqs=2)).generate([p], gen)[0] for p in prompts]


def test_the_fused_block_computes_what_the_plain_w8a8_block_does(calibrated):
    folder, _ = calibrated
    plain = load_model(folder, quantize="w8a8")
    fused = load_model(folder, quantize="w8a8")
    prepare_for_serving(fused)
    ids = torch.tensor([prompts_of([24])[0]])
    with torch.no_grad():
        a, b = plain(ids), fused(ids)
    # float32: the same integer sums; only the float epilogue's order of operations may differ
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(a.abs().max()))


# --- refusals ------------------------------------------------------------------------------------


def test_w8a8_without_a_calibration_is_one_line(tmp_path, capsys):
    folder = save_checkpoint(random_state_dict(CFG, seed=1), CFG, tmp_path / "m")
    rc = main(["generate", "--model", str(folder), "--quantize", "w8a8", "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "gptj calibrate --model" in err
    with pytest.raises(GptjError, match="needs its calibration record"):
        quant.make_quantization(CFG, "w8a8")
    with pytest.raises(GptjError, match="takes no calibration"):
        quant.make_quantization(CFG, "int8", calibration=cal.make_record(0.5, "x", 1, 1))


def test_calibration_cuts_each_prompt_to_the_models_context(tmp_path):
    """A prompt longer than the model's positions is calibrated on its first n_positions tokens (the
    model could not run the rest), not refused with a traceback."""
    cfg = CFG.replace(n_positions=64)
    folder = save_checkpoint(random_state_dict(cfg, seed=3), cfg, tmp_path / "m")
    record = calibrate(folder, prompts_of([100, 20]), "test prompts", dtype=torch.float32)
    assert record["tokens"] == 64 + 20 and record["samples"] == 2


def test_calibrate_refuses_a_quantized_model_and_a_bad_alpha(calibrated, tmp_path, capsys):
    folder, _ = calibrated
    q = convert(folder, tmp_path / "q", quantize="int8")
    assert main(["calibrate", "--model", str(q), "--samples", "1"]) == 1
    assert "already quantized (int8)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--model", str(folder), "--alpha", "1.5"])
    assert e.value.code == 2 and "expected a number in [0, 1]" in capsys.readouterr().err


def test_gptj_calibrate_on_the_bundled_samples(tmp_path, capsys):
    folder = save_checkpoint(random_state_dict(CFG, seed=2, std=0.3), CFG, tmp_path / "m")
    assert main(["calibrate", "--model", str(folder), "--samples", "2", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "calibrated" in out and "on 2 prompts" in out
    record = json.loads((folder / "config.json").read_text())["calibration"]
    assert record["samples"] == 2 and record["method"] == "smoothquant" and record["alpha"] == 0.5
    model = load_model(folder, quantize="w8a8")
    assert all(isinstance(m, quant.W8A8Linear) for n, m in model.named_modules() if n in quant.linear_names(CFG))
    assert len(generate(model, prompts_of([6]), GenerationConfig(max_new_tokens=4, eos_token_id=None))[0]) == 4


@pytest.mark.parametrize("kind", ["this CPU", cpu.AVX2])
def test_the_quantization_report_covers_w8a8(calibrated, kind, monkeypatch):
    """Accuracy and speed (with the serving kernels) of each mode, and the CPU's kind and W8A8 form
    (this CPU's, and an AVX2 CPU's with its flags faked)."""
    from gptj.bench.quant_report import format_report, quantization_report

    if kind != "this CPU":
        fake_cpu(monkeypatch, kind)
    folder, _ = calibrated
    report = quantization_report(folder, modes=["int8", "w8a8"], prompts=prompts_of([20, 12]), dtype=torch.float32)
    hw = report["hardware"]
    assert hw["cpu"] == cpu.describe() and f"{policy.w8a8_form()} form" in hw["w8a8_kernel"]
    without_vnni = policy.NATIVE if policy.native_gemv_available() else policy.SPLIT
    assert (kind == cpu.AVX2) <= (policy.w8a8_form() == without_vnni and "no AVX-512 VNNI" in hw["w8a8_kernel"])
    for r in report["modes"].values():
        assert r["one_token_ms"] > 0 and r["prefill_tok_s"] > 0
    fast = report["fastest"]
    assert fast["one_token_ms"] == min(report["modes"], key=lambda m: report["modes"][m]["one_token_ms"])
    assert fast["prefill_tok_s"] == max(report["modes"], key=lambda m: report["modes"][m]["prefill_tok_s"])
    text = format_report(report)
    assert f"CPU: {hw['cpu']}; w8a8 runs {hw['w8a8_kernel']}" in text
    assert f"one token {fast['one_token_ms']}, prefill {fast['prefill_tok_s']}" in text
    w8a8, int8 = report["modes"]["w8a8"], report["modes"]["int8"]
    assert report["positions"] == 32 and 0 <= w8a8["top1_agreement"] <= 1
    # the int8 checkpoint's bytes plus one bfloat16 smoothing factor per input of every linear
    assert w8a8["weight_bytes"] == int8["weight_bytes"] + 2 * sum(quant.linear_in_features(CFG).values())
    assert w8a8["mean_abs_logit_error"] > 0  # activations are rounded too: not the float model
