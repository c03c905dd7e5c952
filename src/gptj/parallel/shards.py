"""`gptj convert --tp N`'s shard files, for every architecture: each rank's tensors in a file of its own
(FasterTransformer's {N}-gpu/ idea), DIR/tp{N}/rank{r}.safetensors, so that a rank reads only its share.

    write_shards(state_dict, config, folder, world)      the whole model's tensors, cut by the plan of its
                                                         architecture (gptj.parallel.tp, .tp_llama)
    load_rank(checkpoint, rank, world, dtype, device)    the rank's model from its file alone
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from gptj.config import GPTJConfig
from gptj.errors import GptjError
from gptj.parallel.tp import load_gptj_rank, shard_state_dict
from gptj.parallel.tp_llama import load_llama_rank, shard_llama_state_dict
from gptj.weights.checkpoint import Checkpoint, shard_file
from gptj.weights.peft import merged


def write_shards(state_dict: Mapping[str, torch.Tensor], config: Any, folder: Path, world: int) -> None:
    """Every rank's file of the whole model's tensors (gptj's names), in folder/tp{world}/."""
    shard = shard_state_dict if isinstance(config, GPTJConfig) else shard_llama_state_dict
    (folder / f"tp{world}").mkdir()
    for rank in range(world):
        save_file(shard(state_dict, config, rank, world), str(shard_file(folder, rank, world)),
                  metadata={"format": "pt", "tp_rank": str(rank), "tp_world": str(world)})


def load_rank(checkpoint: Checkpoint, rank: int, world: int, dtype: torch.dtype, device: torch.device | str,
              group: dist.ProcessGroup | None = None) -> nn.Module:
    """Rank's model from its shard file alone, as Checkpoint.read(folder, rank, world) found it, with
    the config read there (GptjError if there is no shard), built with its rank-sized blocks and head
    and its checkpoint's adapter folded into its slices of the weights (before they are rounded)."""
    if checkpoint.shard is None:
        raise GptjError(f"{shard_file(checkpoint.folder, rank, world)}: no such shard (write it with gptj convert "
                        f"--tp {world})")
    config = checkpoint.config
    gptj = isinstance(config, GPTJConfig)
    sd = load_file(str(checkpoint.shard), device=str(device))
    if checkpoint.adapter is not None:  # the adapter's whole deltas, cut as the weights were
        sd = _adapted(checkpoint, sd, shard_state_dict if gptj else shard_llama_state_dict, rank, world, device)
    return (load_gptj_rank if gptj else load_llama_rank)(config, sd, world, dtype, device, group)


def _adapted(checkpoint: Checkpoint, sd: dict[str, torch.Tensor], shard: Callable, rank: int, world: int,
             device: torch.device | str) -> dict[str, torch.Tensor]:
    """A rank's tensors with the checkpoint's adapter folded into its slices of the weights (before
    they are rounded): each delta made whole (it names the file's modules: HF's), then cut by `shard`."""
    config, adapter = checkpoint.config, checkpoint.adapter  # it fits: Checkpoint.with_adapter checked it
    stored = checkpoint.stored_names  # the model's name -> the file's
    deltas = {n: d for n in sd if (d := adapter.delta(stored.get(n, n), device)) is not None}
    return {**sd, **{n: merged(sd[n], d) for n, d in shard(deltas, config, rank, world).items()}}
