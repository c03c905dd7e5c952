"""LoRA (gptj.lora): adapters on a frozen base, merged equal to unmerged, HF PEFT reading gptj's
adapters and gptj reading PEFT's, and `gptj train` with a `lora:` section (only the adapters train,
--resume exact, an int8 base, the fine-tune lowering the eval loss)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from gptj.cli import main
from gptj.errors import GptjError
from gptj.lora import (LoRAConfig, LoRALinear, apply_lora, attach_adapter, lora_modules, merge_lora, read_adapter,
                       save_adapter)
from gptj.weights.io import load_model

ROOT = Path(__file__).resolve().parent.parent
PROMPT = torch.tensor([[5, 17, 300, 2, 9, 41, 7, 1000, 12]])
ALL = ("q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out")


def randomized(model: torch.nn.Module, seed: int = 0, std: float = 0.05) -> None:
    """Give every adapter non-zero A and B (a trained adapter's shape, not an untrained one's B = 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_A.weight.copy_(torch.randn(m.lora_A.weight.shape, generator=g) * std)
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * std)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT)[0].float()


@pytest.fixture
def adapter_dir(tiny_checkpoint, tmp_path):
    """A random adapter on every linear of the tiny model, saved as gptj writes it."""
    model = load_model(tiny_checkpoint)
    config = LoRAConfig(rank=4, alpha=8.0, target_modules=ALL)
    apply_lora(model, config)
    randomized(model)
    return save_adapter(model, config, tmp_path / "adapter", base_model=str(tiny_checkpoint)), logits(model)


def test_an_untrained_adapter_changes_nothing(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    before = logits(model)
    params = apply_lora(model, LoRAConfig(rank=8, target_modules=ALL))
    assert torch.equal(logits(model), before)  # B starts at zero
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == len(params) == 2 * 6 * model.config.n_layer
    assert {id(p) for p in trainable} == {id(p) for p in params}


def test_merged_equals_unmerged_and_both_differ_from_the_base(tiny_checkpoint, adapter_dir):
    folder, unmerged = adapter_dir
    base = logits(load_model(tiny_checkpoint))
    merged_model = load_model(tiny_checkpoint)
    merge_lora(merged_model, read_adapter(folder))
    merged = logits(merged_model)
    attached = load_model(tiny_checkpoint)
    attach_adapter(attached, read_adapter(folder))
    scale = float(base.abs().max())
    # W + s B A rounded once against x W + s (x A) B in float32: summation order only (gptj's float32 bound)
    assert float((merged - unmerged).abs().max()) <= 1e-4 * scale
    assert torch.equal(logits(attached), unmerged)  # read back from disk: the same tensors
    assert float((merged - base).abs().max()) > 100 * 1e-4 * scale  # and the adapter matters


def test_the_adapter_is_peft_format_and_peft_computes_the_same_logits(tiny_checkpoint, adapter_dir):
    peft = pytest.importorskip("peft", reason="HF PEFT (the test extras install it) loads gptj's adapter")
    import transformers

    folder, ours = adapter_dir
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    keys = set(load_file(str(folder / "adapter_model.safetensors")))
    assert "base_model.model.transformer.h.0.attn.q_proj.lora_A.weight" in keys and len(keys) == 2 * 6 * 2
    hf = transformers.GPTJForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    theirs = peft.PeftModel.from_pretrained(hf, str(folder)).eval()
    with torch.no_grad():
        got = theirs(PROMPT).logits[0].float()
    assert float((got - ours).abs().max()) <= 1e-4 * float(ours.abs().max())


def test_gptj_reads_an_adapter_peft_wrote(tiny_checkpoint, tmp_path):
    peft = pytest.importorskip("peft", reason="HF PEFT (the test extras install it) writes the adapter")
    import transformers

    hf = transformers.GPTJForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()
    wrapped = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "fc_out"],
                                                      lora_dropout=0.0, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        theirs = wrapped(PROMPT).logits[0].float()
    wrapped.save_pretrained(str(tmp_path / "peft"))
    model = load_model(tiny_checkpoint)
    adapter = read_adapter(tmp_path / "peft")
    assert adapter.config == LoRAConfig(rank=4, alpha=16, target_modules=("q_proj", "fc_out"))
    attach_adapter(model, adapter)
    assert float((logits(model) - theirs).abs().max()) <= 1e-4 * float(theirs.abs().max())


def test_an_int8_base_passes_gradients_to_every_adapter(tiny_checkpoint):
    """The quantized base has no backward of its own: x's gradient goes through its dequantized weight,
    so the first layer's adapter learns from a loss above the last layer's int8 linears."""
    model = load_model(tiny_checkpoint, quantize="int8")
    params = apply_lora(model, LoRAConfig(rank=4, target_modules=ALL))
    randomized(model)
    model(PROMPT).float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    assert all(not b.requires_grad for m in lora_modules(model).values() for b in m.base.parameters())
    # the dequantized weight's x-gradient is the float math's: against a float copy of the same int8 weights
    m = lora_modules(model)[(1, "fc_in")]
    x = torch.randn(3, m.in_features, requires_grad=True)
    m(x).sum().backward()
    w = m.base.dequantized_weight(torch.float32)
    x2 = x.detach().clone().requires_grad_(True)
    (x2 @ w.T + m.lora_B(m.lora_A(x2)) * m.scale).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, said", [
    ({"rank": 0}, "rank must be a positive integer"),
    ({"target_modules": ("lm_head",)}, "target_modules must be some of"),
    ({"dropout": 1.0}, "dropout must be in [0, 1)"),
])
def test_bad_lora_configs(bad, said):
    with pytest.raises(GptjError, match=None) as e:
        LoRAConfig(**bad)
    assert said in str(e.value)


def test_adapter_folders_gptj_cannot_run_are_one_line(adapter_dir):
    folder, _ = adapter_dir
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(GptjError, match="use_dora True is not supported"):
        read_adapter(folder)
    (folder / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(GptjError, match="peft_type must be LORA"):
        read_adapter(folder)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_an_adapter_holding_non_finite_values_is_refused(adapter_dir, tiny_checkpoint, capsys, value):
    """As the base loader refuses a checkpoint's: one line naming the file and the tensor (without
    the check `gptj generate --lora` runs it and every token it touches turns NaN)."""
    from safetensors.torch import save_file

    folder, _ = adapter_dir
    weights = folder / "adapter_model.safetensors"
    sd = load_file(weights)
    key = sorted(sd)[3]
    sd[key][1, 0] = value
    save_file(sd, weights, metadata={"format": "pt"})
    with pytest.raises(GptjError) as e:
        read_adapter(folder)
    assert str(e.value) == f"{weights}: tensor {key} has NaN or infinite values"
    code = main(["generate", "--model", str(tiny_checkpoint), "--lora", str(folder), "--prompt-ids", "1,2,3",
                 "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and f"{weights}: tensor {key} has NaN" in err, err


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_an_adapter_file_linked_out_of_its_folder_is_refused(adapter_dir, tmp_path, name):
    import os

    folder, _ = adapter_dir
    (tmp_path / "elsewhere").mkdir()
    os.replace(folder / name, tmp_path / "elsewhere" / name)
    (folder / name).symlink_to(tmp_path / "elsewhere" / name)
    with pytest.raises(GptjError, match=rf"^{folder / name}: leaves the model folder"):
        read_adapter(folder)


# --- gptj train with lora: ---------------------------------------------------------------------

def lora_config(tmp_path: Path, **changes) -> Path:
    """The shipped fine-tune (tiny preset, MLPerf-template summaries) with a LoRA on every linear."""
    cfg = yaml.safe_load((ROOT / "examples" / "train" / "finetune_summarization.yaml").read_text())
    for split in ("train", "eval"):
        cfg["data"][split]["summarization"] = str(ROOT / "examples" / "data" / Path(
            cfg["data"][split]["summarization"]).name)
    cfg.update(max_steps=10, eval_interval=10, log_interval=5, checkpoint_interval=5, out=str(tmp_path / "run"),
               lora={"rank": 8, "alpha": 32, "target_modules": list(ALL)}, optimizer={"lr": 1e-2},
               schedule={"warmup_steps": 2, "min_lr": 1e-4})
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_lora_fine_tune_trains_only_the_adapters_and_lowers_the_eval_loss(tmp_path, capsys):
    from gptj.train.config import load_config
    from gptj.train import model as run_model
    from gptj.train.trainer import evaluate_only

    path = lora_config(tmp_path)
    cfg = load_config(path)
    untrained = run_model.initial_model(cfg)  # the base the run starts from (seeded), its adapters at B = 0
    save_adapter(untrained, run_model.lora_config(cfg), tmp_path / "untrained")
    before = evaluate_only(cfg, tmp_path / "untrained", progress=False)
    assert main(["train", "--config", str(path), "--quiet"]) == 0
    assert "adapter, checkpoints and metrics.jsonl in" in capsys.readouterr().out
    run = tmp_path / "run"
    assert (run / "adapter_config.json").is_file() and not (run / "model.safetensors").exists()
    after = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line][-1]
    assert after["eval_loss"] < before["eval_loss"] - 0.05  # nats per target token (measured: about 0.12)
    # the base did not move: the trained adapter on the seeded base gives the run's own evaluation
    again = evaluate_only(cfg, progress=False)
    assert again["eval_loss"] == after["eval_loss"]
    base_sd = {k: v for k, v in untrained.state_dict().items() if "lora_" not in k}
    trained = run_model.initial_model(cfg)
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in base_sd.items())


def test_lora_resume_gives_the_adapter_of_an_uninterrupted_run(tmp_path):
    # one sequence a micro-step (exactness does not depend on the batch; two micro-steps keep the
    # shipped accumulation): a quarter of the shipped fine-tune's 4 x 2 sequences of 192 tokens a step
    short = {"max_steps": 4, "checkpoint_interval": 2, "eval_interval": 0, "batch_size": 1, "grad_accum_steps": 2}
    whole = lora_config(tmp_path / "a", **short)
    assert main(["train", "--config", str(whole), "--quiet"]) == 0
    split = lora_config(tmp_path / "b", **short)
    assert main(["train", "--config", str(split), "--max-steps", "2", "--quiet"]) == 0
    assert main(["train", "--config", str(split), "--resume", "--quiet"]) == 0
    a = load_file(str(tmp_path / "a" / "run" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "run" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_from_the_command_line_and_an_int8_base(tmp_path, capsys):
    # one sample a step: bfloat16 autocast is slow on a CPU without AVX512-BF16 (2 steps of 8 took 19 s)
    path = lora_config(tmp_path, lora=None, max_steps=2, eval_interval=2, checkpoint_interval=0, batch_size=1,
                       grad_accum_steps=1)
    assert main(["train", "--config", str(path), "--set", "lora.rank=4", "--set", "lora.base=int8", "--set",
                 "precision=bf16", "--quiet"]) == 0
    adapter = read_adapter(tmp_path / "run")
    assert adapter.config == LoRAConfig(rank=4) and adapter.config.target_modules == ("q_proj", "v_proj")
    assert any(float(b.abs().max()) > 0 for _, b in adapter.weights.values())  # B moved from zero


@pytest.mark.parametrize("sets, said", [
    (["lora.rank=4", "distributed=fsdp"], "lora with distributed: fsdp is not supported"),
    (["lora.rank=4", "lora.base=bfloat16"], "lora.base: bfloat16 computes in bfloat16: set precision: bf16"),
    (["lora.rank=4", "lora.target_modules=[lm_head]"], "lora.target_modules.0"),
])
def test_bad_lora_sections_are_one_line(tmp_path, capsys, sets, said):
    path = lora_config(tmp_path, lora=None)
    args = ["train", "--config", str(path), "--quiet"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err


def test_lora_linear_wraps_the_base_it_was_given(tiny_checkpoint):
    model = load_model(tiny_checkpoint)
    q = model.transformer.h[0].attn.q_proj
    apply_lora(model, LoRAConfig(rank=2))
    wrapped = model.transformer.h[0].attn.q_proj
    assert isinstance(wrapped, LoRALinear) and wrapped.base is q and not q.weight.requires_grad
    with pytest.raises(GptjError, match="carries LoRA adapters already"):
        apply_lora(model, LoRAConfig(rank=2))


def test_an_adapter_for_another_base_is_warned_of_in_one_line(adapter_dir, tiny_checkpoint, tmp_path, capsys):
    """adapter_config.json's base_model_name_or_path names the base it was trained on: applied to
    another (by path, or by name), `gptj generate --lora` says so in one warning line and runs; the
    same base (its path, or an HF id ending in its folder's name) gets none; shapes that do not fit
    are an error."""
    import shutil

    from gptj.lora import CONFIG_FILE, base_mismatch

    folder, _ = adapter_dir
    argv = ["generate", "--model", str(tiny_checkpoint), "--lora", str(folder), "--prompt-ids", "1,2,3",
            "--max-new-tokens", "2"]
    assert main(argv) == 0 and "warning" not in capsys.readouterr().err
    other = shutil.copytree(tiny_checkpoint, tmp_path / "another-model")
    assert main([*argv[:2], str(other), *argv[3:]]) == 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("gptj generate: warning: adapter") and str(tiny_checkpoint) in line and str(other) in line
    config = json.loads((folder / CONFIG_FILE).read_text())
    for named, warned in (("EleutherAI/another-model", False), ("EleutherAI/gpt-j-6b", True), (None, False)):
        (folder / CONFIG_FILE).write_text(json.dumps(config | {"base_model_name_or_path": named}))
        assert (base_mismatch(folder, other) is not None) is warned, named
    wide = tmp_path / "wide"  # another shape: an error, one line
    assert main(["init", "--preset", "small", "--out", str(wide)]) == 0
    capsys.readouterr()
    assert main([*argv[:2], str(wide), *argv[3:]]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_an_adapter_folds_into_the_weights_as_they_load(tiny_checkpoint, adapter_dir, tmp_path):
    """--lora at load (gptj.weights.peft: W + scale * B @ A in float32, rounded once to the dtype) gives
    merge_lora's weights on a float32 model, one rounding of the float32 sum in bfloat16, and under
    --tp each rank's slice of the merged whole model (the sliced adapter delta on the shard file)."""
    from gptj.parallel.context import SINGLE
    from gptj.parallel.shards import load_rank
    from gptj.parallel.tp import shard_state_dict
    from gptj.weights.checkpoint import Checkpoint
    from gptj.weights.peft import weight_name

    folder, _ = adapter_dir
    adapter = read_adapter(folder)
    whole = load_model(tiny_checkpoint)
    merge_lora(whole, adapter)
    loaded = SINGLE.load(str(tiny_checkpoint), torch.float32, "cpu", lora=str(folder))
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in whole.state_dict().items())
    base = load_model(tiny_checkpoint).state_dict()
    bf16 = SINGLE.load(str(tiny_checkpoint), torch.bfloat16, "cpu", lora=str(folder)).state_dict()
    name = weight_name(1, "fc_in")
    assert torch.equal(bf16[name], (base[name] + adapter.delta(name)).to(torch.bfloat16))
    assert not torch.equal(bf16[name], base[name].to(torch.bfloat16))

    assert main(["convert", str(tiny_checkpoint), "--out", str(tmp_path / "tp"), "--tp", "2", "--quiet"]) == 0
    for rank in range(2):
        checkpoint = Checkpoint.read(tmp_path / "tp", rank, 2, lora=str(folder))
        got = load_rank(checkpoint, rank, 2, torch.float32, "cpu").state_dict()
        want = shard_state_dict(whole.state_dict(), whole.config, rank, 2)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("change, said", [({"n_layer": 3}, "adapts layer 2; the model has 2"),
                                          ({"n_embd": 128, "n_inner": 256}, "the model's is")])
def test_an_adapter_for_another_shape_is_refused_before_any_weight_is_read(tiny_checkpoint, tmp_path, capsys,
                                                                           change, said):
    """An adapter trained on a model of other shapes does not fit: Checkpoint.read refuses it in one
    line, before a tensor of the base is read (once for the one process and every --tp rank)."""
    from gptj.config import get_preset
    from gptj.weights.checkpoint import Checkpoint
    from gptj.weights.io import random_state_dict, save_checkpoint

    cfg = get_preset("tiny").replace(**change)
    other = save_checkpoint(random_state_dict(cfg, seed=1), cfg, tmp_path / "other")
    model = load_model(other)
    config = LoRAConfig(rank=4, alpha=8.0, target_modules=ALL)
    apply_lora(model, config)
    folder = save_adapter(model, config, tmp_path / "adapter", base_model=str(other))
    with pytest.raises(GptjError, match=said):
        Checkpoint.read(tiny_checkpoint, lora=str(folder))
    code = main(["generate", "--model", str(tiny_checkpoint), "--lora", str(folder), "--prompt-ids", "1,2,3",
                 "--max-new-tokens", "2"])
    last = capsys.readouterr().err.splitlines()[-1]  # after the warning that it was trained on another base
    assert code == 1 and last.startswith("gptj generate: error: ") and said in last, last
