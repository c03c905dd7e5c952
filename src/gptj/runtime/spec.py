"""What model to run and how (`ModelSpec`), and how big its engine is (`kv_plan`).

A ModelSpec is validated once, when it is made: every command (generate, serve, mlperf, bench)
makes one from its flags (gptj.runtime.flags) and hands it to gptj.runtime.build. The engine's
size is asked for with an `EngineConfig` (gptj.engine.config) and decided by `plan_kv`, the one
sizing rule; `kv_plan` is that rule applied to a spec's model.

torch is imported inside the functions so that `gptj --help` starts without it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gptj.errors import GptjError

if TYPE_CHECKING:
    import torch

    from gptj.config import GPTJConfig
    from gptj.engine.config import EngineConfig, KVPlan


# --dtype's two rules besides a named dtype (every command that runs a model, one default: AUTO).
AUTO = "auto"  # the checkpoint's own dtype, as config.json records it (HF transformers 5's and vLLM's "auto")
FAST = "fast"  # bfloat16 where it runs fast, else float32 (gptj.policy.fast_dtype)


def _positive(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GptjError(f"{what} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    """How to run a model: which checkpoint, its float dtype and device, weight-only quantization,
    tensor x pipeline parallel ranks. (How the engine computes — its kernels, torch.compile, CUDA
    graphs — is the EngineConfig's: one home for those switches.)"""

    path: str | None = None  # the model folder (None: a template, e.g. serve's for each --model)
    # activations, float weights and the KV cache (aliases: fp32, bf16, fp16); AUTO: the checkpoint's
    # (checkpoint_dtype; a template, path None, keeps "auto" until .at(path)); FAST: policy.fast_dtype
    dtype: str = AUTO
    device: str = "cpu"  # cpu, cuda, cuda:N or auto (resolved where the model loads: a rank's, a node's)
    quantize: str | None = None  # weight-only linears, on load (gptj.quant.QUANT_MODES)
    group_size: int | None = None  # int4 group size (None: the loader's default)
    tp: int = 1  # tensor-parallel ranks
    pp: int = 1  # pipeline stages
    lora: str | None = None  # a LoRA adapter folder (HF PEFT format) merged into the weights on load

    def __post_init__(self) -> None:
        from gptj.device import dtype_name, parse_dtype

        if self.path is not None:
            object.__setattr__(self, "path", str(self.path))
        if not isinstance(self.device, str) or not self.device:
            raise GptjError(f"device must be a name (cpu, cuda, cuda:N or auto), got {self.device!r}")
        if self.dtype == FAST:  # resolved once, here: bfloat16 where the device computes it, else float32
            from gptj.device import named_device
            from gptj.policy import fast_dtype

            object.__setattr__(self, "dtype", dtype_name(fast_dtype(named_device(self.device))))
        elif self.dtype == AUTO and self.path is not None:  # resolved once the folder is known
            from gptj.weights.hf import checkpoint_dtype

            object.__setattr__(self, "dtype", checkpoint_dtype(self.path))
        if self.dtype != AUTO:
            object.__setattr__(self, "dtype", dtype_name(parse_dtype(self.dtype)))  # canonical: bf16 -> bfloat16
        if self.quantize is not None:
            from gptj.quant import check_mode

            check_mode(self.quantize)
        if self.group_size is not None:
            _positive("group_size", self.group_size)
        _positive("tp", self.tp)
        _positive("pp", self.pp)
        if self.lora is not None:
            object.__setattr__(self, "lora", str(self.lora))
            if self.world > 1:
                raise GptjError("--lora with --tp / --pp is not supported")
            if self.quantize == "w8a8":
                raise GptjError("--lora with --quantize w8a8 is not supported: its calibration belongs to the base's "
                                "weights (merge the adapter into a copy and calibrate that)")

    @property
    def torch_dtype(self) -> torch.dtype:
        from gptj.device import parse_dtype

        if self.dtype == AUTO:  # a template's: each model's folder decides (.at)
            raise GptjError("dtype auto is the checkpoint's: give the spec a model folder first")
        return parse_dtype(self.dtype)

    @property
    def world(self) -> int:
        """Ranks one model runs on (tp x pp)."""
        return self.tp * self.pp

    def at(self, path: object) -> ModelSpec:
        """This spec for the model folder `path`."""
        return dataclasses.replace(self, path=str(path))


def kv_plan(spec: ModelSpec, model_config: GPTJConfig, engine: EngineConfig, free_bytes: int | None = None,
            device: torch.device | str | None = None) -> KVPlan:
    """The engine's size for `spec`'s model: plan_kv with the spec's KV dtype (its float dtype) and
    this rank's heads (n_head / tp). free_bytes: the free memory to plan within (None: measured
    now on `device`, default the spec's)."""
    from gptj.engine.config import plan_kv
    from gptj.device import resolve_device

    device = resolve_device(spec.device) if device is None else device
    return plan_kv(model_config, spec.torch_dtype, device, engine, n_head=model_config.n_head // spec.tp,
                   free_bytes=free_bytes)
