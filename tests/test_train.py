"""Training: loss falls, fine-tuning counts only the response, --resume equals an uninterrupted run,
2 DDP ranks equal one process, the result loads in gptj generate and HF transformers, bad configs
are one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from gptj.cli import main
from gptj.config import get_preset
from gptj.errors import GptjError
from gptj.train.config import load_config
from gptj.train.trainer import Sampler, _loss_sum, lr_at, train
from gptj.weights.io import random_state_dict

ROOT = Path(__file__).resolve().parent.parent
SENTENCES = ["the red fox runs to the old barn.", "a small bird sings in the tall tree.",
             "the old man walks his brown dog.", "two cats sleep on the warm mat."]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "train.txt").write_text(" ".join(SENTENCES[i % 4] for i in range(400)))
    (folder / "eval.txt").write_text(" ".join(SENTENCES[(i + 1) % 4] for i in range(40)))
    return folder


def write_config(path: Path, **changes) -> Path:
    base = {"model": {"preset": "tiny"},
            "data": {"train": {"text": [str(changes.pop("train"))]}, "seq_len": 32},
            "optimizer": {"lr": 3e-3, "weight_decay": 0.01}, "schedule": {"warmup_steps": 2},
            "batch_size": 4, "max_steps": 6, "log_interval": 1, "seed": 3, "out": str(path.parent / "run")}
    for key, value in changes.items():
        node = base
        *parents, last = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    path.write_text(yaml.safe_dump(base))
    return path


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


U32 = 2.0**-24  # float32 unit roundoff
# The tolerance of a float32 training gradient against the float64 gradient, relative to the
# tensor's largest entry. A float32 sum of n terms is off by at most (n - 1) u sum|terms|
# (Higham, Accuracy and Stability, 3.1). The longest reduction in the tiny model's backward is
# over the vocabulary (dlogits @ lm_head: n = 50,400, 3.0e-3 of the terms' size); the others are
# over <= 256 features or <= 128 rows (<= 1.5e-5 each, ~20 of them chained: 3e-4). The float32
# side is then off by <= 3.3e-3 and the two runs compared by <= 6.6e-3 of the terms' size, which
# here is that of the tensor's largest entry (random init: no large cancelling terms). A logic
# error (a micro-batch or rank missing, counted twice, scaled by its own token count) moves a
# gradient by a sizeable fraction of itself, far beyond 1e-2.
GRAD_TOL = 1e-2
# The logged loss of one process against that of two ranks: the same <= 128 positive per-token
# cross-entropies summed in another order (<= 2 (n - 1) u = 1.5e-5 relative), each from logits
# rounded differently (forward reductions <= 256 long, ~20 chained: <= 3e-4 of the logits' size;
# a cross-entropy moves by <= 2 max|logit error|, and the tiny model's logits stay below its
# losses of 5-11 over these few steps): <= 6e-4 relative. Two ranks that logged their own
# halves' loss, or did not add them, are off by far more.
LOSS_RTOL = 1e-3


def step_gradients(cfg, out: Path) -> dict[int, tuple[dict, dict]]:
    """{step k: (the gradient AdamW was given at step k, the weights it was computed at)}, read
    from the run's checkpoints step-(k-1) and step-k (it needs checkpoint_interval: 1 and
    grad_clip: null). AdamW keeps m_k = m_(k-1) + (1 - b1) (g_k - m_(k-1)), so
    g_k = (m_k - b1 m_(k-1)) / (1 - b1) (in float64: off by ~20 u of the largest |g|)."""
    beta1 = cfg.optimizer.betas[0]
    from gptj.weights.io import model_from_state_dict

    start = random_state_dict(get_preset(cfg.model.preset), seed=cfg.seed, std=cfg.model.init_std)
    params = list(model_from_state_dict(get_preset(cfg.model.preset), dict(start)).named_parameters())
    names = [k for k, v in params if v.dim() >= 2] + [k for k, v in params if v.dim() < 2]  # _param_groups' order
    saved = {}
    for folder in sorted((out / "checkpoints").iterdir()):
        state = torch.load(folder / "trainer_state.pt", weights_only=True)
        by_key = state["optimizer"]["state"]
        m = {(names[k] if isinstance(k, int) else k): v["exp_avg"].double() for k, v in by_key.items()}
        saved[state["step"]] = (m, weights(folder))
    found = {}
    for k in sorted(saved):
        before_m, before_w = saved[k - 1] if k > 1 else ({n: 0.0 for n in names}, start)
        if k > 1 and k - 1 not in saved:
            continue
        m = saved[k][0]
        found[k] = ({n: (m[n] - beta1 * before_m[n]) / (1 - beta1) for n in names}, before_w)
    return found


def float64_gradient(cfg, data_folder: Path, state: dict, step: int, world: int) -> dict[str, torch.Tensor]:
    """The gradient of step `step`'s global batch (the trainer's loss: summed target-token
    cross-entropy over the batch's target count) at weights `state`, clipped to the global norm
    cfg.grad_clip as torch's clip_grad_norm_ does, all in float64."""
    from gptj.train.data import TokenData
    from gptj.train.trainer import _batch
    from gptj.weights.io import model_from_state_dict

    td = TokenData(data_folder)
    n = cfg.batch_size * cfg.grad_accum_steps * world
    ids, input_mask, loss_mask = _batch(td, Sampler(len(td), cfg.seed)(range((step - 1) * n, step * n)),
                                        torch.device("cpu"))
    model = model_from_state_dict(get_preset(cfg.model.preset), {k: v.double() for k, v in state.items()})
    logits = model(ids, attention_mask=input_mask)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = torch.where(loss_mask[:, 1:], ids[:, 1:], -100)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    (loss / loss_mask[:, 1:].sum()).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def assert_exact_gradients(cfg, out: Path, steps: int, world: int = 1) -> None:
    """Each step's float32 gradient equals the float64 one of that step's global batch at the
    weights it was taken at, within GRAD_TOL of the tensor's largest entry, and so does the
    logged gradient norm (relative: a norm has no cancellation). With grad_clip: null, so that
    a gradient scaled wrongly shows (clipping would rescale it to the same norm)."""
    assert cfg.grad_clip is None
    found = step_gradients(cfg, out)
    assert sorted(found) == list(range(1, steps + 1)), sorted(found)
    logged = {m["step"]: m["grad_norm"] for m in metrics(out) if "grad_norm" in m}
    for step, (grad, before) in found.items():
        exact = float64_gradient(cfg, out / "data" / "train", before, step, world)
        assert grad.keys() == exact.keys()
        norm = float(sum(g.norm() ** 2 for g in exact.values())) ** 0.5
        assert logged[step] == pytest.approx(norm, rel=GRAD_TOL)
        for name, g in exact.items():
            err, size = float((grad[name] - g).abs().max()), float(g.abs().max())
            assert err <= GRAD_TOL * size, f"step {step} {name}: off by {err:.3g}, largest entry {size:.3g}"


def test_loss_falls_clearly_on_a_repetitive_corpus(corpus, tmp_path):
    # 50 steps: the mean loss of steps 41-50 is about 0.3 (seeds 3 and 5 measured), a third of the
    # 0.1 x ~9.0 (steps 1-10) asserted; the corpus is a fixed cycle of 4 sentences, so its floor is ~0
    cfg = load_config(write_config(tmp_path / "c.yaml", train=corpus / "train.txt", max_steps=50, batch_size=4,
                                   log_interval=10, eval_interval=25, optimizer={"lr": 5e-3, "weight_decay": 0.01},
                                   schedule={"warmup_steps": 5, "min_lr": 5e-4},
                                   data__eval={"text": [str(corpus / "eval.txt")]}))
    last = train(cfg, progress=False)
    log = [m for m in metrics(Path(cfg.out)) if "loss" in m]
    assert log[0]["loss"] > 6.0  # random init: about ln(50400) = 10.8 at the first step
    assert last["loss"] < 0.1 * log[0]["loss"], log
    evals = [m for m in metrics(Path(cfg.out)) if "eval_loss" in m]
    assert [m["step"] for m in evals] == [25, 50]
    assert evals[-1]["eval_ppl"] < evals[0]["eval_ppl"] and evals[-1]["eval_ppl"] == pytest.approx(
        math.exp(evals[-1]["eval_loss"]))
    assert all(m["tokens_per_s"] > 0 and m["lr"] > 0 for m in log)
    assert (Path(cfg.out) / "config.json").is_file() and (Path(cfg.out) / "tokenizer.json").is_file()


def test_finetuning_loss_counts_only_the_response(tmp_path):
    from gptj.mlperf.dataset import Example, build_prompt
    from gptj.tokenizer import load_tokenizer
    from gptj.train.data import TokenData, prepare_summarization

    example = {"instruction": "Summarize the following news article:",
               "input": "The town library opened a new reading room on Monday.", "output": "A library grew."}
    (tmp_path / "s.json").write_text(json.dumps([example]))
    prepare_summarization(tmp_path / "s.json", tmp_path / "pairs", seq_len=96, progress=False)
    td = TokenData(tmp_path / "pairs")
    ids, input_mask, loss_mask = (torch.from_numpy(a) for a in td.get([0]))
    tok = load_tokenizer()
    prompt = tok.encode(build_prompt(Example(**example)))
    response = tok.encode(" " + example["output"]) + [tok.eos_token_id]
    assert ids[0, :len(prompt) + len(response)].tolist() == prompt + response
    assert loss_mask[0].nonzero().flatten().tolist() == list(range(len(prompt), len(prompt) + len(response)))

    class Fixed(torch.nn.Module):  # logits as a leaf tensor, to read the loss's gradient on them
        def __init__(self):
            super().__init__()
            self.logits = torch.nn.Parameter(torch.randn(1, 96, 50400, generator=torch.Generator().manual_seed(0)))

        def forward(self, ids, attention_mask=None):
            return self.logits

    model = Fixed()
    loss = _loss_sum(model, ids, input_mask.long(), loss_mask, "float32", torch.device("cpu"))
    # by hand: the cross-entropy of each response token (and EOS) given the position before it
    logp = torch.log_softmax(model.logits[0].detach(), -1)
    want = -sum(logp[t - 1, ids[0, t]] for t in range(len(prompt), len(prompt) + len(response)))
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-5)
    loss.backward()
    touched = model.logits.grad[0].abs().sum(-1).nonzero().flatten().tolist()
    assert touched == list(range(len(prompt) - 1, len(prompt) + len(response) - 1))  # no prompt position


RESUME_RUN = {"max_steps": 4, "checkpoint_interval": 1, "keep_checkpoints": 3}


@pytest.fixture(scope="module")
def stopped_at_3(corpus, tmp_path_factory):
    """An uninterrupted run of 4 steps, and one stopped after step 3 (checkpoints 1, 2 and 3)."""
    folder = tmp_path_factory.mktemp("resume")
    train(load_config(write_config(folder / "a.yaml", train=corpus / "train.txt", out=str(folder / "straight"),
                                   **RESUME_RUN)), progress=False)
    train(load_config(write_config(folder / "b.yaml", train=corpus / "train.txt", out=str(folder / "split"),
                                   **RESUME_RUN)), stop_after=3, progress=False)
    return folder


def test_resume_gives_the_weights_of_an_uninterrupted_run(corpus, stopped_at_3, tmp_path):
    # the uninterrupted run: stopped_at_3's (4 steps; its checkpoints every step change no weight)
    straight = stopped_at_3 / "straight"
    split = load_config(write_config(tmp_path / "b.yaml", train=corpus / "train.txt", max_steps=4,
                                     out=str(tmp_path / "split")))
    train(split, stop_after=2, progress=False)
    assert [p.name for p in (tmp_path / "split" / "checkpoints").iterdir()] == ["step-0000002"]
    # stopped early, the model of step 2 is in the output folder too (as `gptj train --max-steps` says)
    stopped = weights(tmp_path / "split")
    assert all(torch.equal(stopped[k], v) for k, v in weights(tmp_path / "split" / "checkpoints" / "step-0000002").items())
    with pytest.raises(GptjError, match="already holds a run"):
        train(split, progress=False)
    train(split, resume=True, progress=False)
    a, b = weights(straight), weights(tmp_path / "split")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [m["loss"] for m in metrics(tmp_path / "split")] == [m["loss"] for m in metrics(straight)]
    # a changed optimizer is refused on resume
    changed = load_config(write_config(tmp_path / "c.yaml", train=corpus / "train.txt", max_steps=4,
                                       out=str(tmp_path / "split"), optimizer={"lr": 1e-2}))
    with pytest.raises(GptjError, match="optimizer"):
        train(changed, resume=True, progress=False)


def _garbage_state(step: Path) -> None:
    (step / "trainer_state.pt").write_bytes(b"\x80\x04not a trainer state" * 50)


def _truncated_model(step: Path) -> None:
    f = step / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _wrong_shape_model(step: Path) -> None:
    from safetensors.torch import save_file

    sd = weights(step)
    name = next(n for n, t in sd.items() if t.dim() == 2)
    sd[name] = sd[name][:, :-1].contiguous()
    save_file(sd, str(step / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("damage, said", [(_garbage_state, "trainer_state.pt: not a trainer state"),
                                          (_truncated_model, "model.safetensors: not a readable safetensors"),
                                          (_wrong_shape_model, "model.safetensors: 'lm_head.weight' has shape [50400, 63]")],
                         ids=["garbage-state", "truncated-model", "wrong-shape-model"])
def test_resume_skips_a_damaged_checkpoint_or_refuses_in_one_line(corpus, stopped_at_3, tmp_path, capsys, damage,
                                                                  said):
    """The newest checkpoint damaged: --resume warns (one line, naming it and the file) and goes on
    from the one before, to the weights of an uninterrupted run; with no intact one, a one-line
    error naming the file, exit 1 (never torch's advice to unpickle with weights_only=False)."""
    import shutil

    shutil.copytree(stopped_at_3 / "split", tmp_path / "split")
    path = write_config(tmp_path / "b.yaml", train=corpus / "train.txt", out=str(tmp_path / "split"), **RESUME_RUN)
    damage(tmp_path / "split" / "checkpoints" / "step-0000003")
    shutil.copytree(tmp_path / "split", tmp_path / "only")
    capsys.readouterr()

    assert main(["train", "--config", str(path), "--resume", "--quiet"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warning" in err[0] and "skips step-0000003" in err[0] and "from step-0000002" in err[0]
    assert said in err[0] and "weights_only" not in err[0], err
    a, b = weights(stopped_at_3 / "straight"), weights(tmp_path / "split")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [m["loss"] for m in metrics(tmp_path / "split")] == [m["loss"] for m in metrics(stopped_at_3 / "straight")]

    for older in ("step-0000001", "step-0000002"):  # only the damaged checkpoint left
        shutil.rmtree(tmp_path / "only" / "checkpoints" / older)
    only = write_config(tmp_path / "c.yaml", train=corpus / "train.txt", out=str(tmp_path / "only"), **RESUME_RUN)
    assert main(["train", "--config", str(only), "--resume", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no intact checkpoint" in err[0] and "step-0000003" in err[0], err
    assert said in err[0] and "weights_only" not in err[0] and "Traceback" not in err[0], err


def test_a_full_disk_while_saving_a_checkpoint_is_one_line_and_keeps_the_older_ones(corpus, stopped_at_3, tmp_path,
                                                                                    capsys, monkeypatch):
    """The trainer state of step 3 runs out of space half-way (as torch.save into a full disk does):
    one line naming the checkpoint and the cause, exit 1, no step-3 folder or temporary folder left,
    steps 1 and 2 as an uninterrupted run wrote them, and --resume goes on from step 2 to its weights."""
    import errno
    import io
    import os

    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if ".step-0000003." not in str(getattr(f, "name", f)):
            return real_save(obj, f, *args, **kwargs)
        buf = io.BytesIO()
        real_save(obj, buf)
        half = buf.getvalue()[: len(buf.getvalue()) // 2]
        if hasattr(f, "write"):
            f.write(half)
            f.flush()
        else:
            Path(f).write_bytes(half)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", save)
    run = tmp_path / "run"
    path = write_config(tmp_path / "b.yaml", train=corpus / "train.txt", out=str(run), **RESUME_RUN)
    capsys.readouterr()
    assert main(["train", "--config", str(path), "--quiet"]) == 1
    err = capsys.readouterr().err
    step3 = run / "checkpoints" / "step-0000003"
    assert err.count("\n") == 1 and f"{step3}: cannot write: no space left on device" in err, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-0000001", "step-0000002"]
    for step in ("step-0000001", "step-0000002"):
        a, b = weights(run / "checkpoints" / step), weights(stopped_at_3 / "split" / "checkpoints" / step)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    monkeypatch.setattr(torch, "save", real_save)
    assert main(["train", "--config", str(path), "--resume", "--quiet"]) == 0
    a, b = weights(stopped_at_3 / "straight"), weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    """(config, output folder) of 3 steps of 4 sequences in one process, grad_clip: null, a checkpoint
    every step: the plain run the gradient checks read, and the one the data-parallel runs equal."""
    folder = tmp_path_factory.mktemp("one")
    cfg = load_config(write_config(folder / "one.yaml", train=corpus / "train.txt", max_steps=3, batch_size=4,
                                   grad_clip=None, checkpoint_interval=1, keep_checkpoints=3, out=str(folder / "one")))
    train(cfg, progress=False)
    return cfg, folder / "one"


def test_grad_accumulation_and_activation_checkpointing_change_nothing(corpus, one_process, tmp_path):
    """Plain, two micro-steps of half the batch, and recomputed activations: each step's gradient
    is the exact (float64) gradient of the same global batch, to float32 rounding (GRAD_TOL).
    The gradients, not the weights, are compared: AdamW divides each update by the gradient's
    own size, so a weight whose gradient is near zero may move by up to 2 lr on a rounding
    difference (3.5e-6 in 1 of 16,384 weights after 3 steps on an AVX-512 CPU)."""
    assert_exact_gradients(*one_process, steps=3)  # plain
    runs = {"accum": {"batch_size": 2, "grad_accum_steps": 2}, "ckpt": {"activation_checkpointing": True}}
    for name, extra in runs.items():
        cfg = load_config(write_config(tmp_path / f"{name}.yaml", train=corpus / "train.txt", max_steps=3,
                                       grad_clip=None, checkpoint_interval=1, keep_checkpoints=3,
                                       out=str(tmp_path / name), **extra))
        train(cfg, progress=False)
        assert_exact_gradients(cfg, tmp_path / name, steps=3)


def _ddp_job(rank, world, payload):
    cfg = load_config(payload["config"])
    if payload.get("split"):  # stop after step 2, then --resume
        train(cfg, stop_after=2, progress=False)
        train(cfg, resume=True, progress=False)
    else:
        train(cfg, progress=False)
    return None


@pytest.mark.parametrize("mode, offload, split", [("ddp", False, False), ("fsdp", True, True)],
                         ids=["ddp", "fsdp-stopped-and-resumed"])
def test_two_ranks_give_the_update_of_one_process(corpus, one_process, tmp_path, mode, offload, split):
    from gptj.parallel.launch import run_parallel

    _, one = one_process  # 3 steps of 4 sequences
    two = load_config(write_config(tmp_path / "two.yaml", train=corpus / "train.txt", max_steps=3, batch_size=2,
                                   distributed=mode, cpu_offload=offload, grad_clip=None, checkpoint_interval=1,
                                   keep_checkpoints=3, out=str(tmp_path / "two")))
    run_parallel(_ddp_job, 2, {"config": str(tmp_path / "two.yaml"), "split": split})
    assert_exact_gradients(two, tmp_path / "two", steps=3, world=2)
    assert [m["loss"] for m in metrics(tmp_path / "two")] == pytest.approx(
        [m["loss"] for m in metrics(one)], rel=LOSS_RTOL)


def test_trained_model_loads_in_generate_and_hf(stopped_at_3, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out = stopped_at_3 / "straight"  # the model `train` wrote after 4 steps (read only here)
    assert main(["generate", "--model", str(out), "--prompt", "the red fox", "--max-new-tokens", "5", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 5
    from gptj.weights.io import load_model

    ours = load_model(out)
    hf = transformers.GPTJForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    ids = torch.tensor([[1, 2, 3, 500, 9000, 42]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)
    # and the MLPerf harness runs it
    assert main(["mlperf", "--model", str(out), "--max-examples", "1", "--max-new-tokens", "4", "--min-new-tokens",
                 "1", "--num-beams", "1", "--log-dir", str(tmp_path / "mlperf"), "--quiet"]) == 0
    assert (tmp_path / "mlperf" / "accuracy.json").is_file()


def test_under_torchrun_two_ranks_train_data_parallel(corpus, one_process, tmp_path):
    """The README's `torchrun --nproc-per-node 2 -m gptj.cli train ...` (the process group from
    torchrun's environment) gives the weights of one process with the same global batch."""
    import subprocess
    import sys

    # imported here, not at the top: test_serve_cli pulls in the serving stack (openai, ...), which
    # every rank _ddp_job spawns would import again with this module (~1.7 s of CPU each)
    from test_serve_cli import free_port

    _, one = one_process  # 3 steps: its first 2 are those of a 2-step run (max_steps moves no lr of
    # steps 1-2: both are in the 2-step warm-up, lr (step + 1) / 2, and step 2's loss is taken at the
    # weights of step 1's update)
    two = load_config(write_config(tmp_path / "two.yaml", train=corpus / "train.txt", max_steps=2, batch_size=2,
                                   grad_clip=None, checkpoint_interval=1, out=str(tmp_path / "two")))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), "-m", "gptj.cli", "train", "--config",
                           str(tmp_path / "two.yaml"), "--quiet"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("trained to") == 1  # rank 0 reports
    assert_exact_gradients(two, tmp_path / "two", steps=2, world=2)
    assert [m["loss"] for m in metrics(tmp_path / "two")] == pytest.approx(
        [m["loss"] for m in metrics(one)][:2], rel=LOSS_RTOL)


def test_shipped_example_configs_are_valid_and_point_at_shipped_data(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # from any folder: a config's data paths are relative to the config
    for name in ("pretrain_tiny.yaml", "finetune_summarization.yaml"):
        cfg = load_config(ROOT / "examples" / "train" / name)
        assert cfg.model.preset == "tiny" and cfg.data.eval is not None
        assert all(f.is_file() and f.is_relative_to(ROOT / "examples" / "data") for f in cfg.data.train.files())


def test_gptj6b_lora_config_loads(tiny_checkpoint):
    cfg = load_config(ROOT / "examples" / "train" / "gptj6b_lora.yaml", [f"model.checkpoint={tiny_checkpoint}"])
    assert (cfg.lora.rank, cfg.lora.base, cfg.precision, cfg.data.seq_len) == (8, "bfloat16", "bf16", 2048)
    # its comment's trainable count: rank x (in + out) per adapted 4,096 x 4,096 linear, 2 per layer, 28 layers
    n = 28 * len(cfg.lora.target_modules) * cfg.lora.rank * (4096 + 4096)
    assert f"{n / 1e6:.1f} M trainable" in (ROOT / "examples" / "train" / "gptj6b_lora.yaml").read_text()


@pytest.mark.parametrize("name", ["gptj6b_pretrain.yaml", "gptj6b_finetune.yaml"])
def test_gptj6b_configs_load_and_state_their_memory(tiny_checkpoint, name):
    """The 6B configs as files: they load (the fine-tune's checkpoint given with --set, as a user
    would after `gptj convert`), run GPT-J's shape with FSDP, bf16 and activation checkpointing, and
    the training-state memory their comments give is 16 bytes per parameter of gptj-6b."""
    import math

    from gptj.weights.io import expected_shapes

    path = ROOT / "examples" / "train" / name
    cfg = load_config(path, [f"model.checkpoint={tiny_checkpoint}"] if "finetune" in name else [])
    assert (cfg.data.seq_len, cfg.precision, cfg.activation_checkpointing, cfg.distributed) == (2048, "bf16", True,
                                                                                                   "fsdp")
    assert cfg.data.eval is not None and all(f.is_file() for f in cfg.data.train.files())
    n = sum(math.prod(shape) for shape in expected_shapes(get_preset("gptj-6b")).values())
    text = path.read_text()
    assert f"{n:,} parameters" in text and f"{16 * n / 1e9:.1f} GB of" in text and f"{16 * n / 8e9:.1f} GB" in text
    if "pretrain" in name:  # mesh-transformer-jax's 6B_roto_256.json: 512 sequences per step on 8 ranks
        assert cfg.model.preset == "gptj-6b" and cfg.batch_size * cfg.grad_accum_steps * 8 == 512


def test_config_paths_are_relative_to_the_config_and_set_paths_to_the_working_directory(monkeypatch, tmp_path,
                                                                                          capsys, corpus):
    """`gptj train --config elsewhere/c.yaml` finds the data the file names beside it; a path
    given with --set (and --out) is the user's, relative to where they are."""
    (tmp_path / "project" / "data").mkdir(parents=True)
    (tmp_path / "project" / "data" / "train.txt").write_text((corpus / "train.txt").read_text())
    (tmp_path / "project" / "c.yaml").write_text(yaml.safe_dump(
        {"model": {"preset": "tiny"}, "data": {"train": {"text": ["data/train.txt"]}, "seq_len": 32},
         "batch_size": 2, "max_steps": 4, "log_interval": 1}))
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "mine.txt").write_text((corpus / "eval.txt").read_text())
    monkeypatch.chdir(tmp_path / "here")
    cfg = load_config("../project/c.yaml", ["data.eval.text=[mine.txt]"])
    assert cfg.data.train.files() == [tmp_path / "project" / "data" / "train.txt"]
    assert [f.resolve() for f in cfg.data.eval.files()] == [tmp_path / "here" / "mine.txt"]
    # the CLI: stopped early with --max-steps, the model is where the message says, and loads
    assert main(["train", "--config", "../project/c.yaml", "--out", "run", "--max-steps", "2", "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "stopped at step 2 of 4" in said and "model, checkpoints and metrics.jsonl in run" in said
    assert main(["generate", "--model", "run", "--prompt", "the red fox", "--max-new-tokens", "3", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
    assert not (tmp_path / "project" / "run").exists()  # --out: the working directory's


@pytest.mark.parametrize("name, steps", [("pretrain_tiny.yaml", 12), ("finetune_summarization.yaml", 8)])
def test_the_shipped_examples_run(monkeypatch, tmp_path, capsys, name, steps):
    """As shipped (only stopped early, logging every step, and written elsewhere): the data they
    name ships too. The first step's loss is the random init's, ln(50400) = 10.83 (measured 10.82 and
    10.85); step 12 of pretrain_tiny and step 8 of the fine-tune are both 1.27 below it (measured)."""
    monkeypatch.chdir(ROOT)  # as the README runs them
    code = main(["train", "--config", f"examples/train/{name}", "--out", str(tmp_path / "run"), "--quiet",
                 "--max-steps", str(steps), "--set", "log_interval=1"])
    assert code == 0, capsys.readouterr().err
    log = [m for m in metrics(tmp_path / "run") if "loss" in m]
    assert log[-1]["step"] == steps and log[-1]["loss"] < log[0]["loss"] - 0.5  # learning (nats per token)
    assert (tmp_path / "run" / "checkpoints" / f"step-{steps:07d}").is_dir()


def test_lr_schedule_warms_up_then_follows_a_cosine(tmp_path, corpus):
    cfg = load_config(write_config(tmp_path / "c.yaml", train=corpus / "train.txt", max_steps=110,
                                   schedule={"warmup_steps": 10, "min_lr": 1e-4}, optimizer={"lr": 1e-3}))
    assert [lr_at(s, cfg) for s in (0, 4, 9)] == pytest.approx([1e-4, 5e-4, 1e-3])
    assert lr_at(60, cfg) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half-way down the cosine
    assert lr_at(110, cfg) == pytest.approx(1e-4)


def test_data_order_is_a_function_of_seed_and_position():
    s = Sampler(10, seed=1)
    first = s(range(0, 10))
    assert sorted(first) == list(range(10))  # an epoch sees every sequence once
    assert Sampler(10, seed=1)(range(5, 15)) == first[5:] + s(range(10, 15))  # from any position
    assert Sampler(10, seed=2)(range(0, 10)) != first


@pytest.mark.parametrize("content, message", [
    ({"model": {"preset": "tiny"}, "data": {"train": {"text": ["x.txt"]}}, "learning_rate": 1}, "learning_rate: unknown key"),
    ({"model": {"preset": "tiny"}, "data": {"train": {"text": ["x.txt"]}}, "batch_size": "big"}, "batch_size:"),
    ({"model": {"preset": "tiny"}, "data": {"train": {"text": ["missing.txt"]}}}, "missing.txt: no such file"),
    ({"model": {"preset": "tiny", "checkpoint": "m"}, "data": {"train": {"text": ["x.txt"]}}}, "exactly one"),
    ({"data": {"train": {"text": ["x.txt"]}}}, "model: required"),
    ({"model": {"preset": "huge"}, "data": {"train": {"text": ["x.txt"]}}}, "unknown preset"),
    ({"model": {"preset": "tiny"}, "data": {"train": {"text": ["x.txt"]}, "seq_len": 4096}},
     "data.seq_len 4096 exceeds the model's context of 2048"),
])
def test_bad_configs_are_one_line(tmp_path, capsys, monkeypatch, content, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.txt").write_text("hello")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(content))
    assert main(["train", "--config", "c.yaml", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_set_overrides_and_yaml_errors(tmp_path, capsys, corpus):
    path = write_config(tmp_path / "c.yaml", train=corpus / "train.txt")
    cfg = load_config(path, ["optimizer.lr=1e-2", "schedule.warmup_steps=0", "precision=bf16"])
    assert (cfg.optimizer.lr, cfg.schedule.warmup_steps, cfg.precision) == (1e-2, 0, "bf16")
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    assert main(["train", "--config", str(tmp_path / "bad.yaml")]) == 1
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["train", "--config", str(path), "--set", "nonsense"]) == 1
    assert "KEY=VALUE" in capsys.readouterr().err


def test_bf16_autocast_trains(corpus, tmp_path):
    # (bf16 is slow on CPUs without AVX-512 BF16: 4 steps of 2.) Step 4's loss is 1.2 below step 1's
    # (measured; float32 the same to 1e-3), far beyond bfloat16's rounding (u = 2^-8 of logits below
    # ~1 at init: <= 0.01 on a cross-entropy)
    cfg = load_config(write_config(tmp_path / "c.yaml", train=corpus / "train.txt", precision="bf16", max_steps=4,
                                   batch_size=2, log_interval=1))
    train(cfg, progress=False)
    log = metrics(Path(cfg.out))
    assert all(math.isfinite(m["loss"]) for m in log) and log[-1]["loss"] < log[0]["loss"]
    assert weights(Path(cfg.out))["lm_head.weight"].dtype == torch.float32  # float32 master weights


def test_tensorboard_logging_or_a_clear_error(corpus, tmp_path):
    cfg = load_config(write_config(tmp_path / "c.yaml", train=corpus / "train.txt", max_steps=2, tensorboard=True))
    try:
        import torch.utils.tensorboard  # noqa: F401 - needs the tensorboard package
    except ImportError:
        with pytest.raises(GptjError, match="needs the tensorboard package"):
            train(cfg, progress=False)
        return
    train(cfg, progress=False)
    assert list((Path(cfg.out) / "tensorboard").glob("events.out.tfevents.*"))


def test_eval_only_reports_what_training_reported_for_each_checkpoint(corpus, tmp_path, capsys):
    """Cerebras' eval mode: loss, perplexity and next-token accuracy of a checkpoint on the eval set,
    without training; equal to the training loop's evaluation at that step."""
    path = write_config(tmp_path / "c.yaml", train=corpus / "train.txt", data__eval={"text": [str(corpus / "eval.txt")]},
                        max_steps=4, eval_interval=2, checkpoint_interval=2, keep_checkpoints=2)
    assert main(["train", "--config", str(path), "--quiet"]) == 0
    run = tmp_path / "run"
    evals = {m["step"]: m for m in metrics(run) if "eval_loss" in m}
    assert set(evals) == {2, 4} and 0 <= evals[4]["eval_accuracy"] <= 1
    for step in (2, 4):
        capsys.readouterr()
        assert main(["train", "--config", str(path), "--eval-only", "--checkpoint",
                     str(run / "checkpoints" / f"step-{step:07d}"), "--json", "--quiet"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["step"] == step
        for key in ("eval_loss", "eval_ppl", "eval_accuracy", "eval_tokens"):
            assert got[key] == evals[step][key], key
    logged = metrics(run)
    assert main(["train", "--config", str(path), "--eval-only", "--quiet"]) == 0  # the output folder's model
    out = capsys.readouterr().out
    assert out.startswith(f"{run}: eval loss {evals[4]['eval_loss']:.4f}")
    assert metrics(run) == logged  # evaluating writes nothing into the run's log


@pytest.mark.parametrize("extra, changes, message", [
    (["--eval-only"], {}, "--eval-only needs an eval set"),
    (["--checkpoint", "x"], {"data__eval": {"text": ["E"]}}, "--checkpoint goes with --eval-only"),
    (["--eval-only", "--resume"], {"data__eval": {"text": ["E"]}}, "--eval-only trains nothing"),
    (["--eval-only"], {"data__eval": {"text": ["E"]}}, "holds no trained model yet"),
])
def test_eval_only_bad_input_is_one_line(corpus, tmp_path, capsys, extra, changes, message):
    changes = {k: ({"text": [str(corpus / "eval.txt")]} if v == {"text": ["E"]} else v) for k, v in changes.items()}
    path = write_config(tmp_path / "c.yaml", train=corpus / "train.txt", **changes)
    assert main(["train", "--config", str(path), *extra, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
