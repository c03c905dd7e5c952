"""Tests for the mesh-transformer-jax slim checkpoint importer (gptj.weights.mtj).

Round trips go through tests/mtj_writer.py, an independent inverse of the
importer, and must be bit-exact (torch.equal).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from mtj_writer import write_mtj_slim

from gptj.errors import CheckpointError
from gptj.weights.mtj import Rule, is_mtj_slim, iter_mtj_slim, load_mtj_slim, mtj_leaves, scan

N_LAYER = 12  # >= 11 so that sorting layer names as strings (1, 10, 11, 2, ...) matters
N_EMBD = 64
N_INNER = 256
REAL_VOCAB = 50400  # GPT-J 6B's padded vocab: 6300 rows per shard
SMALL_VOCAB = 800  # a multiple of 8 (and of the shard counts used below)


def _random_state_dict(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A small random GPT-J in HF naming, with every tensor (LN and biases too) random."""
    config = transformers.GPTJConfig(
        n_layer=N_LAYER,
        n_embd=N_EMBD,
        n_head=4,
        rotary_dim=8,
        n_inner=N_INNER,
        vocab_size=vocab_size,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPTJForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for name, t in model.state_dict().items():
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers (absent in recent transformers)
        noise = torch.randn(t.shape, generator=gen) * 0.02
        sd[name] = 1.0 + 5 * noise if re.search(r"ln_\w+\.weight$", name) else noise
    return sd


def _to_bf16(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    # With 8 significand bits, folding a non-zero bias out of wte exactly needs a
    # narrow range per column: use multiples of 2**-10 below 2**-3.
    wte = sd["transformer.wte.weight"]
    out["transformer.wte.weight"] = (torch.round(wte * 1024).clamp(-127, 127) / 1024).to(torch.bfloat16)
    return out


def _assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(loaded) == set(expected)
    for name, t in expected.items():
        assert loaded[name].dtype == t.dtype, name
        assert loaded[name].shape == t.shape, name
        assert torch.equal(loaded[name], t), name


@pytest.fixture(scope="module")
def sd_small() -> dict[str, torch.Tensor]:
    return _random_state_dict(SMALL_VOCAB)


@pytest.fixture(scope="module")
def ckpt_small(tmp_path_factory, sd_small) -> Path:
    """A float32 slim checkpoint, 8 shards x 16 files, with a step leaf (copied by tests that corrupt it)."""
    path = tmp_path_factory.mktemp("mtj") / "step_1"
    write_mtj_slim(sd_small, path, bf16=False)
    return path


@pytest.fixture
def ckpt_copy(tmp_path, ckpt_small) -> Path:
    path = tmp_path / "step_1"
    shutil.copytree(ckpt_small, path)
    return path


def _locate(shard_dir: Path, index: int) -> tuple[Path, str]:
    """The file and array name holding leaf `index` of a shard (files in numeric order)."""
    files = sorted(shard_dir.glob("*.npz"), key=lambda p: int(p.stem))
    for f in files:
        with np.load(f, allow_pickle=False) as npz:
            n = len(npz.files)
        if index < n:
            return f, f"arr_{index}"
        index -= n
    raise IndexError(index)


def _rewrite(path: Path, edit) -> None:
    """Rewrite one npz file: edit(list of arrays) -> list of arrays."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = [npz[f"arr_{i}"] for i in range(len(npz.files))]
    np.savez(path, *edit(arrays))


# --------------------------------------------------------------------------- layout rules


def test_leaf_order_is_jax_tree_flatten_order():
    leaves = mtj_leaves(N_LAYER)
    names = [leaf.name for leaf in leaves]
    assert len(names) == 6 + 10 * N_LAYER
    root = "causal_transformer_shard/~/"
    assert names[:2] == [root + "embedding_shard/~/linear/b", root + "embedding_shard/~/linear/w"]
    assert names[-4:] == [
        root + "projection_shard/~/linear/b",
        root + "projection_shard/~/linear/w",
        root + "projection_shard/~/replicated_layer_norm/offset",
        root + "projection_shard/~/replicated_layer_norm/scale",
    ]
    # Layers sorted as strings.
    layers = list(dict.fromkeys(int(m) for n in names for m in re.findall(r"layer_(\d+)/", n)))
    assert layers == [0, 1, 10, 11, 2, 3, 4, 5, 6, 7, 8, 9]
    # Within a layer: modules sorted, then params (b before w, offset before scale).
    layer0 = [n.split("layer_0/~/")[1] for n in names if "layer_0/" in n]
    assert layer0 == [
        "linear/w", "linear_1/w", "linear_2/w", "linear_3/w", "linear_4/b", "linear_4/w",
        "linear_5/b", "linear_5/w", "replicated_layer_norm/offset", "replicated_layer_norm/scale",
    ]  # fmt: skip
    by_name = {leaf.name: leaf for leaf in leaves}
    l3 = root + "layer_3/~/"
    assert by_name[l3 + "linear/w"].hf_name == "transformer.h.3.attn.q_proj.weight"
    assert by_name[l3 + "linear_1/w"].hf_name == "transformer.h.3.attn.v_proj.weight"
    assert by_name[l3 + "linear_2/w"].hf_name == "transformer.h.3.attn.k_proj.weight"
    assert by_name[l3 + "linear_3/w"].rule is Rule.ROWS
    assert by_name[l3 + "linear_5/b"].rule is Rule.SUM
    assert by_name[l3 + "replicated_layer_norm/offset"].hf_name == "transformer.h.3.ln_1.bias"


def test_is_mtj_slim(tmp_path, ckpt_small):
    assert is_mtj_slim(ckpt_small)
    assert not is_mtj_slim(tmp_path)
    (tmp_path / "shard_0").mkdir()
    assert not is_mtj_slim(tmp_path)


# --------------------------------------------------------------------------- round trips


def test_round_trip_float32_real_vocab(tmp_path):
    sd = _random_state_dict(REAL_VOCAB, seed=1)
    c = write_mtj_slim(sd, tmp_path / "ckpt", n_shards=8, files=16, bf16=False)
    assert (c != 0).float().mean() > 0.9  # the embedding bias fold is really exercised
    with np.load(tmp_path / "ckpt" / "shard_0" / "0.npz", allow_pickle=False) as npz:
        assert npz["arr_1"].shape == (REAL_VOCAB // 8, N_EMBD)  # wte rows per shard
    loaded = load_mtj_slim(tmp_path / "ckpt", N_LAYER)
    _assert_same(loaded, sd)


def test_round_trip_bf16(tmp_path, sd_small):
    sd = _to_bf16(sd_small)
    c = write_mtj_slim(sd, tmp_path / "ckpt", bf16=True)
    assert (c != 0).float().mean() > 0.5
    with np.load(tmp_path / "ckpt" / "shard_3" / "0.npz", allow_pickle=False) as npz:
        assert npz["arr_2"].dtype == np.dtype("V2")  # bf16 on disk as 2-byte void
    loaded = load_mtj_slim(tmp_path / "ckpt", N_LAYER, expected_shapes={k: v.shape for k, v in sd.items()})
    _assert_same(loaded, sd)
    # An explicit output dtype: the same values, upcast.
    loaded32 = load_mtj_slim(tmp_path / "ckpt", N_LAYER, dtype=torch.float32)
    _assert_same(loaded32, {k: v.float() for k, v in sd.items()})


def test_summed_biases_are_rounded_once_to_the_output_dtype(tmp_path, sd_small):
    """wte + embedding bias and the fc_out bias sums are computed exactly and rounded once to the
    dtype asked for: float32 keeps the exact sums (not their bfloat16 rounding), through convert and
    load_model too."""
    from safetensors.torch import load_file

    from gptj.config import GPTJConfig
    from gptj.weights.io import convert, load_model

    exact: dict[str, torch.Tensor] = {}
    write_mtj_slim(_to_bf16(sd_small), tmp_path / "ckpt", n_shards=8, files=16, bf16=True, free_biases=exact)
    assert len(exact) == 1 + N_LAYER
    for name, t in exact.items():  # the case that matters: sums bfloat16 cannot hold
        assert (t.to(torch.bfloat16).double() != t).any(), name
    cfg = GPTJConfig(vocab_size=SMALL_VOCAB, n_positions=32, n_embd=N_EMBD, n_layer=N_LAYER, n_head=4,
                     rotary_dim=8, n_inner=N_INNER, bos_token_id=0, eos_token_id=0)

    loaded = dict(iter_mtj_slim(scan(tmp_path / "ckpt"), N_LAYER, dtype=torch.float32))
    out = convert(tmp_path / "ckpt", tmp_path / "f32", fmt="mtj", config=cfg, dtype=torch.float32)
    converted = load_file(out / "model.safetensors")
    model = load_model(tmp_path / "ckpt", dtype=torch.float32, config=cfg).state_dict()
    bf16 = dict(iter_mtj_slim(scan(tmp_path / "ckpt"), N_LAYER))  # the stored dtype: one rounding to bfloat16
    for name, t in exact.items():
        for got in (loaded[name], converted[name], model[name]):
            assert got.dtype == torch.float32 and torch.equal(got.double(), t), name
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], t.to(torch.bfloat16)), name


@pytest.mark.parametrize(("n_shards", "files", "step"), [(8, 5, None), (4, 16, 7), (1, 3, 0), (2, 130, 3)])
def test_round_trip_other_layouts(tmp_path, sd_small, n_shards, files, step):
    write_mtj_slim(sd_small, tmp_path / "ckpt", n_shards=n_shards, files=files, bf16=False, step=step)
    names = []
    for name, t in iter_mtj_slim(scan(tmp_path / "ckpt", n_shards), N_LAYER):
        names.append(name)
        assert torch.equal(t, sd_small[name]), name
    assert sorted(names) == sorted(sd_small)


def test_layer_norm_taken_from_shard_0(ckpt_copy, sd_small):
    index = [leaf.name for leaf in mtj_leaves(N_LAYER)].index(
        "causal_transformer_shard/~/projection_shard/~/replicated_layer_norm/scale"
    )
    for s in range(1, 8):  # change every copy but shard 0's
        path, key = _locate(ckpt_copy / f"shard_{s}", index)
        i = int(key.removeprefix("arr_"))
        _rewrite(path, lambda arrays: arrays[:i] + [arrays[i] * 3] + arrays[i + 1 :])
    loaded = load_mtj_slim(ckpt_copy, N_LAYER)
    assert torch.equal(loaded["transformer.ln_f.weight"], sd_small["transformer.ln_f.weight"])


def test_progress_bar(ckpt_small, sd_small, capsys):
    assert len(load_mtj_slim(ckpt_small, N_LAYER, progress=True)) == len(sd_small)
    assert "Loading MTJ checkpoint" in capsys.readouterr().err


# --------------------------------------------------------------------------- errors


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no shard_0"):
        load_mtj_slim(tmp_path, N_LAYER)


def test_missing_shard_folder(ckpt_copy):
    shutil.rmtree(ckpt_copy / "shard_3")
    with pytest.raises(CheckpointError, match="missing shard folder shard_3"):
        load_mtj_slim(ckpt_copy, N_LAYER)


def test_missing_last_shard_folder(ckpt_copy):
    shutil.rmtree(ckpt_copy / "shard_7")
    with pytest.raises(CheckpointError, match="found 7 shard folders, expected 8"):
        load_mtj_slim(ckpt_copy, N_LAYER, n_shards=8)
    # Without n_shards, the per-shard slices do not add up to n_embd.
    with pytest.raises(CheckpointError, match=r"shard_0/0\.npz arr_2 .*layer_0/~/linear/w.*shard folder missing"):
        load_mtj_slim(ckpt_copy, N_LAYER)


def test_missing_npz_file(ckpt_copy):
    (ckpt_copy / "shard_2" / "11.npz").unlink()
    with pytest.raises(CheckpointError, match=r"shard_2: missing file 11\.npz"):
        load_mtj_slim(ckpt_copy, N_LAYER)


def test_truncated_leaf_count(ckpt_copy):
    for s in range(8):
        _rewrite(ckpt_copy / f"shard_{s}" / "15.npz", lambda arrays: arrays[:-2])
    with pytest.raises(CheckpointError, match=r"wrong leaf count: 125 arrays .* expected 126 params for n_layer=12"):
        load_mtj_slim(ckpt_copy, N_LAYER)


def test_wrong_n_layer(ckpt_small):
    with pytest.raises(CheckpointError, match=r"wrong leaf count.*n_layer=11.*fits n_layer=12"):
        load_mtj_slim(ckpt_small, 11)


def test_inconsistent_shards(ckpt_copy):
    _rewrite(ckpt_copy / "shard_5" / "4.npz", lambda arrays: arrays[:-1])
    with pytest.raises(CheckpointError, match=r"shard_5/4\.npz: inconsistent shards: 7 arrays, but shard_0/4\.npz has 8"):
        load_mtj_slim(ckpt_copy, N_LAYER)


def test_bad_shape_names_shard_and_tensor(ckpt_copy):
    index = [leaf.name for leaf in mtj_leaves(N_LAYER)].index("causal_transformer_shard/~/layer_10/~/linear_4/w")
    path, key = _locate(ckpt_copy / "shard_4", index)
    i = int(key.removeprefix("arr_"))
    _rewrite(path, lambda arrays: arrays[:i] + [arrays[i][:, :-1]] + arrays[i + 1 :])
    msg = rf"shard_4/{path.name} {key} \(.*layer_10/~/linear_4/w -> transformer\.h\.10\.mlp\.fc_in\.weight\): shape \(64, 31\)"
    with pytest.raises(CheckpointError, match=msg):
        load_mtj_slim(ckpt_copy, N_LAYER)


def test_expected_shapes_mismatch(ckpt_small, sd_small):
    shapes = {k: v.shape for k, v in sd_small.items()}
    shapes["lm_head.weight"] = (50400, N_EMBD)
    with pytest.raises(CheckpointError, match=r"lm_head\.weight: shape \(800, 64\) .* expected \(50400, 64\)"):
        load_mtj_slim(ckpt_small, N_LAYER, expected_shapes=shapes)


def test_nan_names_file_and_tensor(tmp_path, sd_small):
    sd = dict(sd_small)
    q = sd["transformer.h.3.attn.q_proj.weight"].clone()
    q[20, 5] = float("nan")  # output row 20 -> shard 20 // (64 / 8) = 2
    sd["transformer.h.3.attn.q_proj.weight"] = q
    write_mtj_slim(sd, tmp_path / "ckpt", bf16=False)
    with pytest.raises(
        CheckpointError, match=r"shard_2/\d+\.npz arr_\d+ \(.*layer_3/~/linear/w -> transformer\.h\.3\.attn\.q_proj\.weight\): non-finite"
    ):
        load_mtj_slim(tmp_path / "ckpt", N_LAYER)


def test_nan_in_bf16_void_array(tmp_path, sd_small):
    write_mtj_slim(_to_bf16(sd_small), tmp_path / "bf16", bf16=True)
    index = [leaf.name for leaf in mtj_leaves(N_LAYER)].index("causal_transformer_shard/~/layer_0/~/linear_5/b")
    path, key = _locate(tmp_path / "bf16" / "shard_6", index)
    i = int(key.removeprefix("arr_"))

    def poison(arrays):
        bits = arrays[i].view(np.uint16).copy()
        bits[0] = 0x7FC0  # bf16 NaN
        return arrays[:i] + [bits.view(np.dtype("V2"))] + arrays[i + 1 :]

    _rewrite(path, poison)
    with pytest.raises(CheckpointError, match=r"shard_6/.*transformer\.h\.0\.mlp\.fc_out\.bias\): non-finite"):
        load_mtj_slim(tmp_path / "bf16", N_LAYER)


def test_corrupt_npz_file(ckpt_copy):
    (ckpt_copy / "shard_1" / "3.npz").write_bytes(b"not a zip archive")
    with pytest.raises(CheckpointError, match=r"shard_1/3\.npz: cannot read npz file"):
        load_mtj_slim(ckpt_copy, N_LAYER)


def test_object_arrays_are_never_unpickled(ckpt_copy):
    _rewrite(ckpt_copy / "shard_0" / "2.npz", lambda arrays: [np.array([{"x": 1}], dtype=object)] + arrays[1:])
    with pytest.raises(CheckpointError, match=r"shard_0/2\.npz arr_0 .*cannot read array"):
        load_mtj_slim(ckpt_copy, N_LAYER)


@pytest.mark.parametrize("n_layer", [11, 13, 10**9])
def test_config_n_layer_is_checked_against_the_leaf_count(tmp_path, ckpt_small, n_layer):
    """load_model / convert with a config claiming more or fewer layers than the shards hold: one error
    naming both numbers and the config file, from the npz directories alone (no table of n_layer leaves:
    10^9 is refused by the config's bounds before the shards are looked at)."""
    from gptj.config import GPTJConfig
    from gptj.errors import ConfigError
    from gptj.weights.io import convert, load_model

    cfg = GPTJConfig(vocab_size=SMALL_VOCAB, n_positions=32, n_embd=N_EMBD, n_layer=12, n_head=4,
                     rotary_dim=8, n_inner=N_INNER, bos_token_id=0, eos_token_id=0)
    d = cfg.to_hf_dict() | {"n_layer": n_layer}
    (tmp_path / "config.json").write_text(json.dumps(d))
    config_json = str(tmp_path / "config.json")
    message = "'n_layer' must be an integer" if n_layer > 1024 else f"'n_layer' is {n_layer} but the checkpoint holds 12"
    with pytest.raises(ConfigError, match=re.escape(f"{config_json}: config field {message}")):
        load_model(ckpt_small, config=config_json)
    with pytest.raises(ConfigError, match=re.escape(message)):
        convert(ckpt_small, tmp_path / "out", config=config_json)
    assert not (tmp_path / "out").exists()


def test_a_slim_checkpoint_is_scanned_once_and_its_tensors_stream_from_that_scan(ckpt_small, sd_small,
                                                                                 monkeypatch):
    """Checkpoint.read scans the shard folders and npz directories once (the layer count, the layout
    it keeps); loading streams the tensors from that layout without scanning again."""
    from gptj.config import GPTJConfig
    from gptj.weights import mtj
    from gptj.weights.checkpoint import Checkpoint

    scans = []
    real = mtj.scan
    monkeypatch.setattr(mtj, "scan", lambda *a, **k: scans.append(a) or real(*a, **k))
    cfg = GPTJConfig(vocab_size=SMALL_VOCAB, n_positions=32, n_embd=N_EMBD, n_layer=N_LAYER, n_head=4,
                     rotary_dim=8, n_inner=N_INNER, bos_token_id=0, eos_token_id=0)
    checkpoint = Checkpoint.read(ckpt_small, config=cfg)
    assert len(scans) == 1 and checkpoint.layout.path == ckpt_small
    loaded = {name: read() for name, _, read, _ in checkpoint.tensors(dtype=torch.float32)}
    assert len(scans) == 1
    _assert_same(loaded, sd_small)
