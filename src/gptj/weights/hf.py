"""Reading HF GPT-J directories: safetensors (single or sharded) and pytorch_model.bin (single or sharded).

Tensors are yielded one at a time so the caller can convert and place each before the
next is read: weights are never held twice. `.bin` files are read only through
`torch.load(weights_only=True)`; a pickle that tries to run code is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from gptj.errors import CheckpointError

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"

# Buffers that old HF GPT-J checkpoints saved (causal mask and its fill value); gptj computes them.
LEGACY_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def is_legacy_buffer(name: str) -> bool:
    return name.endswith(LEGACY_SUFFIXES)


def weight_files(path: Path) -> list[Path]:
    """The weight files of an HF directory, preferring safetensors over .bin."""
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (BIN, BIN_INDEX)):
        if (path / index).is_file():
            idx_path = path / index
            try:
                weight_map = json.loads(idx_path.read_text(encoding="utf-8"))["weight_map"]
                names = sorted(set(weight_map.values()), key=str)
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{idx_path}: not a valid weight index ({e})") from None
            for n in names:
                if not isinstance(n, str) or Path(n).name != n:  # no paths out of the directory
                    raise CheckpointError(f"{idx_path}: shard name {n!r} must be a plain file name")
                if not (path / n).is_file():
                    raise CheckpointError(f"{idx_path}: shard {n} is missing")
            files = [path / n for n in names]
            return files
        if (path / single).is_file():
            return [path / single]
    raise CheckpointError(f"{path}: no {SAFETENSORS}, {SAFETENSORS_INDEX}, {BIN} or {BIN_INDEX}")


# safetensors dtype names -> torch dtypes (the ones a GPT-J checkpoint can hold).
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors_header(file: Path) -> tuple[dict[str, dict], int]:
    """The tensor table of a safetensors file and where its data starts; checked against the file size."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("header too small")
            n = int.from_bytes(head, "little")
            if n > min(size - 8, 100 * 1024**2):
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        header.pop("__metadata__", None)
        data_start = 8 + n
        for name, info in header.items():
            begin, end = info["data_offsets"]
            dtype = _ST_DTYPES[info["dtype"]]
            numel = 1
            for d in info["shape"]:
                numel *= int(d)
            if end - begin != numel * torch.empty((), dtype=dtype).element_size() or not 0 <= begin <= end:
                raise ValueError(f"tensor {name}: offsets do not match its shape and dtype")
            if data_start + end > size:
                raise ValueError(f"tensor {name} extends past the end of the file (truncated?)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    return header, data_start


def _iter_safetensors(file: Path) -> Iterator[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
    """Each tensor read straight from the file into its own memory (no mmap, no second copy).

    Plain reads rather than the safetensors library's mmap: a mapped file's pages count in the
    process's resident memory while it is open, which would make peak memory weights + file size.
    """
    header, data_start = read_safetensors_header(file)
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        shape = tuple(int(d) for d in info["shape"])

        def read(info: dict = info, shape: tuple[int, ...] = shape, name: str = name) -> torch.Tensor:
            tensor = torch.empty(shape, dtype=_ST_DTYPES[info["dtype"]])
            buf = tensor.view(-1).view(torch.uint8).numpy() if tensor.numel() else None
            begin, end = info["data_offsets"]
            got = 0
            try:
                with open(file, "rb", buffering=0) as f:
                    f.seek(data_start + begin)
                    view = memoryview(buf) if buf is not None else memoryview(b"")
                    while got < len(view):  # one read returns at most ~2 GiB
                        n = f.readinto(view[got:])
                        if not n:
                            break
                        got += n
            except OSError as e:
                raise CheckpointError(f"{file}: tensor {name}: {e}") from None
            if got != end - begin:
                raise CheckpointError(f"{file}: tensor {name}: short read ({got} of {end - begin} bytes)")
            return tensor

        yield name, shape, read


def load_bin(file: Path) -> dict[str, torch.Tensor]:
    """torch.load with weights_only=True (never unpickle code); mmap where the zip format allows."""
    try:
        try:
            sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # legacy (non-zip) format can't be mmapped: read it plainly
                raise
            sd = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle safely is the same user error
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{file}: refusing to load: not a plain tensor checkpoint (weights_only=True failed: {first})"
        ) from None
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()):
        raise CheckpointError(f"{file}: expected a dict of name -> tensor")
    return sd


def _iter_bin(file: Path) -> Iterator[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
    sd = load_bin(file)
    for name in list(sd):
        tensor = sd.pop(name)  # drop our reference as we go
        yield name, tuple(tensor.shape), (lambda t=tensor: t)


def iter_hf_tensors(path: Path) -> Iterator[tuple[str, tuple[int, ...], callable, Path]]:
    """(name, shape, read(), file) for every tensor of an HF directory, legacy buffers included."""
    for file in weight_files(path):
        reader = _iter_safetensors if file.suffix == ".safetensors" else _iter_bin
        for name, shape, read in reader(file):
            yield name, shape, read, file
