"""`gptj quant-report`: how close each quantization mode (gptj.quant) stays to the
float32 model, teacher-forced on real prompts. It loads checkpoints, so it sits above both
gptj.quant and gptj.weights (which imports gptj.quant for quantized checkpoints)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gptj.errors import GptjError
from gptj.quant import QUANT_MODES, check_mode
from gptj.weights.io import load_model, read_checkpoint


def _report_prompts(prompts: Sequence[Sequence[int] | str] | None, n_prompts: int, max_tokens: int,
                    model_dir: Any) -> list[list[int]]:
    if prompts is None:
        from gptj.mlperf.dataset import Dataset

        ids = Dataset.load(max_examples=n_prompts).input_ids
    else:
        from gptj.tokenizer import tokenizer_for_model

        tok = None
        ids = []
        for p in prompts:
            if isinstance(p, str):
                tok = tok or tokenizer_for_model(str(model_dir))
                ids.append(tok.encode(p))
            else:
                ids.append([int(i) for i in p])
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise GptjError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    ids = [p[:max_tokens] for p in ids]
    if not ids or any(len(p) == 0 for p in ids):
        raise GptjError("quantization report: every prompt needs at least one token")
    return ids


def _state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@torch.inference_mode()
def quantization_report(model_dir: Any, modes: Sequence[str] = QUANT_MODES, prompts: Sequence[Any] | None = None,
                        n_prompts: int = 8, max_tokens: int = 128, group_size: int | None = None,
                        dtype: torch.dtype = torch.bfloat16, device: Any = "cpu", baseline: bool = True
                        ) -> dict[str, Any]:
    """Accuracy of each quantization mode against the float32 model, teacher-forced.

    Each prompt (default: the first `n_prompts` of the bundled MLPerf sample set, each cut to
    `max_tokens` tokens; or token-id lists / strings) runs once through the float32 model and once
    through each quantized one (quantized on load from the float checkpoint at `model_dir`, its
    float parts and activations in `dtype`). At every position: whether the next-token argmax
    agrees, and the logit error. `baseline` adds the unquantized model in `dtype` as a yardstick
    (what the dtype alone costs). Returns a JSON-able dict (see `format_report`).
    """
    cfg, _ = read_checkpoint(model_dir)
    if cfg.quantization:
        raise GptjError(f"{model_dir}: the report needs a float checkpoint (this one is quantized)")
    for mode in modes:
        check_mode(mode)
    ids = _report_prompts(prompts, n_prompts, max_tokens, model_dir)
    ref_model = load_model(model_dir, dtype=torch.float32, device=device)
    ref_logits = [ref_model(torch.tensor([p], device=device))[0] for p in ids]
    report: dict[str, Any] = {
        "model": str(model_dir), "reference": "float32", "dtype": str(dtype).removeprefix("torch."),
        "prompts": len(ids), "positions": sum(len(p) for p in ids), "max_tokens": max_tokens,
        "float32_weight_bytes": _state_bytes(ref_model), "modes": {},
    }
    del ref_model
    runs = ([None] if baseline and dtype != torch.float32 else []) + list(modes)
    for mode in runs:
        model = load_model(model_dir, dtype=dtype, device=device, quantize=mode,
                           group_size=group_size if mode == "int4" else None)
        agree = 0
        max_err = sum_err = 0.0
        n_logits = 0
        for p, ref in zip(ids, ref_logits):
            out = model(torch.tensor([p], device=device))[0].float()
            agree += int((out.argmax(-1) == ref.argmax(-1)).sum())
            err = (out - ref).abs()
            max_err = max(max_err, float(err.max()))
            sum_err += float(err.double().sum())
            n_logits += err.numel()
        q = model.config.quantization
        report["modes"][mode or report["dtype"]] = {
            "group_size": q["group_size"] if q else None,
            "top1_agreement": agree / report["positions"],
            "max_abs_logit_error": max_err,
            "mean_abs_logit_error": sum_err / n_logits,
            "weight_bytes": _state_bytes(model),
        }
        del model
    return report


def format_report(report: Mapping[str, Any]) -> str:
    """A quantization report as a small text table."""
    row = "{:<10} {:>5} {:>11} {:>12} {:>13} {:>10}"
    lines = [f"{report['model']}: {report['prompts']} prompts, {report['positions']} positions "
             f"(teacher-forced, up to {report['max_tokens']} tokens each), {report['dtype']} activations "
             f"vs {report['reference']}",
             row.format("mode", "group", "top-1 agree", "max |dlogit|", "mean |dlogit|", "weights"),
             row.format("float32", "-", "1.0000", "0.0000", "0.00000", _gib(report["float32_weight_bytes"]))]
    for mode, r in report["modes"].items():
        lines.append(row.format(mode, r["group_size"] or "-", f"{r['top1_agreement']:.4f}",
                                f"{r['max_abs_logit_error']:.4f}", f"{r['mean_abs_logit_error']:.5f}",
                                _gib(r["weight_bytes"])))
    return "\n".join(lines) + "\n"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
