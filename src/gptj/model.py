"""GPT-J as plain math.

Parameter names match HF's GPTJForCausalLM (`transformer.h.0.attn.q_proj.weight`,
...) so loading a checkpoint is a copy with every shape asserted. The math follows
EleutherAI's mesh-transformer-jax and HF's port of it:

    h = wte(ids)
    for each layer:  x = ln_1(h);  h = h + attn(x) + mlp(x)      # attn and mlp in parallel
    logits = lm_head(ln_f(h))                                    # untied, with bias; float32

Shapes: B batch, T new tokens, S = past + T keys, H heads, D head_dim, E n_embd.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gptj.config import GPTJConfig
from gptj.policy import exact

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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v with scores and softmax in float32, as HF GPTJAttention._attn.

    q: (B, H, T, D); k, v: (B, H, S, D); mask: additive float32, broadcastable to (B, H, T, S), or None.
    causal: mask is the plain causal mask of T queries over S = T keys (the fused kernel then skips
    the masked half instead of reading a mask). Returns (B, H, T, D) in v's dtype.

    float32 runs this exact math (gptj.policy.exact). bfloat16/float16 go through torch's
    fused SDPA instead (softmax accumulated in float32 inside the kernel), which never materialises
    float32 copies of the keys and values — the same formula, a different rounding; tests bound the
    difference.
    """
    if not exact(q.dtype) and q.dtype == k.dtype == v.dtype:
        if causal and q.shape[-2] == k.shape[-2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        bool_mask = None if mask is None else mask == 0  # additive 0 / min -> True where allowed
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


class KVCache:
    """Keys and values of every layer, preallocated for `max_len` positions.

    k[layer], v[layer]: (B, H, max_len, D). Positions [0, length) are filled; a forward
    pass writes its T new positions after them and attends over [0, length + T).
    """

    def __init__(self, config: GPTJConfig, batch_size: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str, n_head: int | None = None) -> None:
        # n_head: the heads this process computes (tensor parallel: n_head / world size)
        shape = (batch_size, n_head or config.n_head, max_len, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.max_len = max_len
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H, T, D) after the filled positions; return all keys and values so far."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions > max_len {self.max_len}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Store this call's k, v and attend over everything cached: (B, H, T, D)."""
        k, v = self.update(layer, k, v)
        return attention(q, k, v, mask)

    def advance(self, n: int) -> None:
        self.length += n

    def rows(self, rows: slice) -> KVCache:
        """A view of some rows (a pipeline micro-batch): writes land in this cache; the caller
        advances this cache, not the view."""
        view = object.__new__(KVCache)
        view.k, view.v = [t[rows] for t in self.k], [t[rows] for t in self.v]
        view.max_len, view.length = self.max_len, self.length
        return view

    def reorder(self, index: torch.Tensor) -> None:
        """Row b becomes old row index[b] (beam search keeps the beams it selected)."""
        n = self.length
        for cache in (self.k, self.v):
            for layer, t in enumerate(cache):
                if t.shape[0] == index.shape[0]:
                    t[:, :, :n] = t[:, :, :n].index_select(0, index)
                else:  # batch size changes: allocate anew
                    cache[layer] = t.index_select(0, index)


class Attention(nn.Module):
    def __init__(self, config: GPTJConfig) -> None:
        super().__init__()
        E = config.n_embd
        self.n_head, self.head_dim, self.rope_dim = config.n_head, config.head_dim, config.rope_dim
        self.q_proj = nn.Linear(E, E, bias=False)
        self.k_proj = nn.Linear(E, E, bias=False)
        self.v_proj = nn.Linear(E, E, bias=False)
        self.out_proj = nn.Linear(E, E, bias=False)

    def forward(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(B, T, self.n_head, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)

        # Rotary on the first rope_dim dims of each head only.
        R = self.rope_dim
        q = torch.cat([apply_rotary(q[..., :R], sin, cos), q[..., R:]], dim=-1).transpose(1, 2)
        k = torch.cat([apply_rotary(k[..., :R], sin, cos), k[..., R:]], dim=-1).transpose(1, 2)

        # The cache stores k, v and attends over all its keys (the engine's cache does this per
        # sequence, each with its own length); without a cache, attend over this call's tokens.
        out = cache.attend(layer, q, k, v, mask) if cache is not None else attention(q, k, v, mask)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, E)


class MLP(nn.Module):
    def __init__(self, config: GPTJConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.n_embd, config.inner_dim)
        self.fc_out = nn.Linear(config.inner_dim, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(gelu_new(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self, config: GPTJConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = Attention(config)
        self.mlp = MLP(config)
        # Tensor parallel (gptj.parallel.tp): sums the ranks' partial attn + mlp outputs, one
        # all-reduce per layer, since GPT-J computes both branches from the same LayerNorm.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, h: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        x = self.ln_1(h)
        # Same summation order as HF: (attn + mlp) + residual.
        out = self.attn(x, sin, cos, mask, cache, layer) + self.mlp(x)
        if self.reduce is not None:
            out = self.reduce(out)
        return out + h


class Transformer(nn.Module):
    def __init__(self, config: GPTJConfig) -> None:
        super().__init__()
        wte = torch.empty(config.vocab_size, config.n_embd)
        if not wte.is_meta:  # nn.Embedding's own init; on meta (shapes only) its normal_ would import
            nn.init.normal_(wte)  # torch's Python meta kernels, ~1 s per process
        self.wte = nn.Embedding(config.vocab_size, config.n_embd, _weight=wte)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)


def causal_mask(attention_mask: torch.Tensor, T: int) -> torch.Tensor:
    """Additive float32 mask (B, 1, T, S) from a (B, S) padding mask whose last T entries are the queries.

    Query i (absolute position S - T + i) sees key j if j <= S - T + i and key j is not padding.
    Masked entries get float32's most negative value (not -inf), so a row that sees nothing
    (a padding query) stays finite, as in HF.
    """
    B, S = attention_mask.shape
    q_pos = torch.arange(S - T, S, device=attention_mask.device)[:, None]  # (T, 1)
    k_pos = torch.arange(S, device=attention_mask.device)[None, :]  # (1, S)
    allowed = (k_pos <= q_pos)[None, None] & attention_mask.bool()[:, None, None, :]  # (B, 1, T, S)
    zero = torch.zeros((), dtype=torch.float32, device=attention_mask.device)
    return torch.where(allowed, zero, torch.finfo(torch.float32).min)


def position_ids_from_mask(attention_mask: torch.Tensor, T: int) -> torch.Tensor:
    """Position of each of the last T tokens: count of real tokens before it (HF generate's rule)."""
    pos = attention_mask.long().cumsum(-1) - 1
    pos = pos.masked_fill(attention_mask == 0, 1)
    return pos[:, -T:]


def kept_positions(h: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """h (B, T, E) at the positions whose logits are computed (see GPTJForCausalLM.forward)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return h[:, logits_to_keep]
    return h[:, -logits_to_keep:] if logits_to_keep > 0 else h


class GPTJForCausalLM(nn.Module):
    def __init__(self, config: GPTJConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = Transformer(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size)
        # [sin | cos] per position, float32; not saved (rebuilt after loading on the meta device).
        self.register_buffer("rope", rope_table(config.n_positions, config.rope_dim), persistent=False)
        self.pipeline = None  # pipeline parallel: the stage this process runs (gptj.parallel.pp)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Rebuild non-persistent buffers (after `load_state_dict(assign=True)` from the meta device)."""
        device = device if device is not None else self.transformer.wte.weight.device
        self.rope = rope_table(self.config.n_positions, self.config.rope_dim, device=torch.device(device))

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - torch.nn.Module's signature
        # .to(dtype) / .cuda() would cast the rotary table with the weights; rebuild it in float32
        # on the weights' device instead, so precision changes never degrade positions.
        super()._apply(fn, recurse)
        self.init_buffers(self.transformer.wte.weight.device)
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """Logits (B, T', vocab) in float32 for the T new tokens: all, the last `logits_to_keep` if
        it is > 0, or those at the positions it lists if it is a tensor (HF's convention).

        input_ids: (B, T) new tokens. attention_mask: (B, past + T), 1 for tokens, 0 for padding;
        None means no padding. position_ids: (B, T); by default derived from the mask.
        cache: filled with this call's keys/values and advanced by T. A cache that tracks each
        sequence's own length (the engine's, `per_sequence = True`) makes its own masks; it needs
        position_ids and no attention_mask.
        """
        B, T = input_ids.shape
        mask = None
        if getattr(cache, "per_sequence", False):
            if position_ids is None:
                raise ValueError("a per-sequence cache needs explicit position_ids")
        else:
            past = cache.length if cache is not None else 0
            if attention_mask is None:
                attention_mask = torch.ones(B, past + T, dtype=torch.long, device=input_ids.device)
            if attention_mask.shape != (B, past + T):
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != {(B, past + T)}")
            if position_ids is None:
                position_ids = position_ids_from_mask(attention_mask, T)
            mask = causal_mask(attention_mask, T)
            # (the engine's cache checks lengths at admission: no device-to-host sync per forward there)
            if int(position_ids.max()) >= self.config.n_positions:
                raise ValueError(f"position {int(position_ids.max())} exceeds n_positions {self.config.n_positions}")

        if self.pipeline is not None:  # this rank runs some of the layers (gptj.parallel.pp)
            return self.pipeline.run(self, input_ids, position_ids, mask, cache, logits_to_keep)
        h = self.transformer.wte(input_ids)  # (B, T, E)
        sin, cos = rotary_tables(self.rope, position_ids, h.dtype)
        for i, block in enumerate(self.transformer.h):
            h = block(h, sin, cos, mask, cache, i)
        if cache is not None:
            cache.advance(T)
        return self.lm_head(self.transformer.ln_f(kept_positions(h, logits_to_keep))).float()

    @property
    def kv_heads(self) -> int:
        """Attention heads this model computes: n_head, or its share under tensor parallelism."""
        block = self.transformer.h[0]
        return getattr(block, "attn", block).n_head

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        w = self.transformer.wte.weight  # the activations' dtype: wte is never quantized
        return KVCache(self.config, batch_size, max_len, dtype=w.dtype, device=w.device, n_head=self.kv_heads)


def build_model(config: GPTJConfig, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> GPTJForCausalLM:
    """A model of `dtype` on `device`; on 'meta' it has shapes only (for loading with assign=True)."""
    with torch.device(device):
        model = GPTJForCausalLM(config)
    return model.to(dtype)  # the rotary table stays float32 (see _apply)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
