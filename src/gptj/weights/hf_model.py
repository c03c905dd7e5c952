"""HF folders of the architectures beside GPT-J (gptj.models.registry; today Llama's LlamaForCausalLM).

    save_folder:   a model's state dict -> an HF-layout folder (config.json by the config's to_hf_dict,
                   generation_config.json, safetensors with HF's names, sharded with an index when large)
                   that transformers' from_pretrained loads, and gptj too
    random_folder: `gptj init` of such a preset: deterministic random weights, made and written one
                   shard at a time (Llama-3.1-8B's 16 GB in bfloat16 never all in memory)

gptj.weights.io's save_checkpoint hands these configs here (GPT-J's own saving stays in io.py);
io.load reads every architecture's folder alike. They quantize at load (int8, int4, fp8); quantized
checkpoints of them are refused for now (Checkpoint.read). No tokenizer is written (gptj's bundled
one is GPT-J's).
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
from gptj.models.registry import architecture_of
from gptj.weights import hf
from gptj.weights.checkpoint import CONFIG

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
    """Write a model's state dict (gptj's names: `model.state_dict()`) as an HF folder, atomically.

    Strict: a missing or unexpected tensor is one line, before anything is written; every tensor
    is checked finite as written. `dtype` converts the float tensors (default: as they are). With
    tied embeddings lm_head.weight is not written (as HF's save_pretrained).
    """
    arch = architecture_of(config)
    names = arch.hf_names(config)  # HF -> ours
    tied = bool(getattr(config, "tie_word_embeddings", False))
    ours = {o: h for h, o in names.items()}
    unexpected = [n for n in state_dict if n not in ours]
    if unexpected:
        raise CheckpointError(f"state dict: unexpected tensor {unexpected[0]} (not a weight of this config)")
    missing = [o for h, o in names.items() if o not in state_dict and not (tied and h == "lm_head.weight")]
    if missing:
        raise CheckpointError(f"state dict: missing tensor {missing[0]} ({len(missing)} missing)")
    write = [h for h in names if not (tied and h == "lm_head.weight")]

    def target(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    def make(h: str) -> torch.Tensor:
        t = state_dict[names[h]].detach()
        return t.to(device="cpu", dtype=target(t))

    nbytes = {h: state_dict[names[h]].numel() * torch.empty((), dtype=target(state_dict[names[h]])).element_size()
              for h in write}
    first = target(state_dict[names[write[0]]])
    return _write_folder(config, Path(out), write, nbytes, make, first, overwrite, progress, max_shard_bytes, extra)


def random_folder(config: Any, out: str | os.PathLike, seed: int = 0, dtype: torch.dtype = torch.float32,
                  std: float = 0.02, overwrite: bool = False, progress: bool | None = None,
                  max_shard_bytes: int = MAX_SHARD_BYTES, extra: Callable[[Path], None] | None = None) -> Path:
    """`gptj init`: deterministic random weights (HF's init: normal(0, std) matrices, unit norms),
    made in float32 one tensor at a time, cast to `dtype`, and written one shard at a time."""
    arch = architecture_of(config)
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
        _write_json(tmp / CONFIG, config.to_hf_dict() | {"torch_dtype": dtype_name(dtype)})
        cfg = config.to_hf_dict()
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
