"""`gptj train` on a Llama checkpoint, with a `lora:` section and without: the data prepared with the
model's own tokenizer and llama3.1-8b's prompt; adapters written under PEFT's names for LlamaForCausalLM
(HF PEFT computes the same logits from them); every weight trained into an HF Llama folder (HF
transformers loads it; --resume exact); what gptj refuses in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from gptj.cli import main
from gptj.lora import read_adapter
from gptj.tokenizer import tokenizer_for_model
from gptj.train.data import TokenData
from gptj.weights.io import load_model

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def llama_tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llama") / "m"
    assert main(["init", "--preset", "llama-tiny", "--out", str(out)]) == 0
    return out


def config_file(tmp_path: Path, model_dir: Path, **changes) -> Path:
    """The shipped summarization fine-tune on `model`, a LoRA on every Llama linear, 8 steps."""
    cfg = yaml.safe_load((ROOT / "examples" / "train" / "finetune_summarization.yaml").read_text())
    for split in ("train", "eval"):
        cfg["data"][split]["summarization"] = str(ROOT / "examples" / "data" / Path(
            cfg["data"][split]["summarization"]).name)
    cfg.update(model={"checkpoint": str(model_dir)}, max_steps=8, eval_interval=8, log_interval=4,
               checkpoint_interval=0, out=str(tmp_path / "run"), batch_size=2, grad_accum_steps=1,
               optimizer={"lr": 1e-2},
               schedule={"warmup_steps": 2, "min_lr": 1e-3},
               lora={"rank": 4, "alpha": 16, "target_modules": list(LLAMA)})
    cfg["data"]["seq_len"] = 256
    cfg.update(changes)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "llama_lora.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_llama_lora_fine_tune_trains_peft_named_adapters_that_peft_reads(llama_tiny, tmp_path, capsys):
    from gptj.train.config import load_config
    from gptj.train.trainer import evaluate_only

    path = config_file(tmp_path, llama_tiny)
    untrained = evaluate_only(load_config(path), llama_tiny, progress=False)  # the base (an untrained adapter adds 0)
    assert main(["train", "--config", str(path), "--quiet"]) == 0
    run = tmp_path / "run"

    # the data: the model's own tokenizer and llama3.1-8b's prompt, BOS first, the loss on the summary only
    td = TokenData(run / "data" / "train")
    tok = tokenizer_for_model(llama_tiny)
    assert td.meta["tokenizer"] == str(llama_tiny) and td.meta["vocab_size"] == tok.vocab_size
    ids, input_mask, loss_mask = td.get([0])
    n = int(input_mask[0].sum())
    assert ids[0, 0] == tok.bos_token_id and ids[0, n - 1] == tok.eos_token_id
    prompt = tok.decode(ids[0, :int(loss_mask[0].argmax())].tolist())
    assert "Summarize the following news article in 128 tokens." in prompt and prompt.rstrip().endswith("Summary:")

    # the adapters: PEFT's names for LlamaForCausalLM, every linear of every layer, the loss lower
    layers = json.loads((llama_tiny / "config.json").read_text())["num_hidden_layers"]
    keys = set(load_file(str(run / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in keys and len(keys) == 2 * 7 * layers
    config = json.loads((run / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(LLAMA) and config["base_model_name_or_path"] == str(llama_tiny)
    trained = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line][-1]
    assert trained["eval_loss"] < untrained["eval_loss"] - 0.05  # nats per target token
    # --eval-only reads the adapter back onto the base (PEFT's Llama names in, gptj's modules out): the run's own figure
    assert evaluate_only(load_config(path), progress=False)["eval_loss"] == trained["eval_loss"]

    # gptj reads it back (merged at load) and HF PEFT computes the same logits from the same folder
    adapter = read_adapter(run)
    assert adapter.layout.arch == "llama" and any(float(b.abs().max()) > 0 for _, b in adapter.weights.values())
    ours_model = load_model(llama_tiny, adapter=adapter)
    prompt_ids = torch.tensor([ids[0, :32].tolist()])
    with torch.no_grad():
        ours = ours_model(prompt_ids)[0].float()
        base = load_model(llama_tiny)(prompt_ids)[0].float()
    assert not torch.allclose(ours, base)  # the adapter moves the logits
    peft = pytest.importorskip("peft", reason="HF PEFT (the test extras install it) loads gptj's adapter")
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(str(llama_tiny), dtype=torch.float32).eval()
    theirs = peft.PeftModel.from_pretrained(hf, str(run)).eval()
    with torch.no_grad():
        got = theirs(prompt_ids).logits[0].float()
    # float32 both ways; the merged weight (W + s B A, rounded once) against PEFT's unmerged sum
    assert float((got - ours).abs().max()) <= 1e-4 * float(ours.abs().max())


def test_gptjs_linears_on_a_llama_are_refused_in_one_line(llama_tiny, tmp_path, capsys):
    path = config_file(tmp_path, llama_tiny, lora={"rank": 4, "target_modules": ["q_proj", "fc_in"]})
    assert main(["train", "--config", str(path), "--quiet"]) != 0
    err = capsys.readouterr().err.strip()
    assert "LoRA target_modules ['fc_in'] are not llama's linears" in err and len(err.splitlines()) == 1
    path = config_file(tmp_path / "preset", llama_tiny, model={"preset": "llama-tiny"})
    assert main(["train", "--config", str(path), "--quiet"]) != 0
    err = capsys.readouterr().err.strip()
    assert "llama-tiny is a Llama preset: write it with gptj init --preset llama-tiny" in err
    assert len(err.splitlines()) == 1


def test_every_weight_of_a_llama_trains_resumes_exactly_and_saves_a_folder_hf_and_gptj_run(llama_tiny, tmp_path):
    """Without `lora:` every weight trains: the loss falls, the final folder is an HF Llama folder
    (HF's tensor names, the base's tokenizer and generation settings beside them) that HF transformers
    and gptj load to the same logits, and a run stopped and resumed gives the uninterrupted run's
    weights bit for bit (the checkpoints' HF names read back as the model's)."""
    short = {"lora": None, "max_steps": 4, "eval_interval": 0, "checkpoint_interval": 2, "log_interval": 1,
             "batch_size": 1, "grad_accum_steps": 2, "optimizer": {"lr": 3e-3}}
    whole = config_file(tmp_path / "a", llama_tiny, **short)
    assert main(["train", "--config", str(whole), "--quiet"]) == 0
    run = tmp_path / "a" / "run"
    log = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert log[-1]["loss"] < log[0]["loss"]
    names = set(load_file(str(run / "model.safetensors")))
    assert "model.layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("transformer.") for n in names)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (run / name).read_bytes() == (llama_tiny / name).read_bytes()
    assert json.loads((run / "config.json").read_text())["model_type"] == "llama"

    split = config_file(tmp_path / "b", llama_tiny, **short)
    assert main(["train", "--config", str(split), "--max-steps", "2", "--quiet"]) == 0
    assert main(["train", "--config", str(split), "--resume", "--quiet"]) == 0
    a, b = load_file(str(run / "model.safetensors")), load_file(str(tmp_path / "b" / "run" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    base = load_file(str(llama_tiny / "model.safetensors"))
    assert not torch.equal(a["model.layers.0.mlp.down_proj.weight"], base["model.layers.0.mlp.down_proj.weight"])

    prompt = torch.tensor([[0, 17, 300, 2, 9, 41, 7, 100, 12]])
    with torch.no_grad():
        ours = load_model(run)(prompt)[0].float()
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(str(run), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(prompt).logits[0].float()
    assert float((theirs - ours).abs().max()) <= 1e-4 * float(ours.abs().max())  # float32 both, summed differently


def test_prepare_data_wraps_articles_in_llamas_prompt_with_its_tokenizer(llama_tiny, tmp_path, capsys):
    source = ROOT / "examples" / "data" / "summaries_eval.json"
    out = tmp_path / "pairs"
    assert main(["prepare-data", "summarization", str(source), "--out", str(out), "--seq-len", "256",
                 "--tokenizer", str(llama_tiny), "--prompt", "llama", "--quiet"]) == 0
    td = TokenData(out)
    tok = tokenizer_for_model(llama_tiny)
    ids, input_mask, loss_mask = td.get([0])
    start = int(loss_mask[0].argmax())
    text = tok.decode(ids[0, :start].tolist())
    assert ids[0, 0] == tok.bos_token_id and text.count("Summarize the following news article in 128 tokens.") == 1
    assert tok.bos_token_id not in ids[0, 1:int(input_mask[0].sum())].tolist()  # one BOS: the response has none
    gptj = tmp_path / "gptj-pairs"  # the same file with gptj-99's prompt (the default) differs
    assert main(["prepare-data", "summarization", str(source), "--out", str(gptj), "--seq-len", "256",
                 "--tokenizer", str(llama_tiny), "--quiet"]) == 0
    first = TokenData(gptj).get([0])[0][0].tolist()
    assert "Summarize the following news article in 128 tokens." not in tok.decode(first)


def test_the_llama_8b_lora_example_loads_and_states_its_trainable_count(llama_tiny):
    from gptj.train.config import load_config

    path = ROOT / "examples" / "train" / "llama31_8b_lora.yaml"
    cfg = load_config(path, [f"model.checkpoint={llama_tiny}"])
    assert (cfg.lora.rank, cfg.lora.base, cfg.precision, cfg.data.seq_len) == (8, "bfloat16", "bf16", 2048)
    assert cfg.activation_checkpointing and all(f.is_file() for f in cfg.data.train.files())
    # its comment's count: rank x (in + out) for q_proj (4,096 -> 4,096) and v_proj (4,096 -> 8 x 128), 32 layers
    n = 32 * cfg.lora.rank * ((4096 + 4096) + (4096 + 1024))
    text = path.read_text()
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and f"{n / 1e6:.1f} M trainable" in text
    assert f"AdamW's\n# state {16 * n / 1e6:.0f} MB" in text  # float32 weight, gradient and two moments


def _train_job(rank, world, payload):  # (module level: run_parallel's ranks import it)
    from gptj.train.config import load_config
    from gptj.train.trainer import train

    train(load_config(payload), progress=False)


@pytest.mark.parametrize("mode, lora", [("fsdp", None),
                                        ("ddp", {"rank": 4, "alpha": 16, "target_modules": ["q_proj", "down_proj"]})],
                         ids=["fsdp", "ddp-lora"])
def test_a_llama_trains_over_two_ranks_as_in_one_process(llama_tiny, tmp_path, mode, lora):
    """Two ranks of one sequence a step (FSDP: a unit per Llama block; DDP with LoRA adapters) take the
    losses of one process of two sequences a step, to float32 rounding (LOSS_RTOL, as test_train's
    GPT-J runs), and write what one process writes (a Llama folder; an adapter)."""
    from gptj.parallel.launch import run_parallel
    from test_train import LOSS_RTOL

    common = {"lora": lora, "max_steps": 2, "eval_interval": 0, "checkpoint_interval": 0, "log_interval": 1,
              "grad_clip": None, "optimizer": {"lr": 3e-3}, "grad_accum_steps": 1}
    one = config_file(tmp_path / "one", llama_tiny, batch_size=2, **common)
    assert main(["train", "--config", str(one), "--quiet"]) == 0
    two = config_file(tmp_path / "two", llama_tiny, batch_size=1, distributed=mode, **common)
    run_parallel(_train_job, 2, str(two))

    def losses(run: Path) -> list[float]:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines if '"loss"' in line]

    assert losses(tmp_path / "two" / "run") == pytest.approx(losses(tmp_path / "one" / "run"), rel=LOSS_RTOL)
    assert len(losses(tmp_path / "two" / "run")) == 2
    name = "model.safetensors" if lora is None else "adapter_model.safetensors"
    written = [set(load_file(str(tmp_path / run / "run" / name))) for run in ("one", "two")]
    assert written[0] == written[1]
