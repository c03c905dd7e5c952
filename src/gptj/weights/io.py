"""Loading models and writing the canonical checkpoint.

The canonical on-disk format is an HF-compatible directory: config.json, safetensors
(one file, or shards with model.safetensors.index.json), generation_config.json and the
tokenizer files, so HF transformers loads what gptj writes.

Loading (`load(Checkpoint.read(folder), ...)`, or `load_model(folder, ...)`: gptj.weights.checkpoint
reads the folder's format, architecture and config once) is the same for every architecture: each
tensor is read once and checked (gptj.weights.reading: name, shape, finiteness; a Llama's HF names
become the model's), converted or quantized as it comes, and assigned to a model built on the meta
device (`load_state_dict(assign=True)`), so weights are never held twice; errors name the tensor and file.

Quantized checkpoints (see `gptj.quant`): config.json's "quantization" entry says which linears
hold int8/int4 weights (with their bfloat16 scales/zeros); those load into quantized modules,
packed for the device's kernel at load time. `load_model(..., quantize="int8"|"int4")` and
`convert(..., quantize=...)` quantize a float checkpoint tensor by tensor as it is read.
HF transformers cannot run quantized checkpoints (it does not know the format): their config.json's
`quantization_config` makes its from_pretrained refuse them with a ValueError (gptj.quant.format);
float ones stay HF-compatible.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from safetensors.torch import save_file
from tqdm import tqdm

from gptj import quant
from gptj.config import GPTJConfig
from gptj.errors import GptjError
from gptj.files import atomic_folder, atomic_write_json, model_file
from gptj.models.registry import ARCHITECTURES
from gptj.quant.calibrate import w8a8_factors
from gptj.quant.format import hf_quantization_config
from gptj.device import dtype_name
from gptj.weights import hf
from gptj.weights.checkpoint import CONFIG, GPTJ, Checkpoint, TensorItem, tensor_names
from gptj.weights.peft import Adapter
from gptj.weights.reading import read_checked

MAX_SHARD_BYTES = 2 * 1024**3  # small shards keep peak memory low while writing
PROGRESS_MIN_PARAMS = 500_000_000  # progress=None: bars for models this big (gptj-6b loads for a minute)


def expected_specs(config: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Name -> (shape, dtype) of every tensor a checkpoint with `config` (any architecture's, the
    model's names) must hold; dtype None means any floating point dtype (int8 / uint8 for the weights
    of a quantized config's linears)."""
    if config.quantization is not None:
        quant.check_quantization(config.quantization, config)
    return quant.quantized_specs(config)


def auto_progress(config: Any, progress: bool | None = None) -> bool:
    """progress=None: a bar (tqdm, on stderr) when stderr is a terminal and the model is big enough
    to keep one waiting (PROGRESS_MIN_PARAMS); True / False as given."""
    if progress is not None:
        return progress
    n = sum(math.prod(shape) for shape in expected_shapes(config.replace(quantization=None)).values())
    return n >= PROGRESS_MIN_PARAMS and sys.stderr.isatty()


def expected_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a checkpoint with `config` must hold."""
    return {name: shape for name, (shape, _) in expected_specs(config).items()}


def checked_state_dict(config: Any, items: Iterable[TensorItem], dtype: torch.dtype | None = None,
                       device: torch.device | str = "cpu", progress: bool = False,
                       desc: str = "loading", quantize: Mapping | None = None,
                       smooth: Mapping[str, torch.Tensor] | None = None,
                       adapter: Adapter | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (of any architecture: a Llama's HF names become the model's), each read
    once and checked against `config` (gptj.weights.reading.read_checked: name, shape, dtype,
    finiteness; `dtype` and `device` for the float ones; `adapter` folded into the float weights it
    adapts as they are read).

    `dtype` applies to float tensors only: quantized weights keep int8/uint8 and their scales and
    zeros stay bfloat16. `quantize` (a `quant.make_quantization` dict, for a float `config`):
    quantize each weight it names as soon as it is read, so no float copy of the model is held.
    """
    if quantize is not None and config.quantization is not None:
        raise GptjError("the checkpoint is already quantized")
    arch = ARCHITECTURES[config.model_type]
    tied = {"lm_head.weight": "transformer.wte.weight"} if getattr(config, "tie_word_embeddings", False) else None
    return read_checked(expected_specs(config), items, dtype=dtype, device=device,
                        progress=progress, desc=desc, quantize=quantize, smooth=smooth, adapter=adapter,
                        skip=arch.legacy, tied=tied, rename=tensor_names(arch, config),
                        what="a GPT-J weight" if arch.hf_names is None else "a weight")


def model_from_state_dict(config: Any, state_dict: Mapping[str, torch.Tensor],
                          device: torch.device | str = "cpu") -> nn.Module:
    """The model of `config`'s architecture holding `state_dict` (the model's names; quantized as
    config.quantization says), assigned on the meta device, packed for `device`'s kernels, eval mode.
    A tied float LM head (tie_word_embeddings) shares the embedding's weight."""
    model = ARCHITECTURES[config.model_type].build_model(config, device="meta")
    if config.quantization is not None:
        quant.swap_quantized_modules(model, config.quantization)
    model.load_state_dict(state_dict, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False) and isinstance(model.lm_head, nn.Linear):
        model.lm_head.weight = model.transformer.wte.weight  # assign=True replaced each Parameter: share them again
    model.init_buffers(device)
    quant.prepare_model(model)  # pack quantized weights for the device's kernels
    return model.eval()


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               config: str | os.PathLike | GPTJConfig | None = None, progress: bool | None = None,
               quantize: str | None = None, group_size: int | None = None,
               adapter: Adapter | None = None) -> nn.Module:
    """The model in `path`: an HF directory (gptj's own format included; its config.json's model_type
    picks the architecture, an unknown one is one line naming the supported ones) or a GPT-J slim
    checkpoint (`config` names its config). `load(Checkpoint.read(path), ...)`, with `adapter` (a LoRA
    adapter, gptj.weights.peft) folded into the float weights it adapts."""
    return load(Checkpoint.read(path, config=config).with_adapter(adapter), dtype, device, quantize, group_size,
                progress)


def load(checkpoint: Checkpoint, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
         quantize: str | None = None, group_size: int | None = None, progress: bool | None = None) -> nn.Module:
    """The whole model of `checkpoint` (any architecture gptj runs), in eval mode.

    `dtype` is the float dtype (activations, embeddings, norms, biases). A quantized checkpoint
    loads into quantized modules. `quantize` ("int8" / "int4", with `group_size` for int4; "w8a8" /
    "fp8") quantizes a float checkpoint tensor by tensor while loading, after the checkpoint's
    adapter is folded into the float weights it adapts. `progress`: a bar on stderr; None draws one
    for a big model (gptj-6b) when stderr is a terminal (`auto_progress`).
    """
    cfg, sd = read_checkpoint(checkpoint, dtype, device, quantize, group_size, progress)
    return model_from_state_dict(cfg, sd, device)


def read_checkpoint(checkpoint: Checkpoint, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                    quantize: str | None = None, group_size: int | None = None, progress: bool | None = False,
                    desc: str = "loading") -> tuple[Any, dict[str, torch.Tensor]]:
    """(config, tensors) of `checkpoint`, each tensor read once and checked (checked_state_dict), with
    its adapter folded in; quantized as read where `quantize` asks (quant.resolve_quantization: W8A8
    with the folder's smoothing factors, quant.calibrate.w8a8_factors), and the config then records it. What load builds a model from
    and convert writes. `progress`: as auto_progress takes it."""
    cfg, folder, hf_dir = checkpoint.config, checkpoint.folder, checkpoint.format == "hf"
    progress = auto_progress(cfg, progress)
    q = quant.resolve_quantization(cfg, quantize, group_size, where=folder)
    smooth = w8a8_factors(q, cfg, folder)
    # A slim checkpoint's reader draws its own bar (per leaf across shards); one bar is enough.
    items = checkpoint.tensors(progress and not hf_dir, dtype)
    sd = checked_state_dict(cfg, items, dtype=dtype, device=device,
                            progress=progress and hf_dir, desc=desc, quantize=q, smooth=smooth,
                            adapter=checkpoint.adapter)
    if q is not None:
        cfg = cfg.replace(quantization=q, calibration=None)  # w8a8: the record moved into `quantization`
    return cfg, sd


def random_state_dict(config: GPTJConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                      std: float = 0.02, progress: bool = False) -> dict[str, torch.Tensor]:
    """Deterministic random weights (HF's init: normal(0, std) matrices, zero biases, unit LayerNorms).

    Generated one tensor at a time in float32 and cast, so a big preset fits in memory.
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in tqdm(sorted(expected_shapes(config.replace(quantization=None)).items()), desc="generating",
                            unit="tensor", disable=not progress):
        if ".ln_" in name or name.startswith("transformer.ln_f"):
            t = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        elif name.endswith("bias"):
            t = torch.zeros(shape)
        else:
            t = torch.empty(shape).normal_(0.0, std, generator=gen)
        out[name] = t.to(dtype)
    return out


def _shard_groups(state_dict: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in state_dict.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_checkpoint(state_dict: Mapping[str, torch.Tensor], config: GPTJConfig, out: str | os.PathLike,
                    dtype: torch.dtype | None = None, overwrite: bool = False, progress: bool = False,
                    max_shard_bytes: int = MAX_SHARD_BYTES, with_tokenizer: bool = True,
                    extra: Callable[[Path], None] | None = None) -> Path:
    """Write the canonical directory atomically: into a temporary sibling, renamed when complete.

    The state dict is checked (names, shapes, finiteness) before anything is written. A quantized
    model's state dict is saved with its config: `save_checkpoint(model.state_dict(), model.config, out)`.
    `extra(folder)` writes more files (a trainer's state) into the folder before it is moved into place.
    A W8A8 calibration record is not kept: its factors belong to the weights it was made on (calibrate again).
    """
    if not isinstance(config, GPTJConfig):  # another architecture's HF folder (no tokenizer: gptj bundles GPT-J's)
        from gptj.weights.hf_model import save_folder

        return save_folder(state_dict, config, out, dtype=dtype, overwrite=overwrite, progress=progress,
                           max_shard_bytes=max_shard_bytes, extra=extra)
    items = ((n, tuple(t.shape), (lambda t=t: t), Path("<memory>")) for n, t in state_dict.items())
    sd = checked_state_dict(config, items, dtype=dtype)
    return _write_checkpoint(sd, config.replace(calibration=None), Path(out), overwrite, progress, max_shard_bytes,
                             with_tokenizer, extra)


def _write_checkpoint(sd: Mapping[str, torch.Tensor], config: GPTJConfig, out: Path, overwrite: bool,
                      progress: bool, max_shard_bytes: int = MAX_SHARD_BYTES, with_tokenizer: bool = True,
                      extra: Callable[[Path], None] | None = None) -> Path:
    """`extra(folder)` writes more files into the folder before it is moved into place."""
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        raise GptjError(f"{out}: already exists (choose a new --out, or pass --force to replace it)")
    with atomic_folder(out) as tmp:
        first_dtype = next((t.dtype for n, t in sd.items() if t.is_floating_point() and not quant.is_quant_param(n)),
                           torch.float32)
        cfg = config.to_hf_dict() | {"torch_dtype": dtype_name(first_dtype)}
        if config.quantization is not None:  # HF transformers refuses the folder instead of misreading it
            cfg["quantization_config"] = hf_quantization_config(config.quantization)
        _write_json(tmp / CONFIG, cfg)
        _write_json(tmp / "generation_config.json",
                    {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id})
        groups = _shard_groups(sd, max_shard_bytes)
        bar = tqdm(total=len(sd), desc="writing", unit="tensor", disable=not progress)
        weight_map = {}
        for i, names in enumerate(groups):
            fname = hf.SAFETENSORS if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file({n: sd[n].contiguous() for n in names}, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in names})
            bar.update(len(names))
        bar.close()
        if len(groups) > 1:
            total = sum(t.numel() * t.element_size() for t in sd.values())
            _write_json(tmp / hf.SAFETENSORS_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
        if with_tokenizer:
            from gptj.tokenizer import load_tokenizer

            load_tokenizer().save(tmp)
        if extra is not None:
            extra(tmp)
    return out


def convert(src: str | os.PathLike, out: str | os.PathLike, fmt: str = "auto", dtype: torch.dtype | None = None,
            config: str | os.PathLike | GPTJConfig | None = None, overwrite: bool = False,
            progress: bool = False, quantize: str | None = None, group_size: int | None = None,
            also: Callable[[Path, dict[str, torch.Tensor], GPTJConfig], None] | None = None) -> Path:
    """Any supported checkpoint -> the canonical directory (nothing is left behind on failure).

    `also(folder, state_dict, config)` writes more files into the folder before it is moved into
    place (gptj convert --tp N: each rank's tensor-parallel shard, gptj.parallel.shards); if it
    raises, nothing is written.

    `quantize` ("int8" / "int4", `group_size` for int4; "w8a8" / "fp8") writes a quantized checkpoint
    (config.json gets its "quantization" entry; `dtype` then applies to the float tensors). HF
    transformers refuses a quantized checkpoint (a ValueError from from_pretrained); gptj's
    `load_model` loads it. Another architecture's folder (Llama) is written in its HF layout, in the
    dtype its config.json records unless `dtype` says, with its tokenizer and generation_config.json.
    """
    checkpoint = Checkpoint.read(src, config=config, fmt=fmt)
    gptj = checkpoint.arch is GPTJ
    if not gptj:  # nothing rounded by default
        dtype = dtype or getattr(torch, hf.checkpoint_dtype(src))
    cfg, sd = read_checkpoint(checkpoint, dtype, quantize=quantize, group_size=group_size, progress=progress,
                              desc="reading")
    kept = [] if gptj else [n for n in KEPT_FILES if (Path(src) / n).is_file()]
    if cfg.calibration is not None:  # a calibrated float checkpoint keeps its factors
        from gptj.quant.calibrate import CALIBRATION_FILE

        kept.append(CALIBRATION_FILE)

    def extra(folder: Path) -> None:
        copy_files(src, folder, kept)
        if also is not None:
            also(folder, sd, cfg)

    if gptj:
        return _write_checkpoint(sd, cfg, Path(out), overwrite, progress, extra=extra)
    from gptj.weights.hf_model import save_folder

    return save_folder(sd, cfg, out, overwrite=overwrite, progress=progress, extra=extra)


def copy_files(src: str | os.PathLike, folder: Path, names: Iterable[str], missing_ok: bool = False) -> None:
    """Copy the files `names` of model folder `src` (read as model_file allows: none from outside it)
    into `folder`, as they are; with `missing_ok`, names it does not hold are passed over."""
    for name in names:
        if not missing_ok or (Path(src) / name).is_file():
            shutil.copyfile(model_file(src, name), folder / name)


# copied as they are by convert (another architecture's folder): its tokenizer and generation settings
KEPT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "generation_config.json")


def calibrate(folder: str | os.PathLike, prompts: list[list[int]], dataset: str, alpha: float | None = None,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> dict:
    """W8A8 calibration of the float checkpoint in `folder` (gptj.quant.calibrate) on `prompts`
    (token ids, from `dataset`; each cut to the model's context): writes its smoothing factors to folder/calibration.safetensors and
    their record to config.json's `calibration` (each file replaced atomically, the factors first);
    returns the record. Then `--quantize w8a8` can load it."""
    from gptj.quant.calibrate import input_absmax, make_record, save_factors, smoothing

    folder = Path(folder)
    checkpoint = Checkpoint.read(folder)
    if checkpoint.format != "hf":
        raise GptjError(f"{folder}: calibration needs a model folder with config.json (gptj convert makes one)")
    cfg = checkpoint.config
    if cfg.quantization is not None:
        raise GptjError(f"{folder}: already quantized ({cfg.quantization['mode']}): calibrate the float checkpoint")
    alpha = quant.SMOOTH_ALPHA if alpha is None else alpha
    model = load_model(folder, dtype=dtype, device=device)
    absmax, tokens = input_absmax(model, [p[:cfg.n_positions] for p in prompts])  # (each within the context)
    smooth = smoothing(model, absmax, alpha)
    record = make_record(alpha, dataset, len(prompts), tokens)
    save_factors(smooth, folder)
    config_json = json.loads(model_file(folder, CONFIG).read_text())
    config_json["calibration"] = record
    atomic_write_json(folder / CONFIG, config_json)
    return record
