"""A Llama-3.1-8B-shaped model for the peer benchmarks (issue 59): the real width (hidden 4096, 32
query heads / 8 KV heads of 128, SwiGLU 14,336, the 128,256-id vocabulary, llama3 rope scaling) with
--layers of its 32 layers, random weights, and a stand-in tokenizer that covers every id.

    python benchmarks/llama_shapes.py --out /tmp/llama-8b-w2 --layers 2          # ~1.5 B params, 3.0 GB bf16
    python benchmarks/llama_shapes.py --out /tmp/llama-8b-bf16 --layers 32       # the whole 8B, 16.1 GB

No real tokenizer can be downloaded here. The stand-in is the byte-level BPE `gptj init --preset
llama-tiny` writes (trained on the bundled articles, BOS id 0 and EOS id 1, the config set to match),
its vocabulary filled up to 128,256 ids with tokens no merge produces: text encodes to ids below
STANDIN_TRAINED, and every id a random-weight model samples decodes (vLLM and llama.cpp detokenize
what they generate, and both check the tokenizer against the vocabulary size).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gptj.device import parse_dtype
from gptj.mlperf.dataset import DEFAULT_DATASET, load_examples
from gptj.models.llama import LLAMA_3_1_8B, LlamaConfig
from gptj.tokenizer import write_standin_tokenizer
from gptj.weights.hf_model import random_folder

STANDIN_TRAINED = 4096  # ids the BPE is trained to; the rest are fillers
FILLER = "<fill{}>"


def llama_config(layers: int) -> LlamaConfig:
    """Llama-3.1-8B's config with `layers` layers and the stand-in tokenizer's BOS (0) and EOS (1)."""
    if not 1 <= layers <= LLAMA_3_1_8B.num_hidden_layers:
        raise SystemExit(f"--layers: 1 to {LLAMA_3_1_8B.num_hidden_layers}, got {layers}")
    return LLAMA_3_1_8B.replace(num_hidden_layers=layers, bos_token_id=0, eos_token_ids=(1,))


def write_full_vocab_tokenizer(folder: Path, vocab_size: int) -> None:
    """The stand-in BPE trained to STANDIN_TRAINED ids, then filled to `vocab_size` ids in tokenizer.json."""
    texts = [t for e in load_examples(DEFAULT_DATASET) for t in (e.input, e.output)]
    write_standin_tokenizer(folder, texts, STANDIN_TRAINED)
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    have = len(vocab)
    vocab.update({FILLER.format(i): i for i in range(have, vocab_size)})
    path.write_text(json.dumps(spec, ensure_ascii=False))


def write_model(out: str | Path, layers: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                overwrite: bool = False) -> Path:
    """The folder `out` (written once: kept when its config.json already says `layers` layers)."""
    out = Path(out)
    config = llama_config(layers)
    if not overwrite and (out / "config.json").is_file():
        if json.loads((out / "config.json").read_text()).get("num_hidden_layers") == layers:
            return out
    return random_folder(config, out, seed=seed, dtype=dtype, overwrite=True,
                         extra=lambda folder: write_full_vocab_tokenizer(folder, config.vocab_size))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="write it again even when it is there")
    p.add_argument("--tokenizer-only", action="store_true",
                   help="write only the stand-in tokenizer into --out, and print its size as JSON (CI's check)")
    args = p.parse_args(argv)
    if args.tokenizer_only:
        from gptj.tokenizer import tokenizer_for_model

        args.out.mkdir(parents=True, exist_ok=True)
        write_full_vocab_tokenizer(args.out, LLAMA_3_1_8B.vocab_size)
        tok = tokenizer_for_model(str(args.out))
        ids = tok.encode("Summarize the following news article")
        print(json.dumps({"vocab": tok.vocab_size, "ids": ids, "last": tok.decode([LLAMA_3_1_8B.vocab_size - 1])}))
        return
    print(write_model(args.out, args.layers, parse_dtype(args.dtype), args.seed, args.force))


if __name__ == "__main__":
    main()
