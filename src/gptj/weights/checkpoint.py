"""What a model folder holds, read once before any tensor: `Checkpoint.read`.

    checkpoint = Checkpoint.read(folder)        its format, architecture and config (checked); under
                                                --tp N a rank's own shard; a LoRA adapter to fold in
    checkpoint.tensors(dtype=...)               the stream of its tensors the loaders read

Formats: an HF directory (config.json + safetensors or .bin, gptj's own folders included; its
config.json's model_type picks the architecture, gptj.models.registry) or a mesh-transformer-jax
slim checkpoint (shard_0/ ...; GPT-J only; it carries no config, so `config` names one: a preset
or a config.json, by default gptj-6b). Every error is one line naming the file.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptj import quant
from gptj.config import GPTJConfig, check_layer_count, get_preset, read_json
from gptj.errors import CheckpointError, GptjError
from gptj.files import model_file
from gptj.models.registry import ARCHITECTURES, Architecture, architecture
from gptj.weights import hf, mtj
from gptj.weights.peft import Adapter, read_adapter

CONFIG = "config.json"
GPTJ = ARCHITECTURES["gptj"]
_LAYER_NAME = re.compile(r"transformer\.h\.(\d{1,9})\.")  # longer: no layer (the stream check names it)

# (name, shape, read, source file) — the stream every reader produces.
TensorItem = tuple[str, tuple[int, ...], Callable[[], torch.Tensor], Path]


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


def config_source(spec: str | os.PathLike | GPTJConfig | None) -> str:
    """How an error names the config resolve_config(spec) gives."""
    if spec is None:
        return "preset 'gptj-6b'"
    if isinstance(spec, GPTJConfig):
        return "the config given"
    p = Path(spec)
    if p.is_dir():
        return str(p / CONFIG)
    return str(p) if p.suffix == ".json" or p.exists() else f"preset {str(spec)!r}"


def layers_named(names: Iterable[str]) -> int:
    """How many layers tensor names cover: 1 + the highest i of a `transformer.h.{i}.` name (0 if none)."""
    layers = [int(m.group(1)) for n in names if (m := _LAYER_NAME.match(n))]
    return max(layers) + 1 if layers else 0


def hf_config(path: Path) -> tuple[Architecture, Any]:
    """The architecture and config of the config.json at `path` (model_type absent: GPT-J, as HF's
    own GPT-J folders sometimes are). A quantized checkpoint of another architecture is refused."""
    d = read_json(path)
    model_type = d.get("model_type") if isinstance(d, dict) else None
    if model_type in (None, "gptj"):
        return GPTJ, GPTJConfig.from_hf_dict(d, source=str(path))
    arch = architecture(model_type, str(path))
    # Errors say both what the folder is not and what is wrong with what it claims to be.
    return arch, arch.config_class.from_hf_dict(d, source=f"{path}: not a GPT-J config (model_type "
                                                         f"{arch.model_type!r}), and not a valid {arch.model_type} one")


def shard_file(folder: str | os.PathLike, rank: int, world: int) -> Path:
    """Where `gptj convert --tp N` puts rank's tensors: DIR/tp{N}/rank{r}.safetensors."""
    return Path(folder) / f"tp{world}" / f"rank{rank}.safetensors"


@dataclass(frozen=True)
class Checkpoint:
    """A model folder as read before any tensor: `format` ('hf' or 'mtj'), `arch` (its architecture),
    `config` (validated: its layer count against the tensors its files list, its quantization
    record checked); under --tp N, rank's own shard file from `gptj convert --tp N` (`shard`; None
    without one); the LoRA adapter folded into its weights as they load (`adapter`). Where its
    tensors are: an HF folder's weight files (`files`, hf.weight_files: none beside a rank's shard),
    a slim checkpoint's shard folders and arrays (`layout`, mtj.scan), each checked once, here."""

    folder: Path
    format: str
    arch: Architecture
    config: Any
    shard: Path | None = None
    adapter: Adapter | None = None
    files: tuple[Path, ...] = ()
    layout: mtj.Layout | None = None

    @classmethod
    def read(cls, folder: str | os.PathLike, rank: int = 0, world: int = 1, lora: str | None = None,
             config: str | os.PathLike | GPTJConfig | None = None, fmt: str = "auto") -> Checkpoint:
        """`folder` for tensor rank `rank` of `world` (1: the whole model), with the adapter in the folder
        `lora` (None: none). `config`: a slim checkpoint's (an HF folder's config.json must equal it);
        `fmt`: the format expected ('auto': either). Its files are read as model_file allows (a link
        out of the folder is a one-line GptjError); so is every error here."""
        path = Path(folder)
        found = detect_format(path)
        if fmt not in ("auto", found):
            raise CheckpointError(f"{path}: expected a {fmt} checkpoint but found a {found} one")
        if found == "mtj":
            cfg, layout = resolve_config(config), mtj.scan(path)
            check_layer_count(cfg, mtj.count_layers(layout), config_source(config), f"{path.name}/shard_*/*.npz")
            checkpoint = cls(path, found, GPTJ, cfg, layout=layout)
        else:
            shard = shard_file(path, rank, world) if world > 1 else None
            shard = model_file(path, shard.relative_to(path)) if shard is not None and shard.is_file() else None
            arch, cfg, files = _read_hf(path, config, listing=shard is None)  # a rank's shard: maybe no other
            checkpoint = cls(path, found, arch, cfg, shard, files=files)
        return checkpoint if lora is None else checkpoint.with_adapter(read_adapter(lora))

    @property
    def mode(self) -> str | None:
        """The quantization mode its config.json records (None: a float checkpoint)."""
        q = getattr(self.config, "quantization", None)
        return q["mode"] if q is not None else None

    @property
    def renames(self) -> dict[str, str] | None:
        """Stored tensor name -> the model's (tensor_names)."""
        return tensor_names(self.arch, self.config)

    @property
    def stored_names(self) -> dict[str, str]:
        """The model's tensor name -> the stored one, where they differ (renames, inverted)."""
        return {ours: name for name, ours in (self.renames or {}).items()}

    def with_adapter(self, adapter: Adapter | None) -> Checkpoint:
        """This checkpoint with `adapter` folded into its float weights as they load (one line if it is
        quantized, adapts another architecture's modules, or does not fit its weights' shapes)."""
        if adapter is None:
            return dataclasses.replace(self, adapter=None)
        if self.mode is not None:
            raise GptjError(f"--lora: {self.folder} is quantized; a LoRA adapter merges into float weights")
        if adapter.layout.arch != self.arch.model_type:
            raise GptjError(f"--lora: {adapter.path} adapts {adapter.layout.arch}'s modules; {self.folder} is a "
                            f"{self.arch.model_type} model")
        stored = self.stored_names
        adapter.check_fits({stored.get(n, n): shape for n, (shape, _) in quant.quantized_specs(self.config).items()},
                           self.config.n_layer)
        return dataclasses.replace(self, adapter=adapter)

    def tensors(self, progress: bool = False, dtype: torch.dtype | None = None) -> Iterator[TensorItem]:
        """Its tensors, one at a time, as stored (an HF folder's). `dtype`: the float dtype they are
        wanted in, for a slim checkpoint's combined tensors (sharded biases, wte + the embedding bias)
        to be summed in float32 and rounded once, to it; `progress`: a slim checkpoint's own bar."""
        if self.format == "hf":
            return hf.iter_hf_tensors(self.files)
        return ((name, tuple(t.shape), (lambda t=t: t), self.folder)
                for name, t in mtj.iter_mtj_slim(self.layout, self.config.n_layer, dtype=dtype, progress=progress))


def _read_hf(path: Path, config: str | os.PathLike | GPTJConfig | None, listing: bool = True
             ) -> tuple[Architecture, Any, tuple[Path, ...]]:
    """An HF folder's architecture, config and weight files (hf.weight_files; `listing` False: none
    are looked for), checked (the config against its tensor listing) before any weight is read."""
    arch, cfg = hf_config(model_file(path, CONFIG))
    if config is not None and resolve_config(config) != cfg:
        raise CheckpointError(f"{path}: its config.json differs from the config given")
    files = tuple(hf.weight_files(path)) if listing else ()
    listed = hf.listed_tensor_names(path) if listing else None
    if listed is not None and arch is GPTJ:  # a single .bin lists nothing until unpickled: checked as read
        names, listing = listed
        check_layer_count(cfg, layers_named(names), str(path / CONFIG), listing.name)
    if cfg.quantization is not None:
        cfg = cfg.replace(quantization=quant.check_quantization(cfg.quantization, cfg, str(path / CONFIG)))
    if listed is not None and arch is not GPTJ:
        check_listing(arch, cfg, *listed)
    return arch, cfg, files


def tensor_names(arch: Architecture, config: Any) -> dict[str, str] | None:
    """Stored (HF) tensor name -> the model's, for an architecture whose module names are not HF's
    (None: they are): every weight's, and beside each the scales, zeros and smoothing factors a
    quantized checkpoint stores under the same module name."""
    if arch.hf_names is None:
        return None
    names = arch.hf_names(config)
    if config.quantization is not None:
        for stored, ours in list(names.items()):
            if stored.endswith(".weight"):
                names.update({stored[:-len("weight")] + leaf: ours[:-len("weight")] + leaf for leaf in quant.QUANT_LEAVES})
    return names


def check_listing(arch: Architecture, config: Any, listed: list[str], listing: Path) -> None:
    """The tensor names a folder of another architecture than GPT-J lists, against its config's (its
    quantization's tensors included), before any weight is read: the first unexpected or missing one,
    in one line (a tied float LM head may be absent)."""
    stored = {ours: name for name, ours in tensor_names(arch, config).items()}
    names = [stored.get(n, n) for n in quant.quantized_specs(config)]
    given = [n for n in listed if not n.endswith(arch.legacy)]
    expected = set(names)
    unexpected = [n for n in given if n not in expected]
    if unexpected:
        raise CheckpointError(f"{listing}: unexpected tensor {unexpected[0]} ({len(unexpected)} unexpected; "
                              f"not a weight of this config)")
    tied, present = bool(getattr(config, "tie_word_embeddings", False)), set(given)
    missing = [n for n in names if n not in present and not (tied and n == "lm_head.weight")]
    if missing:
        raise CheckpointError(f"{listing}: missing tensor {missing[0]} ({len(missing)} missing)")
