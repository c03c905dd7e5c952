"""HF folders of the architectures beside GPT-J (gptj.models.registry; today Llama's LlamaForCausalLM).

    save_folder:   a model's state dict -> an HF-layout folder (config.json by the config's to_hf_dict,
                   generation_config.json, safetensors with HF's names, sharded with an index when large)
                   that transformers' from_pretrained loads, and gptj too; a quantized one (each linear's
                   scales beside its weight) gptj loads and transformers refuses
    random_folder: `gptj init` of such a preset: deterministic random weights, made and written one
                   shard at a time (Llama-3.1-8B's 16 GB in bfloat16 never all in memory)

gptj.weights.io's save_checkpoint and convert hand these configs here (GPT-J's own writing stays in
io.py); io.load reads every architecture's folder alike. No tokenizer is written (gptj's bundled one
is GPT-J's; convert copies the folder's).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from gptj.device import dtype_name
from gptj.weights.finite import check_finite
from gptj.errors import CheckpointError, GptjError
from gptj.files import atomic_folder
from gptj.models.registry import ARCHITECTURES
from gptj.quant.format import hf_quantization_config, is_quant_param, quantized_specs
from gptj.weights import hf
from gptj.weights.checkpoint import CONFIG, tensor_names

MAX_SHARD_BYTES = 2 * 1024**3
PROGRESS_MIN_PARAMS = 500_000_000  # as gptj.weights.io's: bars for models this big on a terminal
def _progress(model_or_count: torch.nn.Module | int, progress: bool | None) -> bool:
    if progress is not None:
        return progress
    if isinstance(model_or_count, int):
        n = model_or_count
    else:
        n = sum(p.numel() for p in model_or_count.parameters())
    return n >= PROGRESS_MIN_PARAMS and sys.stderr.isatty()


# --- writing -------------------------------------------------------------------------------------


def save_folder(state_dict: Mapping[str, torch.Tensor], config: Any, out: str | os.PathLike,
                dtype: torch.dtype | None = None, overwrite: bool = False, progress: bool = False,
                max_shard_bytes: int = MAX_SHARD_BYTES, extra: Callable[[Path], None] | None = None) -> Path:
    """Write a model's state dict (gptj's names: `model.state_dict()`, or a checked read's) as an HF
    folder, atomically; a quantized config's tensors too (its scales beside each weight, HF's module
    names), with config.json's `quantization_config` that makes transformers refuse the folder.

    Strict: a missing or unexpected tensor is one line, before anything is written; every tensor
    is checked finite as written. `dtype` converts the float weights (default: as they are; a
    quantization's scales stay bfloat16). With tied embeddings a float lm_head.weight is not written
    (as HF's save_pretrained).
    """
    arch = ARCHITECTURES[config.model_type]
    stored = {ours: name for name, ours in tensor_names(arch, config).items()}  # ours -> HF
    specs = quantized_specs(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    unexpected = [n for n in state_dict if n not in specs]
    if unexpected:
        raise CheckpointError(f"state dict: unexpected tensor {unexpected[0]} (not a weight of this config)")
    ours = [o for o in specs if not (tied and o == "lm_head.weight" and specs[o][1] is None)]
    missing = [o for o in ours if o not in state_dict]
    if missing:
        raise CheckpointError(f"state dict: missing tensor {missing[0]} ({len(missing)} missing)")
    names = {stored[o]: o for o in ours}  # HF -> ours, in the model's order

    def target(o: str) -> torch.dtype:
        keep = dtype is None or specs[o][1] is not None or is_quant_param(o)
        return state_dict[o].dtype if keep else dtype

    def make(h: str) -> torch.Tensor:
        return state_dict[names[h]].detach().to(device="cpu", dtype=target(names[h]))

    nbytes = {h: state_dict[o].numel() * torch.empty((), dtype=target(o)).element_size() for h, o in names.items()}
    first = target(next(o for o in ours if specs[o][1] is None))
    return _write_folder(config, Path(out), list(names), nbytes, make, first, overwrite, progress, max_shard_bytes,
                         extra)


def random_folder(config: Any, out: str | os.PathLike, seed: int = 0, dtype: torch.dtype = torch.float32,
                  std: float = 0.02, overwrite: bool = False, progress: bool | None = None,
                  max_shard_bytes: int = MAX_SHARD_BYTES, extra: Callable[[Path], None] | None = None) -> Path:
    """`gptj init`: deterministic random weights (HF's init: normal(0, std) matrices, unit norms),
    made in float32 one tensor at a time, cast to `dtype`, and written one shard at a time."""
    arch = ARCHITECTURES[config.model_type]
    names = arch.hf_names(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    params = dict(arch.build_model(config, device="meta").named_parameters(remove_duplicate=False))
    write = [h for h in names if not (tied and h == "lm_head.weight")]
    shapes = {h: tuple(params[names[h]].shape) for h in write}
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = {h: math.prod(s) * size for h, s in shapes.items()}
    gen = torch.Generator().manual_seed(seed)

    def make(h: str) -> torch.Tensor:
        if h.endswith("norm.weight"):
            return torch.ones(shapes[h], dtype=dtype)
        return torch.empty(shapes[h]).normal_(0.0, std, generator=gen).to(dtype)

    progress = _progress(sum(math.prod(s) for s in shapes.values()), progress)
    return _write_folder(config, Path(out), write, nbytes, make, dtype, overwrite, progress, max_shard_bytes, extra)


def _shards(names: list[str], nbytes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        if groups[-1] and size + nbytes[name] > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes[name]
    return groups


def _write_folder(config: Any, out: Path, names: list[str], nbytes: Mapping[str, int],
                  make: Callable[[str], torch.Tensor], dtype: torch.dtype, overwrite: bool, progress: bool,
                  max_shard_bytes: int, extra: Callable[[Path], None] | None = None) -> Path:
    """config.json, generation_config.json and the tensors `make(name)` gives, shard by shard."""
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise GptjError(f"{out}: already exists (choose a new --out, or pass --force to replace it)")
    groups = _shards(names, nbytes, max_shard_bytes)
    with atomic_folder(out) as tmp:
        cfg = config.to_hf_dict() | {"torch_dtype": dtype_name(dtype)}
        if config.quantization is not None:  # HF transformers refuses the folder instead of misreading it
            cfg["quantization_config"] = hf_quantization_config(config.quantization)
        _write_json(tmp / CONFIG, cfg)
        _write_json(tmp / "generation_config.json",
                    {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")})
        bar = tqdm(total=len(names), desc="writing", unit="tensor", disable=not progress)
        weight_map = {}
        for i, group in enumerate(groups):
            fname = hf.SAFETENSORS if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            tensors = {}
            for name in group:
                tensors[name] = make(name).contiguous()
                check_finite(tensors[name], name, "<memory>")
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            del tensors
            weight_map.update({n: fname for n in group})
            bar.update(len(group))
        bar.close()
        if len(groups) > 1:
            _write_json(tmp / hf.SAFETENSORS_INDEX,
                        {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map})
        if extra is not None:
            extra(tmp)
    return out


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
