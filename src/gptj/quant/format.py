"""The quantized checkpoint's format: its tensors, config.json's `quantization` entry, its modes.

Checkpoint layout (portable: plain safetensors, no kernel-specific packing), for a
quantized linear `M` (e.g. `transformer.h.0.attn.q_proj`):

  int8:  M.weight        int8     (out, in)
         M.weight_scale  bfloat16 (out,)
  int4:  M.weight        uint8    (out, in / 2)  two 4-bit values per byte, HIGH nibble first:
                                  byte[n, j] = q[n, 2j] << 4 | q[n, 2j + 1]
                                  (the input layout of torch._convert_weight_to_int4pack on CUDA)
         M.weight_scale  bfloat16 (out, in / group_size)
         M.weight_zero   bfloat16 (out, in / group_size)
  w4a8:  int4's tensors (the activations are rounded per block of 32 inputs at each call, gptj.quant.w4a8)
  fp8:   M.weight        float8_e4m3fn (out, in)
         M.weight_scale  bfloat16 (out,)
  w8a8:  M.weight        int8     (out, in)       of W * input_smooth (per input column)
         M.weight_scale  bfloat16 (out,)
         M.input_smooth  bfloat16 (in,)          SmoothQuant's factors: the layer runs on x / input_smooth
  both:  M.bias          the model's float dtype, as before (fc_in, fc_out, lm_head)

config.json records `"quantization": {"version": 1, "mode": "int8"|"int4"|"w4a8"|"w8a8"|"fp8", "group_size": null|g,
"modules": [every quantized module name]}`, and for w8a8 its `"calibration"` (how the factors were
made: `make_record`, checked by `check_record`; a calibrated float checkpoint records the same entry
beside its factors file, gptj.quant.calibrate); the format is read from there, never guessed.

HF transformers cannot run these checkpoints (it does not know this format); gptj can. Without a
sign in config.json transformers would load one anyway, its int8 weights taken as floats and its
scales dropped ("weight_scale | UNEXPECTED"), and generate garbage. So config.json also carries
`"quantization_config"` (hf_quantization_config): an entry with no `quant_method`, which
transformers' from_pretrained refuses with a ValueError ("The model's quantization config ... has
no `quant_method` attribute"). A known method would make it run that method's loader on gptj's
tensors, and an unknown one it skips with a warning and loads the floats. gptj never reads the entry.

QUANT_MODES is the one list of quantization modes: the CLI, the benchmarks and the runtime take
their choices from here.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gptj.errors import CheckpointError, GptjError
from gptj.quant.ops import (
    DEFAULT_GROUP_SIZE,
    FP8_DTYPE,
    INT4_GROUP_SIZES,
    SCALE_DTYPE,
    check_group_size,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)

QUANT_MODES = ("int8", "int4", "w4a8", "w8a8", "fp8")
PER_CHANNEL = ("int8", "w8a8", "fp8")  # one scale per output channel: no group size
GROUPED = ("int4", "w4a8")  # int4's weights: a scale and a zero per group of inputs
QUANT_VERSION = 1
_QUANT_KEYS = {"version", "mode", "group_size", "modules"}
_W8A8_KEYS = _QUANT_KEYS | {"calibration"}


def check_mode(mode: object) -> str:
    if mode not in QUANT_MODES:
        raise GptjError(f"unknown quantization mode {mode!r} (choose from {', '.join(QUANT_MODES)})")
    return mode  # type: ignore[return-value]


def quantize_weight(w: torch.Tensor, mode: str, group_size: int | None = None,
                    smooth: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One float weight -> its checkpoint tensors: {"weight", "weight_scale"[, "weight_zero" | "input_smooth"]}.
    smooth: w8a8's smoothing factors (in,) for this layer (required for w8a8)."""
    check_mode(mode)
    if mode == "w8a8":
        if smooth is None:
            raise GptjError("w8a8 quantization needs the layer's smoothing factors (gptj calibrate)")
        smooth = smooth.to(device=w.device, dtype=SCALE_DTYPE)
        q, s = quantize_int8(w, smooth)
        return {"weight": q, "weight_scale": s, "input_smooth": smooth}
    if mode == "int8":
        q, s = quantize_int8(w)
        return {"weight": q, "weight_scale": s}
    if mode == "fp8":
        q, s = quantize_fp8(w)
        return {"weight": q, "weight_scale": s}
    packed, s, z = quantize_int4(w, group_size if group_size is not None else DEFAULT_GROUP_SIZE)
    return {"weight": packed, "weight_scale": s, "weight_zero": z}


def _float_meta_model(config: Any) -> nn.Module:
    """A float model of `config`'s architecture (GPT-J's or Llama's) on the meta device: shapes only."""
    from gptj.models.registry import ARCHITECTURES

    arch = next(a for a in ARCHITECTURES.values() if isinstance(config, a.config_class))
    return arch.build_model(config.replace(quantization=None), device="meta")


def linear_in_features(config: Any) -> dict[str, int]:
    """Module name -> in_features of every nn.Linear of a model (GPT-J or Llama) with `config`."""
    return {n: m.in_features for n, m in _float_meta_model(config).named_modules() if isinstance(m, nn.Linear)}


def fitting_group_size(in_features: Mapping[str, int]) -> int:
    """The default int4 group for layers with these inputs (module name -> in_features):
    DEFAULT_GROUP_SIZE where it divides them all, else the largest supported size that does
    (the tiny preset's 64 inputs take 64); GptjError naming a layer if none does."""
    fits = [g for g in INT4_GROUP_SIZES if all(k % g == 0 for k in in_features.values())]
    if DEFAULT_GROUP_SIZE in fits:
        return DEFAULT_GROUP_SIZE
    if not fits:
        name, k = next((n, k) for n, k in in_features.items() if k % min(INT4_GROUP_SIZES))  # none fits: one fails 32
        raise GptjError(f"no int4 group size ({', '.join(map(str, INT4_GROUP_SIZES))}) divides the {k} inputs of "
                        f"{name} (skip that layer, or use int8)")
    return max(fits)


def _no_group_size(mode: str) -> GptjError:
    return GptjError(f"{mode} quantization is per output channel: a group size applies to {' and '.join(GROUPED)} only")


def make_quantization(config: Any, mode: str, group_size: int | None = None,
                      skip: Sequence[str] = (), calibration: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The `quantization` entry of config.json for quantizing a float GPT-J with `config`.

    mode: "int8" (per output channel; group_size must be None) or "int4" (group_size in
    32/64/128/256 dividing every quantized layer's inputs; by default 128, or where 128 does not
    divide them (small models) the largest size that does, see `fitting_group_size`). skip: module
    names or fnmatch patterns kept in float (e.g. "lm_head", "transformer.h.0.*"). wte is never quantized.
    calibration: w8a8's record of how its smoothing factors were made (gptj.quant.calibrate.make_record).
    """
    check_mode(mode)
    if (mode == "w8a8") != (calibration is not None):
        raise GptjError("w8a8 quantization needs its calibration record" if mode == "w8a8" else
                        f"{mode} quantization takes no calibration (w8a8 does)")
    if mode in PER_CHANNEL:
        if group_size is not None:
            raise _no_group_size(mode)
    elif group_size is not None:
        group_size = check_group_size(group_size)
    if isinstance(skip, str):
        skip = (skip,)
    in_features = linear_in_features(config)
    modules = [n for n in in_features if not any(fnmatch.fnmatchcase(n, p) for p in skip)]
    if not modules:
        raise GptjError("nothing to quantize: every linear layer is skipped")
    if mode in GROUPED and group_size is None:
        group_size = fitting_group_size({n: in_features[n] for n in modules})
    if mode in GROUPED:
        for n in modules:
            if in_features[n] % group_size:
                raise GptjError(f"{mode} group size {group_size} does not divide the {in_features[n]} inputs of {n} "
                                f"(choose a group size that does, or skip it)")
    out = {"version": QUANT_VERSION, "mode": mode, "group_size": group_size, "modules": sorted(modules)}
    if mode == "w8a8":
        out["calibration"] = dict(calibration)
    return out


def hf_quantization_config(q: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's `quantization_config` for a checkpoint quantized as `q`: what makes HF
    transformers refuse the folder (no `quant_method`; see the module's docstring) and says why to
    whoever reads the file."""
    return {"format": "gptj", "mode": q["mode"],
            "note": "gptj's own quantized format (config.json's 'quantization'): load it with gptj; "
                    "HF transformers cannot run it, so no quant_method is given and it refuses the folder"}


CALIBRATION_VERSION = 1
METHOD = "smoothquant"
_RECORD_KEYS = {"version", "method", "alpha", "dataset", "samples", "tokens"}


def make_record(alpha: float, dataset: str, samples: int, tokens: int) -> dict[str, Any]:
    return {"version": CALIBRATION_VERSION, "method": METHOD, "alpha": float(alpha), "dataset": str(dataset),
            "samples": int(samples), "tokens": int(tokens)}


def check_record(record: object, source: str = "config") -> dict[str, Any]:
    """A recorded calibration entry, validated; CheckpointError naming what is wrong."""
    if not isinstance(record, Mapping):
        raise CheckpointError(f"{source}: 'calibration' must be an object, got {type(record).__name__}")
    unknown, missing = set(record) - _RECORD_KEYS, _RECORD_KEYS - set(record)
    if unknown or missing:
        what = f"unknown field {sorted(unknown)[0]!r}" if unknown else f"missing field {sorted(missing)[0]!r}"
        raise CheckpointError(f"{source}: 'calibration' has {what}")
    if record["version"] != CALIBRATION_VERSION or record["method"] != METHOD:
        raise CheckpointError(f"{source}: calibration {record['method']!r} version {record['version']!r} is not "
                              f"supported (this gptj reads {METHOD!r} version {CALIBRATION_VERSION})")
    alpha = record["alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
        raise CheckpointError(f"{source}: calibration alpha must be a number in [0, 1], got {alpha!r}")
    return dict(record)


def check_quantization(q: object, config: Any, source: str = "config") -> dict[str, Any]:
    """Validate a recorded `quantization` entry against the model's shape; CheckpointError if bad."""
    if not isinstance(q, Mapping):
        raise CheckpointError(f"{source}: 'quantization' must be an object, got {type(q).__name__}")
    keys = _W8A8_KEYS if q.get("mode") == "w8a8" else _QUANT_KEYS
    unknown, missing = set(q) - keys, keys - set(q)
    if unknown:
        raise CheckpointError(f"{source}: 'quantization' has unknown field {sorted(unknown)[0]!r}")
    if missing:
        raise CheckpointError(f"{source}: 'quantization' is missing field {sorted(missing)[0]!r}")
    if q["version"] != QUANT_VERSION:
        raise CheckpointError(f"{source}: quantization version {q['version']!r} is not supported "
                              f"(this gptj reads version {QUANT_VERSION})")
    mode, group_size, modules = q["mode"], q["group_size"], q["modules"]
    try:
        check_mode(mode)
        if mode in PER_CHANNEL and group_size is not None:
            raise GptjError(f"{mode} quantization has no group size (it is per output channel)")
        if mode in GROUPED:
            check_group_size(group_size)
    except GptjError as e:
        raise CheckpointError(f"{source}: {e}") from None
    calibration = None
    if mode == "w8a8":
        calibration = check_record(q["calibration"], f"{source}: quantization")
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise CheckpointError(f"{source}: quantization 'modules' must be a non-empty list of module names")
    in_features = linear_in_features(config)
    for m in modules:
        if m not in in_features:
            raise CheckpointError(f"{source}: quantization names {m!r}, not a linear layer of this model")
        if mode in GROUPED and in_features[m] % group_size:
            raise CheckpointError(f"{source}: {mode} group size {group_size} does not divide the inputs of {m}")
    out = {"version": QUANT_VERSION, "mode": mode, "group_size": group_size, "modules": sorted(set(modules))}
    if calibration is not None:
        out["calibration"] = calibration
    return out


def same_request(recorded: Mapping[str, Any], mode: str, group_size: int | None) -> bool:
    """Whether asking for (mode, group_size) is satisfied by a checkpoint quantized as `recorded`."""
    check_mode(mode)
    if mode in PER_CHANNEL and group_size is not None:
        raise _no_group_size(mode)
    if mode in GROUPED and group_size is not None:
        check_group_size(group_size)
    return recorded["mode"] == mode and (group_size is None or recorded["group_size"] == group_size)


def resolve_quantization(config: Any, quantize: str | None, group_size: int | None = None,
                         where: object = "checkpoint") -> dict | None:
    """What to quantize while reading a checkpoint with `config` when asked for `quantize`.

    None when nothing is to be done (no request, or the checkpoint is already quantized that
    way); GptjError when it is quantized differently (re-quantizing quantized weights would
    compound the error: convert from the float checkpoint instead), or w8a8 is asked of a
    checkpoint without its calibration.
    """
    if quantize is None:
        if group_size is not None:
            raise GptjError("a group size needs a quantization mode (int4 or w4a8)")
        return None
    if config.quantization is not None:
        q = config.quantization
        if not same_request(q, quantize, group_size):
            have = q["mode"] + (f" (group size {q['group_size']})" if q["group_size"] else "")
            want = quantize + (f" (group size {group_size})" if group_size else "")
            raise GptjError(f"{where}: already quantized as {have}; cannot quantize it as {want} "
                            f"(quantize the float checkpoint instead)")
        return None
    if quantize == "w8a8" and config.calibration is None:
        raise GptjError(f"{where}: w8a8 needs a calibration: run `gptj calibrate --model {where}` first")
    return make_quantization(config, quantize, group_size, calibration=config.calibration if quantize == "w8a8" else None)


def quantized_specs(config: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Name -> (shape, dtype) of every tensor of a checkpoint with `config` (dtype None: any float).

    For a float config these are the float tensors; a config with `quantization` replaces each
    quantized weight with its quantized tensors.
    """
    meta = _float_meta_model(config)
    specs: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {
        n: (tuple(t.shape), None) for n, t in meta.state_dict().items()}
    q = config.quantization
    if not q:
        return specs
    out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
    modules = set(q["modules"])
    for name, spec in specs.items():
        module, _, leaf = name.rpartition(".")
        if module in modules and leaf == "weight":
            N, K = spec[0]
            if q["mode"] in PER_CHANNEL:
                out[name] = ((N, K), FP8_DTYPE if q["mode"] == "fp8" else torch.int8)
                out[f"{module}.weight_scale"] = ((N,), None)
                if q["mode"] == "w8a8":
                    out[f"{module}.input_smooth"] = ((K,), None)
            else:
                G = K // q["group_size"]
                out[name] = ((N, K // 2), torch.uint8)
                out[f"{module}.weight_scale"] = ((N, G), None)
                out[f"{module}.weight_zero"] = ((N, G), None)
        else:
            out[name] = spec
    return out


QUANT_LEAVES = ("weight_scale", "weight_zero", "input_smooth")  # a quantized linear's tensors beside its weight


def is_quant_param(name: str) -> bool:
    """Scales, zeros and smoothing factors: float tensors kept as bfloat16 whatever the model's dtype."""
    return name.endswith(tuple("." + leaf for leaf in QUANT_LEAVES))


def quantize_state_dict(state_dict: Mapping[str, torch.Tensor], config: Any, mode: str,
                        group_size: int | None = None, skip: Sequence[str] = (),
                        smooth: Mapping[str, torch.Tensor] | None = None,
                        calibration: Mapping[str, Any] | None = None
                        ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A float state dict -> (the quantized checkpoint's tensors, the `quantization` dict).
    w8a8: `smooth` {module: factors} and its `calibration` record (gptj.quant.calibrate)."""
    if config.quantization:
        raise GptjError("the config is already quantized")
    q = make_quantization(config, mode, group_size, skip, calibration)
    weights = {f"{m}.weight" for m in q["modules"]}
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name in weights:
            module = name[: -len(".weight")]
            for leaf, qt in quantize_weight(t, mode, q["group_size"], (smooth or {}).get(module)).items():
                out[f"{module}.{leaf}"] = qt
        else:
            out[name] = t
    return out, q
