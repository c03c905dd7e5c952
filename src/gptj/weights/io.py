"""Loading models and writing the canonical checkpoint.

The canonical on-disk format is an HF-compatible directory: config.json, safetensors
(one file, or shards with model.safetensors.index.json), generation_config.json and the
tokenizer files, so HF transformers loads what gptj writes.

Loading builds the model on the meta device and assigns each tensor as it is read
and converted (`load_state_dict(assign=True)`), so weights are never held twice.
Every tensor is checked for name, shape and finiteness; errors name the tensor and file.

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
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from gptj import quant
from gptj.config import GPTJConfig, check_layer_count, get_preset
from gptj.errors import CheckpointError, GptjError
from gptj.files import atomic_folder, atomic_write_json, model_file
from gptj.models.gptj import GPTJForCausalLM, build_model
from gptj.models.registry import Architecture, architecture
from gptj.quant.format import hf_quantization_config
from gptj.device import check_finite, dtype_name
from gptj.weights import hf, mtj
from gptj.weights.peft import Adapter, merged, read_adapter

CONFIG = "config.json"
MAX_SHARD_BYTES = 2 * 1024**3  # small shards keep peak memory low while writing
_LAYER_NAME = re.compile(r"transformer\.h\.(\d{1,9})\.")  # longer: no layer (the stream check names it)
PROGRESS_MIN_PARAMS = 500_000_000  # progress=None: bars for models this big (gptj-6b loads for a minute)

# (name, shape, read, source file) — the stream every reader produces.
TensorItem = tuple[str, tuple[int, ...], Callable[[], torch.Tensor], Path]


def expected_specs(config: GPTJConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Name -> (shape, dtype) of every tensor a checkpoint with `config` must hold; dtype None means
    any floating point dtype (int8 / uint8 for the weights of a quantized config's linears)."""
    if config.quantization is not None:
        quant.check_quantization(config.quantization, config)
    return quant.quantized_specs(config)


def auto_progress(config: GPTJConfig, progress: bool | None = None) -> bool:
    """progress=None: a bar (tqdm, on stderr) when stderr is a terminal and the model is big enough
    to keep one waiting (PROGRESS_MIN_PARAMS); True / False as given."""
    if progress is not None:
        return progress
    n = sum(math.prod(shape) for shape in expected_shapes(config.replace(quantization=None)).values())
    return n >= PROGRESS_MIN_PARAMS and sys.stderr.isatty()


def expected_shapes(config: GPTJConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a GPT-J checkpoint with `config` must hold."""
    return {name: shape for name, (shape, _) in expected_specs(config).items()}


def detect_format(path: Path) -> str:
    """'hf' (a directory with config.json) or 'mtj' (a slim checkpoint with shard_0/)."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (expected an HF GPT-J directory or a slim checkpoint)")
    if (path / CONFIG).is_file():
        return "hf"
    if mtj.is_mtj_slim(path):
        return "mtj"
    raise CheckpointError(f"{path}: neither an HF GPT-J directory (no {CONFIG}) nor a slim checkpoint (no shard_0/)")


def resolve_config(spec: str | os.PathLike | GPTJConfig | None) -> GPTJConfig:
    """A config from a preset name, a config.json path (or its directory), or a GPTJConfig."""
    if spec is None:
        return get_preset("gptj-6b")
    if isinstance(spec, GPTJConfig):
        return spec
    p = Path(spec)
    if p.is_dir():
        p = model_file(p, CONFIG)
    if p.suffix == ".json" or p.exists():
        return GPTJConfig.from_json_file(p)
    return get_preset(str(spec))


def _mtj_items(path: Path, config: GPTJConfig, progress: bool, dtype: torch.dtype | None) -> Iterator[TensorItem]:
    # The dtype goes down to the reader: it sums the sharded biases (and wte + the embedding bias)
    # in float32 and rounds once to it; rounding to the stored bfloat16 first would lose bits.
    for name, tensor in mtj.iter_mtj_slim(path, config.n_layer, dtype=dtype, progress=progress):
        yield name, tuple(tensor.shape), (lambda t=tensor: t), path


def read_checkpoint(path: str | os.PathLike, config: str | os.PathLike | GPTJConfig | None = None,
                    fmt: str = "auto", progress: bool = False, dtype: torch.dtype | None = None
                    ) -> tuple[GPTJConfig, Iterator[TensorItem]]:
    """The config and a stream of tensors of an HF directory or a slim checkpoint.

    For a slim checkpoint (which carries no config) `config` names it: a preset or a
    config.json; by default gptj-6b. `dtype`: the float dtype the tensors are wanted in, for a
    slim checkpoint's combined tensors to be rounded once, to it (an HF directory's tensors come
    as stored; the caller converts them).
    """
    path = Path(path)
    found = detect_format(path)
    if fmt not in ("auto", found):
        raise CheckpointError(f"{path}: expected a {fmt} checkpoint but found a {found} one")
    # The config is validated (GPTJConfig) and its n_layer checked against the layers the checkpoint's
    # tensor listing names before any tensor table is built or any weight read.
    if found == "hf":
        cfg = GPTJConfig.from_json_file(model_file(path, CONFIG))
        if config is not None and resolve_config(config) != cfg:
            raise CheckpointError(f"{path}: its config.json differs from the config given")
        listed = hf.listed_tensor_names(path)
        if listed is not None:  # a single .bin lists nothing until unpickled: its tensors are checked as read
            names, listing = listed
            check_layer_count(cfg, layers_named(names), str(path / CONFIG), listing.name)
        if cfg.quantization is not None:
            cfg = cfg.replace(quantization=quant.check_quantization(cfg.quantization, cfg, str(path / CONFIG)))
        return cfg, hf.iter_hf_tensors(path)
    cfg = resolve_config(config)
    check_layer_count(cfg, mtj.count_layers(path), _config_source(config), f"{path.name}/shard_*/*.npz")
    return cfg, _mtj_items(path, cfg, progress, dtype)


def layers_named(names: Iterable[str]) -> int:
    """How many layers tensor names cover: 1 + the highest i of a `transformer.h.{i}.` name (0 if none)."""
    layers = [int(m.group(1)) for n in names if (m := _LAYER_NAME.match(n))]
    return max(layers) + 1 if layers else 0


def _config_source(spec: str | os.PathLike | GPTJConfig | None) -> str:
    """How an error names the config resolve_config(spec) gives."""
    if spec is None:
        return "preset 'gptj-6b'"
    if isinstance(spec, GPTJConfig):
        return "the config given"
    p = Path(spec)
    if p.is_dir():
        return str(p / CONFIG)
    return str(p) if p.suffix == ".json" or p.exists() else f"preset {str(spec)!r}"


def checked_state_dict(config: GPTJConfig, items: Iterable[TensorItem], dtype: torch.dtype | None = None,
                       device: torch.device | str = "cpu", progress: bool = False,
                       desc: str = "loading", quantize: Mapping | None = None,
                       smooth: Mapping[str, torch.Tensor] | None = None,
                       adapter: Adapter | None = None) -> dict[str, torch.Tensor]:
    """Read every tensor once, check name/shape/dtype/finiteness, convert to dtype and device.
    `adapter`: a LoRA adapter folded into the float weights it adapts as they are read (before
    they are rounded to `dtype` or quantized; gptj.weights.peft).

    `dtype` applies to float tensors only: quantized weights keep int8/uint8 and their scales and
    zeros stay bfloat16. `quantize` (a `quant.make_quantization` dict, for a float `config`):
    quantize each weight it names as soon as it is read, so no float copy of the model is held.
    """
    specs = expected_specs(config)
    if quantize is not None:
        if config.quantization is not None:
            raise GptjError("the checkpoint is already quantized")
        qweights = {f"{m}.weight" for m in quantize["modules"]}
    else:
        qweights = set()
    if adapter is not None:
        adapter.check_fits({name: shape for name, (shape, _) in specs.items()}, config.n_layer)
    out: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    bar = tqdm(total=len(specs), desc=desc, unit="tensor", disable=not progress)
    for name, shape, read, file in items:
        if hf.is_legacy_buffer(name):
            continue
        if name not in specs:
            raise CheckpointError(f"{file}: unexpected tensor {name} (not a GPT-J weight of this config)")
        if name in seen:
            raise CheckpointError(f"{file}: tensor {name} appears twice")
        seen.add(name)
        want_shape, want_dtype = specs[name]
        if shape != want_shape:
            raise CheckpointError(f"{file}: tensor {name} has shape {list(shape)}, expected {list(want_shape)}")
        tensor = read()
        if adapter is not None and tensor.is_floating_point():
            tensor = merged(tensor, adapter.delta(name))
        if want_dtype is not None:  # a quantized weight: exactly int8 / uint8, kept as is
            if tensor.dtype != want_dtype:
                raise CheckpointError(f"{file}: tensor {name} has dtype {dtype_name(tensor.dtype)}, "
                                      f"expected {dtype_name(want_dtype)} (quantized weight)")
            out[name] = tensor.to(device=device)
        elif not tensor.is_floating_point():
            raise CheckpointError(f"{file}: tensor {name} has dtype {dtype_name(tensor.dtype)}, "
                                  f"expected floating point")
        elif name in qweights:
            check_finite(tensor, name, file)
            module = name[: -len(".weight")]  # quantized on the target device (fast on a GPU), from the stored dtype
            for leaf, t in quant.quantize_weight(tensor.to(device), quantize["mode"], quantize["group_size"],
                                                 (smooth or {}).get(module)).items():
                out[f"{module}.{leaf}"] = t
            del tensor
        else:
            target = quant.SCALE_DTYPE if quant.is_quant_param(name) else (dtype or tensor.dtype)
            tensor = tensor.to(device=device, dtype=target)
            check_finite(tensor, name, file)
            if name.endswith(".weight_scale") and not bool((tensor > 0).all()):
                raise CheckpointError(f"{file}: tensor {name} has scales that are not positive")
            out[name] = tensor
        bar.update()
    bar.close()
    missing = [n for n in specs if n not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]}{more}")
    return out


def model_from_state_dict(config: GPTJConfig, state_dict: Mapping[str, torch.Tensor],
                          device: torch.device | str = "cpu") -> GPTJForCausalLM:
    model = build_model(config, device="meta")
    if config.quantization is not None:
        quant.swap_quantized_modules(model, config.quantization)
    model.load_state_dict(state_dict, strict=True, assign=True)
    model.init_buffers(device)
    quant.prepare_model(model)  # pack quantized weights for the device's kernels
    return model.eval()


def resolve_quantization(config: GPTJConfig, quantize: str | None, group_size: int | None = None,
                         where: object = "checkpoint") -> dict | None:
    """What to quantize while reading a checkpoint with `config` when asked for `quantize`.

    None when nothing is to be done (no request, or the checkpoint is already quantized that
    way); GptjError when it is quantized differently (re-quantizing quantized weights would
    compound the error: convert from the float checkpoint instead).
    """
    if quantize is None:
        if group_size is not None:
            raise GptjError("a group size needs a quantization mode (int4)")
        return None
    if config.quantization is not None:
        q = config.quantization
        if not quant.same_request(q, quantize, group_size):
            have = q["mode"] + (f" (group size {q['group_size']})" if q["group_size"] else "")
            want = quantize + (f" (group size {group_size})" if group_size else "")
            raise GptjError(f"{where}: already quantized as {have}; cannot quantize it as {want} "
                            f"(quantize the float checkpoint instead)")
        return None
    if quantize == "w8a8" and config.calibration is None:
        raise GptjError(f"{where}: w8a8 needs a calibration: run `gptj calibrate --model {where}` first")
    return quant.make_quantization(config, quantize, group_size,
                                   calibration=config.calibration if quantize == "w8a8" else None)


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               config: str | os.PathLike | GPTJConfig | None = None, progress: bool | None = None,
               quantize: str | None = None, group_size: int | None = None,
               adapter: Adapter | None = None) -> GPTJForCausalLM:
    """Load a GPT-J from an HF directory (gptj's own format included) or a slim checkpoint.

    `dtype` is the float dtype (activations, embeddings, norms, biases). A quantized checkpoint
    loads into quantized modules. `quantize` ("int8" / "int4", with `group_size` for int4)
    quantizes a float checkpoint tensor by tensor while loading, after `adapter` (a LoRA adapter,
    gptj.weights.peft) is folded into the float weights it adapts. `progress`: a bar on stderr; None
    draws one for a big model (gptj-6b) when stderr is a terminal (`auto_progress`).

    An HF folder of another architecture (config.json's model_type, gptj.models.registry: Llama)
    loads through gptj.weights.hf_model; an unknown model_type is one line naming the supported ones.
    """
    arch = other_architecture(path, config)
    if arch is not None:
        from gptj.weights.hf_model import load_folder

        return load_folder(path, arch, dtype=dtype, device=device, quantize=quantize, group_size=group_size,
                           progress=progress, adapter=adapter)
    cfg, items = read_checkpoint(path, config, progress=False, dtype=dtype)
    hf_dir = detect_format(Path(path)) == "hf"
    progress = auto_progress(cfg, progress)
    if progress and not hf_dir:  # a slim checkpoint's reader draws its own bar (per leaf across shards)
        cfg, items = read_checkpoint(path, config, progress=True, dtype=dtype)
    q = resolve_quantization(cfg, quantize, group_size, where=path)
    sd = checked_state_dict(cfg, items, dtype=dtype, device=device, progress=progress and hf_dir, quantize=q,
                            smooth=w8a8_factors(q, cfg, path), adapter=adapter)
    if q is not None:
        cfg = cfg.replace(quantization=q, calibration=None)  # w8a8: the record moved into `quantization`
    return model_from_state_dict(cfg, sd, device)


def other_architecture(path: str | os.PathLike, config: object = None) -> Architecture | None:
    """The architecture of the HF folder `path` when its config.json names one other than GPT-J
    (None: GPT-J's loader reads it, as it always has; also for a config given or one it cannot read)."""
    if config is not None or not (Path(path) / CONFIG).is_file():
        return None
    from gptj.weights.hf_model import model_type_of

    model_type = model_type_of(path)
    if model_type is None or model_type == "gptj":
        return None
    return architecture(model_type, str(Path(path) / CONFIG))


def w8a8_factors(q: Mapping | None, config: GPTJConfig, folder: str | os.PathLike) -> dict | None:
    """The smoothing factors a w8a8 quantization `q` of the float checkpoint in `folder` needs (else None)."""
    if q is None or q["mode"] != "w8a8":
        return None
    from gptj.quant.calibrate import CALIBRATION_FILE, load_factors

    model_file(folder, CALIBRATION_FILE)
    return load_factors(Path(folder), q["modules"], quant.linear_in_features(config))


def shard_file(folder: str | os.PathLike, rank: int, world: int) -> Path:
    """Where `gptj convert --tp N` puts rank's tensors: DIR/tp{N}/rank{r}.safetensors."""
    return Path(folder) / f"tp{world}" / f"rank{rank}.safetensors"


@dataclass(frozen=True)
class Checkpoint:
    """What the runtime's load reads of a model folder before any tensor, once (Checkpoint.read):
    the quantization mode recorded in its config.json (`mode`: None when there is none, or when the
    config cannot be read, which the loader then reports); for tensor rank `rank` of --tp N, its own
    shard file (`shard`, from `gptj convert --tp N`; None without one) with the config (`config`)
    its model is built from; the LoRA adapter folded into its weights as they load (`adapter`)."""

    folder: str | os.PathLike
    mode: str | None = None
    shard: Path | None = None
    config: GPTJConfig | None = None
    adapter: Adapter | None = None

    @classmethod
    def read(cls, folder: str | os.PathLike, rank: int = 0, world: int = 1, lora: str | None = None) -> Checkpoint:
        """`folder` for tensor rank `rank` of `world` (1: the whole model), with the adapter in the
        folder `lora` (None: none). Its files are read as model_file allows (a link out of the folder
        is a one-line GptjError); a bad adapter, or one on a quantized checkpoint, is one too."""
        shard = shard_file(folder, rank, world) if world > 1 else None
        adapter = None if lora is None else read_adapter(lora)
        config = None
        if shard is not None and shard.is_file():
            shard = model_file(folder, shard.relative_to(folder))
            config = GPTJConfig.from_json_file(model_file(folder, CONFIG))
            recorded = config.quantization
        else:
            shard = None
            try:
                recorded = json.loads(model_file(folder, CONFIG).read_text()).get("quantization")
            except (OSError, ValueError, AttributeError):
                recorded = None
        if adapter is not None and recorded is not None:
            raise GptjError(f"--lora: {folder} is quantized; a LoRA adapter merges into float weights")
        return cls(folder, _mode(recorded), shard, config, adapter)


def _mode(quantization: object) -> str | None:
    return quantization.get("mode") if isinstance(quantization, dict) else None


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
    place (gptj convert --tp N: each rank's tensor-parallel shard, from gptj.parallel.tp); if it
    raises, nothing is written.

    `quantize` ("int8" / "int4", `group_size` for int4) writes a quantized checkpoint (config.json
    gets its "quantization" entry; `dtype` then applies to the float tensors). HF transformers
    refuses a quantized checkpoint (a ValueError from from_pretrained); gptj's `load_model` loads it.
    """
    arch = other_architecture(src, config)
    if arch is not None:
        return _convert_folder(src, out, arch, dtype, overwrite, progress, quantize, group_size, also)
    cfg, items = read_checkpoint(src, config, fmt=fmt, progress=progress, dtype=dtype)
    q = resolve_quantization(cfg, quantize, group_size, where=src)
    # A slim checkpoint's reader draws its own bar (per leaf across shards); one bar is enough.
    own_bar = progress and detect_format(Path(src)) == "hf"
    sd = checked_state_dict(cfg, items, dtype=dtype, progress=own_bar, desc="reading", quantize=q,
                            smooth=w8a8_factors(q, cfg, src))
    if q is not None:
        cfg = cfg.replace(quantization=q, calibration=None)  # w8a8: the record moved into `quantization`
    extras = []
    if cfg.calibration is not None:  # a calibrated float checkpoint keeps its factors
        from gptj.quant.calibrate import CALIBRATION_FILE

        extras.append(lambda folder: shutil.copyfile(model_file(src, CALIBRATION_FILE), folder / CALIBRATION_FILE))
    if also is not None:
        extras.append(lambda folder: also(folder, sd, cfg))

    def extra(folder: Path) -> None:
        for write in extras:
            write(folder)

    return _write_checkpoint(sd, cfg, Path(out), overwrite, progress, extra=extra)


# copied as they are by convert (another architecture's folder): its tokenizer and generation settings
KEPT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "generation_config.json")


def _convert_folder(src: str | os.PathLike, out: str | os.PathLike, arch: Architecture, dtype: torch.dtype | None,
                    overwrite: bool, progress: bool, quantize: str | None, group_size: int | None,
                    also: Callable | None) -> Path:
    """convert for an HF folder of another architecture (Llama): read in `dtype` (default: the one its
    config.json records, so nothing is rounded) and written again in gptj's layout, with the
    folder's tokenizer and generation_config.json (its EOS ids) as they are; float only so far."""
    from gptj.weights.hf_model import load_folder, save_folder

    if quantize is not None or group_size is not None or also is not None:
        raise GptjError(f"{src}: gptj convert writes a {arch.model_type} folder in float only so far "
                        "(no --quantize, no --tp; quantize on load instead)")
    dtype = dtype or getattr(torch, hf.checkpoint_dtype(src))
    model = load_folder(src, arch, dtype=dtype, progress=progress)

    def kept_files(folder: Path) -> None:
        for name in KEPT_FILES:
            if (Path(src) / name).is_file():
                shutil.copyfile(model_file(src, name), folder / name)

    return save_folder(model.state_dict(), model.config, out, dtype=dtype, overwrite=overwrite, progress=progress,
                       extra=kept_files)


def calibrate(folder: str | os.PathLike, prompts: list[list[int]], dataset: str, alpha: float | None = None,
              dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> dict:
    """W8A8 calibration of the float checkpoint in `folder` (gptj.quant.calibrate) on `prompts`
    (token ids, from `dataset`): writes its smoothing factors to folder/calibration.safetensors and
    their record to config.json's `calibration` (each file replaced atomically, the factors first);
    returns the record. Then `--quantize w8a8` can load it."""
    from gptj.quant.calibrate import input_absmax, make_record, save_factors, smoothing

    folder = Path(folder)
    if detect_format(folder) != "hf":
        raise GptjError(f"{folder}: calibration needs a model folder with config.json (gptj convert makes one)")
    cfg = GPTJConfig.from_json_file(model_file(folder, CONFIG))
    if cfg.quantization is not None:
        raise GptjError(f"{folder}: already quantized ({cfg.quantization['mode']}): calibrate the float checkpoint")
    alpha = quant.SMOOTH_ALPHA if alpha is None else alpha
    model = load_model(folder, dtype=dtype, device=device)
    absmax, tokens = input_absmax(model, prompts)
    smooth = smoothing(model, absmax, alpha)
    record = make_record(alpha, dataset, len(prompts), tokens)
    save_factors(smooth, folder)
    config_json = json.loads(model_file(folder, CONFIG).read_text())
    config_json["calibration"] = record
    atomic_write_json(folder / CONFIG, config_json)
    return record
