"""A training run's checkpoints and its final model: OUT/checkpoints/step-NNNNNNN/ (the model, or a
LoRA run's adapter, plus trainer_state.pt: optimizer state, step, RNG and the config's fingerprint),
the newest intact one found and loaded for --resume (a damaged one skipped with a warning), and the
model of the last step trained written into OUT itself, config.json last.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptj.errors import GptjError
from gptj.files import no_space_is_an_error, save_torch
from gptj.train.config import TrainConfig
from gptj.train.model import lora_config, lora_of, trained_state

STATE_FILE = "trainer_state.pt"
FINAL_FILES_LAST = "config.json"  # written last into the output folder: its presence means "a whole model"


def checkpoint_folders(out: Path) -> list[Path]:
    """OUT/checkpoints/step-N folders holding a trainer state, oldest first."""
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
    want = trained_state(model, lora)
    rename = {} if lora else (_stored_names(model.config) or {})  # a Llama's files hold HF's names
    sd: dict[str, torch.Tensor] = {}
    if not files:
        raise _Damaged(f"{folder}: no {'adapter_model' if lora else 'model'}.safetensors")
    for f in files:
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise _Damaged(f"{f}: not a readable safetensors file ({_first_line(e)})") from None
        part = {rename.get(name, name): t for name, t in part.items()}
        for name, t in part.items():
            if name not in want:
                raise _Damaged(f"{f}: holds '{name}', which the model has no tensor for")
            if tuple(t.shape) != tuple(want[name].shape):
                raise _Damaged(f"{f}: '{name}' has shape {list(t.shape)}, the model's is {list(want[name].shape)}")
            if not t.is_floating_point():
                raise _Damaged(f"{f}: '{name}' is {t.dtype}, not a float tensor")
        sd.update(part)
    if not lora and getattr(model.config, "tie_word_embeddings", False) and "transformer.wte.weight" in sd:
        sd.setdefault("lm_head.weight", sd["transformer.wte.weight"])  # (a tied head is not written: HF's way)
    missing = [n for n in want if n not in sd]
    if missing:
        raise _Damaged(f"{files[0] if len(files) == 1 else folder}: lacks '{missing[0]}'"
                       + (f" and {len(missing) - 1} more tensors" if len(missing) > 1 else ""))
    return state, sd


def _stored_names(config: Any) -> dict[str, str] | None:
    """Stored (HF) tensor name -> the model's, where an architecture's files name them otherwise (a
    Llama's: gptj.weights.checkpoint.tensor_names); None for GPT-J's."""
    from gptj.models.registry import ARCHITECTURES
    from gptj.weights.checkpoint import tensor_names

    return tensor_names(ARCHITECTURES[config.model_type], config)


def _with_model_files(cfg: TrainConfig, config: Any, extra: Any = None) -> Any:
    """`extra` (folder -> None, or None) that also copies, for a model of another architecture than
    GPT-J, the files its checkpoint folder holds beside the weights (tokenizer, generation settings:
    gptj.weights.io.KEPT_FILES), so that a saved model runs as its base does. GPT-J's folders get
    gptj's own tokenizer (save_checkpoint)."""
    from gptj.config import GPTJConfig

    if isinstance(config, GPTJConfig) or cfg.model.checkpoint is None:
        return extra
    from gptj.weights.io import KEPT_FILES, copy_files

    def copy(folder: Path) -> None:
        copy_files(cfg.model.checkpoint, folder, KEPT_FILES, missing_ok=True)
        if extra is not None:
            extra(folder)

    return copy


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


def resume_from(found: list[Path], model: nn.Module, cfg: TrainConfig, main: bool) -> tuple[Path, dict]:
    """--resume: the newest intact checkpoint of `found` loaded into `model` (its weights, or a LoRA
    run's adapters) and torch's RNG -> (its folder, its trainer state). A checkpoint of another
    config (its fingerprint) is refused in one line naming what changed."""
    last, state, sd = _intact_checkpoint(found, model, main, cfg.lora is not None)
    if state["fingerprint"] != cfg.fingerprint():
        changed = sorted(k for k in cfg.fingerprint() if cfg.fingerprint()[k] != state["fingerprint"].get(k))
        raise GptjError(f"--resume: the config changed since {last.name} ({', '.join(changed)}); "
                        "resume with the same model, data, optimizer, batch and seed")
    if cfg.lora is not None:
        from gptj.lora import load_adapter_state

        load_adapter_state(model, sd)
    else:
        model.load_state_dict(sd, strict=True)
    torch.set_rng_state(state["torch_rng"])
    return last, state


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, mode: str) -> tuple[dict, dict | None]:
    """(model state dict, optimizer state dict), whole, on rank 0 (under FSDP: gathered from the
    shards, a collective every rank joins; the other ranks get empty dicts)."""
    if mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return (get_model_state_dict(model, options=options),
                get_optimizer_state_dict(model, optimizer, options=options))
    inner = model.module if mode == "ddp" else model
    return trained_state(inner, lora_of(inner)), optimizer.state_dict()


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


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, mode: str, folder: Path) -> None:
    """The optimizer state of the checkpoint in `folder` (its trainer state `state`) into `optimizer`;
    one that does not fit the model is a one-line error."""
    try:
        _load_optimizer(model, optimizer, state, mode)
    except (ValueError, KeyError, RuntimeError) as e:
        raise GptjError(f"--resume: {folder / STATE_FILE}: the optimizer state does not fit the model "
                        f"({_first_line(e)})") from None


def save(out: Path, config: Any, model_sd: dict, optim_sd: dict | None, step: int, cfg: TrainConfig,
          keep: int, mode: str) -> Path:
    from gptj.weights.io import save_checkpoint

    target = out / "checkpoints" / f"step-{step:07d}"

    def extra(folder: Path) -> None:  # through a file object: a full disk is an OSError (gptj.files)
        save_torch({"step": step, "optimizer": optim_sd, "optimizer_format": "fsdp" if mode == "fsdp" else "plain",
                    "fingerprint": cfg.fingerprint(), "torch_rng": torch.get_rng_state()}, folder / STATE_FILE)

    if cfg.lora is not None:
        from gptj.lora import save_adapter

        save_adapter(model_sd, lora_config(cfg), target, base_model=_base_name(cfg), extra=extra)
    else:
        save_checkpoint({k: v.detach().float().cpu() for k, v in model_sd.items()}, config, target, overwrite=True,
                        extra=_with_model_files(cfg, config, extra))
    for old in checkpoint_folders(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def _base_name(cfg: TrainConfig) -> str:
    """What a LoRA run's adapter_config.json names as its base model."""
    return str(cfg.model.checkpoint) if cfg.model.checkpoint is not None else f"gptj preset {cfg.model.preset}"


def write_final(out: Path, config: Any, model_sd: dict, cfg: TrainConfig) -> None:
    """The final model (a LoRA run: its adapter) into OUT itself: written whole into a temporary
    folder, then moved in file by file, config.json (adapter_config.json) last."""
    from gptj.weights.io import save_checkpoint

    tmp = out / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with no_space_is_an_error(out):  # a full disk names OUT, not the temporary folder
        if cfg.lora is not None:
            from gptj.lora import CONFIG_FILE, save_adapter

            save_adapter(model_sd, lora_config(cfg), tmp, base_model=_base_name(cfg))
            last = CONFIG_FILE
        else:
            save_checkpoint({k: v.detach().float().cpu() for k, v in model_sd.items()}, config, tmp, overwrite=True,
                            extra=_with_model_files(cfg, config))
            last = FINAL_FILES_LAST
    names = sorted(p.name for p in tmp.iterdir())
    for name in [n for n in names if n != last] + [last]:
        os.replace(tmp / name, out / name)
    shutil.rmtree(tmp, ignore_errors=True)
