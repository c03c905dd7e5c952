"""Test helper: write a synthetic mesh-transformer-jax (MTJ) "slim" GPT-J checkpoint.

This is the inverse of gptj.weights.mtj, written independently of it (its own
module table and its own tree flattening), so that a wrong rule in the
importer is not silently mirrored here:

* every HF tensor is transposed to haiku's [in, out] and cut into n_shards
  pieces (q/k/v/fc_in/lm_head by output columns, out_proj/fc_out by input
  rows, wte by vocab rows);
* the biases MTJ sums over shards (fc_out bias, embedding bias) are split into
  n_shards random parts that sum exactly to the bias;
* a random embedding bias c is chosen and wte - c is stored as the embedding
  weight, so the importer must add the summed bias back to every wte row;
* layer norms are replicated on every shard;
* the leaves are flattened like ``jax.tree_flatten({"params": ..., "step": ...})``
  (dict keys sorted as strings), spread over ``files`` npz files per shard
  like MTJ's ``write_ckpt`` (positional arr_0, arr_1, ...), bf16 stored as
  2-byte void (|V2).

Exactness: the round trip is bit-exact (torch.equal) by construction, see
_split_exact and _embedding_bias.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

_ROOT = "causal_transformer_shard/~/"

# Significand bits (with the implicit bit) of the storage dtypes.
_SIG_BITS = {torch.bfloat16: 8, torch.float32: 24}

# Inside a layer: haiku module -> (HF submodule, how it is split).
_LAYER = {
    "linear": "attn.q_proj",
    "linear_1": "attn.v_proj",
    "linear_2": "attn.k_proj",
    "linear_3": "attn.out_proj",
    "linear_4": "mlp.fc_in",
    "linear_5": "mlp.fc_out",
    "replicated_layer_norm": "ln_1",
}


def _split_exact(b: torch.Tensor, n: int, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """Split b into n random parts (each representable in dtype) whose sum is exactly b.

    Write each element as b = M * u with M an integer, |M| < 2**p (p = significand
    bits of dtype) and u = ulp(b) a power of two. Cut |M| at n - 1 random points
    into n non-negative integers a_k: every part a_k * u and every partial sum
    (an integer <= |M| times u) is exactly representable, in dtype and in float32,
    so summing the parts in any order gives back b exactly.
    """
    p = _SIG_BITS[dtype]
    x = b.double().flatten()
    mant, exp = torch.frexp(x)  # x = mant * 2**exp, 0.5 <= |mant| < 1
    m_abs = (mant.abs() * 2.0**p).long()  # exact: b has at most p significant bits
    u = torch.pow(2.0, (exp - p).double())
    cuts = (torch.rand(n - 1, x.numel(), generator=gen, dtype=torch.float64) * (m_abs + 1)).floor().long()
    cuts = cuts.sort(dim=0).values
    bounds = torch.cat([torch.zeros(1, x.numel(), dtype=torch.long), cuts, m_abs[None]])
    parts = bounds.diff(dim=0).double() * u * torch.sign(x)  # [n, numel]
    # Tiny (subnormal-range) values: keep them whole on shard 0.
    tiny = x.abs() < 2.0**-100
    parts[:, tiny] = 0.0
    parts[0, tiny] = x[tiny]
    out = [parts[k].reshape(b.shape).to(dtype) for k in range(n)]
    # Self-check: parts representable and their float32 sum is b.
    total = torch.zeros(b.shape, dtype=torch.float32)
    for k, part in enumerate(out):
        assert torch.equal(part.double().flatten(), parts[k]), "part not representable"
        total += part.float()
    assert torch.equal(total.to(dtype), b.to(dtype)) and torch.equal(total.double(), b.double())
    return out


def _embedding_bias(wte: torch.Tensor, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A random bias c [E] such that w = wte - c is exact in dtype and float32(w) + c == wte.

    For column j take c_j = m_j * G_j, G_j the largest ulp among the column's
    entries and m_j a random integer; where wte - c is not exactly representable
    (a column with a wide dynamic range), halve m_j until it is (m_j = 0 always
    is). Float32 weights give non-zero biases almost everywhere; bf16 weights
    (8 significand bits) need a narrow range per column, e.g. multiples of
    2**-10 below 2**-3 as in the bf16 test.
    """
    p = _SIG_BITS[dtype]
    x = wte.double()
    _, exp = torch.frexp(x)
    exp = torch.where(x == 0, torch.full_like(exp, -10_000), exp)
    grain = torch.pow(2.0, (exp.max(dim=0).values - p).double())  # [E]
    bound = 2 ** (p // 2)
    m = torch.randint(-bound, bound + 1, (x.shape[1],), generator=gen).double()
    for _ in range(p + 2):
        c = m * grain
        w = x - c
        ok = (w.to(dtype).double() == w).all(dim=0) & (c.to(dtype).double() == c)
        if bool(ok.all()):
            break
        m = torch.where(ok, m, torch.trunc(m / 2))
    c = (m * grain).to(dtype)
    w = (x - c.double()).to(dtype)
    assert torch.equal((w.float() + c.float()).to(dtype), wte.to(dtype))
    return c


def _hf_to_haiku(sd: dict[str, torch.Tensor], n_layer: int) -> dict[str, dict[str, torch.Tensor]]:
    """HF names -> {haiku module: {param: full (unsharded) tensor in haiku layout}}.

    Linear weights are transposed to [in, out]. The embedding is stored as the
    [vocab, E] weight itself (haiku's Linear on a one-hot: [in=vocab, out=E]).
    """
    params: dict[str, dict[str, torch.Tensor]] = {
        _ROOT + "embedding_shard/~/linear": {"w": sd["transformer.wte.weight"]},
        _ROOT + "projection_shard/~/replicated_layer_norm": {
            "scale": sd["transformer.ln_f.weight"],
            "offset": sd["transformer.ln_f.bias"],
        },
        _ROOT + "projection_shard/~/linear": {"w": sd["lm_head.weight"].T, "b": sd["lm_head.bias"]},
    }
    for i in range(n_layer):
        for sub, hf in _LAYER.items():
            prefix = f"transformer.h.{i}.{hf}"
            if sub == "replicated_layer_norm":
                p = {"scale": sd[prefix + ".weight"], "offset": sd[prefix + ".bias"]}
            else:
                p = {"w": sd[prefix + ".weight"].T}
                if prefix + ".bias" in sd:
                    p["b"] = sd[prefix + ".bias"]
            params[f"{_ROOT}layer_{i}/~/{sub}"] = p
    return params


def _tree_flatten(tree: dict) -> list:
    """Leaves of a nested dict in jax.tree_flatten order: keys sorted as strings."""
    out = []
    for key in sorted(tree):
        value = tree[key]
        out.extend(_tree_flatten(value) if isinstance(value, dict) else [value])
    return out


def _to_numpy(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    t = t.to(dtype).contiguous()
    if dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.dtype("V2"))  # like jax's bf16 on disk
    return t.numpy()


def write_mtj_slim(
    state_dict_hf: dict[str, torch.Tensor],
    out_dir: str | Path,
    n_shards: int = 8,
    files: int = 16,
    bf16: bool = True,
    step: int | None = 383500,
    seed: int = 0,
    free_biases: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Write ``state_dict_hf`` (HF GPT-J names) as an MTJ slim checkpoint in ``out_dir``.

    With bf16=True every tensor must be exactly representable in bfloat16 (round
    the state dict first); otherwise float32 is stored. ``step=None`` writes no
    trailing step leaf. Returns the embedding bias that was folded out of wte
    (so tests can check it is non-trivial).

    ``free_biases`` (a dict to fill): instead of the round trip, store wte as given
    and random per-shard embedding and fc_out bias parts, multiples of 2**-12 below
    2**-4 (exact in bfloat16, and every float32 partial sum of them, and wte + their
    sum for a wte on a 2**-10 grid below 2**-3, is exact), whose sums are in general
    NOT representable in bfloat16. The dict gets the exact (float64) values the
    importer must produce before its one rounding: ``transformer.wte.weight`` (wte +
    summed bias) and every ``transformer.h.{i}.mlp.fc_out.bias`` (summed parts).
    """
    dtype = torch.bfloat16 if bf16 else torch.float32
    gen = torch.Generator().manual_seed(seed)
    sd = {k: v.detach() for k, v in state_dict_hf.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    for name, t in sd.items():
        if not torch.allclose(t.to(dtype).to(t.dtype), t, rtol=0, atol=0, equal_nan=True):
            raise ValueError(f"{name} is not exactly representable in {dtype}")
    n_layer = len({k.split(".")[2] for k in sd if k.startswith("transformer.h.")})
    params = _hf_to_haiku(sd, n_layer)

    # Fold a random embedding bias out of wte: store wte - c, and c split over shards.
    emb = params[_ROOT + "embedding_shard/~/linear"]
    if free_biases is None:
        c = _embedding_bias(emb["w"], dtype, gen)
        emb["w"] = (emb["w"].double() - c.double()).to(dtype)
    else:
        c = None  # drawn per shard below
    emb["b"] = c

    # Per-shard pieces of each leaf: {module: {param: [piece for each shard]}}.
    shards: dict[str, dict[str, list[torch.Tensor]]] = {}
    for module, ps in params.items():
        sub = module.rsplit("/~/", 1)[-1]
        shards[module] = {}
        for name, t in ps.items():
            summed = name == "b" and (sub == "linear_5" or "embedding_shard" in module)
            if summed and free_biases is not None:
                shape = (params[module]["w"].shape[-1],)  # [out]
                k = torch.randint(-255, 256, (n_shards, *shape), generator=gen).double() * 2.0**-12
                pieces = [k[s].to(dtype) for s in range(n_shards)]
                total = k.sum(dim=0)
                if "embedding_shard" in module:
                    free_biases["transformer.wte.weight"] = params[module]["w"].double() + total
                else:
                    layer = int(module.split("layer_")[1].split("/")[0])
                    free_biases[f"transformer.h.{layer}.mlp.fc_out.bias"] = total
                shards[module][name] = pieces
                continue
            t = t.to(dtype)
            if "replicated_layer_norm" in module:
                pieces = [t] * n_shards  # replicated
            elif summed:
                pieces = _split_exact(t, n_shards, dtype, gen)  # partial biases, summed by psum
            elif "embedding_shard" in module:
                pieces = list(t.chunk(n_shards, dim=0))  # [V/S, E]: split by vocab rows
            elif sub in ("linear_3", "linear_5"):
                pieces = list(t.chunk(n_shards, dim=0))  # out_proj / fc_out w: split by input rows
            else:
                pieces = list(t.chunk(n_shards, dim=-1))  # q/k/v/fc_in/lm_head w and b: by output
            assert len(pieces) == n_shards, (module, name, t.shape)
            shards[module][name] = pieces

    out_dir = Path(out_dir)
    for s in range(n_shards):
        tree: dict = {
            "params": {m: {n: pieces[s] for n, pieces in ps.items()} for m, ps in shards.items()},
        }
        if step is not None:
            tree["step"] = step
        leaves = [
            np.asarray(leaf, dtype=np.int32) if isinstance(leaf, int) else _to_numpy(leaf, dtype)
            for leaf in _tree_flatten(tree)
        ]
        # Spread the leaves over `files` files like MTJ's write_ckpt: the first
        # len % files files get one leaf more.
        shard_dir = out_dir / f"shard_{s}"
        shard_dir.mkdir(parents=True, exist_ok=True)
        k, m = divmod(len(leaves), files)
        for i in range(files):
            chunk = leaves[i * k + min(i, m) : (i + 1) * k + min(i + 1, m)]
            np.savez(shard_dir / f"{i}.npz", *chunk)
    return c
