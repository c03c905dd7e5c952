"""HF Llama folders through gptj.weights.io (issue 59): what transformers' save_pretrained writes loads
(one file or shards with an index) to HF's float32 logits; gptj's own save loads in HF's from_pretrained
to the same logits and back in gptj; tied embeddings; one-line refusals; `gptj init --preset llama-tiny`."""

from __future__ import annotations

import json

import pytest
import torch

from gptj.cli import main
from gptj.errors import CheckpointError, ConfigError, GptjError
from gptj.models.llama import LlamaConfig
from gptj.models.registry import PRESETS, architecture
from gptj.weights.io import load_model, save_checkpoint

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=200, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=512,
            bos_token_id=0, eos_token_id=1,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 256})
IDS = torch.tensor([[5, 17, 42, 99, 3, 150, 23, 64]])
U = 2.0 ** -24


@torch.no_grad()
def hf_model(tie: bool = False, seed: int = 0):
    cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=tie, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # far from HF's near-flat init, so logits differ a lot
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
    return model


def bound(logits: torch.Tensor) -> float:
    """float32 rounding between two orders of the same sums (tests/test_llama_model.py's bound)."""
    return 7 * 128 * U * float(logits.abs().max())


def same_logits(ours, hf) -> None:
    with torch.no_grad():
        got, want = ours(IDS), hf(IDS).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=bound(want))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_save_pretrained_sharded_loads_to_hf_logits(tmp_path, tie):
    hf = hf_model(tie)
    hf.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()  # sharded
    assert len(list((tmp_path / "m").glob("model-*-of-*.safetensors"))) > 1
    ours = load_model(tmp_path / "m")
    assert type(ours).__name__ == "LlamaForCausalLM" and not ours.training
    assert (ours.lm_head.weight is ours.transformer.wte.weight) == tie
    assert ours.transformer.wte.weight.device.type == "cpu" and not ours.transformer.wte.weight.is_meta
    same_logits(ours, hf)
    bf16 = load_model(tmp_path / "m", dtype=torch.bfloat16)
    assert bf16.transformer.h[0].mlp.up_proj.weight.dtype == torch.bfloat16


def test_single_file_and_gptj_save_round_trip(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path / "one")
    assert (tmp_path / "one" / "model.safetensors").is_file()
    ours = load_model(tmp_path / "one")
    same_logits(ours, hf)
    # gptj's save: an HF folder (sharded here) that from_pretrained loads to the same logits, and gptj loads back
    save_checkpoint(ours.state_dict(), ours.config, tmp_path / "saved", max_shard_bytes=100_000)
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["model_type"] == "llama" and (tmp_path / "saved" / "model.safetensors.index.json").is_file()
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="eager").float()
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, hf(IDS).logits)  # the same weights, the same HF math
    again = load_model(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(again(IDS), ours(IDS))


def test_tied_save_writes_no_lm_head(tmp_path):
    hf = hf_model(tie=True)
    hf.save_pretrained(tmp_path / "m")
    ours = load_model(tmp_path / "m")
    save_checkpoint(ours.state_dict(), ours.config, tmp_path / "saved")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="eager").float()
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, hf(IDS).logits)
    assert load_model(tmp_path / "saved").lm_head.weight is not None


def test_a_tied_head_is_the_embedding_and_a_stored_one_must_equal_it(tmp_path):
    """A tied folder without lm_head loads with the head sharing the embedding's tensor; one that stores
    a float head equal to the embedding loads too, and one whose stored head differs is refused in one
    line naming both."""
    from safetensors.torch import load_file, save_file

    hf_model(tie=True).save_pretrained(tmp_path / "m")
    model = load_model(tmp_path / "m")
    assert model.lm_head.weight is model.transformer.wte.weight
    file = tmp_path / "m" / "model.safetensors"
    sd = load_file(str(file))
    save_file({**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}, str(file), metadata={"format": "pt"})
    assert torch.equal(load_model(tmp_path / "m").lm_head.weight, sd["model.embed_tokens.weight"])
    save_file({**sd, "lm_head.weight": sd["model.embed_tokens.weight"] + 1}, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path / "m")
    assert "lm_head.weight is tied to model.embed_tokens.weight" in one_line(e)


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_missing_shard_tensor_and_unknown_model_type_are_one_line(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    shard = sorted((tmp_path / "m").glob("model-*.safetensors"))[-1]
    shard.rename(tmp_path / "away.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path / "m")
    assert f"shard {shard.name} is missing" in one_line(e)
    # a tensor dropped from the index (its shard present): named before any weight is read
    (tmp_path / "away.safetensors").rename(shard)
    index = tmp_path / "m" / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    del d["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    index.write_text(json.dumps(d))
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path / "m")
    assert "missing tensor model.layers.1.mlp.down_proj.weight" in one_line(e)
    # a tensor the config does not have
    d["weight_map"]["model.layers.1.mlp.down_proj.weight"] = shard.name
    d["weight_map"]["model.layers.2.mlp.up_proj.weight"] = shard.name
    index.write_text(json.dumps(d))
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path / "m")
    assert "unexpected tensor model.layers.2.mlp.up_proj.weight" in one_line(e)
    cfg = tmp_path / "m" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "model_type": "mistral"}))
    with pytest.raises(ConfigError) as e:
        load_model(tmp_path / "m")
    assert "model_type 'mistral' is not supported (supported: 'gptj', 'llama')" in one_line(e)
    with pytest.raises(ConfigError, match="supported: 'gptj', 'llama'"):
        architecture("bert")


def test_non_finite_weight_and_quantize_are_refused(tmp_path):
    hf = hf_model()
    with torch.no_grad():
        hf.model.layers[0].self_attn.k_proj.weight[0, 0] = float("nan")
    hf.save_pretrained(tmp_path / "m")
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path / "m")
    assert "model.layers.0.self_attn.k_proj.weight has NaN or infinite values" in one_line(e)
    with pytest.raises(GptjError) as e:
        load_model(tmp_path / "m", quantize="w8a8")
    assert "w8a8 needs a calibration: run `gptj calibrate --model" in one_line(e)
    with pytest.raises(GptjError) as e:
        load_model(tmp_path / "m", group_size=32)
    assert "a group size needs a quantization mode" in one_line(e)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_at_load_every_linear_within_its_rounding(tmp_path, mode):
    """--quantize int8 / int4 on a Llama folder: every linear (the blocks' seven, lm_head) becomes the
    mode's layer, each weight within its rounding of the float one, and the engine decodes with it
    as gptj.decode does."""
    from gptj.decode import generate
    from gptj.engine import Engine, EngineConfig
    from gptj.generation_config import GenerationConfig
    from gptj.quant.linear import LAYERS

    hf_model().save_pretrained(tmp_path / "m")
    ref, q = load_model(tmp_path / "m"), load_model(tmp_path / "m", quantize=mode)
    floats = {n: m for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(floats) == 2 * 7 + 1 and q.config.quantization["mode"] == mode
    for name, lin in floats.items():
        layer = q.get_submodule(name)
        assert type(layer) is LAYERS[mode], name
        w, deq = lin.weight.detach(), layer.dequantized_weight(torch.float32)
        if mode == "int8":  # symmetric per row: half a step, plus the bfloat16 scale's rounding (2^-8 of up to 127 steps)
            step = w.abs().amax(1, keepdim=True) / 127
            assert bool(((w - deq).abs() <= step * (0.5 + 127 * 2.0 ** -8) + 1e-7).all()), name
        else:  # asymmetric per group of the inputs: at most one step of 15 over the group's range
            g = q.config.quantization["group_size"]
            groups = w.reshape(w.shape[0], -1, g)
            step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
            assert bool(((groups - deq.reshape(groups.shape)).abs() <= step * (1 + 15 * 2.0 ** -8) + 1e-7).all()), name
    gen = GenerationConfig(max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    prompts = [IDS[0].tolist(), IDS[0, :5].tolist()]
    assert Engine(q, EngineConfig(max_seqs=2, block_size=8)).generate(prompts, gen) == generate(q, prompts, gen)


def test_a_calibrated_llama_loads_as_w8a8_within_its_rounding(tmp_path):
    """W8A8 for Llama: calibrate records the factors (q, k, v share ln_1's; gate and up share ln_2's)
    and transformers still reads the folder; --quantize w8a8 makes every linear a W8A8Linear, each
    weight within its rounding of the float one, that the engine decodes with as gptj.decode does;
    quant-report takes w8a8 among its modes; convert keeps the factors, and the copy quantizes to the
    same tensors."""
    from gptj.decode import generate
    from gptj.engine import Engine, EngineConfig
    from gptj.generation_config import GenerationConfig
    from gptj.quant import W8A8Linear
    from gptj.weights.io import calibrate, convert

    folder = tmp_path / "m"
    hf = hf_model()
    hf.save_pretrained(folder)
    record = calibrate(folder, [IDS[0].tolist(), [7, 8, 9, 10]], "test prompts")
    assert json.loads((folder / "config.json").read_text())["calibration"] == record and record["tokens"] == 12
    ref, q = load_model(folder), load_model(folder, quantize="w8a8")
    same_logits(ref, transformers.LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").float())
    assert q.config.quantization["calibration"] == record and q.config.calibration is None
    for name, lin in ((n, m) for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear)):
        layer = q.get_submodule(name)
        assert type(layer) is W8A8Linear, name
        # per row of W * s: half a step of 127, plus the bfloat16 scale's rounding; then / s per input column
        w, s = lin.weight.detach(), layer.input_smooth.float()
        step = (w * s).abs().amax(1, keepdim=True) / 127
        err = (w - layer.dequantized_weight(torch.float32)).abs()
        assert bool((err <= step * (0.5 + 127 * 2.0 ** -8) / s + 1e-6).all()), name
    attn, mlp = q.transformer.h[1].attn, q.transformer.h[1].mlp
    assert torch.equal(attn.q_proj.input_smooth, attn.k_proj.input_smooth)
    assert torch.equal(attn.q_proj.input_smooth, attn.v_proj.input_smooth)
    assert torch.equal(mlp.gate_proj.input_smooth, mlp.up_proj.input_smooth)
    assert not torch.equal(mlp.gate_proj.input_smooth, mlp.down_proj.input_smooth)
    gen = GenerationConfig(max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    prompts = [IDS[0].tolist(), IDS[0, :5].tolist()]
    assert Engine(q, EngineConfig(max_seqs=2, block_size=8)).generate(prompts, gen) == generate(q, prompts, gen)
    from gptj.bench.quant_report import quantization_report

    report = quantization_report(folder, prompts=[IDS[0].tolist()], speed=False)  # every mode: w8a8 too, calibrated
    assert set(report["modes"]) >= {"int8", "int4", "w8a8"} and 0 <= report["modes"]["w8a8"]["top1_agreement"] <= 1
    copy = convert(folder, tmp_path / "copy")
    assert (copy / "calibration.safetensors").read_bytes() == (folder / "calibration.safetensors").read_bytes()
    a, b = q.state_dict(), load_model(copy, quantize="w8a8").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gptj_init_llama_tiny_writes_a_folder_that_loads(tmp_path, capsys):
    assert "llama3.1-8b" in PRESETS and PRESETS["llama3.1-8b"].num_key_value_heads == 8
    assert main(["init", "--preset", "llama-tiny", "--out", str(tmp_path / "m")]) == 0
    assert "llama-tiny" in capsys.readouterr().out
    model = load_model(tmp_path / "m")
    assert isinstance(model.config, LlamaConfig) and model.config == PRESETS["llama-tiny"]
    w = model.transformer.h[0].attn.q_proj.weight
    assert 0.015 < float(w.detach().std()) < 0.025 and torch.equal(model.transformer.ln_f.weight, torch.ones(64))
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m", attn_implementation="eager").float()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), back(IDS).logits, rtol=0, atol=bound(back(IDS).logits))
    # deterministic: the same seed writes the same weights; bfloat16 on request
    assert main(["init", "--preset", "llama-tiny", "--out", str(tmp_path / "b"), "--dtype", "bfloat16"]) == 0
    assert torch.equal(load_model(tmp_path / "b").transformer.h[0].attn.q_proj.weight, w.bfloat16())


def test_bad_llama_config_is_one_line(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError) as e:
        load_model(tmp_path / "m")
    assert "and not a valid llama one: config field 'vocab_size' is missing" in one_line(e)
    hf_model().save_pretrained(tmp_path / "c")  # a calibration record that is not an object
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    (tmp_path / "c" / "config.json").write_text(json.dumps({**config, "calibration": 5}))
    with pytest.raises(ConfigError) as e:
        load_model(tmp_path / "c")
    assert "config field 'calibration' must be an object or absent, got 5" in one_line(e)


def test_compare_and_quant_report_take_a_llama_folder(tmp_path):
    """gptj compare --hf (HF's LlamaForCausalLM against gptj's, float32: within the float32 floor) and
    gptj quant-report (GPT-J's modes but w8a8, whose calibration is GPT-J's) on a Llama folder."""
    from gptj.bench.compare import compare, gptj_side, hf_side
    from gptj.bench.quant_report import quantization_report

    hf_model().save_pretrained(tmp_path / "m")
    cpu = torch.device("cpu")
    report = compare(hf_side(tmp_path / "m", torch.float32, cpu), gptj_side(tmp_path / "m", torch.float32, cpu),
                     [IDS[0].tolist()], 4)
    assert report["verdict"] == "agree"
    report = quantization_report(tmp_path / "m", prompts=[IDS[0].tolist()], speed=False)
    assert "int8" in report["modes"] and "int4" in report["modes"] and "w8a8" not in report["modes"]
    assert report["modes"]["int8"]["weight_bytes"] < report["float32_weight_bytes"] / 3


def test_convert_rewrites_a_llama_folder_in_another_dtype(tmp_path, capsys):
    """gptj convert on a Llama folder: the weights rounded once to --dtype (by default the dtype its
    config.json records: nothing rounded), its tokenizer and generation_config.json (the EOS ids) kept
    as they are; a --tp plan the model cannot take refused in one line, nothing written."""
    hf_model().save_pretrained(tmp_path / "m")
    gen = {"bos_token_id": 0, "eos_token_id": [1, 7]}
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(gen))
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x"}))
    assert main(["convert", str(tmp_path / "m"), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16",
                 "--quiet"]) == 0
    assert main(["convert", str(tmp_path / "m"), "--out", str(tmp_path / "same"), "--quiet"]) == 0
    src, bf16, same = (load_model(tmp_path / d).state_dict() for d in ("m", "bf16", "same"))
    assert all(torch.equal(bf16[n], t.to(torch.bfloat16)) and torch.equal(same[n], t) for n, t in src.items())
    for d in ("bf16", "same"):
        assert json.loads((tmp_path / d / "generation_config.json").read_text()) == gen
        assert json.loads((tmp_path / d / "tokenizer_config.json").read_text()) == {"eos_token": "x"}
    capsys.readouterr()  # --tp N writes each rank's shard (tests/test_parallel_pp.py); a plan that cannot be is refused
    assert main(["convert", str(tmp_path / "m"), "--out", str(tmp_path / "no"), "--quiet", "--tp", "3"]) == 1
    assert "divisible by 3" in capsys.readouterr().err and not (tmp_path / "no").exists()


@pytest.mark.parametrize("mode, tie", [("int8", False), ("int4", True), ("w8a8", False), ("w8a8", True)])
def test_a_quantized_llama_checkpoint_round_trips(tmp_path, capsys, mode, tie):
    """gptj convert --quantize on a Llama folder writes HF's module names with each linear's scales
    beside its weight (a tied head too: quantized, it is no longer the embedding); it loads to the
    tensors quantizing at load gives, and decodes the same tokens; HF transformers refuses it; saving
    the loaded model writes the same folder again."""
    from gptj.decode import generate
    from gptj.generation_config import GenerationConfig
    from gptj.weights.io import calibrate

    folder = tmp_path / "m"
    hf_model(tie).save_pretrained(folder)
    if mode == "w8a8":
        calibrate(folder, [IDS[0].tolist()], "test prompts")
    assert main(["convert", str(folder), "--out", str(tmp_path / "q"), "--quantize", mode, "--quiet"]) == 0
    from safetensors import safe_open

    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight_scale",
            "lm_head.weight_scale"} <= keys
    assert ("model.layers.0.self_attn.q_proj.input_smooth" in keys) == (mode == "w8a8")
    on_load, saved = load_model(folder, quantize=mode), load_model(tmp_path / "q")
    assert saved.config.quantization == on_load.config.quantization
    if mode == "w8a8":  # every linear on its calibrated factors: a tied head made from the embedding too
        from safetensors.torch import load_file

        factors = load_file(str(folder / "calibration.safetensors"))
        assert torch.equal(on_load.lm_head.input_smooth, factors["lm_head.input_smooth"])
    a, b = on_load.state_dict(), saved.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    gen = GenerationConfig(max_new_tokens=5, eos_token_id=None, pad_token_id=0)
    assert generate(saved, [IDS[0].tolist()], gen) == generate(on_load, [IDS[0].tolist()], gen)
    with pytest.raises(ValueError):
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "q")
    again = save_checkpoint(saved.state_dict(), saved.config, tmp_path / "again")
    c = load_model(again).state_dict()
    assert c.keys() == b.keys() and all(torch.equal(c[k], b[k]) for k in b)


def test_a_peft_adapter_folds_into_a_llama_as_it_loads(tmp_path):
    """A LoRA adapter HF PEFT saved for LlamaForCausalLM (Llama's module names: attention's q/k/v/o and
    the MLP's gate/up/down), folded in as the folder loads: HF PEFT's merged model's logits, within
    float32 rounding (and each --tp rank's slice of it, from its shard file), and the same weights merged
    into a built model; a GPT-J adapter on it refused in one line."""
    peft = pytest.importorskip("peft")
    from gptj.lora import merge_lora
    from gptj.parallel.context import SINGLE
    from gptj.weights.peft import read_adapter

    hf = hf_model()
    hf.save_pretrained(tmp_path / "m")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    wrapped = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:  # a trained adapter's shape: B is not zero
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    wrapped.save_pretrained(tmp_path / "adapter")
    want = wrapped.merge_and_unload()
    ours = SINGLE.load(str(tmp_path / "m"), torch.float32, "cpu", lora=str(tmp_path / "adapter"))
    with torch.no_grad():
        base = load_model(tmp_path / "m")(IDS)
        got, ref = ours(IDS), want(IDS).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=2 * bound(ref))
    assert float((got - base).abs().max()) > 100 * bound(ref)  # and the adapter matters
    adapter = read_adapter(tmp_path / "adapter")
    assert adapter.layout.arch == "llama" and len(adapter.weights) == 2 * 7
    built = load_model(tmp_path / "m")
    merge_lora(built, adapter)  # on a built model: the weights folding it in at load gives
    assert all(torch.equal(t, ours.state_dict()[n]) for n, t in built.state_dict().items())
    from gptj.lora import LoRAConfig, save_adapter

    gptj_names = {"base_model.model.transformer.h.0.attn.q_proj.lora_A.weight": torch.zeros(4, 64),
                  "base_model.model.transformer.h.0.attn.q_proj.lora_B.weight": torch.zeros(64, 4)}
    save_adapter(gptj_names, LoRAConfig(rank=4, target_modules=("q_proj",)), tmp_path / "gptj-adapter")
    with pytest.raises(GptjError) as e:
        SINGLE.load(str(tmp_path / "m"), torch.float32, "cpu", lora=str(tmp_path / "gptj-adapter"))
    assert "adapts gptj's modules" in one_line(e) and "is a llama model" in one_line(e)
    with pytest.raises(GptjError) as e:
        merge_lora(built, read_adapter(tmp_path / "gptj-adapter"))
    assert "a gptj adapter on a llama model" in one_line(e)
    # under --tp, from `gptj convert --tp 2`'s shard files: each rank's slice of the merged whole model
    from gptj.parallel.shards import load_rank
    from gptj.parallel.tp_llama import shard_llama_state_dict
    from gptj.weights.checkpoint import Checkpoint

    assert main(["convert", str(tmp_path / "m"), "--out", str(tmp_path / "tp"), "--tp", "2", "--quiet"]) == 0
    for rank in range(2):  # no process group needed to build a rank's model
        got = load_rank(Checkpoint.read(tmp_path / "tp", rank, 2, lora=str(tmp_path / "adapter")), rank, 2,
                        torch.float32, "cpu").state_dict()
        want = shard_llama_state_dict(ours.state_dict(), ours.config, rank, 2)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_gptj_init_llama_tiny_writes_a_stand_in_tokenizer(tmp_path, capsys):
    """llama-tiny's folder runs every command that takes text: a byte-level BPE of its 512 ids trained
    on the bundled articles (deterministic), BOS 0 added to what it encodes, EOS 1 as config.json and
    generation_config.json say. A Llama folder without a tokenizer is refused in one line, not given
    GPT-J's."""
    from gptj.tokenizer import HFTokenizer, load_tokenizer, tokenizer_for_model

    for d in ("a", "b"):
        assert main(["init", "--preset", "llama-tiny", "--out", str(tmp_path / d)]) == 0
    assert "stand-in tokenizer" in capsys.readouterr().out
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    tok = load_tokenizer(tmp_path / "a")
    assert isinstance(tok, HFTokenizer) and tok.eos_token_ids == (1,) and tok.vocab_size == 512
    ids = tok.encode("The storm hit the coast on Tuesday.")
    assert ids[0] == 0 and 1 not in ids and max(ids) < 512 and tok.decode(ids[1:]) == "The storm hit the coast on Tuesday."
    (tmp_path / "a" / "tokenizer.json").unlink()
    with pytest.raises(GptjError) as e:
        tokenizer_for_model(tmp_path / "a")
    assert "a llama model without its tokenizer" in one_line(e)


def test_the_shared_read_loop_passes_over_old_rotary_buffers_and_names_a_bad_tensor(tmp_path):
    """Llama folders go through the one checked read (gptj.weights.reading): a .bin without a listing (so
    only the loop sees its names), with an old checkpoint's rotary_emb.inv_freq buffer and a tied head
    left out, loads to HF's logits; a non-finite weight and a missing one are one line naming them."""
    hf = hf_model(tie=True)
    sd = {k: v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    hf.config.save_pretrained(tmp_path / "m")
    torch.save(sd, tmp_path / "m" / "pytorch_model.bin")
    same_logits(load_model(tmp_path / "m"), hf)
    bad = dict(sd)
    bad["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"].clone()
    bad["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    torch.save(bad, tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path / "m")
    assert "model.layers.1.mlp.up_proj.weight has NaN or infinite values" in one_line(e)
    del bad["model.layers.1.mlp.up_proj.weight"]
    torch.save(bad, tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path / "m")
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in one_line(e)
