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
import shutil
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gptj.errors import GptjError
from gptj.files import append_line, atomic_write_text, no_space_is_an_error, save_torch
from gptj.train.config import DataSource, TrainConfig

STATE_FILE = "trainer_state.pt"
METRICS_FILE = "metrics.jsonl"
FINAL_FILES_LAST = "config.json"  # written last into the output folder: its presence means "a whole model"


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    started_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def _setup_ranks(device: str) -> Ranks:
    """This process's place: a process group torchrun set up (env), one gptj spawned, or none."""
    from gptj.parallel.launch import backend_for, rank_device, under_torchrun
    from gptj.device import resolve_device

    started = False
    if not dist.is_initialized() and under_torchrun():
        dist.init_process_group(backend_for(device))
        started = True
    if dist.is_initialized() and dist.get_world_size() > 1:
        dev = resolve_device(rank_device(device))
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        return Ranks(dist.get_rank(), dist.get_world_size(), dev, started)
    return Ranks(device=resolve_device(device))


# --- data -------------------------------------------------------------------------------

def _prepared(source: DataSource, split: str, cfg: TrainConfig, out: Path, ranks: Ranks, progress: bool):
    """The source as a TokenData: a prepared folder as is; raw files (text, summarization pairs,
    Cerebras' HDF5 data) prepared once into OUT/data/SPLIT by rank 0 (kept while the sources and
    seq_len stay the same)."""
    from gptj.train import data

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
    if ranks.main:
        current = None
        if data.is_prepared(folder):
            current = json.loads((folder / "meta.json").read_text())
        if current is None or (current.get("sources"), current.get("seq_len"), current.get("kind")) != (
                sources, cfg.data.seq_len, kind):
            if source.cerebras_hdf5 is not None:
                data.prepare_cerebras_hdf5(source.cerebras_hdf5, folder, cfg.data.seq_len, force=True,
                                           progress=progress)
            elif source.text is not None:
                data.prepare_text(sources, folder, cfg.data.seq_len, jsonl_key=source.jsonl_key, force=True,
                                  progress=progress)
            else:
                data.prepare_summarization(sources[0], folder, cfg.data.seq_len, force=True, progress=progress)
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


# --- model ------------------------------------------------------------------------------

def _check_model_fits(cfg: TrainConfig) -> None:
    """What the model's config alone can refuse, before any data is prepared or weights are read."""
    from gptj.config import get_preset
    from gptj.weights.io import resolve_config

    if cfg.model.preset is not None:
        config = get_preset(cfg.model.preset)
    else:
        folder = Path(cfg.model.checkpoint)
        if not (folder / "config.json").is_file():
            return  # the loader says what is wrong with the folder
        config = resolve_config(folder)
    if cfg.data.seq_len > config.n_positions:
        raise GptjError(f"data.seq_len {cfg.data.seq_len} exceeds the model's context of {config.n_positions} "
                        "positions (n_positions)")


def _initial_model(cfg: TrainConfig) -> nn.Module:
    """The model training starts from: float32 (every weight trained), or with `lora:` its base held
    as lora.base asks (float32, bfloat16 or int8) and frozen, the adapters added (gptj.lora)."""
    from gptj.config import get_preset
    from gptj.weights.io import load_model, model_from_state_dict, random_state_dict

    base = cfg.lora.base if cfg.lora is not None else "float32"
    dtype = torch.float32 if base == "float32" else torch.bfloat16
    quantize = "int8" if base == "int8" else None
    if cfg.model.preset is not None:
        config = get_preset(cfg.model.preset)
        model = model_from_state_dict(config, random_state_dict(config, seed=cfg.seed, std=cfg.model.init_std))
        if quantize:
            from gptj.quant import quantize_model

            quantize_model(model, quantize)
        model.to(dtype)
    else:  # loaded straight into the base's form: a 6B base in bfloat16 never exists in float32
        model = load_model(cfg.model.checkpoint, dtype=dtype, quantize=quantize)
        if model.config.quantization is not None and quantize is None:
            raise GptjError(f"model.checkpoint: {cfg.model.checkpoint} is quantized; train from float weights")
    if cfg.lora is not None:
        from gptj.lora import apply_lora

        apply_lora(model, _lora_config(cfg))
    return model


def _lora_config(cfg: TrainConfig):  # noqa: ANN202 - gptj.lora.LoRAConfig
    from gptj.lora import LoRAConfig

    spec = cfg.lora
    return LoRAConfig(rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout, target_modules=tuple(spec.target_modules))


def _trained_state(model: nn.Module, lora: bool) -> dict[str, torch.Tensor]:
    """What a checkpoint of this run holds: every weight, or (LoRA) the adapters under PEFT's names."""
    if lora:
        from gptj.lora import adapter_state_dict

        return adapter_state_dict(model)
    return model.state_dict()


def _checkpointed(block: nn.Module) -> None:
    """Recompute this block's activations in the backward pass instead of keeping them."""
    from torch.utils.checkpoint import checkpoint

    plain = type(block).forward

    def forward(self, *args):  # noqa: ANN001, ANN202
        return checkpoint(plain, self, *args, use_reentrant=False)

    block.forward = types.MethodType(forward, block)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warm-up, then cosine to min_lr."""
    lr, warm, total, low = cfg.optimizer.lr, cfg.schedule.warmup_steps, cfg.max_steps, cfg.schedule.min_lr
    if step < warm:
        return lr * (step + 1) / warm
    if total <= warm:
        return lr
    t = min(1.0, (step - warm) / max(1, total - warm))
    return low + (lr - low) * 0.5 * (1.0 + math.cos(math.pi * t))


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on biases and LayerNorm weights)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# --- checkpoints ------------------------------------------------------------------------

def _checkpoints(out: Path) -> list[Path]:
    folder = out / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step-")
                  and (p / STATE_FILE).is_file())


class _Damaged(Exception):
    """A checkpoint that cannot be resumed from; its message names the file and what is wrong."""


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def _read_checkpoint(folder: Path, model: nn.Module, lora: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """(trainer state, model state dict) of one checkpoint folder, every tensor checked against
    `model` before anything is loaded into it; _Damaged naming the file otherwise."""
    import pickle
    import warnings

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from gptj.files import model_file

    files = sorted(folder.glob("adapter_model.safetensors" if lora else "*.safetensors"))
    try:  # every file read lies inside the checkpoint's folder (a link out of it is not followed)
        path = model_file(folder, STATE_FILE)
        files = [model_file(folder, f.name) for f in files]
    except GptjError as e:
        raise _Damaged(str(e)) from None
    try:
        # weights_only: a checkpoint folder is data, never code (torch's own advice to pass
        # weights_only=False on failure is not repeated: that would run whatever the file holds).
        with warnings.catch_warnings():  # torch's note on a pickle protocol: not the user's concern
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError) as e:
        reason = "truncated" if isinstance(e, EOFError) else "not a trainer state torch can read safely"
        raise _Damaged(f"{path}: {reason} ({type(e).__name__})") from None
    except OSError as e:
        raise _Damaged(f"{path}: cannot read: {e.strerror or e}") from None
    needed = {"step": int, "optimizer": dict, "fingerprint": dict, "torch_rng": torch.Tensor}
    if not isinstance(state, dict):
        raise _Damaged(f"{path}: holds a {type(state).__name__}, not a trainer state")
    for key, kind in needed.items():
        if not isinstance(state.get(key), kind):
            raise _Damaged(f"{path}: '{key}' is missing or not a {kind.__name__}")
    want = _trained_state(model, lora)
    sd: dict[str, torch.Tensor] = {}
    if not files:
        raise _Damaged(f"{folder}: no {'adapter_model' if lora else 'model'}.safetensors")
    for f in files:
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise _Damaged(f"{f}: not a readable safetensors file ({_first_line(e)})") from None
        for name, t in part.items():
            if name not in want:
                raise _Damaged(f"{f}: holds '{name}', which the model has no tensor for")
            if tuple(t.shape) != tuple(want[name].shape):
                raise _Damaged(f"{f}: '{name}' has shape {list(t.shape)}, the model's is {list(want[name].shape)}")
            if not t.is_floating_point():
                raise _Damaged(f"{f}: '{name}' is {t.dtype}, not a float tensor")
        sd.update(part)
    missing = [n for n in want if n not in sd]
    if missing:
        raise _Damaged(f"{files[0] if len(files) == 1 else folder}: lacks '{missing[0]}'"
                       + (f" and {len(missing) - 1} more tensors" if len(missing) > 1 else ""))
    return state, sd


def _intact_checkpoint(found: list[Path], model: nn.Module, main: bool,
                       lora: bool = False) -> tuple[Path, dict, dict]:
    """The newest checkpoint that reads whole: (folder, trainer state, model state dict). A damaged
    one is skipped with a one-line warning (as HF Trainer and Lightning users expect a resume to
    go on from the last good save); none intact is a one-line error naming the newest."""
    import sys

    skipped: list[tuple[Path, str]] = []
    for folder in reversed(found):
        try:
            state, sd = _read_checkpoint(folder, model, lora)
        except _Damaged as e:
            skipped.append((folder, str(e)))
            continue
        if main:
            for bad, why in skipped:
                print(f"gptj train: warning: --resume skips {bad.name}, resuming from {folder.name}: {why}",
                      file=sys.stderr, flush=True)
        return folder, state, sd
    more = f" (and {len(skipped) - 1} older checkpoints, all damaged)" if len(skipped) > 1 else ""
    raise GptjError(f"--resume: no intact checkpoint to resume from: {skipped[0][1]}{more}")


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer, mode: str) -> tuple[dict, dict | None]:
    """(model state dict, optimizer state dict), whole, on rank 0 (under FSDP: gathered from the
    shards, a collective every rank joins; the other ranks get empty dicts)."""
    if mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(model, options=options),
                get_optimizer_state_dict(model, optimizer, options=options))
    inner = model.module if mode == "ddp" else model
    return _trained_state(inner, lora_of(inner)), optimizer.state_dict()


def lora_of(model: nn.Module) -> bool:
    """Whether `model` trains LoRA adapters (gptj.lora) rather than its weights."""
    from gptj.lora import lora_modules

    return bool(lora_modules(model))


def _load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, mode: str) -> None:
    saved = state.get("optimizer_format", "plain")
    wanted = "fsdp" if mode == "fsdp" else "plain"
    if saved != wanted:
        raise GptjError(f"--resume: the checkpoint's optimizer state was written with distributed: "
                        f"{'fsdp' if saved == 'fsdp' else 'none/ddp'}; resume it the same way")
    if mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state["optimizer"])


def _save(out: Path, config: Any, model_sd: dict, optim_sd: dict | None, step: int, cfg: TrainConfig,
          keep: int, mode: str) -> Path:
    from gptj.weights.io import save_checkpoint

    target = out / "checkpoints" / f"step-{step:07d}"

    def extra(folder: Path) -> None:  # through a file object: a full disk is an OSError (gptj.files)
        save_torch({"step": step, "optimizer": optim_sd, "optimizer_format": "fsdp" if mode == "fsdp" else "plain",
                    "fingerprint": cfg.fingerprint(), "torch_rng": torch.get_rng_state()}, folder / STATE_FILE)

    if cfg.lora is not None:
        from gptj.lora import save_adapter

        save_adapter(model_sd, _lora_config(cfg), target, base_model=_base_name(cfg), extra=extra)
    else:
        save_checkpoint({k: v.detach().float().cpu() for k, v in model_sd.items()}, config, target, overwrite=True,
                        extra=extra)
    for old in _checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def _base_name(cfg: TrainConfig) -> str:
    """What a LoRA run's adapter_config.json names as its base model."""
    return str(cfg.model.checkpoint) if cfg.model.checkpoint is not None else f"gptj preset {cfg.model.preset}"


def _write_final(out: Path, config: Any, model_sd: dict, cfg: TrainConfig) -> None:
    """The final model (a LoRA run: its adapter) into OUT itself: written whole into a temporary
    folder, then moved in file by file, config.json (adapter_config.json) last."""
    from gptj.weights.io import save_checkpoint

    tmp = out / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with no_space_is_an_error(out):  # a full disk names OUT, not the temporary folder
        if cfg.lora is not None:
            from gptj.lora import CONFIG_FILE, save_adapter

            save_adapter(model_sd, _lora_config(cfg), tmp, base_model=_base_name(cfg))
            last = CONFIG_FILE
        else:
            save_checkpoint({k: v.detach().float().cpu() for k, v in model_sd.items()}, config, tmp, overwrite=True)
            last = FINAL_FILES_LAST
    names = sorted(p.name for p in tmp.iterdir())
    for name in [n for n in names if n != last] + [last]:
        os.replace(tmp / name, out / name)
    shutil.rmtree(tmp, ignore_errors=True)


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
    _check_model_fits(cfg)
    from gptj.lora import is_adapter, read_adapter_state

    out = Path(cfg.out)
    folder = Path(checkpoint) if checkpoint is not None else out
    if checkpoint is None and not ((out / FINAL_FILES_LAST).is_file() or is_adapter(out)):
        raise GptjError(f"--eval-only: {out} holds no trained model yet; give --checkpoint DIR (e.g. "
                        f"{out / 'checkpoints' / 'step-NNNNNNN'})")
    ranks = _setup_ranks(device)
    try:
        if is_adapter(folder):  # a LoRA adapter: on the config's base, held as lora.base says
            if cfg.lora is None:
                raise GptjError(f"--eval-only: {folder} is a LoRA adapter; the config has no lora section for it")
            from gptj.lora import load_adapter_state

            model = _initial_model(cfg)
            load_adapter_state(model, read_adapter_state(folder, _lora_config(cfg)))
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

    ranks = _setup_ranks(device)
    try:
        return _train(cfg, ranks, stop_after, resume, progress, tqdm)
    finally:
        if ranks.started_group:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, ranks: Ranks, stop_after: int | None, resume: bool, progress: bool,
           tqdm: Any) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)
    mode = cfg.distributed
    if mode == "auto":
        mode = "ddp" if ranks.world > 1 else "none"
    if mode == "none" and ranks.world > 1:
        raise GptjError("distributed: none, but this run has several ranks (use ddp or fsdp)")
    if cfg.tensorboard:
        _summary_writer()  # before any work
    _check_model_fits(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if ranks.main:  # what a killed run of this folder left half-written (never a live run's)
        from gptj.files import remove_leftovers

        remove_leftovers(out / "checkpoints", r"step-[0-9]+")
        remove_leftovers(out / "data", "train|eval")
        remove_leftovers(out, re.escape(".final.tmp"))
    found = _checkpoints(out)
    if resume and not found:
        raise GptjError(f"--resume: no checkpoint in {out / 'checkpoints'}")
    if not resume and (found or (out / METRICS_FILE).exists()):
        raise GptjError(f"{out} already holds a run: pass --resume to continue it, or choose another --out")

    train_data = _prepared(cfg.data.train, "train", cfg, out, ranks, progress)
    eval_data = _prepared(cfg.data.eval, "eval", cfg, out, ranks, progress) if cfg.data.eval else None
    global_batch = cfg.batch_size * cfg.grad_accum_steps * ranks.world
    if len(train_data) == 0:
        raise GptjError("data.train holds no sequences")

    model = _initial_model(cfg)
    config = model.config
    start = 0
    state = None
    if resume:
        last, state, sd = _intact_checkpoint(found, model, ranks.main, cfg.lora is not None)
        if state["fingerprint"] != cfg.fingerprint():
            changed = sorted(k for k in cfg.fingerprint() if cfg.fingerprint()[k] != state["fingerprint"].get(k))
            raise GptjError(f"--resume: the config changed since {last.name} ({', '.join(changed)}); "
                            "resume with the same model, data, optimizer, batch and seed")
        if cfg.lora is not None:
            from gptj.lora import load_adapter_state

            load_adapter_state(model, sd)
        else:
            model.load_state_dict(sd, strict=True)
        start = state["step"]
        torch.set_rng_state(state["torch_rng"])
    model.to(ranks.device)
    model.train()
    if cfg.lora is None:  # (a LoRA run trains its adapters only: gptj.lora froze the rest)
        for p in model.parameters():
            p.requires_grad_(True)
    if cfg.activation_checkpointing:
        for block in model.transformer.h:
            _checkpointed(block)

    if mode == "ddp" and ranks.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[ranks.device.index] if ranks.device.type == "cuda" else None)
    elif mode == "fsdp":
        model = _fsdp(model, cfg, ranks)
    optimizer = torch.optim.AdamW(_param_groups(model, cfg.optimizer.weight_decay), lr=lr_at(start, cfg),
                                  betas=cfg.optimizer.betas, eps=cfg.optimizer.eps, foreach=False)
    if state is not None:
        try:
            _load_optimizer(model, optimizer, state, mode)
        except (ValueError, KeyError, RuntimeError) as e:
            raise GptjError(f"--resume: {last / STATE_FILE}: the optimizer state does not fit the model "
                            f"({_first_line(e)})") from None

    metrics = Metrics(out, ranks.main, start if resume else None, cfg.tensorboard)
    sampler = Sampler(len(train_data), cfg.seed)
    last_step = min(cfg.max_steps, stop_after) if stop_after is not None else cfg.max_steps
    bar = tqdm(total=last_step, initial=start, desc="training", unit="step", disable=not (progress and ranks.main))
    record: dict[str, Any] = {}
    window = {"tokens": 0, "t": time.perf_counter(), "loss": 0.0, "targets": 0.0}
    b = cfg.batch_size
    try:
        for step in range(start, last_step):
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            positions = range(step * global_batch, (step + 1) * global_batch)
            indices = sampler(positions)
            # Every rank knows the whole global batch's target count: the loss is a sum over it
            # divided by that count, the same whatever the split over ranks and micro-steps.
            batch = _batch(train_data, indices, torch.device("cpu"))  # read once; each rank uses its rows
            n_targets = float(batch[2][:, 1:].sum())
            scale = ranks.world / max(n_targets, 1.0)  # DDP / FSDP average the ranks' gradients
            loss_sum = 0.0
            for micro in range(cfg.grad_accum_steps):
                first = (micro * ranks.world + ranks.rank) * b
                ids, im, lm = (t[first:first + b].to(ranks.device) for t in batch)
                sync = micro == cfg.grad_accum_steps - 1 or mode == "none"
                context = model.no_sync() if not sync and hasattr(model, "no_sync") else contextlib.nullcontext()
                with context:
                    part = _loss_sum(model, ids, im, lm, cfg.precision, ranks.device)
                    (part * scale).backward()
                loss_sum += float(part.detach())
                window["tokens"] += int(im.sum())
            grad_norm = _clip(model, cfg.grad_clip, mode)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            window["loss"] += loss_sum
            window["targets"] += n_targets
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
                model_sd, optim_sd = _full_state(model, optimizer, mode)
                if ranks.main:
                    _save(out, config, model_sd, optim_sd, done, cfg, cfg.keep_checkpoints, mode)
                ranks.barrier()
        # The model of the last step trained, into OUT (early stops included: users look there).
        model_sd, _ = _full_state(model, optimizer, mode)
        if ranks.main:
            _write_final(out, config, model_sd, cfg)
        ranks.barrier()
    finally:
        bar.close()
        metrics.close()
    return record


def _clip(model: nn.Module, max_norm: float | None, mode: str) -> float:
    """Clip the global gradient norm (over every rank's shard under FSDP); returns the norm before."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor (FSDP): the norm over all shards
        norm = norm.full_tensor()
    return float(norm)


def _fsdp(model: nn.Module, cfg: TrainConfig, ranks: Ranks) -> nn.Module:
    """Shard parameters, gradients and optimizer state over the ranks (FSDP2's fully_shard: one
    unit per transformer block, then the rest); cpu_offload keeps them in CPU memory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(ranks.device.type, (ranks.world,))
    # On CPU the parameters live in CPU memory anyway (and the offload policy needs an accelerator).
    policy = CPUOffloadPolicy() if cfg.cpu_offload and ranks.device.type != "cpu" else OffloadPolicy()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model
