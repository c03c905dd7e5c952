"""`gptj compare`: how close two checkpoints' logits are, as FasterTransformer's GPT-J guide checks a
converted model against the original.

Each side is a checkpoint gptj loads (an HF folder, gptj's own format, a quantized folder, a
mesh-transformer-jax slim checkpoint; GPT-J or Llama), optionally quantized on load, or HF
transformers' own model on an HF folder (GPTJForCausalLM or LlamaForCausalLM: the reference gptj is
exact against). For each prompt:

  1. the first side (A, the reference) continues the prompt greedily for `new_tokens` tokens
     (gptj's decoder when A is a gptj model, else B's: the path is the same up to the first
     divergence, whichever side draws it);
  2. both sides run teacher-forced over prompt + continuation, once each, one after the other
     (one model in memory at a time);
  3. at every position: |logit_A - logit_B| (max and mean over the vocabulary), whether the argmaxes
     agree (top-1), and A's margin between its best two logits.

The first diverging greedy token is the first continuation position where B's argmax differs from
A's token: up to there both greedy decodes would have produced the same tokens.

The verdict: the two agree when the largest logit difference is within the tolerance (below). Then
every top-1 disagreement is a near-tie (a flip needs A's top-two margin to be at most twice the
largest difference); the report gives the widest such margin. A conversion bug (a transposed
weight, a wrong rotary) moves logits by about their own size, far outside any tolerance here.

The tolerance comes from the sides' number formats. Each format has a unit roundoff u (FORMAT_UNIT:
float32 2^-24, float16 2^-11, bfloat16 2^-8; a quantized side that of its weights' grid: int8 and
w8a8 2^-8, the half-step of 127 levels; int4 and fp8's e4m3 2^-4). Rounding activations or weights
by u moves the logits by a few u times their size, and not more with depth: the residual stream
keeps each layer's share small. So

    tolerance = max(FLOOR, SAFETY * u) * max |logit_A|

with u the coarser side's. Measured on random models of 2 to 28 layers (docs/COMPARE.md), the
largest difference was at most 6.7 u; SAFETY (16) leaves more than twice that. FLOOR (1e-4) is
float32's: two float32 implementations summing in different orders (gptj against HF transformers)
differ by less than that, the bound gptj's own tests hold HF to. For 4-bit formats the tolerance is
the logits' own size: on them the verdict tells a broken checkpoint from rounding only coarsely.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gptj.errors import GptjError

FORMAT_UNIT = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8,
               "int8": 2.0**-8, "w8a8": 2.0**-8, "int4": 2.0**-4, "w4a8": 2.0**-4,
               "fp8": 2.0**-4}
SAFETY = 16.0
FLOOR = 1e-4


@dataclass
class Model:
    """One loaded model: `logits(ids)` -> (len(ids), vocab) float32, teacher-forced; `greedy(ids, n)`
    -> n new tokens (gptj's decoder; None for HF transformers')."""

    fmt: str  # its coarsest number format (a FORMAT_UNIT key)
    logits: Callable[[list[int]], torch.Tensor]
    greedy: Callable[[list[int], int], list[int]] | None


@dataclass
class Side:
    """One model under comparison, loaded when its turn comes (one model in memory at a time: two
    GPT-J 6B in bfloat16 would not fit a 24 GiB machine)."""

    name: str  # what the report calls it
    load: Callable[[], Model]
    decodes: bool  # its Model has `greedy`


def side_format(dtype: torch.dtype, quantization: dict | None) -> str:
    """A side's coarsest format: its quantization mode, else its float dtype."""
    from gptj.device import dtype_name

    if quantization:
        return quantization["mode"]
    return dtype_name(dtype)


def tolerance_rel(fmt_a: str, fmt_b: str) -> float:
    """The verdict's tolerance on max |dlogit|, relative to A's largest |logit| (see the module doc)."""
    return max(FLOOR, SAFETY * max(FORMAT_UNIT[fmt_a], FORMAT_UNIT[fmt_b]))


def gptj_side(path: str | Path, dtype: torch.dtype, device: torch.device, quantize: str | None = None,
              group_size: int | None = None, config: str | None = None, name: str | None = None) -> Side:
    """A checkpoint as gptj loads it (any format; `quantize` on load; `config` for a slim checkpoint)."""
    def load() -> Model:
        from gptj.decode import GenerationConfig, generate
        from gptj.quant.format import GROUPED
        from gptj.weights.checkpoint import detect_format
        from gptj.weights.io import load_model

        slim = detect_format(Path(path)) == "mtj"  # --config names a slim checkpoint's (an HF folder has its own)
        model = load_model(path, dtype=dtype, device=device, config=config if slim else None, quantize=quantize,
                           group_size=group_size if quantize in GROUPED else None).eval()
        c = model.config  # one prompt: no padding, but the id must be a token of this model
        pad = next(t for t in (c.pad_token_id, c.eos_token_id, 0) if t is not None)

        @torch.inference_mode()
        def logits(ids: list[int]) -> torch.Tensor:
            return model(torch.tensor([ids], device=device))[0].float()

        def greedy(ids: list[int], n: int) -> list[int]:
            gen = GenerationConfig(max_new_tokens=n, eos_token_id=None, pad_token_id=pad)  # never stops early
            return generate(model, [ids], gen)[0]

        return Model(side_format(dtype, c.quantization), logits, greedy)

    return Side(name or str(path) + (f" ({quantize} on load)" if quantize else ""), load, decodes=True)


def hf_side(path: str | Path, dtype: torch.dtype, device: torch.device) -> Side:
    """HF transformers' model for the HF folder `path` (its GPTJForCausalLM or LlamaForCausalLM, with
    the eager attention gptj's float32 math follows; float checkpoints only)."""
    import json

    from gptj.device import dtype_name
    from gptj.files import model_file
    from gptj.weights.checkpoint import CONFIG, detect_format

    if detect_format(Path(path)) != "hf":
        raise GptjError(f"{path}: --hf needs an HF folder (config.json + weights); convert a slim checkpoint "
                        "first (gptj convert)")
    try:
        raw = json.loads(model_file(path, CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise GptjError(f"{Path(path) / CONFIG}: cannot read ({e})") from None
    if not isinstance(raw, dict) or raw.get("quantization") or raw.get("quantization_config"):
        raise GptjError(f"{path}: --hf needs a float checkpoint (HF transformers cannot load gptj's quantized "
                        "format)")
    try:
        import transformers
    except ImportError:
        raise GptjError("--hf needs HF transformers: pip install transformers") from None

    def load() -> Model:
        transformers.utils.logging.disable_progress_bar()  # its "Loading weights" bar: not this command's output
        # transformers 4.56 renamed from_pretrained's torch_dtype to dtype (the old name warns in 5.x)
        new = tuple(int(x) for x in transformers.__version__.split(".")[:2] if x.isdigit()) >= (4, 56)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager",
                                                                  **{"dtype" if new else "torch_dtype": dtype})
        model = model.to(device).eval()

        @torch.inference_mode()
        def logits(ids: list[int]) -> torch.Tensor:
            return model(torch.tensor([ids], device=device)).logits[0].float()

        return Model(dtype_name(dtype), logits, None)

    return Side(f"HF transformers on {path}", load, decodes=False)


def _run(side: Side, prompts: list[list[int]], conts: list[list[int]] | None, new_tokens: int,
         progress: Callable[[str], None] = lambda line: None) -> tuple[Model, list[list[int]], list[torch.Tensor]]:
    """Load `side`, continue each prompt greedily (unless `conts` are given), take the teacher-forced
    logits over prompt + continuation, and let the model go (its Model keeps no weights alive
    once the caller drops its functions). `progress` is told each step as it starts."""
    progress(f"loading {side.name}")
    m = side.load()
    if conts is None and new_tokens:
        progress(f"continuing {len(prompts)} prompt{'s' * (len(prompts) != 1)} by {new_tokens} greedy tokens")
    if conts is None:
        conts = [m.greedy(p, new_tokens) if new_tokens else [] for p in prompts]
    progress(f"teacher-forced logits of {len(prompts)} prompt{'s' * (len(prompts) != 1)}")
    out = [m.logits(p + c) for p, c in zip(prompts, conts)]
    return Model(m.fmt, None, None), conts, out


def compare(a: Side, b: Side, prompts: Sequence[Sequence[int]], new_tokens: int = 16,
            progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """The report (JSON-able): per prompt and overall max / mean |dlogit|, top-1 agreement, the first
    diverging greedy token; the tolerance and the verdict. The side that decodes (A when it can) runs
    first and draws the continuations; then the other; one model in memory at a time. `progress` is
    told each step (loading a side, decoding, the logits) as it starts: a run takes minutes on 6B."""
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise GptjError("compare: every prompt needs at least one token")
    if new_tokens and not (a.decodes or b.decodes):
        raise GptjError("compare: neither side can decode (one must be a gptj model)")
    first, second = (a, b) if a.decodes or not new_tokens else (b, a)
    m1, conts, out1 = _run(first, prompts, None, new_tokens, progress)
    gc.collect()
    m2, _, out2 = _run(second, prompts, conts, new_tokens, progress)
    (ma, la_all), (mb, lb_all) = ((m1, out1), (m2, out2)) if first is a else ((m2, out2), (m1, out1))
    rows, scale = [], 0.0
    for ids, cont, la, lb in zip(prompts, conts, la_all, lb_all):
        if la.shape != lb.shape:
            raise GptjError(f"compare: the two models' vocabularies differ ({la.shape[-1]} and {lb.shape[-1]})")
        diff = (la - lb).abs()
        top2 = la.topk(2, dim=-1).values if la.shape[-1] > 1 else torch.cat([la, la], -1)
        agree = la.argmax(-1) == lb.argmax(-1)
        # the continuation's token t is the drawer's argmax at position len(ids) - 1 + t; the other
        # side diverges where its argmax differs
        other = (lb if first is a else la).argmax(-1)[len(ids) - 1:len(ids) - 1 + len(cont)].tolist()
        at = next((t for t, (x, y) in enumerate(zip(cont, other)) if x != y), None)
        pair = None if at is None else ([cont[at], other[at]] if first is a else [other[at], cont[at]])
        rows.append({"prompt_tokens": len(ids), "new_tokens": len(cont), "positions": len(agree),
                     "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.double().mean()),
                     "top1_agreement": float(agree.double().mean()),
                     "first_divergence": at, "diverging_tokens": pair,  # [A's token, B's token]
                     "_disagree_margin": float((top2[:, 0] - top2[:, 1])[~agree].max()) if (~agree).any() else None,
                     "_agree": int(agree.sum()), "_sum": float(diff.double().sum()), "_n": diff.numel()})
        scale = max(scale, float(la.abs().max()))
    positions = sum(r["positions"] for r in rows)
    rel = tolerance_rel(ma.fmt, mb.fmt)
    tol = rel * scale
    max_diff = max(r["max_abs_diff"] for r in rows)
    margins = [r["_disagree_margin"] for r in rows if r["_disagree_margin"] is not None]
    return {
        "a": a.name, "b": b.name, "formats": [ma.fmt, mb.fmt], "prompts": len(rows), "positions": positions,
        "new_tokens": new_tokens, "max_abs_diff": max_diff,
        "mean_abs_diff": sum(r["_sum"] for r in rows) / sum(r["_n"] for r in rows),
        "top1_agreement": sum(r["_agree"] for r in rows) / positions,
        "first_divergence": min((r["first_divergence"] for r in rows if r["first_divergence"] is not None),
                                default=None),
        "max_abs_logit_a": scale, "tolerance_rel": rel, "tolerance": tol,
        "widest_disagreeing_margin": max(margins, default=None),
        "verdict": "agree" if max_diff <= tol else "differ",
        "per_prompt": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
    }


def format_compare(report: dict[str, Any]) -> str:
    """The report as a small table and the one-line verdict."""
    row = "{:>6} {:>7} {:>5} {:>13} {:>13} {:>11} {:>16}"
    lines = [f"A: {report['a']} ({report['formats'][0]})", f"B: {report['b']} ({report['formats'][1]})",
             row.format("prompt", "tokens", "new", "max |dlogit|", "mean |dlogit|", "top-1 agree", "first diverging")]
    for i, r in enumerate(report["per_prompt"], 1):
        first = "-" if r["first_divergence"] is None else f"{r['first_divergence']} ({r['diverging_tokens'][0]} vs " \
                                                           f"{r['diverging_tokens'][1]})"
        lines.append(row.format(i, r["prompt_tokens"], r["new_tokens"], f"{r['max_abs_diff']:.3g}",
                                f"{r['mean_abs_diff']:.3g}", f"{r['top1_agreement']:.4f}", first))
    lines.append(row.format("all", report["positions"], "", f"{report['max_abs_diff']:.3g}",
                            f"{report['mean_abs_diff']:.3g}", f"{report['top1_agreement']:.4f}",
                            "-" if report["first_divergence"] is None else str(report["first_divergence"])))
    why = (f"max |dlogit| {report['max_abs_diff']:.3g} against a tolerance of {report['tolerance']:.3g} "
           f"({report['tolerance_rel']:.2g} of A's largest |logit| {report['max_abs_logit_a']:.3g}, from "
           f"{' / '.join(report['formats'])})")
    if report["widest_disagreeing_margin"] is not None:
        why += f"; top-1 disagreements at top-two margins up to {report['widest_disagreeing_margin']:.3g}"
    lines.append(f"{report['verdict'].upper()}: {why}")
    return "\n".join(lines) + "\n"
