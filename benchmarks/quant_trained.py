"""How close each quantization mode stays to bfloat16 on a model whose logits are NOT near-tied.

Random weights are the hard case for top-1 agreement: their 50,400 logits are nearly tied, so a
quantization's small logit errors flip many argmaxes (gptj quant-report on a random model). A
trained model predicts with margins of nats where the text is predictable. This script trains
gptj's tiny preset on the repetitive corpus shipped in examples/data (examples/train/pretrain_tiny.yaml,
200 steps, eval loss ~1.1) — or takes a trained checkpoint — and compares, teacher-forced on the
held-out corpus (examples/data/pretrain_eval.txt, windows of --window tokens):

    bfloat16            the baseline the issue names
    int8, int4          weight-only (gptj.quant)
    w4a8                int4's weights, each linear's input rounded to int8 per block of 32 (gptj.quant.w4a8)
    fp8                 e4m3 weights, weight-only math (decode's TRITON path on a GPU; DEQUANTIZE on CPU)
    fp8-scaled          e4m3 weights and e4m3 activations per token (the SCALED_MM path of a GPU's
                        bigger calls; torch._scaled_mm's CPU form here)

each as top-1 agreement with bfloat16 and with float32, over every position and over the positions
where the float32 model's top-1 leads its runner-up by at least --margin nats. Without a GPU the
e4m3 math runs on CPU: the same products, summed in another order.

    python benchmarks/quant_trained.py --out /tmp/qt                     # trains first (minutes on CPU)
    python benchmarks/quant_trained.py --model DIR --out /tmp/qt        # a trained checkpoint
    python benchmarks/quant_trained.py --smoke                          # a rehearsal: 5 training steps
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from _smoke import parse_args

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "train" / "pretrain_tiny.yaml"
EVAL_TEXT = ROOT / "examples" / "data" / "pretrain_eval.txt"


def windows(model_dir: Path, size: int) -> list[list[int]]:
    from gptj.tokenizer import tokenizer_for_model

    ids = tokenizer_for_model(str(model_dir)).encode(EVAL_TEXT.read_text(encoding="utf-8"))
    return [ids[i:i + size] for i in range(0, len(ids) - size + 1, size)]


@torch.inference_mode()
def logits_of(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    device = next(model.parameters()).device
    return torch.cat([model(torch.tensor([p], device=device))[0].float().cpu() for p in prompts])


def compare(model_dir: Path, prompts: list[list[int]], margin: float, device: str = "cpu") -> dict:
    from gptj import policy, quant
    from gptj.quant.base import pin_path
    from gptj.weights.io import load_model

    ref = logits_of(load_model(model_dir, dtype=torch.float32, device=device), prompts)
    top2 = ref.topk(2, -1).values
    confident = (top2[:, 0] - top2[:, 1]) >= margin
    bf16 = logits_of(load_model(model_dir, dtype=torch.bfloat16, device=device), prompts)
    out = {"positions": int(ref.shape[0]), "confident_positions": int(confident.sum()), "margin_nats": margin,
           "median_top1_margin": float((top2[:, 0] - top2[:, 1]).median()), "modes": {}}
    weight_only = policy.TRITON if policy.fp8_supported(device) else policy.DEQUANTIZE  # the same math
    runs = {"bfloat16": (None, None), "int8": ("int8", None), "int4": ("int4", None), "w4a8": ("w4a8", None),
            "fp8": ("fp8", weight_only),
            "fp8-scaled": ("fp8", policy.SCALED_MM)}
    for name, (mode, path) in runs.items():
        if mode is None:
            got = bf16
        else:
            model = load_model(model_dir, dtype=torch.bfloat16, quantize=mode, device=device)
            if path is not None:
                pin_path(model, path, torch.bfloat16)
            got = logits_of(model, prompts)
            assert quant.is_quantized(model)
        top = got.argmax(-1)
        out["modes"][name] = {
            "top1_vs_bfloat16": float((top == bf16.argmax(-1)).float().mean()),
            "top1_vs_float32": float((top == ref.argmax(-1)).float().mean()),
            "top1_vs_float32_confident": float((top == ref.argmax(-1))[confident].float().mean())
            if confident.any() else None,
            "max_abs_logit_error": float((got - ref).abs().max()),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a trained checkpoint (default: train tiny into OUT/train)")
    ap.add_argument("--out", type=Path, default=Path("quant-trained"))
    ap.add_argument("--max-steps", type=int, default=200, help="training steps (the config's: 200; fewer stop early)")
    ap.add_argument("--window", type=int, default=64, help="tokens per held-out window (the config's seq_len)")
    ap.add_argument("--margin", type=float, default=1.0, help="nats: the confident positions' least top-1 lead")
    ap.add_argument("--device", default="cpu", help="where to train and compare")
    ap.add_argument("--json", action="store_true")
    args = parse_args(ap, {"max_steps": 5}, argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model
    if model_dir is None:
        model_dir = args.out / "train"
        if not (model_dir / "config.json").is_file():
            train = subprocess.run([sys.executable, "-m", "gptj.cli", "train", "--config", str(CONFIG), "--out",
                                    str(model_dir), "--max-steps", str(args.max_steps), "--device", args.device,
                                    "--quiet"], stdout=subprocess.DEVNULL)
            if train.returncode:
                print(f"quant_trained: training failed (exit {train.returncode})", file=sys.stderr)
                return 1
    result = compare(model_dir, windows(model_dir, args.window), args.margin, args.device)
    result["model"] = str(model_dir)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{model_dir}: {result['positions']} held-out positions, {result['confident_positions']} where float32's "
          f"top-1 leads by >= {args.margin} nats (median lead {result['median_top1_margin']:.2f})")
    print(f"{'mode':<11} {'vs bf16':>8} {'vs fp32':>8} {'confident':>10} {'max|dlogit|':>12}")
    for name, r in result["modes"].items():
        conf = "-" if r["top1_vs_float32_confident"] is None else f"{r['top1_vs_float32_confident']:.4f}"
        print(f"{name:<11} {r['top1_vs_bfloat16']:>8.4f} {r['top1_vs_float32']:>8.4f} {conf:>10} "
              f"{r['max_abs_logit_error']:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
