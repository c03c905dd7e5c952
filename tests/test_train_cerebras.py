"""Reading the Cerebras model zoo's GPT data (HDF5: input_ids, attention_mask as a loss mask on the
labels, labels = next tokens) into gptj's rows: the same targets, the same loss, one-line errors.
The files are written here in the layout Cerebras' HDF5IterableDataset reads (a dataset "data" of
shape (n, 3, T) per .h5 file, the attribute n_examples)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from gptj.errors import GptjError
from gptj.train.data import TokenData, prepare_cerebras_hdf5

h5py = pytest.importorskip("h5py", reason="h5py (the test extras install it) reads Cerebras' HDF5 files")

T = 16
EOS = 50256


def cerebras_rows(seed: int = 0) -> np.ndarray:
    """Three packed rows (every label a target) and one fine-tuning row: a prompt (no targets), a
    response and EOS (targets), then padding whose labels are arbitrary and masked."""
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, 50000, size=3 * T + 1)
    rows = []
    for r in range(3):
        x = stream[r * T:(r + 1) * T]
        rows.append([x, np.ones(T, dtype=np.int64), stream[r * T + 1:(r + 1) * T + 1]])
    tokens = np.concatenate([rng.integers(0, 50000, size=9), [EOS]])  # 6 prompt tokens, 3 response, EOS
    x = np.full(T, EOS)
    x[:len(tokens)] = tokens
    labels = np.full(T, 7)  # padding labels: anything (masked)
    labels[:len(tokens) - 1] = tokens[1:]
    mask = np.zeros(T, dtype=np.int64)
    mask[5:len(tokens) - 1] = 1  # predicting tokens 6..9: the response and EOS
    rows.append([x, mask, labels])
    return np.asarray(rows, dtype=np.int32)


def write_h5(folder, rows: np.ndarray, per_file: int = 2):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(rows), per_file):
        with h5py.File(folder / f"data-{i // per_file:05d}.h5", "w") as h:
            part = rows[i:i + per_file]
            h.create_dataset("data", data=part)
            h.attrs["n_examples"] = len(part)
    return folder


def test_rows_keep_their_tokens_and_targets(tmp_path):
    rows = cerebras_rows()
    meta = prepare_cerebras_hdf5(write_h5(tmp_path / "cb", rows), tmp_path / "out", progress=False)
    td = TokenData(tmp_path / "out")
    ids, input_mask, loss_mask = td.get(range(len(rows)))
    assert td.kind == "cerebras-hdf5" and td.seq_len == T and len(td) == len(rows)
    assert np.array_equal(ids, rows[:, 0]) and input_mask.all()
    assert not loss_mask[:, 0].any() and np.array_equal(loss_mask[:, 1:], rows[:, 1, :-1] != 0)
    # each target is the next token: gptj's (row, t + 1) is Cerebras' label (row, t)
    r, t = np.nonzero(loss_mask)
    assert np.array_equal(ids[r, t], rows[r, 2, t - 1])
    assert meta["dropped_targets"] == 3 and meta["targets"] == int((rows[:, 1] != 0).sum()) - 3


def test_the_loss_is_cerebras_loss_without_the_dropped_labels(tmp_path, tiny_checkpoint):
    """gptj's training loss on the converted rows equals cross-entropy of Cerebras' labels under its
    mask, the rows' last labels left out."""
    from gptj.train.trainer import _loss_sum
    from gptj.weights.io import load_model

    rows = cerebras_rows(1)
    prepare_cerebras_hdf5(write_h5(tmp_path / "cb", rows), tmp_path / "out", progress=False)
    ids, im, lm = (torch.from_numpy(a) for a in TokenData(tmp_path / "out").get(range(len(rows))))
    model = load_model(tiny_checkpoint).eval()
    with torch.no_grad():
        ours = _loss_sum(model, ids, im.long(), lm, "float32", torch.device("cpu"))
        logits = model(torch.from_numpy(rows[:, 0]).long())
        mask = torch.from_numpy(rows[:, 1] != 0)
        mask[:, -1] = False
        labels = torch.where(mask, torch.from_numpy(rows[:, 2]).long(), -100)
        theirs = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


@pytest.mark.parametrize("damage, said", [
    ("unshifted", "labels[3] is not input_ids[4]"),
    ("features", "gptj reads ['input_ids', 'attention_mask', 'labels']"),
    ("shape", "expected a dataset 'data' of shape (n, 3, seq_len)"),
    ("seq_len", "rows of 16 tokens; the config's data.seq_len is 32"),
])
def test_data_gptj_cannot_read_is_one_line(tmp_path, damage, said):
    rows = cerebras_rows()
    seq_len = None
    if damage == "unshifted":
        rows[1, 2, 3] += 1
    folder = write_h5(tmp_path / "cb", rows)
    if damage == "features":
        (folder / "data_params.json").write_text(json.dumps({"features": ["input_ids", "labels", "attention_mask"]}))
    if damage == "shape":
        with h5py.File(folder / "data-00000.h5", "w") as h:
            h.create_dataset("data", data=rows[:, :2])
    if damage == "seq_len":
        seq_len = 32
    with pytest.raises(GptjError, match=None) as e:
        prepare_cerebras_hdf5(folder, tmp_path / "out", seq_len=seq_len, progress=False)
    assert said in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_train_and_eval_only_read_it_from_the_config(tmp_path, capsys):
    from gptj.cli import main

    cb = write_h5(tmp_path / "cb", cerebras_rows())
    cfg = {"model": {"preset": "tiny"}, "data": {"train": {"cerebras_hdf5": "cb"}, "eval": {"cerebras_hdf5": "cb"},
                                                 "seq_len": T},
           "batch_size": 2, "max_steps": 2, "eval_interval": 2, "log_interval": 1, "seed": 0, "out": str(tmp_path / "run")}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--quiet"]) == 0
    trained = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    capsys.readouterr()
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--eval-only", "--json", "--quiet"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["eval_loss"] == trained[-1]["eval_loss"] and got["eval_tokens"] == trained[-1]["eval_tokens"]
    assert cb.is_dir() and TokenData(tmp_path / "run" / "data" / "train").kind == "cerebras-hdf5"
