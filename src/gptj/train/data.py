"""Training data: raw text or summarization pairs, tokenized into fixed-length rows on disk.

A prepared folder (format "gptj-tokens/1") holds N rows of T = seq_len tokens each, as
numpy memmaps in C order, like the Cerebras model zoo's input_ids / input_mask features::

    meta.json        {"format", "kind", "seq_len", "n_sequences", "n_tokens", "vocab_size",
                      "eos_token_id", "pad_token_id", "sources", "tokenizer", "ids_dtype"}
    input_ids.bin    uint16 (N, T), or uint32 for a vocabulary of more than 65,536 ids (Llama 3's
                     128,256; meta.json's ids_dtype says which, absent: uint16); padding positions
                     hold pad_token_id (= EOS)
    input_mask.bin   uint8  (N, T); 1 for real tokens, 0 for padding
    loss_mask.bin    uint8  (N, T); 1 where the token is a training target, i.e. is
                     predicted from the position before it

Two kinds:

- "packed" (`prepare_text`): documents are tokenized one by one, each followed by EOS,
  concatenated in order and cut into rows of T tokens; only the last row is padded. The
  loss mask is the input mask with column 0 cleared (nothing predicts a row's first token).
- "pairs" (`prepare_summarization`): one row per cnn_eval.json example: the MLPerf prompt
  (gptj-99's, `gptj.mlperf.dataset.build_prompt`, or with `prompt="llama"` llama3.1-8b's,
  `llama_prompt`), then the response `" " + output.strip()` and EOS, then padding. The loss mask
  covers exactly the response tokens and that EOS.

- "cerebras-hdf5" (`prepare_cerebras_hdf5`): rows read from data that the Cerebras model zoo
  prepared for its GPT models (its GptHDF5DataProcessor's HDF5 files), converted to the
  convention below.

The masks against the Cerebras model zoo's (they differ): Cerebras stores each row as
`input_ids`, `labels` (the next tokens: labels[t] = input_ids[t + 1]) and a mask aligned with
the labels. In its PyTorch data (HDF5) that mask is called `attention_mask` but is a loss mask:
1 where labels[t] is a target; attention stays causal over every position. In its older TensorFlow
data (TFRecords) `input_mask` marks padding: 1 on padded positions, 0 on real tokens, the opposite
of gptj's. gptj stores no labels: the next token is the row's own next id, so its `loss_mask` is
aligned with the tokens (loss_mask[t + 1] = Cerebras' mask[t]), and its `input_mask` is 1 on real
tokens (HF's attention_mask). A Cerebras row of T tokens becomes a gptj row of the same T tokens;
its last label (the token after the row) has no place in it and is dropped (meta.json's
`dropped_targets` counts them: one per full row, 1 / T of the targets).

Output folders are written atomically: everything goes into a temporary sibling folder
that is renamed into place when complete, so a failed run leaves nothing half-written.
`TokenData` memory-maps a prepared folder for the trainer.

This module does not import torch.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from tqdm import tqdm

from gptj.errors import GptjError
from gptj.files import move_into_place, read_text, temp_sibling
from gptj.mlperf.dataset import (LLAMA_PROMPT_TEMPLATE, PROMPT_TEMPLATE, Example, build_prompt, llama_prompt,
                                 load_examples)
from gptj.tokenizer import Tokenizer, load_tokenizer

FORMAT = "gptj-tokens/1"
KINDS = ("packed", "pairs", "cerebras-hdf5")
META = "meta.json"
IDS_FILE = "input_ids.bin"
INPUT_MASK_FILE = "input_mask.bin"
LOSS_MASK_FILE = "loss_mask.bin"
# The masks' file name -> dtype on disk; the ids' dtype is IDS_DTYPES[meta["ids_dtype"]] (ids_dtype_for).
MASK_FILES: dict[str, np.dtype] = {
    INPUT_MASK_FILE: np.dtype(np.uint8),
    LOSS_MASK_FILE: np.dtype(np.uint8),
}
IDS_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}
MAX_VOCAB_SIZE = 1 << 32
MIN_SEQ_LEN = 2  # one input token and one target

# Documents of a .jsonl file are tokenized in batches (in parallel, in Rust) of at most
# this many documents or characters, so memory stays bounded on large corpora.
_BATCH_DOCS = 1024
_BATCH_CHARS = 1 << 22

# The MLPerf templates split around the article: header (gptj-99's with the instruction filled in),
# article, footer. Used only when a prompt must be shortened.
_TEMPLATES = {"gptj": PROMPT_TEMPLATE.split("{input}"), "llama": LLAMA_PROMPT_TEMPLATE.split("{input}")}
PROMPTS = tuple(_TEMPLATES)


def ids_dtype_for(vocab_size: int) -> str:
    """How a prepared folder stores the ids of a vocabulary of `vocab_size` ids: uint16 where they fit
    (GPT-J's 50,400), uint32 beyond (Llama 3's 128,256)."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# --- helpers -----------------------------------------------------------------------


def _type_name(value: object) -> str:
    names = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
    if type(value) in names:
        return names[type(value)]
    return "number" if isinstance(value, int | float) else type(value).__name__


def _check_seq_len(seq_len: int) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < MIN_SEQ_LEN:
        raise GptjError(f"seq_len must be an integer >= {MIN_SEQ_LEN}, got {seq_len!r}")
    return seq_len


def _resolve_tokenizer(tokenizer: Tokenizer | str | Path | None) -> tuple[Tokenizer, str]:
    """The tokenizer to use and how meta.json names it ("gpt-j", a path, or "custom")."""
    if tokenizer is None:
        tok, name = load_tokenizer(), "gpt-j"
    elif isinstance(tokenizer, str | Path):
        tok, name = load_tokenizer(tokenizer), str(tokenizer)
    else:
        tok = tokenizer
        name = "gpt-j" if tok is load_tokenizer() else "custom"
    if tok.vocab_size > MAX_VOCAB_SIZE:
        raise GptjError(f"tokenizer vocabulary has {tok.vocab_size} ids; token ids are stored as uint32, "
                        f"so at most {MAX_VOCAB_SIZE} are supported")
    return tok, name


def _check_source(path: Path) -> None:
    if not path.exists():
        raise GptjError(f"{path}: input file not found")
    if path.is_dir():
        raise GptjError(f"{path}: is a directory, not an input file")


def _read_text(path: Path) -> str:
    """A whole text file (UTF-8, a leading BOM dropped), errors as one-line GptjErrors."""
    return read_text(path, "input file")


def _jsonl_documents(path: Path, key: str) -> Iterator[tuple[str, int]]:
    """(text, bytes read) for each non-blank line of a JSON-lines file."""
    try:
        f = path.open("rb")
    except OSError as e:
        raise GptjError(f"{path}: cannot read: {e.strerror or e}") from None
    with f:
        lineno = 0
        while True:
            try:
                raw = f.readline()
            except OSError as e:
                raise GptjError(f"{path}: cannot read: {e.strerror or e}") from None
            if not raw:
                return
            lineno += 1
            where = f"{path}: line {lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise GptjError(f"{where}: not valid UTF-8 (byte {e.start} of the line)") from None
            if not line.strip():
                yield "", len(raw)
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise GptjError(f"{where}: not valid JSON: {e.msg} at column {e.colno}") from None
            if not isinstance(obj, dict):
                raise GptjError(f"{where}: must be a JSON object, got {_type_name(obj)}")
            if key not in obj:
                raise GptjError(f"{where}: missing key {key!r}")
            if not isinstance(obj[key], str):
                raise GptjError(f"{where}: {key!r} must be a string, got {_type_name(obj[key])}")
            yield obj[key], len(raw)


def _documents(path: Path, jsonl_key: str) -> Iterator[tuple[str, int]]:
    """(text, bytes read) per document: a .jsonl file's lines, or a whole plain-text file."""
    if path.suffix.lower() == ".jsonl":
        yield from _jsonl_documents(path, jsonl_key)
    else:
        text = _read_text(path)
        yield text, len(text.encode("utf-8"))


def _token_batches(
    sources: Sequence[Path], tok: Tokenizer, jsonl_key: str, bar: tqdm
) -> Iterator[list[list[int]]]:
    """Token ids of the documents in order (whitespace-only ones skipped), in batches."""
    texts: list[str] = []
    chars = pending_bytes = 0
    for path in sources:
        for text, nbytes in _documents(path, jsonl_key):
            pending_bytes += nbytes
            if text.strip():
                texts.append(text)
                chars += len(text)
            if len(texts) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                yield tok.encode_batch(texts)
                bar.update(pending_bytes)
                texts, chars, pending_bytes = [], 0, 0
    if texts:
        yield tok.encode_batch(texts)
    bar.update(pending_bytes)


def _is_prepared_meta(folder: Path) -> bool:
    """Whether `folder` has a meta.json of this format (files not checked)."""
    try:
        meta = json.loads((folder / META).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def _check_out(out: Path, force: bool) -> None:
    """GptjError unless `out` may be written: absent or empty, or (with force) a prepared folder."""
    if not out.exists():
        return
    if not out.is_dir():
        raise GptjError(f"{out}: exists and is not a folder")
    if not any(out.iterdir()):
        return
    if not force:
        raise GptjError(f"{out}: already exists (choose a new --out, or pass --force to replace it)")
    if not _is_prepared_meta(out):
        # --force replaces earlier outputs only: a mistyped --out must not wipe other data.
        raise GptjError(
            f"{out}: not a prepared data folder (no {META} of format {FORMAT}); "
            "refusing to replace it, even with --force"
        )


@contextmanager
def _atomic_folder(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; when the body succeeds, rename it to `out`.

    On any failure (KeyboardInterrupt included) the temporary folder is removed and an
    existing `out` is left untouched.
    """
    _check_out(out, force)
    target = Path(os.path.abspath(out))  # "." and "dir/.." have no usable name or parent
    try:
        tmp = temp_sibling(target)
    except OSError as e:
        raise GptjError(f"{out}: cannot create: {e.strerror or e}") from None
    try:
        try:
            yield tmp
            move_into_place(tmp, target)
        except OSError as e:
            raise GptjError(f"{out}: cannot write: {e.strerror or e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_meta(folder: Path, meta: dict) -> None:
    (folder / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _make_meta(kind: str, seq_len: int, n_sequences: int, n_tokens: int, tok: Tokenizer,
               sources: Sequence[str | Path], tokenizer_name: str) -> dict:
    return {
        "format": FORMAT,
        "kind": kind,
        "seq_len": seq_len,
        "n_sequences": n_sequences,
        "n_tokens": n_tokens,
        "vocab_size": tok.vocab_size,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.eos_token_id,
        "sources": [str(s) for s in sources],
        "tokenizer": tokenizer_name,
        "ids_dtype": ids_dtype_for(tok.vocab_size),
    }


def _memmap(path: Path, dtype: np.dtype, shape: tuple[int, int]) -> np.memmap:
    return np.memmap(path, dtype=dtype, mode="w+", shape=shape)


# --- preparation -------------------------------------------------------------------


def prepare_text(
    sources: Sequence[str | Path],
    out: str | Path,
    seq_len: int,
    tokenizer: Tokenizer | str | Path | None = None,
    jsonl_key: str = "text",
    force: bool = False,
    progress: bool = True,
) -> dict:
    """Tokenize text files into packed rows of `seq_len` tokens in folder `out`; return its meta.

    A file ending in `.jsonl` holds one JSON object per line, the document in its string
    field `jsonl_key` (blank lines skipped); any other file is plain UTF-8 text and is one
    document. Documents that are empty or only whitespace are skipped. Each document's ids
    are followed by EOS; all are concatenated in the order given and cut into rows, and the
    last partial row is padded with EOS (input_mask 0 there).

    Documents are read and tokenized a batch at a time; the ids go straight to disk, so
    neither the text nor the ids of a large corpus are held in memory at once.

    `tokenizer`: None for GPT-J's, a path to load one from, or a `Tokenizer`. `force`
    replaces an existing prepared folder. Raises GptjError for bad input (a missing or
    unreadable file, a bad JSON line, no text at all, seq_len < 2, an existing `out`).
    """
    if isinstance(sources, str | Path):
        sources = [sources]
    seq_len = _check_seq_len(seq_len)
    paths = [Path(s) for s in sources]
    if not paths:
        raise GptjError("no input files given")
    for path in paths:
        _check_source(path)
    tok, tokenizer_name = _resolve_tokenizer(tokenizer)
    out = Path(out)
    eos = tok.eos_token_id
    dtype = IDS_DTYPES[ids_dtype_for(tok.vocab_size)]
    total_bytes = sum(p.stat().st_size for p in paths)
    with _atomic_folder(out, force) as tmp:
        n_tokens = 0
        with (tmp / IDS_FILE).open("wb") as f, tqdm(
            total=total_bytes, desc="tokenizing", unit="B", unit_scale=True, disable=not progress
        ) as bar:
            for batch in _token_batches(paths, tok, jsonl_key, bar):
                for ids in batch:
                    ids.append(eos)
                    np.asarray(ids, dtype=dtype).tofile(f)
                    n_tokens += len(ids)
            if n_tokens == 0:
                raise GptjError(f"no text in {', '.join(map(str, paths))} (every document is empty)")
            n_rows = -(-n_tokens // seq_len)
            np.full(n_rows * seq_len - n_tokens, eos, dtype=dtype).tofile(f)
        for name, mask_dtype in MASK_FILES.items():
            mask = _memmap(tmp / name, mask_dtype, (n_rows, seq_len))
            mask.reshape(-1)[:n_tokens] = 1
            if name == LOSS_MASK_FILE:
                mask[:, 0] = 0
            mask.flush()
            del mask
        meta = _make_meta("packed", seq_len, n_rows, n_tokens, tok, sources, tokenizer_name)
        _write_meta(tmp, meta)
    return meta


def _pair_ids(example: Example, index: int, tok: Tokenizer, seq_len: int,
              prompt_kind: str = "gptj") -> tuple[list[int], list[int]]:
    """(prompt ids, response ids + EOS) for one example, fitted into `seq_len` tokens.

    The prompt (`build_prompt(example)`, or llama3.1-8b's template around the article) is
    tokenized as one string, with the special tokens the tokenizer adds (a Llama's BOS); the
    response without. When prompt + response + EOS are longer than `seq_len`, the article alone
    is shortened: the template text before and after `{input}` (instruction included) and the
    article are tokenized separately, the article's ids are cut from its end, and the three id
    lists are concatenated. The ids then differ slightly from tokenizing the shortened prompt
    string at once (BPE does not merge across the joins); the template text and the response are
    always kept whole.
    """
    head, foot = _TEMPLATES[prompt_kind]
    response = tok.encode(" " + example.output.strip(), add_special_tokens=False) + [tok.eos_token_id]
    prompt = tok.encode(build_prompt(example) if prompt_kind == "gptj" else llama_prompt(example.input))
    if len(prompt) + len(response) <= seq_len:
        return prompt, response
    header = tok.encode(head.format_map({"instruction": example.instruction}))  # (llama's has no field)
    footer = tok.encode(foot, add_special_tokens=False)
    room = seq_len - len(header) - len(footer) - len(response)
    if room < 0:
        needed = seq_len - room
        raise GptjError(
            f"example {index}: the prompt template and response need {needed} tokens even with "
            f"an empty article, more than seq_len {seq_len}"
        )
    return header + tok.encode(example.input, add_special_tokens=False)[:room] + footer, response


def prepare_summarization(
    source: str | Path,
    out: str | Path,
    seq_len: int,
    tokenizer: Tokenizer | str | Path | None = None,
    force: bool = False,
    progress: bool = True,
    prompt: str = "gptj",
) -> dict:
    """Turn a cnn_eval.json-format file into prompt/response rows in folder `out`; return its meta.

    One row per example: the MLPerf prompt (`prompt`: "gptj", gptj-99's `build_prompt`, or
    "llama", llama3.1-8b's around the article), the response
    `" " + output.strip()` and EOS, then EOS padding to `seq_len`. The loss mask is 1 exactly
    on the response tokens and the EOS after them. Too-long prompts are shortened by cutting
    the article's tail (see `_pair_ids`); an example whose template and response alone do not
    fit is a GptjError naming its index. An example with an empty output is a GptjError too.
    """
    seq_len = _check_seq_len(seq_len)
    if prompt not in PROMPTS:
        raise GptjError(f"prompt must be one of {', '.join(PROMPTS)}, got {prompt!r}")
    source_path = Path(source)
    _check_source(source_path)
    examples = load_examples(source_path)
    for i, example in enumerate(examples):
        if not example.output.strip():
            raise GptjError(f"{source_path}: entry {i}: 'output' is empty (nothing to train on)")
    tok, tokenizer_name = _resolve_tokenizer(tokenizer)
    out = Path(out)
    pad = tok.pad_token_id
    shape = (len(examples), seq_len)
    with _atomic_folder(out, force) as tmp:
        ids = _memmap(tmp / IDS_FILE, IDS_DTYPES[ids_dtype_for(tok.vocab_size)], shape)
        input_mask = _memmap(tmp / INPUT_MASK_FILE, MASK_FILES[INPUT_MASK_FILE], shape)
        loss_mask = _memmap(tmp / LOSS_MASK_FILE, MASK_FILES[LOSS_MASK_FILE], shape)
        ids[:] = pad
        n_tokens = 0
        for i, example in enumerate(tqdm(examples, desc="tokenizing", unit="example", disable=not progress)):
            prompt_ids, response = _pair_ids(example, i, tok, seq_len, prompt)
            n = len(prompt_ids) + len(response)
            ids[i, :n] = prompt_ids + response
            input_mask[i, :n] = 1
            loss_mask[i, len(prompt_ids):n] = 1
            n_tokens += n
        for mm in (ids, input_mask, loss_mask):
            mm.flush()
        del ids, input_mask, loss_mask
        meta = _make_meta("pairs", seq_len, len(examples), n_tokens, tok, [source], tokenizer_name)
        _write_meta(tmp, meta)
    return meta


CEREBRAS_FEATURES = ["input_ids", "attention_mask", "labels"]  # Cerebras' GptHDF5DataProcessor's default order


def _cerebras_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise GptjError(f"{folder}: no such folder (expected Cerebras' HDF5 data: *.h5 files)")
    files = sorted(folder.glob("*.h5"))
    if not files:
        raise GptjError(f"{folder}: no .h5 files (expected data the Cerebras model zoo prepared for GPT models)")
    params = folder / "data_params.json"
    if params.is_file():
        try:
            features = json.loads(params.read_text(encoding="utf-8")).get("features", CEREBRAS_FEATURES)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise GptjError(f"{params}: cannot read: {e}") from None
        if features != CEREBRAS_FEATURES:
            raise GptjError(f"{params}: features {features}; gptj reads {CEREBRAS_FEATURES} (GPT pre-training "
                            "and fine-tuning data)")
    return files


def prepare_cerebras_hdf5(source: str | Path, out: str | Path, seq_len: int | None = None,
                          tokenizer: Tokenizer | str | Path | None = None, force: bool = False,
                          progress: bool = True) -> dict:
    """Convert the Cerebras model zoo's GPT data (a folder of .h5 files, each a dataset "data" of
    shape (n, 3, T): input_ids, attention_mask (a loss mask on the labels), labels) into a prepared
    folder (kind "cerebras-hdf5") with the same rows; return its meta. See the module doc for the
    masks. `seq_len`: the rows' T, checked if given. Needs h5py."""
    try:
        import h5py
    except ImportError:
        raise GptjError("reading Cerebras HDF5 data needs h5py: pip install h5py") from None
    folder = Path(source)
    files = _cerebras_files(folder)
    tok, tokenizer_name = _resolve_tokenizer(tokenizer)
    shapes = []
    for f in files:
        try:
            with h5py.File(f, "r") as h:
                shape = h["data"].shape if "data" in h else None
        except OSError as e:
            raise GptjError(f"{f}: not a readable HDF5 file ({e})") from None
        if shape is None or len(shape) != 3 or shape[1] != 3 or shape[2] < MIN_SEQ_LEN:
            raise GptjError(f"{f}: expected a dataset 'data' of shape (n, 3, seq_len), got {shape}")
        shapes.append(shape)
    width = shapes[0][2]
    if any(sh[2] != width for sh in shapes) or (seq_len is not None and seq_len != width):
        got = sorted({sh[2] for sh in shapes})
        raise GptjError(f"{folder}: rows of {', '.join(map(str, got))} tokens; "
                        + (f"the config's data.seq_len is {seq_len}" if seq_len is not None else "they must be equal"))
    n = sum(sh[0] for sh in shapes)
    if n == 0:
        raise GptjError(f"{folder}: no rows")
    out = Path(out)
    with _atomic_folder(out, force) as tmp:
        ids = _memmap(tmp / IDS_FILE, IDS_DTYPES[ids_dtype_for(tok.vocab_size)], (n, width))
        input_mask = _memmap(tmp / INPUT_MASK_FILE, MASK_FILES[INPUT_MASK_FILE], (n, width))
        loss_mask = _memmap(tmp / LOSS_MASK_FILE, MASK_FILES[LOSS_MASK_FILE], (n, width))
        row, dropped, targets = 0, 0, 0
        for f in tqdm(files, desc="reading", unit="file", disable=not progress):
            with h5py.File(f, "r") as h:
                data = np.asarray(h["data"][:], dtype=np.int64)
            x, mask, labels = data[:, 0], data[:, 1] != 0, data[:, 2]
            if x.min() < 0 or x.max() >= tok.vocab_size or labels[mask].min(initial=0) < 0 \
                    or labels[mask].max(initial=0) >= tok.vocab_size:
                raise GptjError(f"{f}: token ids outside the tokenizer's vocabulary [0, {tok.vocab_size})")
            shifted = labels[:, :-1] != x[:, 1:]
            if (shifted & mask[:, :-1]).any():
                r, t = np.argwhere(shifted & mask[:, :-1])[0]
                raise GptjError(f"{f}: row {r}: labels[{t}] is not input_ids[{t + 1}]; gptj reads next-token "
                                "labels only")
            k = len(x)
            ids[row:row + k] = x
            input_mask[row:row + k] = 1  # Cerebras masks no attention: every position is a real one
            loss_mask[row:row + k, 0] = 0
            loss_mask[row:row + k, 1:] = mask[:, :-1]
            dropped += int(mask[:, -1].sum())
            targets += int(mask.sum())
            row += k
        for mm in (ids, input_mask, loss_mask):
            mm.flush()
        del ids, input_mask, loss_mask
        meta = _make_meta("cerebras-hdf5", width, n, n * width, tok, [str(f) for f in files], tokenizer_name)
        meta.update(targets=targets - dropped, dropped_targets=dropped)
        _write_meta(tmp, meta)
    return meta


# --- reading -----------------------------------------------------------------------


def _is_int(value: object, low: int, high: int | None = None) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value <= high))


def _read_meta(folder: Path) -> dict:
    """meta.json of a prepared folder, checked; GptjError (one line) if it is not one."""
    path = folder / META
    if not folder.is_dir():
        raise GptjError(f"{folder}: prepared data folder not found")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GptjError(f"{folder}: not a prepared data folder (no {META}; run gptj prepare-data)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GptjError(f"{path}: cannot read: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise GptjError(f"{path}: format must be {FORMAT!r}, got {got!r}")
    if meta.get("kind") not in KINDS:
        raise GptjError(f"{path}: kind must be one of {', '.join(KINDS)}, got {meta.get('kind')!r}")
    checks = {
        "seq_len": (MIN_SEQ_LEN, None),
        "n_sequences": (1, None),
        "vocab_size": (1, MAX_VOCAB_SIZE),
    }
    for key, (low, high) in checks.items():
        if not _is_int(meta.get(key), low, high):
            raise GptjError(f"{path}: {key} must be an integer >= {low}, got {meta.get(key)!r}")
    if not _is_int(meta.get("n_tokens"), 0, meta["n_sequences"] * meta["seq_len"]):
        raise GptjError(f"{path}: n_tokens is not between 0 and n_sequences * seq_len: {meta.get('n_tokens')!r}")
    for key in ("eos_token_id", "pad_token_id"):
        if not _is_int(meta.get(key), 0, meta["vocab_size"] - 1):
            raise GptjError(f"{path}: {key} must be a token id below vocab_size, got {meta.get(key)!r}")
    meta.setdefault("ids_dtype", "uint16")  # written before uint32 ids existed
    if meta["ids_dtype"] not in IDS_DTYPES or (meta["ids_dtype"] == "uint16" and meta["vocab_size"] > 1 << 16):
        raise GptjError(f"{path}: ids_dtype must be uint16 (a vocabulary of at most 65536 ids) or uint32, got "
                        f"{meta['ids_dtype']!r} for {meta['vocab_size']} ids")
    return meta


class TokenData:
    """A prepared folder, memory-mapped (read-only).

    Attributes: `folder`, `meta` (meta.json), `kind` ("packed" or "pairs"), `seq_len`,
    and the raw memmaps `input_ids` (uint16 or uint32), `input_mask` and `loss_mask` (uint8), each of
    shape (len(self), seq_len). `get` returns batches as fresh arrays.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.meta: dict = _read_meta(self.folder)
        self.kind: str = self.meta["kind"]
        self.seq_len: int = self.meta["seq_len"]
        shape = (self.meta["n_sequences"], self.seq_len)
        maps = {}
        for name, dtype in {IDS_FILE: IDS_DTYPES[self.meta["ids_dtype"]], **MASK_FILES}.items():
            path = self.folder / name
            expected = shape[0] * shape[1] * dtype.itemsize
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise GptjError(f"{self.folder}: {name} is missing") from None
            if size != expected:
                raise GptjError(
                    f"{path}: {size} bytes, expected {expected} for {shape[0]} x {shape[1]} {dtype.name}"
                )
            try:
                maps[name] = np.memmap(path, dtype=dtype, mode="r", shape=shape)
            except OSError as e:
                raise GptjError(f"{path}: cannot read: {e.strerror or e}") from None
        self.input_ids: np.memmap = maps[IDS_FILE]
        self.input_mask: np.memmap = maps[INPUT_MASK_FILE]
        self.loss_mask: np.memmap = maps[LOSS_MASK_FILE]

    def __len__(self) -> int:
        return self.meta["n_sequences"]

    def __repr__(self) -> str:
        return f"TokenData({str(self.folder)!r}, {self.kind}, {len(self)} x {self.seq_len})"

    def get(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows `indices` as (input_ids int64, input_mask bool, loss_mask bool), each (B, T).

        The arrays are copies (writable, independent of the files). IndexError for an
        index outside [0, len(self)).
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"row index out of range [0, {len(self)}): {idx.min()}..{idx.max()}")
        return (
            np.array(self.input_ids[idx], dtype=np.int64),
            np.array(self.input_mask[idx], dtype=bool),
            np.array(self.loss_mask[idx], dtype=bool),
        )


def is_prepared(folder: str | Path) -> bool:
    """Whether `folder` is a complete prepared data folder (meta.json and file sizes check out)."""
    try:
        TokenData(folder)
    except GptjError:
        return False
    return True
