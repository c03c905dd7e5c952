"""The model a training run trains (gptj.train.trainer's): built from a preset or a checkpoint, with
`lora:` its base frozen and adapters added; what its checkpoints hold; how its parameters are grouped
for AdamW, checkpointed in the backward pass, and sharded under FSDP.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gptj.errors import GptjError
from gptj.train.config import TrainConfig
from gptj.train.ranks import Ranks


def check_model_fits(cfg: TrainConfig) -> None:
    """What the model's config alone can refuse, before any data is prepared or weights are read: a
    context shorter than data.seq_len."""
    from gptj.config import get_preset
    from gptj.files import model_file
    from gptj.weights.checkpoint import hf_config

    if cfg.model.preset is not None:
        config = get_preset(cfg.model.preset)
    else:
        folder = Path(cfg.model.checkpoint)
        if not (folder / "config.json").is_file():
            return  # the loader says what is wrong with the folder
        _, config = hf_config(model_file(folder, "config.json"))
    if cfg.data.seq_len > config.n_positions:
        raise GptjError(f"data.seq_len {cfg.data.seq_len} exceeds the model's context of {config.n_positions} "
                        "positions (n_positions)")


def data_tokenizer(cfg: TrainConfig) -> tuple[str | None, str]:
    """(the tokenizer raw data is prepared with, as gptj.train.data takes it: None, GPT-J's packaged
    one, for GPT-J models; another architecture's checkpoint folder, its own tokenizer.json; the
    MLPerf prompt summarization pairs take: "llama" for a Llama, else "gptj"). A folder of another
    architecture without its tokenizer is refused in one line."""
    from gptj.files import model_file
    from gptj.tokenizer import tokenizer_for_model
    from gptj.weights.checkpoint import GPTJ, hf_config

    if cfg.model.checkpoint is None or not (Path(cfg.model.checkpoint) / "config.json").is_file():
        return None, "gptj"
    arch, _ = hf_config(model_file(cfg.model.checkpoint, "config.json"))
    if arch is GPTJ:
        return None, "gptj"
    tokenizer_for_model(cfg.model.checkpoint)  # (the refusal)
    return str(cfg.model.checkpoint), "llama" if arch.model_type == "llama" else "gptj"


def initial_model(cfg: TrainConfig) -> nn.Module:
    """The model training starts from: float32 (every weight trained), or with `lora:` its base held
    as lora.base asks (float32, bfloat16 or int8) and frozen, the adapters added (gptj.lora)."""
    from gptj.config import get_preset
    from gptj.weights.io import load_model, model_from_state_dict, random_state_dict

    base = cfg.lora.base if cfg.lora is not None else "float32"
    dtype = torch.float32 if base == "float32" else torch.bfloat16
    quantize = "int8" if base == "int8" else None
    if cfg.model.preset is not None:
        config = get_preset(cfg.model.preset)
        model = model_from_state_dict(config, random_state_dict(config, seed=cfg.seed, std=cfg.model.init_std))
        if quantize:
            from gptj.quant import quantize_model

            quantize_model(model, quantize)
        model.to(dtype)
    else:  # loaded straight into the base's form: a 6B base in bfloat16 never exists in float32
        model = load_model(cfg.model.checkpoint, dtype=dtype, quantize=quantize)
        if model.config.quantization is not None and quantize is None:
            raise GptjError(f"model.checkpoint: {cfg.model.checkpoint} is quantized; train from float weights")
    if cfg.lora is not None:
        from gptj.lora import apply_lora

        apply_lora(model, lora_config(cfg))
    return model


def lora_config(cfg: TrainConfig):  # noqa: ANN202 - gptj.lora.LoRAConfig
    """The adapters the config's `lora:` section asks for, as gptj.lora takes them."""
    from gptj.lora import LoRAConfig

    spec = cfg.lora
    return LoRAConfig(rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout, target_modules=tuple(spec.target_modules))


def trained_state(model: nn.Module, lora: bool) -> dict[str, torch.Tensor]:
    """What a checkpoint of this run holds: every weight, or (LoRA) the adapters under PEFT's names."""
    if lora:
        from gptj.lora import adapter_state_dict

        return adapter_state_dict(model)
    return model.state_dict()


def lora_of(model: nn.Module) -> bool:
    """Whether `model` trains LoRA adapters (gptj.lora) rather than its weights."""
    from gptj.lora import lora_modules

    return bool(lora_modules(model))


def checkpointed(block: nn.Module) -> None:
    """Recompute this block's activations in the backward pass instead of keeping them."""
    from torch.utils.checkpoint import checkpoint

    plain = type(block).forward

    def forward(self, *args):  # noqa: ANN001, ANN202
        return checkpoint(plain, self, *args, use_reentrant=False)

    block.forward = types.MethodType(forward, block)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (not on biases and LayerNorm weights)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def distribute(model: nn.Module, cfg: TrainConfig, ranks: Ranks, mode: str) -> nn.Module:
    """The model as the run's `mode` trains it: DistributedDataParallel (ddp over several ranks), sharded
    (fsdp), or itself."""
    if mode == "ddp" and ranks.world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[ranks.device.index] if ranks.device.type == "cuda" else None)
    if mode == "fsdp":
        return _fsdp(model, cfg, ranks)
    return model


def _fsdp(model: nn.Module, cfg: TrainConfig, ranks: Ranks) -> nn.Module:
    """Shard parameters, gradients and optimizer state over the ranks (FSDP2's fully_shard: one
    unit per transformer block, then the rest); cpu_offload keeps them in CPU memory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(ranks.device.type, (ranks.world,))
    # On CPU the parameters live in CPU memory anyway (and the offload policy needs an accelerator).
    policy = CPUOffloadPolicy() if cfg.cpu_offload and ranks.device.type != "cpu" else OffloadPolicy()
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model
