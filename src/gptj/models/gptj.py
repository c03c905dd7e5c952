"""GPT-J as plain math.

Parameter names match HF's GPTJForCausalLM (`transformer.h.0.attn.q_proj.weight`,
...) so loading a checkpoint is a copy with every shape asserted. The math follows
EleutherAI's mesh-transformer-jax and HF's port of it:

    h = wte(ids)
    for each layer:  x = ln_1(h);  h = h + attn(x) + mlp(x)      # attn and mlp in parallel
    logits = lm_head(ln_f(h))                                    # untied, with bias; float32

Shapes: B batch, T new tokens, S = past + T keys, H heads, D head_dim, E n_embd, I inner_dim.

One block class. Serving changes how a block's weights are laid out and which kernels its
elementwise ops run, not its math, and both are chosen once, at load (gptj.kernels.fuse_block):
`w_in` = [q | k | v | fc_in] as one linear (GPT-J feeds attention and the MLP the same LayerNorm
output), `w_out` = [out_proj | fc_out] over [attention | gelu] (float weights), and `ops` (the rotary
and GELU by gptj.native or Triton). This file imports no kernel: the plain ops below are HF's math,
and float32 runs them op for op (token-identical to HF).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from gptj.config import GPTJConfig
from gptj.models.base import CausalLM, KVCache, attention

ROPE_BASE = 10000.0


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GELU, written as HF's NewGELUActivation so results match bit for bit."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def rope_table(n_positions: int, rope_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """(n_positions, rope_dim) float32: [sin | cos] of position * 10000^(-2i/rope_dim)."""
    where = torch.device(device) if device is not None else torch.get_default_device()
    if where.type == "meta":  # shapes only (a model built to be loaded): its math would run torch's
        return torch.empty(n_positions, rope_dim, device=where)  # Python meta kernels, ~1 s to import
    inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, rope_dim, 2, dtype=torch.int64, device=device) / rope_dim))
    angles = torch.arange(n_positions, dtype=torch.int64, device=device).float()[:, None] * inv_freq
    return torch.cat((torch.sin(angles), torch.cos(angles)), dim=1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's interleaved rotation: pairs (x0, x1), (x2, x3), ... become (-x1, x0), (-x3, x2), ..."""
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotary_tables(rope: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """sin, cos (B, T, 1, R) in `dtype` for the positions, each angle repeated for its pair of dims.

    Cast to the activations' dtype as HF casts to the key dtype; built once per forward, shared by
    every layer.
    """
    sin, cos = rope[position_ids].to(dtype).chunk(2, dim=-1)  # (B, T, R/2) each
    return (torch.repeat_interleave(sin, 2, dim=-1)[:, :, None, :],
            torch.repeat_interleave(cos, 2, dim=-1)[:, :, None, :])


def apply_rotary(x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, R); sin, cos: (B, T, 1, R) from `rotary_tables`."""
    return x * cos + rotate_every_two(x) * sin


class BlockOps:
    """The elementwise ops a Block runs: HF's math here; gptj.kernels gives a fused block faster ones
    (gptj.native's or Triton's, chosen at load by gptj.policy)."""

    def rotary_qk_(self, qkv: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> None:
        """Rotary on q and k of qkv (B, T, 3, H, D), their first R dims, in place; sin, cos (B, T, 1, R)."""
        R = sin.shape[-1]
        qk = qkv[:, :, :2, :, :R]  # q and k together; sin, cos -> (B, T, 1, 1, R)
        qkv[:, :, :2, :, :R] = apply_rotary(qk, sin[:, :, None], cos[:, :, None])

    def gelu_into(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out = gelu_new(x)."""
        out.copy_(gelu_new(x))

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        """gelu_new(x), a new tensor."""
        return gelu_new(x)


PLAIN_OPS = BlockOps()


class Attention(nn.Module):
    """The attention's weights (HF's names) and heads; Block computes it."""

    def __init__(self, config: GPTJConfig) -> None:
        super().__init__()
        E = config.n_embd
        self.n_head, self.head_dim, self.rope_dim = config.n_head, config.head_dim, config.rope_dim
        self.q_proj = nn.Linear(E, E, bias=False)
        self.k_proj = nn.Linear(E, E, bias=False)
        self.v_proj = nn.Linear(E, E, bias=False)
        self.out_proj = nn.Linear(E, E, bias=False)


class MLP(nn.Module):
    """The MLP's weights (HF's names): fc_out(gelu_new(fc_in(x))); Block computes it."""

    def __init__(self, config: GPTJConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.n_embd, config.inner_dim)
        self.fc_out = nn.Linear(config.inner_dim, config.n_embd)


class Block(nn.Module):
    """h + out_proj(attention(rotary(q), rotary(k), v)) + fc_out(gelu_new(fc_in(x))), x = ln_1(h)."""

    def __init__(self, config: GPTJConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = Attention(config)
        self.mlp = MLP(config)
        self.w_in: nn.Module | None = None  # fused at load: [q | k | v | fc_in] (their linears then gone)
        self.w_out: nn.Module | None = None  # fused at load (float weights): [out_proj | fc_out]
        self.ops = PLAIN_OPS

    def forward(self, h: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        return self.update(h, sin, cos, mask, cache, layer) + h

    def update(self, h: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, mask: torch.Tensor | None,
               cache: KVCache | None, layer: int) -> torch.Tensor:
        """What the block adds to the residual stream h (B, T, E): attn(x) + mlp(x), x = ln_1(h)."""
        B, T, _ = h.shape
        H, D = self.attn.n_head, self.attn.head_dim  # this rank's heads under tensor parallelism
        qkv, f = self.project_in(self.ln_1(h))  # (B, T, 3, H, D), (B, T, I)
        if self.attn.rope_dim:
            self.ops.rotary_qk_(qkv, sin, cos)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, D) views
        # The cache stores k, v and attends over all its keys (the engine's cache does this per
        # sequence, each with its own length); without a cache, attend over this call's tokens.
        a = cache.attend(layer, q, k, v, mask) if cache is not None else attention(q, k, v, mask)
        return self.project_out(a.transpose(1, 2).reshape(B, T, H * D), f)  # attn + mlp, HF's order

    def project_in(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, E) -> [q | k | v] (B, T, 3, H, D) and fc_in(x) (B, T, I)."""
        B, T, _ = x.shape
        H, D = self.attn.n_head, self.attn.head_dim
        if self.w_in is not None:
            y = self.w_in(x)  # (B, T, 3 H D + I)
            return y[..., :3 * H * D].view(B, T, 3, H, D), y[..., 3 * H * D:]
        a = self.attn
        return torch.stack((a.q_proj(x), a.k_proj(x), a.v_proj(x)), dim=2).view(B, T, 3, H, D), self.mlp.fc_in(x)

    def project_out(self, a: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """out_proj(a) + fc_out(gelu_new(f)): a (B, T, H D) the attention, f (B, T, I) fc_in's output."""
        E = a.shape[-1]
        if self.w_out is not None:  # one linear over [attention | gelu]
            x = torch.empty((*f.shape[:-1], E + f.shape[-1]), dtype=f.dtype, device=f.device)
            x[..., :E] = a
            self.ops.gelu_into(f, x[..., E:])
            return self.w_out(x)
        return self.attn.out_proj(a) + self.mlp.fc_out(self.ops.gelu(f))


class Transformer(nn.Module):
    def __init__(self, config: GPTJConfig, block: Callable[[GPTJConfig], nn.Module] = Block) -> None:
        super().__init__()
        wte = torch.empty(config.vocab_size, config.n_embd)
        if not wte.is_meta:  # nn.Embedding's own init; on meta (shapes only) its normal_ would import
            nn.init.normal_(wte)  # torch's Python meta kernels, ~1 s per process
        self.wte = nn.Embedding(config.vocab_size, config.n_embd, _weight=wte)
        self.h = nn.ModuleList(block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)


class GPTJForCausalLM(CausalLM):
    """GPT-J: its blocks over the shared forward (models.base.CausalLM). `block` makes its blocks and
    `head` is its lm_head (None: the whole vocabulary's); a tensor-parallel rank's come from
    gptj.parallel.tp."""

    def __init__(self, config: GPTJConfig, block: Callable[[GPTJConfig], nn.Module] = Block,
                 head: nn.Module | None = None) -> None:
        super().__init__()
        self.config = config
        self.transformer = Transformer(config, block)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size) if head is None else head
        # [sin | cos] per position, float32; not saved (rebuilt after loading on the meta device).
        self.register_buffer("rope", rope_table(config.n_positions, config.rope_dim), persistent=False)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Rebuild non-persistent buffers (after `load_state_dict(assign=True)` from the meta device)."""
        device = device if device is not None else self.transformer.wte.weight.device
        self.rope = rope_table(self.config.n_positions, self.config.rope_dim, device=torch.device(device))

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks' (sin, cos) at the positions."""
        return rotary_tables(self.rope, position_ids, dtype)

    @property
    def kv_heads(self) -> int:
        """Attention heads this model computes: n_head, or its share under tensor parallelism (read
        from its first block here: a pipeline stage holds some of them)."""
        return next(b for b in self.transformer.h if hasattr(b, "attn")).attn.n_head


# Buffers old HF GPT-J checkpoints saved (the causal mask and its fill value); gptj computes them.
LEGACY_BUFFERS = (".attn.bias", ".attn.masked_bias")


def build_model(config: GPTJConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                block: Callable[[GPTJConfig], nn.Module] = Block, head: nn.Module | None = None) -> GPTJForCausalLM:
    """A model of `dtype` on `device`; on 'meta' it has shapes only (for loading with assign=True).
    `block`, `head`: what makes its blocks and lm_head (GPTJForCausalLM)."""
    with torch.device(device):
        model = GPTJForCausalLM(config, block, head)
    return model.to(dtype)  # the rotary table stays float32 (see _apply)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
