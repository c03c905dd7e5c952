"""The one checked read of a checkpoint's tensors, which every architecture's loader runs.

    sd = read_checked(specs, items, dtype=..., device=...)

`items` is the stream a reader produces (gptj.weights.checkpoint.TensorItem: name, shape, read, file),
`specs` what the checkpoint must hold (name -> (shape, dtype): dtype None for any floating point one, an
integer dtype for a quantized weight, kept exactly as stored). Each tensor is read once and checked as
it comes: a name it must hold, not twice, its shape, its dtype, finite values; every error is one line
naming the file. A LoRA adapter (one that fits: Checkpoint.with_adapter checked it) is folded into the
float weights it adapts before they are rounded or quantized, and `quantize` quantizes the weights it
names as soon as they are read, so no float copy of the model is held. A tied weight the checkpoint
leaves out (an LM head tied to the embedding) is its source's, quantized as `quantize` asks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from tqdm import tqdm

from gptj import quant
from gptj.device import dtype_name
from gptj.weights.finite import check_finite
from gptj.errors import CheckpointError
from gptj.weights.peft import Adapter, merged

Specs = Mapping[str, tuple[tuple[int, ...], "torch.dtype | None"]]


def read_checked(specs: Specs, items: Iterable, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu", progress: bool = False, desc: str = "loading",
                 quantize: Mapping | None = None, smooth: Mapping[str, torch.Tensor] | None = None,
                 adapter: Adapter | None = None, skip: tuple[str, ...] = (), tied: Mapping[str, str] | None = None,
                 rename: Mapping[str, str] | None = None, what: str = "a weight") -> dict[str, torch.Tensor]:
    """Every tensor of `items`, checked against `specs` and converted: float ones to `dtype` (None: as
    stored) on `device`, a quantization's scales to its scale dtype. `quantize` (a
    quant.make_quantization dict): the weights of its modules quantized as read (`smooth`: W8A8's
    factors by module). `skip`: name suffixes of buffers old checkpoints saved, passed over;
    `tied`: name -> the name it is tied to (a tied LM head: the embedding's), which may be absent (then
    it is the other's, or its quantized copy) and where stored and float must equal it; `rename`:
    stored name -> the model's, where they differ (Llama's HF names: the specs, `quantize`, `smooth`
    and the result use the model's; errors and the adapter the stored ones); `what`: how an
    unexpected name is called."""
    rename = rename or {}
    stored = {ours: name for name, ours in rename.items()}  # the model's name -> the file's
    qweights = {f"{m}.weight" for m in quantize["modules"]} if quantize is not None else set()
    out: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    bar = tqdm(total=len(specs), desc=desc, unit="tensor", disable=not progress)
    for stored_name, shape, read, file in items:
        if skip and stored_name.endswith(skip):
            continue
        name = rename.get(stored_name, stored_name)
        if name not in specs:
            raise CheckpointError(f"{file}: unexpected tensor {stored_name} (not {what} of this config)")
        if name in seen:
            raise CheckpointError(f"{file}: tensor {stored_name} appears twice")
        seen.add(name)
        want_shape, want_dtype = specs[name]
        if shape != want_shape:
            raise CheckpointError(f"{file}: tensor {stored_name} has shape {list(shape)}, expected {list(want_shape)}")
        tensor = read()
        if adapter is not None and tensor.is_floating_point():
            tensor = merged(tensor, adapter.delta(stored_name))
        if want_dtype is not None:  # a quantized weight: exactly int8 / uint8, kept as is
            if tensor.dtype != want_dtype:
                raise CheckpointError(f"{file}: tensor {stored_name} has dtype {dtype_name(tensor.dtype)}, "
                                      f"expected {dtype_name(want_dtype)} (quantized weight)")
            out[name] = tensor.to(device=device)
        elif not tensor.is_floating_point():
            raise CheckpointError(f"{file}: tensor {stored_name} has dtype {dtype_name(tensor.dtype)}, "
                                  f"expected floating point")
        elif name in qweights:
            check_finite(tensor, stored_name, file)
            out.update(_quantized(name, tensor.to(device), quantize, smooth))  # on the device, from the stored dtype
            del tensor
        else:
            target = quant.SCALE_DTYPE if quant.is_quant_param(name) else (dtype or tensor.dtype)
            tensor = tensor.to(device=device, dtype=target)
            check_finite(tensor, stored_name, file)
            if name.endswith(".weight_scale") and not bool((tensor > 0).all()):
                raise CheckpointError(f"{file}: tensor {stored_name} has scales that are not positive")
            out[name] = tensor
        bar.update()
    bar.close()
    for name, source in (tied or {}).items():
        if name not in seen and source in out:  # left out: the source's (already checked and converted)
            out.update(_quantized(name, out[source], quantize, smooth) if name in qweights else {name: out[source]})
            seen.add(name)
        elif name in out and out[name].is_floating_point() and not torch.equal(out[name], out[source]):
            raise CheckpointError(f"{stored.get(name, name)} is tied to {stored.get(source, source)} "
                                  f"(tie_word_embeddings) but differs from it")
    missing = [n for n in specs if n not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {stored.get(missing[0], missing[0])}{more}")
    return out


def _quantized(name: str, weight: torch.Tensor, quantize: Mapping, smooth: Mapping[str, torch.Tensor] | None
               ) -> dict[str, torch.Tensor]:
    """The tensors of the quantized weight `name` (its module's, quant.quantize_weight's leaves)."""
    module = name[: -len(".weight")]
    return {f"{module}.{leaf}": t for leaf, t in
            quant.quantize_weight(weight, quantize["mode"], quantize["group_size"], (smooth or {}).get(module)).items()}

