"""Llama (Llama 2, Llama 3, Llama 3.1) as plain math, beside GPT-J's gptj.py and with its interface.

    h = embed(ids)
    for each layer:  h = h + attn(rmsnorm_1(h));  h = h + mlp(rmsnorm_2(h))     # sequential, pre-norm
    logits = lm_head(rmsnorm_f(h))                                              # float32

    attn: grouped-query attention, RoPE (rotate-half) on q and k; a KV head serves H / KV query heads
    mlp:  down(silu(gate(x)) * up(x))                                           # SwiGLU

Shapes: B batch, T new tokens, S = past + T keys, E hidden_size, I intermediate_size,
H query heads, KV key/value heads, G = H / KV heads per group, D head_dim.

The modules are laid out as GPT-J's (`transformer.wte`, `transformer.h[i]`, `transformer.ln_f`,
`lm_head`) so the code that reaches into a model (the decode loops, the engine's KV planning) finds
the same attributes; the leaves keep HF's Llama names (q_proj ... o_proj, gate_proj, up_proj,
down_proj) so PEFT-style adapters name the same modules. `HF_NAMES` maps HF's state-dict names to
these, and `load_hf_state_dict` loads an HF state dict strictly.

float32 runs HF's eager math op for op (RMSNorm in float32, the rotary angles from HF's inverse
frequencies, softmax in float32, keys and values repeated per group), so greedy decoding is
token-identical to transformers' LlamaForCausalLM; below float32 attention goes through torch's SDPA
(gptj.models.base.attention).

The engine (gptj.engine) serves it as it serves GPT-J: with its per-sequence cache (`per_sequence`)
`step_inputs` builds no mask, the rotary angles come from each row's own positions, and each block
hands `cache.attend` its H query heads and KV key/value heads (every attention backend computes
grouped-query attention: gptj.policy.attention_path). Below float32 gptj.kernels fuses its blocks'
q|k|v and gate|up into one linear each (Block.w_qkv, Block.w_gate_up); bfloat16 linears are packed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from gptj.config import MAX_EMBD, MAX_INNER, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, check_int, check_records, is_int
from gptj.errors import CheckpointError, ConfigError
from gptj.models.base import CausalLM, KVCache, gqa_attention

# --- config ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Llama3RopeScaling:
    """HF's rope_scaling {"rope_type": "llama3", ...}: long wavelengths slowed down by `factor`."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def to_hf_dict(self) -> dict[str, Any]:
        return {"rope_type": "llama3", **dataclasses.asdict(self)}


def _check_number(name: str, value: Any, low: float, high: float, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value <= high:  # NaN fails
        raise ConfigError(f"config field {name!r} must be a number {what}, got {value!r}")


def validate_llama(c: LlamaConfig) -> None:
    """Every rule a LlamaConfig obeys, checked on construction; ConfigError naming the field."""
    check_int("num_hidden_layers", c.num_hidden_layers, 1, MAX_LAYERS)
    check_int("hidden_size", c.hidden_size, 1, MAX_EMBD)
    check_int("intermediate_size", c.intermediate_size, 1, MAX_INNER)
    check_int("num_attention_heads", c.num_attention_heads, 1, c.hidden_size)
    check_int("num_key_value_heads", c.num_key_value_heads, 1, c.num_attention_heads,
               " (at most num_attention_heads)")
    if c.num_attention_heads % c.num_key_value_heads:
        raise ConfigError(f"config field 'num_key_value_heads' ({c.num_key_value_heads}) must divide "
                          f"num_attention_heads ({c.num_attention_heads})")
    check_int("head_dim", c.head_dim, 2, MAX_EMBD)
    if c.head_dim % 2:
        raise ConfigError(f"config field 'head_dim' ({c.head_dim}) must be even (rotary embeddings rotate pairs)")
    check_int("vocab_size", c.vocab_size, 1, MAX_VOCAB)
    check_int("max_position_embeddings", c.max_position_embeddings, 1, MAX_POSITIONS)
    _check_number("rms_norm_eps", c.rms_norm_eps, 0, 1, "in (0, 1]")
    _check_number("rope_theta", c.rope_theta, 1, 1e12, "in (1, 1e12]")
    s = c.rope_scaling
    if s is not None:
        if not isinstance(s, Llama3RopeScaling):
            raise ConfigError(f"config field 'rope_scaling' must be llama3 scaling or null, got {s!r}")
        _check_number("rope_scaling.factor", s.factor, 0, 1e6, "in (0, 1e6]")
        _check_number("rope_scaling.high_freq_factor", s.high_freq_factor, 0, 1e6, "in (0, 1e6]")
        _check_number("rope_scaling.low_freq_factor", s.low_freq_factor, 0, s.high_freq_factor,
                      f"in (0, high_freq_factor {s.high_freq_factor}) (the blend divides by their difference)")
        if s.low_freq_factor == s.high_freq_factor:
            raise ConfigError(f"config field 'rope_scaling.low_freq_factor' must be below high_freq_factor "
                              f"({s.high_freq_factor}), got {s.low_freq_factor!r}")
        check_int("rope_scaling.original_max_position_embeddings", s.original_max_position_embeddings, 1,
                   MAX_POSITIONS)
    if not isinstance(c.tie_word_embeddings, bool):
        raise ConfigError(f"config field 'tie_word_embeddings' must be true or false, got {c.tie_word_embeddings!r}")
    inside = f" (a token id below vocab_size {c.vocab_size})"
    for name in ("bos_token_id", "pad_token_id"):
        if getattr(c, name) is not None:
            check_int(name, getattr(c, name), 0, c.vocab_size - 1, inside + " or null")
    if not isinstance(c.eos_token_ids, tuple) or not c.eos_token_ids:
        raise ConfigError(f"config field 'eos_token_id' must be a token id or a non-empty list, "
                          f"got {c.eos_token_ids!r}")
    for eos in c.eos_token_ids:
        check_int("eos_token_id", eos, 0, c.vocab_size - 1, inside)
    check_records(c)


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a LlamaForCausalLM, with HF's field names (config.json), checked on construction.

    GPT-J's names (n_layer, n_embd, n_head, head_dim, n_positions, inner_dim, eos_token_id) are
    properties, so the code written for GPTJConfig (KV caches, planning) reads a Llama config too.
    """

    model_type: ClassVar[str] = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = None  # type: ignore[assignment]  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)  # HF's eos_token_id: one id or a list (Llama 3.1 Instruct: 3)
    pad_token_id: int | None = None
    quantization: dict | None = None  # gptj.quant.make_quantization's entry: quantized at load, or in the checkpoint
    calibration: dict | None = None  # W8A8 calibration of a float checkpoint (gptj.quant.calibrate's record)

    def __post_init__(self) -> None:
        E, H = self.hidden_size, self.num_attention_heads
        if self.head_dim is None and is_int(E) and is_int(H) and H > 0:  # else validate names the bad field
            if E % H:
                raise ConfigError(f"config field 'hidden_size' ({E}) must be divisible by num_attention_heads "
                                  f"({H}) when head_dim is absent")
            object.__setattr__(self, "head_dim", E // H)
        validate_llama(self)

    # GPT-J's names, for the code shared with GPTJConfig.
    n_layer = property(lambda self: self.num_hidden_layers)
    n_embd = property(lambda self: self.hidden_size)
    n_head = property(lambda self: self.num_attention_heads)
    n_kv_head = property(lambda self: self.num_key_value_heads)
    n_positions = property(lambda self: self.max_position_embeddings)
    inner_dim = property(lambda self: self.intermediate_size)
    rope_dim = property(lambda self: self.head_dim)
    eos_token_id = property(lambda self: self.eos_token_ids[0])

    def replace(self, **changes: Any) -> LlamaConfig:
        return dataclasses.replace(self, **changes)

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json of LlamaForCausalLM (rope_theta / rope_scaling as transformers 4 and 5 read them)."""
        d: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": self.model_type, "hidden_act": "silu",
                             "attention_bias": False, "mlp_bias": False}
        for f in dataclasses.fields(self):
            d[f.name] = getattr(self, f.name)
        for name in ("quantization", "calibration"):
            if d[name] is None:
                del d[name]
        eos = d.pop("eos_token_ids")
        d["eos_token_id"] = eos[0] if len(eos) == 1 else list(eos)
        d["rope_scaling"] = self.rope_scaling.to_hf_dict() if self.rope_scaling is not None else None
        return dict(sorted(d.items()))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config") -> LlamaConfig:
        """From HF's config.json (transformers 4's rope_theta + rope_scaling, or 5's rope_parameters);
        absent optional fields take transformers.LlamaConfig's defaults. One-line ConfigError."""
        try:
            return cls(**_llama_kwargs(d))
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"{source}: {e}") from None


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL = ("num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
             "bos_token_id", "pad_token_id", "quantization", "calibration")


def _llama_kwargs(d: Any) -> dict[str, Any]:
    """LlamaConfig's keyword arguments from an HF config dict; ConfigError for what Llama is not."""
    if not isinstance(d, dict):
        raise ConfigError("expected a JSON object")
    if d.get("model_type") != "llama":
        raise ConfigError(f"not a Llama config (model_type is {d.get('model_type')!r}, expected 'llama')")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {d['hidden_act']!r} is not supported (Llama uses 'silu')")
    for name in ("attention_bias", "mlp_bias"):
        if d.get(name, False) is not False:
            raise ConfigError(f"config field {name!r} must be false (Llama's projections have no bias), "
                              f"got {d[name]!r}")
    for name in _REQUIRED:
        if name not in d:
            raise ConfigError(f"config field {name!r} is missing")
    kwargs = {k: d[k] for k in _REQUIRED + _OPTIONAL if k in d}
    if kwargs.get("num_key_value_heads") is None:  # HF: absent or null means one KV head per query head
        kwargs["num_key_value_heads"] = d["num_attention_heads"]
    eos = d.get("eos_token_id", 2)
    kwargs["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (eos,)
    rope = d.get("rope_parameters")  # transformers 5: theta and scaling in one object
    if isinstance(rope, dict):
        theta, scaling = rope.get("rope_theta", d.get("rope_theta", 10000.0)), rope
    else:
        theta, scaling = d.get("rope_theta", 10000.0), d.get("rope_scaling")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConfigError(f"config field 'rope_theta' must be a number, got {theta!r}")
    kwargs["rope_theta"] = float(theta)
    kwargs["rope_scaling"] = _rope_scaling(scaling)
    return kwargs


def _rope_scaling(s: Any) -> Llama3RopeScaling | None:
    """None (plain RoPE) or the llama3 scaling from HF's rope_scaling / rope_parameters."""
    if s is None:
        return None
    if not isinstance(s, dict):
        raise ConfigError(f"config field 'rope_scaling' must be an object or null, got {s!r}")
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(f"config field 'rope_scaling' has rope_type {kind!r}: only 'llama3' and 'default' "
                          f"are supported")
    if s.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"config field 'partial_rotary_factor' must be 1.0, got {s['partial_rotary_factor']!r}")
    names = [f.name for f in dataclasses.fields(Llama3RopeScaling)]
    for name in names:
        if name not in s:
            raise ConfigError(f"config field 'rope_scaling.{name}' is missing (llama3 rope scaling needs it)")
    return Llama3RopeScaling(**{name: s[name] for name in names})


# Meta's Llama-3.1-8B (-Instruct: the MLPerf llama3.1-8b model; its three end-of-turn/text ids).
LLAMA_3_1_8B = LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=8192),
    max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
    eos_token_ids=(128001, 128008, 128009))

# `gptj init --preset NAME` (models.registry.PRESETS, beside GPT-J's): the real shape, and a tiny one for tests.
PRESETS: dict[str, LlamaConfig] = {
    "llama3.1-8b": LLAMA_3_1_8B,
    "llama-tiny": LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
                              max_position_embeddings=4096, bos_token_id=0, eos_token_ids=(1,)),  # 4096: the
    # bundled articles in its 512-id stand-in tokenizer's tokens (up to 1,931) and 128 new ones fit
}


# --- the math ----------------------------------------------------------------------------------


def rope_frequencies(config: LlamaConfig) -> torch.Tensor:
    """(D/2,) float32 inverse frequencies theta^(-2i/D), llama3-scaled if the config says so.

    Computed on the CPU with HF's float32 operations in HF's order, so the angles (and every
    rotation) match transformers bit for bit. llama3: wavelengths longer than
    original / low_freq_factor are slowed down by `factor`, those shorter than
    original / high_freq_factor kept, and those between blended linearly in original / wavelength.
    """
    D = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float() / D))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    original = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = original / s.low_freq_factor, original / s.high_freq_factor
    slow = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * slow / s.factor + smooth * slow
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, slow)


def rotary_tables(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, 1, T, D) in `dtype` for position_ids (B, T): angles in float32, each frequency used
    for dims i and i + D/2 (rotate-half). Built once per forward, shared by every layer."""
    freqs = position_ids[..., None].float() * inv_freq  # (B, T, D/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (B, T, D); HF's attention_scaling is 1.0 for these ropes
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, D); cos, sin: (B, 1, T, D) from `rotary_tables`."""
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps), the normalisation in float32 and cast back before the weight (HF)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """The attention's weights (HF's names) and heads; Block computes it."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        E, D = config.hidden_size, config.head_dim
        self.n_head, self.n_kv_head, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        self.q_proj = nn.Linear(E, self.n_head * D, bias=False)
        self.k_proj = nn.Linear(E, self.n_kv_head * D, bias=False)
        self.v_proj = nn.Linear(E, self.n_kv_head * D, bias=False)
        self.o_proj = nn.Linear(self.n_head * D, E, bias=False)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)): (B, T, E) -> (B, T, I) -> (B, T, E)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """h + attn(ln_1(h)), then + mlp(ln_2(.)): pre-norm, attention and MLP one after the other.

    Fused at load for serving (gptj.kernels.fuse_block, below float32): `w_qkv` = [q | k | v] and
    `w_gate_up` = [gate | up] as one linear each (their linears then gone), the same dot products in
    fewer weight-streaming calls; `qkv_sizes` their output widths."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.ln_1 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.ln_2 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.w_qkv: nn.Module | None = None
        self.w_gate_up: nn.Module | None = None
        self.qkv_sizes: tuple[int, int, int] = (0, 0, 0)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        h = h + self.self_attention(self.ln_1(h), cos, sin, mask, cache, layer)
        x = self.ln_2(h)
        if self.w_gate_up is None:
            return h + self.mlp(x)
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # (B, T, I) each
        return h + self.mlp.down_proj(F.silu(gate) * up)

    def self_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                       cache: KVCache | None, layer: int) -> torch.Tensor:
        """o_proj(attention(rope(q), rope(k), v)) of x (B, T, E); the cache keeps the KV heads only."""
        B, T, _ = x.shape
        a = self.attn
        D = a.head_dim
        if self.w_qkv is None:
            q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
        else:
            q, k, v = self.w_qkv(x).split(self.qkv_sizes, dim=-1)
        q = q.view(B, T, -1, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, -1, D).transpose(1, 2)  # (B, KV, T, D)
        v = v.view(B, T, -1, D).transpose(1, 2)  # (B, KV, T, D)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if getattr(cache, "per_sequence", False):  # the engine's: stores k, v and attends, each sequence
            out = cache.attend(layer, q, k, v, mask)  # over its own blocks (H query heads, KV key/value heads)
        else:
            if cache is not None:
                k, v = cache.update(layer, k, v)  # (B, KV, S, D): everything cached so far
            out = gqa_attention(q, k, v, mask)  # (B, H, T, D)
        return a.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class Transformer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        wte = torch.empty(config.vocab_size, config.hidden_size)
        if not wte.is_meta:  # on meta (shapes only) normal_ would import torch's Python meta kernels
            nn.init.normal_(wte)
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size, _weight=wte)
        self.h = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.ln_f = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """Llama: its blocks over the shared forward (models.base.CausalLM); the cache holds the KV heads."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = Transformer(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        # (D/2,) float32, not saved: rebuilt on the weights' device after loading or casting.
        self.register_buffer("inv_freq", rope_frequencies(config).to(self.transformer.wte.weight.device),
                             persistent=False)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Rebuild non-persistent buffers (after `load_state_dict(assign=True)` from the meta device)."""
        device = device if device is not None else self.transformer.wte.weight.device
        self.inv_freq = rope_frequencies(self.config).to(device)

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks' (cos, sin) at the positions."""
        return rotary_tables(self.inv_freq, position_ids, dtype)

    @property
    def kv_heads(self) -> int:
        """Key/value heads the cache holds: num_key_value_heads (fewer than the query heads under GQA;
        read from its first block here: a pipeline stage holds some of them)."""
        return next(b for b in self.transformer.h if hasattr(b, "attn")).attn.n_kv_head


def build_model(config: LlamaConfig, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A model of `dtype` on `device`; on 'meta' it has shapes only (for `load_hf_state_dict`)."""
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype)  # inv_freq stays float32 (see _apply)


# --- HF state dicts ----------------------------------------------------------------------------

LEGACY_BUFFERS = ("rotary_emb.inv_freq",)  # old HF Llama checkpoints saved it; rope_frequencies computes it

# HF LlamaForCausalLM's state-dict name -> this module's; {i} is the layer.
HF_NAMES: dict[str, str] = {
    "model.embed_tokens.weight": "transformer.wte.weight",
    "model.layers.{i}.input_layernorm.weight": "transformer.h.{i}.ln_1.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "transformer.h.{i}.attn.q_proj.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "transformer.h.{i}.attn.k_proj.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "transformer.h.{i}.attn.v_proj.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "transformer.h.{i}.attn.o_proj.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "transformer.h.{i}.ln_2.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "transformer.h.{i}.mlp.gate_proj.weight",
    "model.layers.{i}.mlp.up_proj.weight": "transformer.h.{i}.mlp.up_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight": "transformer.h.{i}.mlp.down_proj.weight",
    "model.norm.weight": "transformer.ln_f.weight",
    "lm_head.weight": "lm_head.weight",
}


def hf_names(config: LlamaConfig) -> dict[str, str]:
    """HF_NAMES for every layer, in checkpoint order: HF name -> this module's name."""
    names = {}
    for hf, ours in HF_NAMES.items():
        layers = range(config.num_hidden_layers) if "{i}" in hf else [None]
        names.update({hf.format(i=i): ours.format(i=i) for i in layers})
    return names


def load_hf_state_dict(model: LlamaForCausalLM, state_dict: dict[str, torch.Tensor],
                       source: str = "state dict") -> None:
    """Load HF LlamaForCausalLM's tensors into `model` (a meta model's are assigned), strictly.

    A missing or unexpected tensor, or one of the wrong shape, is a one-line CheckpointError naming
    the first. With tied embeddings lm_head.weight may be absent (as save_pretrained writes it) or
    present and equal to model.embed_tokens.weight. HF's old rotary_emb.inv_freq buffers are ignored.
    """
    names = hf_names(model.config)
    tied = model.config.tie_word_embeddings
    given = {k: v for k, v in state_dict.items() if not k.endswith(LEGACY_BUFFERS)}
    missing = [k for k in names if k not in given and not (tied and k == "lm_head.weight")]
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing)")
    unexpected = [k for k in given if k not in names]
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected)")
    embed = given["model.embed_tokens.weight"]
    if tied and "lm_head.weight" in given and not torch.equal(given["lm_head.weight"], embed):
        raise CheckpointError(f"{source}: tie_word_embeddings is true but lm_head.weight differs from "
                              f"model.embed_tokens.weight")
    params = dict(model.named_parameters(remove_duplicate=False))
    ours = {}
    for hf, name in names.items():
        t = embed if tied and hf == "lm_head.weight" else given[hf]
        if tuple(t.shape) != tuple(params[name].shape):
            raise CheckpointError(f"{source}: tensor {hf!r} has shape {tuple(t.shape)}, the config expects "
                                  f"{tuple(params[name].shape)}")
        ours[name] = t
    with torch.no_grad():
        model.load_state_dict(ours, strict=True, assign=model.transformer.wte.weight.is_meta)
    if tied:  # assign=True replaced each Parameter on its own: share them again
        model.lm_head.weight = model.transformer.wte.weight
    model.init_buffers()
