"""HF folders of the architectures beside GPT-J (gptj.models.registry; today Llama's LlamaForCausalLM).

    load_folder:   a Checkpoint (gptj.weights.checkpoint read its config) -> the model built on the meta
                   device -> each tensor read (one safetensors file, or the shards
                   model.safetensors.index.json lists; .bin through weights_only),
                   checked (name, shape, floating point, finite), converted and assigned: never two copies
    save_folder:   a model's state dict -> an HF-layout folder (config.json by the config's to_hf_dict,
                   generation_config.json, safetensors with HF's names, sharded with an index when large)
                   that transformers' from_pretrained loads, and gptj too
    random_folder: `gptj init` of such a preset: deterministic random weights, made and written one
                   shard at a time (Llama-3.1-8B's 16 GB in bfloat16 never all in memory)

gptj.weights.io.load and save_checkpoint hand these folders and configs here; GPT-J's own loading
and saving stay in io.py. They quantize at load (int8, int4, fp8); quantized checkpoints of them are
refused for now (Checkpoint.read). No tokenizer is written (gptj's bundled one is GPT-J's).
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

from gptj.device import check_finite, dtype_name
from gptj.errors import CheckpointError, GptjError
from gptj.files import atomic_folder
from gptj.models.registry import architecture_of
from gptj.quant.format import make_quantization
from gptj.quant.linear import quantize_model
from gptj.weights import hf
from gptj.weights.checkpoint import CONFIG, Checkpoint
from gptj.weights.reading import read_checked

MAX_SHARD_BYTES = 2 * 1024**3
PROGRESS_MIN_PARAMS = 500_000_000  # as gptj.weights.io's: bars for models this big on a terminal
_LEGACY = ("rotary_emb.inv_freq",)  # buffers old HF Llama checkpoints saved; gptj computes them


def _check_listing(listed: list[str], names: Mapping[str, str], tied: bool, listing: Path) -> None:
    """The listed tensor names against the config's, before any weight is read: the first missing or
    unexpected one, in one line."""
    given = {n for n in listed if not n.endswith(_LEGACY)}
    unexpected = [n for n in listed if n in given and n not in names]
    if unexpected:
        raise CheckpointError(f"{listing}: unexpected tensor {unexpected[0]} ({len(unexpected)} unexpected; "
                              f"not a weight of this config)")
    missing = [n for n in names if n not in given and not (tied and n == "lm_head.weight")]
    if missing:
        raise CheckpointError(f"{listing}: missing tensor {missing[0]} ({len(missing)} missing)")


def load_folder(checkpoint: Checkpoint, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                quantize: str | None = None, group_size: int | None = None,
                progress: bool | None = None) -> torch.nn.Module:
    """The model of `checkpoint` (an HF folder of an architecture beside GPT-J's, as Checkpoint.read found
    it), in `dtype` on `device`, eval mode; its adapter (a LoRA adapter of the architecture's module
    names) folded into the weights it adapts as they are read, before they are rounded to `dtype` or quantized."""
    folder, arch, config, adapter = checkpoint.folder, checkpoint.arch, checkpoint.config, checkpoint.adapter
    if quantize == "w8a8":
        raise GptjError(f"{folder}: --quantize w8a8 needs gptj calibrate's smoothing factors, which are made for "
                        f"GPT-J models only so far: use int8, int4 or fp8 for {arch.model_type}")
    if quantize is None and group_size is not None:
        raise GptjError("a group size needs a quantization mode (int4)")
    q = make_quantization(config, quantize, group_size) if quantize else None  # the mode and group checked first
    names = arch.hf_names(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    listed = hf.listed_tensor_names(folder)  # the index checked, every shard present
    if listed is not None:
        _check_listing(listed[0], names, tied, listed[1])
    model = arch.build_model(config, device="meta", dtype=dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    if adapter is not None and adapter.layout.arch != arch.model_type:
        raise GptjError(f"--lora: {adapter.path} adapts {adapter.layout.arch}'s modules; {folder} is a "
                        f"{arch.model_type} model")
    specs = {h: (tuple(params[o].shape), None) for h, o in names.items()}  # HF names, our shapes
    sd = read_checked(specs, hf.iter_hf_tensors(folder), config.num_hidden_layers, dtype=dtype, device=device,
                      progress=_progress(model, progress), adapter=adapter, skip=_LEGACY,
                      optional=("lm_head.weight",) if tied else ())
    arch.load_hf(model, sd, str(folder))  # strict: the first missing tensor in one line; ties lm_head
    del sd
    if q is not None:  # module by module: each float weight is freed as its quantized one takes its place
        quantize_model(model, quantize, q["group_size"])
    return model.eval()


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
