"""Reading HF GPT-J directories: safetensors (single or sharded) and pytorch_model.bin (single or sharded).

Tensors are yielded one at a time so the caller can convert and place each before the
next is read: weights are never held twice. `.bin` files are read only through
`torch.load(weights_only=True)`; a pickle that tries to run code is refused.
"""

from __future__ import annotations

import json
import math
import mmap
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from gptj.errors import CheckpointError, GptjError
from gptj.files import model_file

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"

def weight_files(path: Path) -> list[Path]:
    """The weight files of an HF directory, preferring safetensors over .bin; each must lie inside it
    (gptj.files.model_file)."""
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (BIN, BIN_INDEX)):
        if (path / index).is_file():
            idx_path = model_file(path, index)
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
            return [model_file(path, n) for n in names]
        if (path / single).is_file():
            return [model_file(path, single)]
    raise CheckpointError(f"{path}: no {SAFETENSORS}, {SAFETENSORS_INDEX}, {BIN} or {BIN_INDEX}")


def listed_tensor_names(path: Path) -> tuple[list[str], Path] | None:
    """The tensor names an HF directory lists without reading a weight, and the file that lists them:
    the index's weight_map, or a single safetensors file's header (the files weight_files picks: call
    it first, it checks the index). None for a single .bin: a pickle lists its tensors only once
    unpickled (they are checked as read)."""
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (BIN, BIN_INDEX)):
        if (path / index).is_file():
            return list(json.loads((path / index).read_text(encoding="utf-8"))["weight_map"]), path / index
        if (path / single).is_file():
            return (list(read_safetensors_header(path / single)[0]), path / single) if single == SAFETENSORS else None
    return None


# safetensors dtype names -> torch dtypes (the ones a GPT-J checkpoint can hold).
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
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
    """Each tensor as a view of the file mapped copy-on-write (as gpt-fast loads with mmap=True).

    Nothing is copied: the page cache holds the bytes once and the weights are those pages, so a
    model stored in the dtype it runs in loads at the speed of touching the file, with resident
    memory equal to the weights. Each tensor maps its own pages (its range rounded out to pages),
    so freeing a tensor unmaps them: the serving kernels repack a layer and free it before the
    next (gptj.kernels), and a small tensor kept (a LayerNorm, a bias) does not pin the rest of
    its file. A tensor converted to another dtype or device is copied by the caller.
    """
    header, data_start = read_safetensors_header(file)
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        shape = tuple(int(d) for d in info["shape"])

        def read(name: str = name, info: dict = info, shape: tuple[int, ...] = shape) -> torch.Tensor:
            dtype = _ST_DTYPES[info["dtype"]]
            begin, end = info["data_offsets"]
            numel = math.prod(shape)
            if numel == 0:
                return torch.empty(shape, dtype=dtype)
            offset = data_start + begin
            lead = offset % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page
            try:  # MAP_PRIVATE: writes stay private; unmapped when the tensor's storage is freed
                with open(file, "rb") as f:
                    mapped = mmap.mmap(f.fileno(), lead + end - begin, access=mmap.ACCESS_COPY, offset=offset - lead)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{file}: cannot map tensor {name} ({e})") from None
            with warnings.catch_warnings():  # frombuffer warns about non-writable buffers; ACCESS_COPY is writable
                warnings.simplefilter("ignore")
                if offset % torch.empty((), dtype=dtype).element_size():  # misaligned: copy instead of viewing
                    raw = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=lead)
                    return raw.clone().view(dtype).view(shape)
                flat = torch.frombuffer(mapped, dtype=dtype, count=numel, offset=lead)
            return flat.view(shape)

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


def iter_hf_tensors(files: Iterable[Path]) -> Iterator[tuple[str, tuple[int, ...], callable, Path]]:
    """(name, shape, read(), file) for every tensor of an HF directory's weight files (weight_files),
    legacy buffers included."""
    for file in files:
        reader = _iter_safetensors if file.suffix == ".safetensors" else _iter_bin
        for name, shape, read in reader(file):
            yield name, shape, read, file


def checkpoint_dtype(path: object) -> str:
    """`--dtype auto` for the model folder `path`: the float dtype its config.json records
    (`torch_dtype`; transformers 5 writes `dtype`), float32 when it records none (or there is no
    config.json: the loader then says what is wrong with the folder). So a run with the defaults
    computes in the dtype HF transformers loads the same checkpoint in, token for token."""
    from gptj.device import DTYPE_NAMES, dtype_name, parse_dtype

    try:
        config = json.loads((Path(str(path)) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    recorded = config.get("torch_dtype", config.get("dtype")) if isinstance(config, dict) else None
    if recorded is None:
        return "float32"
    name = str(recorded).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise GptjError(f"{path}: config.json records torch_dtype {recorded!r}, which gptj does not run; "
                        f"pass --dtype ({', '.join(DTYPE_NAMES)})")
    return dtype_name(parse_dtype(name))
