"""The training config: a YAML file, checked by pydantic, with `--set key=value` overrides.

    model:      {preset: tiny}  or  {checkpoint: path/to/model}    (what to start from)
    data:       {train: {text: [files]}, eval: {...}, seq_len: 128}
                (a source is one of: text: [plain or .jsonl files], summarization: cnn_eval.json,
                 prepared: a folder written by `gptj prepare-data`, cerebras_hdf5: a folder of the
                 Cerebras model zoo's GPT data, *.h5)
    optimizer:  {lr, betas, eps, weight_decay}                      (AdamW)
    schedule:   {warmup_steps, min_lr}                              (linear warm-up, then cosine)
    batch_size (sequences per rank per micro-step), grad_accum_steps, grad_clip, precision
    (float32 | bf16: bfloat16 autocast over float32 weights), activation_checkpointing,
    max_steps, eval_interval, eval_batches, checkpoint_interval, keep_checkpoints, log_interval,
    seed, out, distributed (auto | none | ddp | fsdp), cpu_offload (fsdp), tensorboard.
    lora:       {rank, alpha, dropout, target_modules, base}        (a LoRA fine-tune: gptj.lora;
                `--set lora.rank=8` turns it on; base: float32 | bfloat16 | int8, the frozen weights)

Relative input paths in the file (data files and folders, model.checkpoint) are relative to the
file's own folder, so a config runs from anywhere; those given with `--set`, and `out` (where the
run is written), are relative to the working directory. Every error is one line naming the key:
`optimizer.lr: ...`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gptj.errors import GptjError

_STRICT = ConfigDict(extra="forbid")


class ModelSpec(BaseModel):
    model_config = _STRICT
    preset: str | None = None  # a gptj preset (tiny, small, gptj-6b): random initial weights (seed)
    checkpoint: str | None = None  # a model folder (HF or gptj format) to fine-tune
    init_std: float = Field(0.02, gt=0)  # with preset: normal(0, init_std) matrices, as HF initializes GPT-J

    @model_validator(mode="after")
    def one_source(self) -> ModelSpec:
        if (self.preset is None) == (self.checkpoint is None):
            raise ValueError("give exactly one of model.preset or model.checkpoint")
        return self


class DataSource(BaseModel):
    model_config = _STRICT
    text: list[str] | None = None  # plain text files (one document each) or .jsonl files
    jsonl_key: str = "text"
    summarization: str | None = None  # a cnn_eval.json-format file: prompt/response pairs
    prepared: str | None = None  # a folder written by gptj prepare-data
    cerebras_hdf5: str | None = None  # a folder of the Cerebras model zoo's GPT data (*.h5; gptj.train.data)

    @model_validator(mode="after")
    def one_kind(self) -> DataSource:
        given = [k for k in ("text", "summarization", "prepared", "cerebras_hdf5") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of text, summarization, prepared or cerebras_hdf5")
        if self.text is not None and not self.text:
            raise ValueError("text: at least one file")
        return self

    def files(self) -> list[Path]:
        """The raw files this source reads (none for a prepared folder)."""
        if self.text is not None:
            return [Path(p) for p in self.text]
        return [Path(self.summarization)] if self.summarization is not None else []


class DataSpec(BaseModel):
    model_config = _STRICT
    train: DataSource
    eval: DataSource | None = None
    seq_len: int = Field(2048, ge=2)


class OptimizerSpec(BaseModel):
    model_config = _STRICT
    lr: float = Field(3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)


class ScheduleSpec(BaseModel):
    model_config = _STRICT
    warmup_steps: int = Field(0, ge=0)
    min_lr: float = Field(0.0, ge=0)  # the cosine ends here at max_steps


class LoRASpec(BaseModel):
    """A LoRA fine-tune (gptj.lora): the base frozen, only the adapters trained and written, in HF
    PEFT's format. `--set lora.rank=8` turns it on with the defaults."""

    model_config = _STRICT
    rank: int = Field(ge=1)
    alpha: float = Field(8.0, gt=0)  # the update's scale is alpha / rank (PEFT's default alpha: 8)
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapter's input, training only
    # GPT-J's linears (q/k/v/out_proj, fc_in/out) or Llama's (q/k/v/o_proj, gate/up/down_proj): the model's
    target_modules: list[Literal["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out", "o_proj", "gate_proj",
                                 "up_proj", "down_proj"]] = ["q_proj", "v_proj"]
    base: Literal["float32", "bfloat16", "int8"] = "float32"  # how the frozen base is held in memory

    @model_validator(mode="after")
    def some_targets(self) -> LoRASpec:
        if not self.target_modules:
            raise ValueError("target_modules: at least one of the model's linears (GPT-J's q_proj, k_proj, v_proj, "
                             "out_proj, fc_in, fc_out; Llama's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                             "down_proj)")
        return self


class TrainConfig(BaseModel):
    model_config = _STRICT
    model: ModelSpec
    data: DataSpec
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    batch_size: int = Field(8, ge=1)  # sequences per rank per micro-step
    grad_accum_steps: int = Field(1, ge=1)  # micro-steps per optimizer step
    grad_clip: float | None = Field(1.0, gt=0)  # global gradient-norm clipping (None: off)
    precision: Literal["float32", "bf16"] = "float32"
    activation_checkpointing: bool = False
    max_steps: int = Field(1000, ge=1)
    eval_interval: int = Field(0, ge=0)  # steps between evaluations (0: only at the end, if data.eval)
    eval_batches: int = Field(0, ge=0)  # batches per evaluation (0: the whole eval set)
    checkpoint_interval: int = Field(0, ge=0)  # steps between checkpoints (0: none before the end)
    keep_checkpoints: int = Field(2, ge=1)
    log_interval: int = Field(10, ge=1)
    seed: int = Field(0, ge=0)
    out: str = "runs/train"
    distributed: Literal["auto", "none", "ddp", "fsdp"] = "auto"  # auto: ddp under torchrun, else none
    cpu_offload: bool = False  # fsdp: parameters and gradients live in CPU memory between uses
    tensorboard: bool = False  # also log to OUT/tensorboard (needs the tensorboard package)
    lora: LoRASpec | None = None  # a LoRA fine-tune instead of training every weight

    @model_validator(mode="after")
    def consistent(self) -> TrainConfig:
        if self.schedule.warmup_steps > self.max_steps:
            raise ValueError(f"schedule.warmup_steps ({self.schedule.warmup_steps}) exceeds max_steps "
                             f"({self.max_steps})")
        if self.schedule.min_lr > self.optimizer.lr:
            raise ValueError("schedule.min_lr exceeds optimizer.lr")
        if self.cpu_offload and self.distributed != "fsdp":
            raise ValueError("cpu_offload needs distributed: fsdp")
        if self.lora is not None and self.distributed == "fsdp":
            raise ValueError("lora with distributed: fsdp is not supported (a LoRA's trainable state is small: use ddp)")
        if self.lora is not None and self.lora.base != "float32" and self.precision != "bf16":
            raise ValueError(f"lora.base: {self.lora.base} computes in bfloat16: set precision: bf16")
        return self

    def fingerprint(self) -> dict[str, Any]:
        """What must not change between a run and its --resume (the rest may, e.g. max_steps)."""
        keep = self.model_dump(mode="json", include={"model", "data", "optimizer", "batch_size", "grad_accum_steps",
                                                     "seed", "precision", "lora"})
        return json.loads(json.dumps(keep))


def _parse_value(text: str) -> Any:
    """A --set value: YAML scalar or flow syntax (1e-3, true, [a, b], {x: 1}); else the string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`optimizer.lr=1e-3` sets raw["optimizer"]["lr"] (creating sections as needed)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise GptjError(f"--set {item!r}: expected KEY=VALUE, e.g. optimizer.lr=1e-3")
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise GptjError(f"--set {item!r}: {part} is not a section")
            node = child
        node[parts[-1]] = _parse_value(value)
    return raw


def _message(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return f"{loc}: unknown key"
    if kind == "missing":
        return f"{loc}: required"
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read, override and check a config; GptjError (one line) for any problem, including a data
    file or model folder that does not exist."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GptjError(f"{p}: no such config file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GptjError(f"{p}: cannot read: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise GptjError(f"{p}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise GptjError(f"{p}: the top level must be a mapping of keys, got {type(raw).__name__}")
    _resolve_inputs(raw, p.absolute().parent)  # before the overrides: theirs stay as the user typed them
    raw = apply_overrides(raw, overrides or [])
    try:
        cfg = TrainConfig.model_validate(raw)
    except ValidationError as e:
        raise GptjError(f"{p}: {_message(e)}") from None
    _check_paths(cfg, p)
    return cfg


def _resolve_inputs(raw: dict[str, Any], folder: Path) -> None:
    """Make the relative input paths of a config file's raw mapping relative to `folder` (the
    file's own). Values of the wrong type are left for validation to name."""

    def resolved(value: Any) -> Any:
        if not isinstance(value, str) or not value:
            return value
        value = os.path.expanduser(value)
        return value if os.path.isabs(value) else os.path.normpath(folder / value)

    model = raw.get("model")
    if isinstance(model, dict) and "checkpoint" in model:
        model["checkpoint"] = resolved(model["checkpoint"])
    data = raw.get("data")
    if not isinstance(data, dict):
        return
    for split in ("train", "eval"):
        source = data.get(split)
        if not isinstance(source, dict):
            continue
        for key in ("summarization", "prepared", "cerebras_hdf5"):
            if key in source:
                source[key] = resolved(source[key])
        if isinstance(source.get("text"), list):
            source["text"] = [resolved(v) for v in source["text"]]


def _check_paths(cfg: TrainConfig, source: Path) -> None:
    if cfg.model.checkpoint is not None and not Path(cfg.model.checkpoint).is_dir():
        raise GptjError(f"{source}: model.checkpoint: {cfg.model.checkpoint}: no such model folder")
    if cfg.model.preset is not None:
        from gptj.config import PRESETS
        from gptj.models import llama

        if cfg.model.preset in llama.PRESETS:  # (no tokenizer of its own: `gptj init` trains a stand-in one)
            raise GptjError(f"{source}: model.preset: {cfg.model.preset} is a Llama preset: write it with gptj init "
                            f"--preset {cfg.model.preset} --out DIR (its weights and tokenizer) and train from "
                            "model.checkpoint: DIR")
        if cfg.model.preset not in PRESETS:
            raise GptjError(f"{source}: model.preset: unknown preset {cfg.model.preset!r} "
                            f"(known: {', '.join(sorted(PRESETS))})")
    for split in ("train", "eval"):
        src = getattr(cfg.data, split)
        if src is None:
            continue
        for key in ("prepared", "cerebras_hdf5"):
            if getattr(src, key) is not None and not Path(getattr(src, key)).is_dir():
                raise GptjError(f"{source}: data.{split}.{key}: {getattr(src, key)}: no such folder")
        for f in src.files():
            if not f.is_file():
                raise GptjError(f"{source}: data.{split}: {f}: no such file")
