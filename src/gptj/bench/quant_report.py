"""`gptj quant-report`: how close each quantization mode (gptj.quant) stays to the
float32 model, teacher-forced on real prompts, and how fast each one runs here. It loads
checkpoints, so it sits above both gptj.quant and gptj.weights (which imports gptj.quant for
quantized checkpoints).

Speed, measured on this machine with the serving kernels (gptj.kernels.prepare_for_serving, as
`gptj serve` and `gptj mlperf` build them): one token through the model (what a batch-1 decode
step's linears cost: every weight read once) and one prompt of `max_tokens` tokens (prefill),
best of SPEED_REPEATS after a warm-up, with no KV cache. Which kernels run depends on the CPU
(gptj.cpu): the report names its kind and the W8A8 form it gets (gptj.policy.w8a8_form)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gptj import cpu, policy
from gptj.errors import GptjError
from gptj.quant import QUANT_MODES, check_mode
from gptj.quant.format import GROUPED
from gptj.weights.checkpoint import Checkpoint
from gptj.weights.io import load_model


def _report_prompts(prompts: Sequence[Sequence[int] | str] | None, n_prompts: int, max_tokens: int,
                    model_dir: Any) -> list[list[int]]:
    from gptj.tokenizer import tokenizer_for_model

    if prompts is None:  # the bundled MLPerf prompts, in the model's own tokens (a Llama folder's tokenizer)
        from gptj.mlperf.dataset import Dataset

        ids = Dataset.load(max_examples=n_prompts, tokenizer=tokenizer_for_model(str(model_dir))).input_ids
    else:
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


SPEED_REPEATS = 3


def _speed(model: nn.Module, tokens: int, device: Any) -> dict[str, float]:
    """one_token_ms and prefill_tok_s of `model` (already prepared for serving) on this machine."""
    def best(ids: torch.Tensor) -> float:
        model(ids)  # warm-up (first-call packing, compiled kernels)
        times = []
        for _ in range(SPEED_REPEATS):
            t0 = time.perf_counter()
            model(ids)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times)

    one = best(torch.zeros((1, 1), dtype=torch.long, device=device))
    prompt = best(torch.zeros((1, tokens), dtype=torch.long, device=device))
    return {"one_token_ms": one * 1e3, "prefill_tok_s": tokens / prompt}


def hardware(device: Any) -> dict[str, str]:
    """What the speed figures ran on: the device, and on CPU its kind and the W8A8 form it gets."""
    if torch.device(device).type != "cpu":
        return {"device": str(device)}
    form = policy.w8a8_form()
    kernel = {policy.AMX: "gptj.native's W8A8 GEMM, amx form (AMX-INT8: int32 sums, exact)",
              policy.SHIFTED: "oneDNN u8 x s8, shifted form (AVX-512 VNNI: int32 sums in one GEMM)",
              policy.NATIVE: "gptj.native's W8A8 GEMM, native form (no AVX-512 VNNI: int16 pairs into int32, exact)",
              policy.SPLIT: "oneDNN u8 x s8, split form (no AVX-512 VNNI: exact, with twice the rows' arithmetic)",
              None: "W8A8Linear as loaded (no packed int8 GEMM here)"}[form]
    return {"device": "cpu", "cpu": cpu.describe(), "w8a8_kernel": kernel}


@torch.inference_mode()
def quantization_report(model_dir: Any, modes: Sequence[str] | None = None, prompts: Sequence[Any] | None = None,
                        n_prompts: int = 8, max_tokens: int = 128, group_size: int | None = None,
                        dtype: torch.dtype = torch.bfloat16, device: Any = "cpu", baseline: bool = True,
                        speed: bool = True) -> dict[str, Any]:
    """Accuracy of each quantization mode against the float32 model, teacher-forced.

    Each prompt (default: the first `n_prompts` of the bundled MLPerf sample set, each cut to
    `max_tokens` tokens; or token-id lists / strings) runs once through the float32 model and once
    through each quantized one (quantized on load from the float checkpoint at `model_dir`, its
    float parts and activations in `dtype`). At every position: whether the next-token argmax
    agrees, and the logit error. `baseline` adds the unquantized model in `dtype` as a yardstick
    (what the dtype alone costs). `speed`: time each one with the serving kernels too (see above).
    Returns a JSON-able dict (see `format_report`).
    """
    checkpoint = Checkpoint.read(model_dir)
    if modes is None:  # every mode (w8a8 where the folder is calibrated: gptj calibrate)
        modes = tuple(m for m in QUANT_MODES if m != "w8a8" or checkpoint.config.calibration is not None)
    if checkpoint.mode is not None:
        raise GptjError(f"{model_dir}: the report needs a float checkpoint (this one is quantized)")
    for mode in modes:
        check_mode(mode)
    ids = _report_prompts(prompts, n_prompts, max_tokens, model_dir)
    ref_model = load_model(model_dir, dtype=torch.float32, device=device)
    ref_logits = [ref_model(torch.tensor([p], device=device))[0] for p in ids]
    report: dict[str, Any] = {
        "model": str(model_dir), "reference": "float32", "dtype": str(dtype).removeprefix("torch."),
        "prompts": len(ids), "positions": sum(len(p) for p in ids), "max_tokens": max_tokens,
        "float32_weight_bytes": _state_bytes(ref_model), "modes": {}, "hardware": hardware(device),
    }
    del ref_model
    runs = ([None] if baseline and dtype != torch.float32 else []) + list(modes)
    for mode in runs:
        model = load_model(model_dir, dtype=dtype, device=device, quantize=mode,
                           group_size=group_size if mode in GROUPED else None)
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
        if speed and mode == "fp8" and not policy.fp8_supported(device):  # emulated: its speed means nothing
            report["modes"]["fp8"].update(one_token_ms=None, prefill_tok_s=None)
            report["emulated"] = "fp8: no FP8 matrix units here, its math emulated (accuracy only, not timed)"
        elif speed:
            from gptj.kernels import prepare_for_serving

            prepare_for_serving(model)
            report["modes"][mode or report["dtype"]].update(_speed(model, max(map(len, ids)), device))
        del model
    if speed:
        timed = [m for m, r in report["modes"].items() if r["one_token_ms"] is not None]
        report["fastest"] = {key: max(timed, key=lambda m: sign * report["modes"][m][key])
                             for key, sign in (("one_token_ms", -1), ("prefill_tok_s", 1))} if timed else {}
    return report


def _speeds(r: Mapping[str, Any]) -> tuple[str, str]:
    if r["one_token_ms"] is None:
        return "-", "-"
    return f"{r['one_token_ms']:.2f}", f"{r['prefill_tok_s']:.0f}"


def format_report(report: Mapping[str, Any]) -> str:
    """A quantization report as a small text table."""
    timed = "fastest" in report
    row = "{:<10} {:>5} {:>11} {:>12} {:>13} {:>10}" + (" {:>12} {:>14}" if timed else "")
    hw = report.get("hardware", {})
    lines = [f"{report['model']}: {report['prompts']} prompts, {report['positions']} positions "
             f"(teacher-forced, up to {report['max_tokens']} tokens each), {report['dtype']} activations "
             f"vs {report['reference']}",
             row.format("mode", "group", "top-1 agree", "max |dlogit|", "mean |dlogit|", "weights",
                        *(("1-token ms", "prefill tok/s") if timed else ())),
             row.format("float32", "-", "1.0000", "0.0000", "0.00000", _gib(report["float32_weight_bytes"]),
                        *(("-", "-") if timed else ()))]
    for mode, r in report["modes"].items():
        lines.append(row.format(mode, r["group_size"] or "-", f"{r['top1_agreement']:.4f}",
                                f"{r['max_abs_logit_error']:.4f}", f"{r['mean_abs_logit_error']:.5f}",
                                _gib(r["weight_bytes"]),
                                *(_speeds(r) if timed else ())))
    if hw.get("cpu"):
        lines.append(f"CPU: {hw['cpu']}; w8a8 runs {hw['w8a8_kernel']}")
    if report.get("emulated"):
        lines.append(report["emulated"])
    if timed and report["fastest"]:
        fast = report["fastest"]
        lines.append(f"fastest here (serving kernels, {hw.get('device', 'cpu')}): one token {fast['one_token_ms']}, "
                     f"prefill {fast['prefill_tok_s']}; speeds of the other CPU kinds: README, 'Which mode on "
                     "which CPU'")
    return "\n".join(lines) + "\n"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
