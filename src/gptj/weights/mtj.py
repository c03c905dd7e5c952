"""Import EleutherAI's original mesh-transformer-jax (MTJ) "slim" GPT-J checkpoint.

The checkpoint GPT-J 6B was released in (e.g. ``step_383500/``) is the params
pytree of a haiku model trained with 8-way model parallelism, written by MTJ's
``write_ckpt``::

    step_383500/
        shard_0/ 0.npz 1.npz ... 15.npz
        shard_1/ ...
        ...
        shard_7/ ...

Layout rules (each one is applied below, and tested in tests/test_mtj.py with
the inverse writer tests/mtj_writer.py):

* One folder ``shard_{s}`` per model-parallel shard, s = 0 .. S-1 (S = 8 for
  the released model). Every shard holds the same leaves, each its own slice.
* A shard's leaves are stored positionally: the concatenation over the files
  ``0.npz, 1.npz, ...`` (sorted numerically, not lexically: ``10.npz`` comes
  after ``9.npz``) of each file's arrays ``arr_0, arr_1, ...`` (``np.savez``
  positional names, again in numeric order).
* The leaves come in ``jax.tree_flatten`` order of ``{"params": ..., "step":
  ...}``: dict keys sorted as strings, so the haiku modules come sorted by
  their full names (``layer_0, layer_1, layer_10, ..., layer_19, layer_2,
  ...``) and the params within a module too (``b`` before ``w``, ``offset``
  before ``scale``). A slim checkpoint holds no optimizer state; a trailing
  ``step`` leaf (a scalar) may follow the params and is ignored.
* bf16 arrays are stored as 2-byte numpy void (``|V2``, numpy has no
  bfloat16): their bits are reinterpreted as bfloat16. float32 arrays may
  appear too. Files are always read with ``allow_pickle=False``.

Module mapping (haiku names are ``causal_transformer_shard/~/<module>``), with
per-shard shapes (E = n_embd, I = n_inner = 4 E, V = padded vocab, S = shards;
for GPT-J 6B: E = 4096, I = 16384, V = 50400, S = 8). Haiku's ``hk.Linear``
stores ``w`` as [in, out], which is transposed to torch's [out, in]::

    haiku module / param            per shard  HF tensor                      shards combine by
    embedding_shard/~/linear w      [V/S, E]   transformer.wte.weight         cat along vocab rows
    embedding_shard/~/linear b      [E]        (added to every wte row)       sum
    layer_{i}/~/linear w            [E, E/S]   h.{i}.attn.q_proj.weight       cat along out
    layer_{i}/~/linear_1 w          [E, E/S]   h.{i}.attn.v_proj.weight       cat along out
    layer_{i}/~/linear_2 w          [E, E/S]   h.{i}.attn.k_proj.weight       cat along out
    layer_{i}/~/linear_3 w          [E/S, E]   h.{i}.attn.out_proj.weight     cat along in
    layer_{i}/~/linear_4 w          [E, I/S]   h.{i}.mlp.fc_in.weight         cat along out
    layer_{i}/~/linear_4 b          [I/S]      h.{i}.mlp.fc_in.bias           cat
    layer_{i}/~/linear_5 w          [I/S, E]   h.{i}.mlp.fc_out.weight        cat along in
    layer_{i}/~/linear_5 b          [E]        h.{i}.mlp.fc_out.bias          sum
    layer_{i}/~/replicated_layer_norm
                   scale, offset    [E]        h.{i}.ln_1.weight, .bias       shard 0's copy
    projection_shard/~/replicated_layer_norm
                   scale, offset    [E]        transformer.ln_f.weight, .bias shard 0's copy
    projection_shard/~/linear w     [E, V/S]   lm_head.weight                 cat along out
    projection_shard/~/linear b     [V/S]      lm_head.bias                   cat

(``h.{i}`` is ``transformer.h.{i}``; the layer modules are named in creation
order in MTJ's TransformerLayerShard: q, v, k, o, dense_proj, dense_proj_o.)

Why the sums: the embedding and ``linear_5`` (fc_out) outputs are partial sums
that MTJ all-reduces (``psum``) across shards, and every shard adds its own
bias before that reduction, so the effective bias is the sum of the shards'
biases. HF GPT-J's embedding has no bias; since an input is one-hot, adding the
bias to the output equals adding it to every row of wte. The sums (and wte +
bias) are computed in float32 and rounded once to the output dtype. (MTJ's own
to_hf_weights.py sums the bf16 parts in bf16, so a conversion made with it may
differ from this one in the last bit of those tensors.)

Layer norms are replicated: every shard holds a copy; shard 0's is used.
"""

from __future__ import annotations

import contextlib
import enum
import re
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from gptj.errors import CheckpointError
from gptj.files import model_file
from gptj.weights.finite import all_finite

__all__ = [
    "Layout",
    "MtjLeaf",
    "Rule",
    "count_layers",
    "is_mtj_slim",
    "iter_mtj_slim",
    "load_mtj_slim",
    "mtj_leaves",
    "scan",
]

_ROOT = "causal_transformer_shard/~/"
EMBEDDING = _ROOT + "embedding_shard/~/linear"
PROJECTION_LINEAR = _ROOT + "projection_shard/~/linear"
PROJECTION_NORM = _ROOT + "projection_shard/~/replicated_layer_norm"


class Rule(enum.Enum):
    """How the S per-shard pieces of one leaf combine into one torch tensor."""

    COLS = "split by output: per shard [in, out/S]; cat along out, transpose to [out, in]"
    ROWS = "split by input: per shard [in/S, out]; cat along in, transpose to [out, in]"
    VOCAB = "split by vocab rows: per shard [V/S, E]; cat along rows, no transpose"
    CAT = "1-D split by output: per shard [out/S]; cat"
    SUM = "1-D partial bias: per shard [E]; sum over shards"
    REPLICATED = "replicated: per shard [E]; take shard 0"


# Per-shard shapes are symbolic: "E" = n_embd; "E/S", "I/S", "V/S" = one shard's
# slice of n_embd, n_inner and the (padded) vocab. They are bound from the first
# array seen; every other array (any shard) must agree (see _Dims).
#
# Inside a layer: haiku module -> (HF submodule, {haiku param: (HF param, rule, shape)}).
# The module names are haiku's creation-order names in MTJ's TransformerLayerShard:
# q, v, k, o, dense_proj, dense_proj_o (note: v before k). q/k/v/out have no bias.
_LAYER_MODULES: dict[str, tuple[str, dict[str, tuple[str, Rule, tuple[str, ...]]]]] = {
    "linear": ("attn.q_proj", {"w": ("weight", Rule.COLS, ("E", "E/S"))}),
    "linear_1": ("attn.v_proj", {"w": ("weight", Rule.COLS, ("E", "E/S"))}),
    "linear_2": ("attn.k_proj", {"w": ("weight", Rule.COLS, ("E", "E/S"))}),
    "linear_3": ("attn.out_proj", {"w": ("weight", Rule.ROWS, ("E/S", "E"))}),
    "linear_4": (
        "mlp.fc_in",
        {"w": ("weight", Rule.COLS, ("E", "I/S")), "b": ("bias", Rule.CAT, ("I/S",))},
    ),
    "linear_5": (
        "mlp.fc_out",
        {"w": ("weight", Rule.ROWS, ("I/S", "E")), "b": ("bias", Rule.SUM, ("E",))},
    ),
    "replicated_layer_norm": (
        "ln_1",
        {"scale": ("weight", Rule.REPLICATED, ("E",)), "offset": ("bias", Rule.REPLICATED, ("E",))},
    ),
}

_TOP_MODULES: dict[str, tuple[str, dict[str, tuple[str, Rule, tuple[str, ...]]]]] = {
    # wte: the bias leaf is not emitted on its own; it is summed over shards and
    # added to every row of the weight (see iter_mtj_slim).
    EMBEDDING: (
        "transformer.wte",
        {"w": ("weight", Rule.VOCAB, ("V/S", "E")), "b": ("weight", Rule.SUM, ("E",))},
    ),
    PROJECTION_NORM: (
        "transformer.ln_f",
        {"scale": ("weight", Rule.REPLICATED, ("E",)), "offset": ("bias", Rule.REPLICATED, ("E",))},
    ),
    PROJECTION_LINEAR: (
        "lm_head",
        {"w": ("weight", Rule.COLS, ("E", "V/S")), "b": ("bias", Rule.CAT, ("V/S",))},
    ),
}


@dataclass(frozen=True)
class MtjLeaf:
    """One leaf of the MTJ params pytree and where it goes in the HF state dict."""

    module: str  # haiku module, e.g. "causal_transformer_shard/~/layer_0/~/linear"
    param: str  # haiku param: "w", "b", "scale" or "offset"
    hf_name: str  # HF GPT-J state dict name
    rule: Rule
    shape: tuple[str, ...]  # symbolic per-shard shape

    @property
    def name(self) -> str:
        return f"{self.module}/{self.param}"


def mtj_leaves(n_layer: int) -> list[MtjLeaf]:
    """The params leaves of an ``n_layer`` MTJ GPT-J, in jax tree-flatten order.

    The order is built by sorting (as jax does for dict keys), not written out:
    modules sorted by full name as strings, then params within a module.
    """
    if n_layer < 1:
        raise ValueError(f"n_layer must be >= 1, got {n_layer}")
    modules = dict(_TOP_MODULES)
    for i in range(n_layer):
        for sub, (hf_sub, params) in _LAYER_MODULES.items():
            modules[f"{_ROOT}layer_{i}/~/{sub}"] = (f"transformer.h.{i}.{hf_sub}", params)
    leaves = []
    for module in sorted(modules):
        hf_prefix, params = modules[module]
        for param in sorted(params):
            hf_param, rule, shape = params[param]
            leaves.append(MtjLeaf(module, param, f"{hf_prefix}.{hf_param}", rule, shape))
    return leaves


def n_leaves(n_layer: int) -> int:
    """The params leaves of an ``n_layer`` slim checkpoint: 6 top-level + 10 per layer (= len(mtj_leaves))."""
    def count(modules: dict) -> int:
        return sum(len(params) for _, params in modules.values())

    return count(_TOP_MODULES) + n_layer * count(_LAYER_MODULES)


def count_layers(layout: Layout) -> int:
    """The number of layers the slim checkpoint `layout` scanned holds, from its leaf count (the npz
    directories only: no array is read). CheckpointError if the count fits no GPT-J."""
    per_layer = n_leaves(1) - n_leaves(0)
    for step in (0, 1):  # a trailing step leaf may follow the params
        layers, rest = divmod(layout.n_leaves - step - n_leaves(0), per_layer)
        if layers >= 1 and rest == 0:
            return layers
    raise CheckpointError(f"{layout.path}: wrong leaf count: {layout.n_leaves} arrays per shard in "
                          f"{len(layout.file_names)} files fit no GPT-J ({n_leaves(0)} + {per_layer} per layer, "
                          f"+1 optional step)")


def is_mtj_slim(path: str | Path) -> bool:
    """True if ``path`` looks like an MTJ checkpoint: a ``shard_0/`` folder with ``*.npz`` files."""
    shard0 = Path(path) / "shard_0"
    return shard0.is_dir() and any(shard0.glob("*.npz"))


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """A slim checkpoint's folders and arrays as `scan` found them (no array read yet)."""

    path: Path  # the checkpoint folder
    shard_dirs: list[Path]  # shard_0 .. shard_{S-1}
    file_names: list[str]  # "0.npz" .. "{N-1}.npz", numeric order, same in every shard
    file_keys: list[list[str]]  # per file: "arr_0" .. "arr_{k-1}", numeric order

    @property
    def n_leaves(self) -> int:
        return sum(len(keys) for keys in self.file_keys)


def _numbered(paths: Sequence[Path], pattern: str, fmt: str, where: Path) -> list[Path]:
    """Sort names like "shard_3" / "12.npz" numerically; they must be 0..n-1 with no gap."""
    numbered: dict[int, Path] = {}
    for p in paths:
        m = re.fullmatch(pattern, p.name)
        if m:
            numbered[int(m.group(1))] = p
    for i in range(len(numbered)):
        if i not in numbered:
            found = ", ".join(sorted(p.name for p in numbered.values()))
            raise CheckpointError(f"{where}: missing {fmt.format(i)} (found {found})")
    return [numbered[i] for i in range(len(numbered))]


def _npz_keys(path: Path, where: str) -> list[str]:
    """Array names of an npz file (reads only the zip directory), in numeric order."""
    try:
        npz = np.load(path, allow_pickle=False)  # never unpickle
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(f"{where}: cannot read npz file: {e}") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise CheckpointError(f"{where}: not an .npz archive")
    with npz:
        names = list(npz.files)
    index: dict[int, str] = {}
    for name in names:
        m = re.fullmatch(r"arr_(\d+)", name)
        if not m:
            raise CheckpointError(f"{where}: unexpected array name {name!r}; expected positional arr_0, arr_1, ...")
        index[int(m.group(1))] = name
    if sorted(index) != list(range(len(index))):
        raise CheckpointError(f"{where}: array names are not arr_0 .. arr_{len(index) - 1}")
    return [index[i] for i in range(len(index))]


def scan(path: str | Path, n_shards: int | None = None) -> Layout:
    """Find the shard folders and files of the slim checkpoint in `path` (each inside it, as
    gptj.files.model_file allows); check every shard has the same file/array counts (`n_shards`: the
    number of shard folders it must have). Only the npz directories are read."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not (path / "shard_0").is_dir():
        raise CheckpointError(f"{path}: not an MTJ checkpoint (no shard_0 folder)")
    shard_dirs = _numbered([p for p in path.iterdir() if p.is_dir()], r"shard_(\d+)", "shard folder shard_{}", path)
    if n_shards is not None and len(shard_dirs) != n_shards:
        raise CheckpointError(f"{path}: found {len(shard_dirs)} shard folders, expected {n_shards}")

    layout: Layout | None = None
    for shard_dir in shard_dirs:
        npz_files = [p for p in shard_dir.iterdir() if p.suffix == ".npz"]
        for p in npz_files:
            if not re.fullmatch(r"\d+\.npz", p.name):
                raise CheckpointError(f"{shard_dir}: unexpected file {p.name}; expected 0.npz, 1.npz, ...")
        files = _numbered(npz_files, r"(\d+)\.npz", "file {}.npz", shard_dir)
        for f in files:  # each array file (and its shard folder) inside the checkpoint's folder
            model_file(path, f.relative_to(path))
        if not files:
            raise CheckpointError(f"{shard_dir}: no .npz files")
        keys = [_npz_keys(f, f"{shard_dir.name}/{f.name}") for f in files]
        if layout is None:
            layout = Layout(path, shard_dirs, [f.name for f in files], keys)
            continue
        # Every shard must hold the same leaves in the same files.
        if len(files) != len(layout.file_names):
            raise CheckpointError(
                f"{shard_dir}: inconsistent shards: {len(files)} npz files, but shard_0 has {len(layout.file_names)}"
            )
        for f, k, k0 in zip(files, keys, layout.file_keys):
            if len(k) != len(k0):
                raise CheckpointError(
                    f"{shard_dir.name}/{f.name}: inconsistent shards: {len(k)} arrays, "
                    f"but shard_0/{f.name} has {len(k0)}"
                )
    assert layout is not None
    return layout


def _check_leaf_count(layout: Layout, n_params: int, n_layer: int) -> None:
    """A slim checkpoint holds exactly the params leaves, plus optionally a trailing step."""
    n = layout.n_leaves
    if n in (n_params, n_params + 1):
        return
    hint = ""
    for extra in (0, 1):  # 6 top-level leaves + 10 per layer (+ step)
        if n - 6 - extra > 0 and (n - 6 - extra) % 10 == 0:
            hint = f"; that count fits n_layer={(n - 6 - extra) // 10}"
    if not hint and n > n_params + 1:
        hint = "; a full checkpoint with optimizer state is not supported, use the slim one"
    raise CheckpointError(
        f"{layout.path}: wrong leaf count: {n} arrays per shard in {len(layout.file_names)} files, "
        f"expected {n_params} params for n_layer={n_layer} (+1 optional step){hint}"
    )


# --------------------------------------------------------------------------- reading


def _to_torch(arr: np.ndarray, where: str) -> torch.Tensor:
    """numpy array -> torch tensor, sharing memory. |V2 (raw bf16 bits) -> bfloat16."""
    if arr.dtype.kind == "V" and arr.dtype.itemsize == 2 and arr.dtype.fields is None:
        # numpy has no bfloat16: jax's bf16 arrays were saved as 2-byte void.
        # Reinterpret the bits: void -> int16 -> torch.int16 -> torch.bfloat16.
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    if arr.dtype in (np.float32, np.float16, np.float64):
        return torch.from_numpy(arr)
    raise CheckpointError(f"{where}: unsupported dtype {arr.dtype}")


class _Dims:
    """Binds the symbolic dims (E, E/S, I/S, V/S) from the arrays and checks every array fits."""

    def __init__(self, n_shards: int) -> None:
        self.n_shards = n_shards
        self.values: dict[str, int] = {}

    def check(self, leaf: MtjLeaf, shape: tuple[int, ...], where: str) -> None:
        expected = tuple(self.values.get(sym, sym) for sym in leaf.shape)
        fits = len(shape) == len(leaf.shape) and all(
            self.values.setdefault(sym, size) == size for sym, size in zip(leaf.shape, shape)
        )
        if not fits:
            shown = "(" + ", ".join(map(str, expected)) + ("," if len(expected) == 1 else "") + ")"
            raise CheckpointError(
                f"{where} ({leaf.name} -> {leaf.hf_name}): shape {tuple(shape)} does not fit, "
                f"expected {shown} per shard"
            )
        e, es = self.values.get("E"), self.values.get("E/S")
        if e is not None and es is not None and es * self.n_shards != e:
            # e.g. a trailing shard folder is missing: the slices do not add up.
            raise CheckpointError(
                f"{where} ({leaf.name} -> {leaf.hf_name}): {es} columns per shard x {self.n_shards} "
                f"shard folders != n_embd {e}; is a shard folder missing?"
            )


def _combine(leaf: MtjLeaf, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Apply the leaf's rule to its per-shard pieces (see Rule)."""
    if leaf.rule is Rule.COLS:  # [in, out/S] each -> [out, in]
        return torch.cat([p.T for p in pieces], dim=0)
    if leaf.rule is Rule.ROWS:  # [in/S, out] each -> [out, in]
        return torch.cat([p.T for p in pieces], dim=1)
    if leaf.rule in (Rule.VOCAB, Rule.CAT):  # [V/S, E] -> [V, E]; [out/S] -> [out]
        return torch.cat(pieces, dim=0)
    if leaf.rule is Rule.SUM:  # partial biases: accumulate in float32, shard 0 first
        total = torch.zeros(pieces[0].shape, dtype=torch.float32)
        for p in pieces:
            total += p.float()
        return total
    if leaf.rule is Rule.REPLICATED:
        return pieces[0]
    raise AssertionError(leaf.rule)


def _pieces(leaf: MtjLeaf, shard_dirs: Sequence[Path], npzs: list, file_name: str, key: str,
            dims: _Dims) -> list[torch.Tensor]:
    """One leaf's array `key` of `file_name` from every shard's open npz file, each shape checked
    against the dims, as finite torch tensors: one a shard, or shard 0's alone for a replicated leaf."""
    pieces = []
    for shard_dir, npz in zip(shard_dirs, npzs):
        where = f"{shard_dir.name}/{file_name} {key}"
        try:
            arr = npz[key]
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
            raise CheckpointError(f"{where} ({leaf.name}): cannot read array: {e}") from None
        dims.check(leaf, arr.shape, where)
        if leaf.rule is Rule.REPLICATED and pieces:
            continue  # replicated copies: shard 0's is used
        t = _to_torch(arr, where)
        if not all_finite(t):
            raise CheckpointError(f"{where} ({leaf.name} -> {leaf.hf_name}): non-finite values")
        pieces.append(t)
    return pieces


def _check_result(leaf: MtjLeaf, tensor: torch.Tensor, expected_shapes: Mapping[str, Sequence[int]] | None,
                  path: Path) -> None:
    """A leaf's HF tensor as it will be yielded: finite after the shards' combination and the dtype's
    conversion, and (expected_shapes given) among the expected names with their shape."""
    if not all_finite(tensor):
        raise CheckpointError(
            f"{leaf.hf_name}: non-finite values after combining shards and converting to {tensor.dtype}"
        )
    if expected_shapes is not None:
        want = expected_shapes.get(leaf.hf_name)
        if want is None:
            raise CheckpointError(f"{leaf.hf_name}: not among the expected tensors")
        if tuple(want) != tuple(tensor.shape):
            raise CheckpointError(
                f"{leaf.hf_name}: shape {tuple(tensor.shape)} from {path} does not match "
                f"the expected {tuple(want)}"
            )


def iter_mtj_slim(
    layout: Layout,
    n_layer: int,
    dtype: torch.dtype | None = None,
    progress: bool = False,
    *,
    expected_shapes: Mapping[str, Sequence[int]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every HF GPT-J tensor of an MTJ slim checkpoint.

    layout: the checkpoint as `scan` found it (its folder holds ``shard_0/`` ..
        ``shard_{S-1}/``).
    n_layer: number of transformer layers (28 for GPT-J 6B); the other dims
        (n_embd, n_inner, vocab) are read from the arrays and checked to agree
        across leaves and shards.
    dtype: output dtype; None keeps the stored dtype (bfloat16 for the
        released checkpoint). Summed biases and wte + bias are computed in
        float32 and rounded once.
    expected_shapes: if given, every produced tensor's name must be in it with
        this exact shape (names not produced here, e.g. buffers, are ignored).

    Memory: files are read one file index at a time across the shards and one
    leaf at a time within a file, so only one leaf's shard pieces are held at
    once besides the tensors already yielded.

    Raises CheckpointError (one-line message naming the shard/file and tensor)
    on a wrong leaf count, an array shape that does not fit, or non-finite values.
    """
    _check_leaf_count(layout, n_leaves(n_layer), n_layer)  # before a table of n_layer leaves is built
    leaves = mtj_leaves(n_layer)
    dims = _Dims(len(layout.shard_dirs))
    wte_bias: torch.Tensor | None = None  # summed embedding bias, float32 [E]

    bar = tqdm(total=len(leaves), desc="Loading MTJ checkpoint", unit="tensor", disable=not progress)
    index = 0  # global leaf index (same in every shard)
    try:
        for file_name, keys in zip(layout.file_names, layout.file_keys):
            if index >= len(leaves):
                break  # only the trailing step leaf is left
            with contextlib.ExitStack() as stack:
                npzs = []
                for shard_dir in layout.shard_dirs:
                    try:
                        npzs.append(stack.enter_context(np.load(shard_dir / file_name, allow_pickle=False)))
                    except (OSError, ValueError, zipfile.BadZipFile) as e:
                        raise CheckpointError(f"{shard_dir.name}/{file_name}: cannot read npz file: {e}") from None
                for key in keys:
                    if index >= len(leaves):
                        break  # the trailing `step` leaf: ignored
                    leaf = leaves[index]
                    index += 1
                    pieces = _pieces(leaf, layout.shard_dirs, npzs, file_name, key, dims)
                    stored_dtype = pieces[0].dtype
                    tensor = _combine(leaf, pieces)
                    del pieces

                    if leaf.module == EMBEDDING:
                        # b sorts before w: hold the summed bias until the weight arrives.
                        if leaf.param == "b":
                            wte_bias = tensor
                            bar.update(1)
                            continue
                        assert wte_bias is not None, "embedding b must precede w in tree order"
                        tensor = tensor.float()  # a fresh tensor (cat above), safe to update in place
                        tensor += wte_bias  # broadcast the [E] bias over every vocab row

                    tensor = tensor.to(dtype or stored_dtype).contiguous()
                    _check_result(leaf, tensor, expected_shapes, layout.path)
                    bar.update(1)
                    yield leaf.hf_name, tensor
    finally:
        bar.close()


def load_mtj_slim(
    path: str | Path,
    n_layer: int,
    dtype: torch.dtype | None = None,
    progress: bool = False,
    *,
    n_shards: int | None = None,
    expected_shapes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Load the MTJ slim checkpoint in the folder `path` as an HF GPT-J state dict (`n_shards`: the
    number of shard folders it must have). See scan and iter_mtj_slim."""
    return dict(iter_mtj_slim(scan(path, n_shards), n_layer, dtype, progress, expected_shapes=expected_shapes))
