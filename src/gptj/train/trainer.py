"""The training loop: `train(cfg)` pre-trains or fine-tunes gptj's own GPT-J model.

One step: `grad_accum_steps` micro-batches of `batch_size` sequences on each of the world's ranks
(the global batch), next-token cross-entropy over the target tokens (`loss_mask`: all real tokens
for text, the response and EOS for summarization pairs), summed and divided by the global batch's
target count, so one process and N data-parallel ranks compute the same update; then gradient
clipping, AdamW, and the learning rate of the next step (linear warm-up, cosine to min_lr).

Data order is a pure function of (seed, epoch): the permutation of epoch e is drawn from a
generator seeded with seed + e, so the data position is just the step, and `--resume` continues
with exactly the batches an uninterrupted run would have seen.

Output folder: the model of the last step trained (a canonical gptj checkpoint: config.json +
model.safetensors + tokenizer; written at max_steps, and where `stop_after` (`gptj train
--max-steps`) stops a run early, replaced when --resume goes on), `metrics.jsonl` (one JSON object per logged step and per evaluation),
`checkpoints/step-NNNNNNN/` (the model, plus `trainer_state.pt`: optimizer state, step and the
config's fingerprint; written atomically, the last `keep_checkpoints` kept; `--resume` goes on from the
newest one that reads whole, warning in one line about each damaged one it skips) and `data/` (the
prepared token files of raw data sources).

Distributed: under torchrun (or in ranks gptj spawned), `distributed: ddp` wraps the model in
DistributedDataParallel; `fsdp` shards parameters, gradients and optimizer state over the ranks
(FullyShardedDataParallel, one unit per transformer block; `cpu_offload: true` keeps them in CPU
memory between uses). gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gptj.errors import GptjError
from gptj.files import append_line, atomic_write_text
from gptj.train.checkpoints import (
    FINAL_FILES_LAST,
    checkpoint_folders,
    full_state,
    load_optimizer,
    resume_from,
    save,
    write_final,
)
from gptj.train.config import DataSource, TrainConfig
from gptj.train.model import checkpointed, check_model_fits, distribute, initial_model, lora_config, param_groups
from gptj.train.ranks import Ranks, setup_ranks

METRICS_FILE = "metrics.jsonl"


# --- data -------------------------------------------------------------------------------

def _prepared(source: DataSource, split: str, cfg: TrainConfig, out: Path, ranks: Ranks, progress: bool):
    """The source as a TokenData: a prepared folder as is; raw files (text, summarization pairs,
    Cerebras' HDF5 data) prepared once into OUT/data/SPLIT by rank 0 (kept while the sources and
    seq_len stay the same)."""
    from gptj.train import data
    from gptj.train.model import data_tokenizer

    if source.prepared is not None:
        td = data.TokenData(source.prepared)
        if td.seq_len != cfg.data.seq_len:
            raise GptjError(f"data.{split}.prepared: {source.prepared} has sequences of {td.seq_len} tokens, the "
                            f"config's data.seq_len is {cfg.data.seq_len}")
        return td
    folder = out / "data" / split
    if source.cerebras_hdf5 is not None:
        sources = [str(p) for p in sorted(Path(source.cerebras_hdf5).glob("*.h5"))]
        kind = "cerebras-hdf5"
    else:
        sources = [str(p) for p in source.files()]
        kind = "packed" if source.text is not None else "pairs"
    tokenizer, prompt = data_tokenizer(cfg)  # the model's own (a Llama's), else GPT-J's
    if ranks.main:
        current = None
        if data.is_prepared(folder):
            current = json.loads((folder / "meta.json").read_text())
        if current is None or (current.get("sources"), current.get("seq_len"), current.get("kind"),
                               current.get("tokenizer")) != (sources, cfg.data.seq_len, kind, tokenizer or "gpt-j"):
            if source.cerebras_hdf5 is not None:
                data.prepare_cerebras_hdf5(source.cerebras_hdf5, folder, cfg.data.seq_len, tokenizer=tokenizer,
                                           force=True, progress=progress)
            elif source.text is not None:
                data.prepare_text(sources, folder, cfg.data.seq_len, tokenizer=tokenizer, jsonl_key=source.jsonl_key,
                                  force=True, progress=progress)
            else:
                data.prepare_summarization(sources[0], folder, cfg.data.seq_len, tokenizer=tokenizer, force=True,
                                           progress=progress, prompt=prompt)
    ranks.barrier()
    return data.TokenData(folder)


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


class Sampler:
    """Global position p (0, 1, 2, ... over the whole run) -> sequence index, epoch after epoch."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self._orders: dict[int, torch.Tensor] = {}

    def __call__(self, positions: range) -> list[int]:
        out = []
        for p in positions:
            epoch = p // self.n
            if epoch not in self._orders:
                self._orders = {epoch: epoch_order(self.n, self.seed, epoch)}
            out.append(int(self._orders[epoch][p % self.n]))
        return out


# --- schedule ---------------------------------------------------------------------------

def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warm-up, then cosine to min_lr."""
    lr, warm, total, low = cfg.optimizer.lr, cfg.schedule.warmup_steps, cfg.max_steps, cfg.schedule.min_lr
    if step < warm:
        return lr * (step + 1) / warm
    if total <= warm:
        return lr
    t = min(1.0, (step - warm) / max(1, total - warm))
    return low + (lr - low) * 0.5 * (1.0 + math.cos(math.pi * t))


# --- metrics ----------------------------------------------------------------------------

def _summary_writer():  # noqa: ANN202 - torch.utils.tensorboard.SummaryWriter
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise GptjError("tensorboard: true needs the tensorboard package (pip install tensorboard)") from None
    return SummaryWriter


class Metrics:
    def __init__(self, out: Path, main: bool, resume_step: int | None, tensorboard: bool) -> None:
        self.path = out / METRICS_FILE
        self.main = main
        self.writer = None
        if not main:
            return
        if resume_step is not None and self.path.exists():  # drop what the resumed steps will log again
            kept = [ln for ln in self.path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            atomic_write_text(self.path, "".join(ln + "\n" for ln in kept))
        elif resume_step is None:
            self.path.unlink(missing_ok=True)
        if tensorboard:
            self.writer = _summary_writer()(str(out / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        if not self.main:
            return
        append_line(self.path, json.dumps(record))
        if self.writer is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float):
                    self.writer.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# --- the loop ---------------------------------------------------------------------------

def _batch(td, indices: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, input_mask, loss_mask = td.get(indices)
    return (torch.from_numpy(ids).to(device), torch.from_numpy(input_mask).long().to(device),
            torch.from_numpy(loss_mask).to(device))


def _logits(model: nn.Module, ids: torch.Tensor, input_mask: torch.Tensor, precision: str,
            device: torch.device) -> torch.Tensor:
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    with autocast:
        return model(ids, attention_mask=input_mask)


def _labels(ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t + 1 where loss_mask[t + 1]; every other position (the last one
    included) gets the ignored label, -100."""
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = torch.where(loss_mask[:, 1:], ids[:, 1:], -100)
    return labels


def _loss_sum(model: nn.Module, ids: torch.Tensor, input_mask: torch.Tensor, loss_mask: torch.Tensor,
              precision: str, device: torch.device) -> torch.Tensor:
    """Summed next-token cross-entropy over the target tokens (float32)."""
    logits = _logits(model, ids, input_mask, precision, device)
    # The logits are not sliced: a slice's backward would build and fill a second logits-sized
    # gradient, the largest tensor of a step.
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), _labels(ids, loss_mask).reshape(-1),
                           ignore_index=-100, reduction="sum")


def evaluate(model: nn.Module, td, cfg: TrainConfig, ranks: Ranks) -> dict[str, float]:
    """Mean target-token loss, perplexity and next-token (top-1) accuracy over the eval set (or its
    first eval_batches batches)."""
    n = len(td)
    per = cfg.batch_size
    batches = math.ceil(n / per)
    if cfg.eval_batches:
        batches = min(batches, cfg.eval_batches)
    total = torch.zeros(3, dtype=torch.float64, device=ranks.device)  # loss sum, targets, correct
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for b in range(ranks.rank, batches, ranks.world):
            idx = list(range(b * per, min(n, (b + 1) * per)))
            ids, im, lm = _batch(td, idx, ranks.device)
            logits = _logits(model, ids, im, cfg.precision, ranks.device).float()
            labels = _labels(ids, lm)
            total[0] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                                        reduction="sum").double()
            total[1] += lm[:, 1:].sum()
            total[2] += (logits.argmax(-1) == labels).sum()  # -100 is never an argmax
    if ranks.world > 1:
        dist.all_reduce(total)
    model.train(was_training)
    targets = total[1].clamp(min=1)
    loss = float(total[0] / targets)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_accuracy": float(total[2] / targets),
            "eval_tokens": int(total[1])}


def evaluate_only(cfg: TrainConfig, checkpoint: str | os.PathLike | None = None, progress: bool = True,
                  device: str = "cpu") -> dict[str, Any]:
    """`gptj train --eval-only`: evaluate a checkpoint on the config's eval set without training, as
    Cerebras' model zoo's eval mode does. `checkpoint`: any float model folder gptj loads (one of
    OUT/checkpoints/step-N, another run's, HF's); default the config's output folder (the model of
    the last step trained). The numbers are those the training loop's evaluation reports for that
    checkpoint (same batches, precision and ranks). Raw eval data are prepared into OUT/data/eval,
    as training prepares them."""
    from gptj.weights.io import load_model

    if cfg.data.eval is None:
        raise GptjError("--eval-only needs an eval set: data.eval in the config (or --set data.eval.text=FILE)")
    check_model_fits(cfg)
    from gptj.lora import is_adapter, read_adapter_state

    out = Path(cfg.out)
    folder = Path(checkpoint) if checkpoint is not None else out
    if checkpoint is None and not ((out / FINAL_FILES_LAST).is_file() or is_adapter(out)):
        raise GptjError(f"--eval-only: {out} holds no trained model yet; give --checkpoint DIR (e.g. "
                        f"{out / 'checkpoints' / 'step-NNNNNNN'})")
    ranks = setup_ranks(device)
    try:
        if is_adapter(folder):  # a LoRA adapter: on the config's base, held as lora.base says
            if cfg.lora is None:
                raise GptjError(f"--eval-only: {folder} is a LoRA adapter; the config has no lora section for it")
            from gptj.lora import load_adapter_state

            model = initial_model(cfg)
            load_adapter_state(model, read_adapter_state(folder, lora_config(cfg)))
        else:
            model = load_model(folder, dtype=torch.float32)
        if model.config.quantization is not None and cfg.lora is None:
            raise GptjError(f"--eval-only: {folder} is quantized; evaluate float weights (gptj compare measures "
                            "a quantized copy against them)")
        if cfg.data.seq_len > model.config.n_positions:
            raise GptjError(f"data.seq_len {cfg.data.seq_len} exceeds {folder}'s context of "
                            f"{model.config.n_positions} positions")
        out.mkdir(parents=True, exist_ok=True)
        eval_data = _prepared(cfg.data.eval, "eval", cfg, out, ranks, progress)
        if len(eval_data) == 0:
            raise GptjError("data.eval holds no sequences")
        model.to(ranks.device)
        step = re.fullmatch(r"step-(\d+)", folder.name)
        return {"checkpoint": str(folder), **({"step": int(step[1])} if step else {}),
                **evaluate(model, eval_data, cfg, ranks)}
    finally:
        if ranks.started_group:
            dist.destroy_process_group()


def train(cfg: TrainConfig, stop_after: int | None = None, resume: bool = False, progress: bool = True,
          device: str = "cpu") -> dict[str, Any]:
    """Run (or continue) the training `cfg` describes; returns the last logged metrics. `stop_after`:
    stop after that step (the schedule still spans cfg.max_steps), as `gptj train --max-steps`; the
    model of the last step trained is written into cfg.out either way."""
    from tqdm import tqdm

    ranks = setup_ranks(device)
    try:
        return _train(cfg, ranks, stop_after, resume, progress, tqdm)
    finally:
        if ranks.started_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, ranks: Ranks, stop_after: int | None, resume: bool, progress: bool,
           tqdm: Any) -> dict[str, Any]:
    """train's run on this rank: the output folder claimed, the data prepared, the model (resumed or
    new) and its optimizer made, then the steps (_steps)."""
    torch.manual_seed(cfg.seed)
    mode = cfg.distributed
    if mode == "auto":
        mode = "ddp" if ranks.world > 1 else "none"
    if mode == "none" and ranks.world > 1:
        raise GptjError("distributed: none, but this run has several ranks (use ddp or fsdp)")
    if cfg.tensorboard:
        _summary_writer()  # before any work
    check_model_fits(cfg)
    out = Path(cfg.out)
    found = _claim_output(out, ranks, resume)
    train_data = _prepared(cfg.data.train, "train", cfg, out, ranks, progress)
    eval_data = _prepared(cfg.data.eval, "eval", cfg, out, ranks, progress) if cfg.data.eval else None
    if len(train_data) == 0:
        raise GptjError("data.train holds no sequences")
    model, config, optimizer, start = _model_and_optimizer(cfg, ranks, mode, found if resume else None)
    last_step = min(cfg.max_steps, stop_after) if stop_after is not None else cfg.max_steps
    metrics = Metrics(out, ranks.main, start if resume else None, cfg.tensorboard)
    bar = tqdm(total=last_step, initial=start, desc="training", unit="step", disable=not (progress and ranks.main))
    try:
        record = _steps(cfg, ranks, mode, model, config, optimizer, range(start, last_step), train_data,
                        eval_data, metrics, bar)
        # The model of the last step trained, into OUT (early stops included: users look there).
        model_sd, _ = full_state(model, optimizer, mode)
        if ranks.main:
            write_final(out, config, model_sd, cfg)
        ranks.barrier()
    finally:
        bar.close()
        metrics.close()
    return record


def _claim_output(out: Path, ranks: Ranks, resume: bool) -> list[Path]:
    """The output folder made ready for this run: what a killed run of it left half-written removed
    (never a live run's), and its checkpoints (oldest first) -> those; --resume needs one, a new run
    none (nor a metrics file)."""
    out.mkdir(parents=True, exist_ok=True)
    if ranks.main:
        from gptj.files import remove_leftovers

        remove_leftovers(out / "checkpoints", r"step-[0-9]+")
        remove_leftovers(out / "data", "train|eval")
        remove_leftovers(out, re.escape(".final.tmp"))
    found = checkpoint_folders(out)
    if resume and not found:
        raise GptjError(f"--resume: no checkpoint in {out / 'checkpoints'}")
    if not resume and (found or (out / METRICS_FILE).exists()):
        raise GptjError(f"{out} already holds a run: pass --resume to continue it, or choose another --out")
    return found


def _model_and_optimizer(cfg: TrainConfig, ranks: Ranks, mode: str,
                         found: list[Path] | None) -> tuple[nn.Module, Any, torch.optim.Optimizer, int]:
    """(the model as trained: on the rank's device, in training mode, wrapped for `mode`; its GPT-J
    config; AdamW over it; the first step to run): new, or with `found` (--resume) from the newest
    intact checkpoint there."""
    model = initial_model(cfg)
    config = model.config
    start, state, last = 0, None, None
    if found is not None:
        last, state = resume_from(found, model, cfg, ranks.main)
        start = state["step"]
    model.to(ranks.device)
    model.train()
    if cfg.lora is None:  # (a LoRA run trains its adapters only: gptj.lora froze the rest)
        for p in model.parameters():
            p.requires_grad_(True)
    if cfg.activation_checkpointing:
        for block in model.transformer.h:
            checkpointed(block)
    model = distribute(model, cfg, ranks, mode)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.optimizer.weight_decay), lr=lr_at(start, cfg),
                                  betas=cfg.optimizer.betas, eps=cfg.optimizer.eps, foreach=False)
    if state is not None:
        load_optimizer(model, optimizer, state, mode, last)
    return model, config, optimizer, start


def _steps(cfg: TrainConfig, ranks: Ranks, mode: str, model: nn.Module, config: Any,  # noqa: ANN001
           optimizer: torch.optim.Optimizer, steps: range, train_data, eval_data, metrics: Metrics,
           bar: Any) -> dict[str, Any]:
    """The optimizer steps `steps`, each logged every log_interval steps and the last, evaluated every
    eval_interval and at max_steps, checkpointed every checkpoint_interval and the last -> the last
    record logged (with its evaluation's numbers)."""
    sampler = Sampler(len(train_data), cfg.seed)
    last_step = steps.stop
    record: dict[str, Any] = {}
    window = {"tokens": 0, "t": time.perf_counter(), "loss": 0.0, "targets": 0.0}
    for step in steps:
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum, n_targets, tokens, grad_norm = _step(cfg, ranks, mode, model, optimizer, train_data, sampler, step)
        window["loss"] += loss_sum
        window["targets"] += n_targets
        window["tokens"] += tokens
        done = step + 1
        bar.update(1)
        if done % cfg.log_interval == 0 or done == last_step:
            totals = torch.tensor([window["loss"], float(window["tokens"])], dtype=torch.float64)
            if ranks.world > 1:
                dist.all_reduce(totals)
            seconds = time.perf_counter() - window["t"]
            record = {"step": done, "loss": float(totals[0]) / max(window["targets"], 1.0),
                      "lr": lr, "grad_norm": grad_norm, "tokens_per_s": float(totals[1]) / max(seconds, 1e-9)}
            metrics.log(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}")
            window = {"tokens": 0, "t": time.perf_counter(), "loss": 0.0, "targets": 0.0}
        if eval_data is not None and (
                (cfg.eval_interval and done % cfg.eval_interval == 0) or done == cfg.max_steps):
            ev = {"step": done, **evaluate(model, eval_data, cfg, ranks)}
            metrics.log(ev)
            record = {**record, **ev}
        if (cfg.checkpoint_interval and done % cfg.checkpoint_interval == 0) or done == last_step:
            model_sd, optim_sd = full_state(model, optimizer, mode)
            if ranks.main:
                save(Path(cfg.out), config, model_sd, optim_sd, done, cfg, cfg.keep_checkpoints, mode)
            ranks.barrier()
    return record


def _step(cfg: TrainConfig, ranks: Ranks, mode: str, model: nn.Module, optimizer: torch.optim.Optimizer,
          train_data, sampler: Sampler, step: int) -> tuple[float, float, int, float]:  # noqa: ANN001
    """Optimizer step `step` on its global batch: this rank's micro-batches, their gradients (synced
    over the ranks on the last), clipping, AdamW -> (this rank's summed loss, the global batch's
    target count, this rank's input tokens, the gradient norm before clipping)."""
    b = cfg.batch_size
    global_batch = b * cfg.grad_accum_steps * ranks.world
    indices = sampler(range(step * global_batch, (step + 1) * global_batch))
    # Every rank knows the whole global batch's target count: the loss is a sum over it
    # divided by that count, the same whatever the split over ranks and micro-steps.
    batch = _batch(train_data, indices, torch.device("cpu"))  # read once; each rank uses its rows
    n_targets = float(batch[2][:, 1:].sum())
    scale = ranks.world / max(n_targets, 1.0)  # DDP / FSDP average the ranks' gradients
    loss_sum = 0.0
    tokens = 0
    for micro in range(cfg.grad_accum_steps):
        first = (micro * ranks.world + ranks.rank) * b
        ids, im, lm = (t[first:first + b].to(ranks.device) for t in batch)
        sync = micro == cfg.grad_accum_steps - 1 or mode == "none"
        context = model.no_sync() if not sync and hasattr(model, "no_sync") else contextlib.nullcontext()
        with context:
            part = _loss_sum(model, ids, im, lm, cfg.precision, ranks.device)
            (part * scale).backward()
        loss_sum += float(part.detach())
        tokens += int(im.sum())
    grad_norm = _clip(model, cfg.grad_clip, mode)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, n_targets, tokens, grad_norm


def _clip(model: nn.Module, max_norm: float | None, mode: str) -> float:
    """Clip the global gradient norm (over every rank's shard under FSDP); returns the norm before."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor (FSDP): the norm over all shards
        norm = norm.full_tensor()
    return float(norm)
