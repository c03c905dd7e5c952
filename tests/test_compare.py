"""`gptj compare` (gptj.bench.compare): logit differences, top-1 agreement, the first diverging greedy
token and the verdict, on checkpoints the tests write (an mtj slim checkpoint by tests/mtj_writer.py)."""

from __future__ import annotations

import json

import pytest
import torch
from mtj_writer import write_mtj_slim

from gptj.bench.compare import FLOOR, FORMAT_UNIT, SAFETY, Model, Side, compare, gptj_side, tolerance_rel
from gptj.bench.quant_report import quantization_report
from gptj.cli import EXIT_DIFFER, main
from gptj.config import get_preset
from gptj.weights.io import convert, random_state_dict, save_checkpoint

CPU = torch.device("cpu")
PROMPTS = [[5, 17, 300, 2, 9, 41, 7], [1000, 12, 4, 4, 77]]


def run(argv, capsys):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_identical_folders_agree_exactly(tiny_checkpoint, tmp_path, capsys):
    copy = save_checkpoint(random_state_dict(get_preset("tiny"), seed=5, std=0.3), get_preset("tiny"),
                           tmp_path / "copy")
    code, out, _ = run(["compare", str(tiny_checkpoint), str(copy), "--prompts", "2", "--max-new-tokens", "4", "--json"],
                       capsys)
    r = json.loads(out)
    assert code == 0 and r["verdict"] == "agree"
    assert r["max_abs_diff"] == 0.0 and r["mean_abs_diff"] == 0.0 and r["top1_agreement"] == 1.0
    assert r["first_divergence"] is None and r["prompts"] == 2
    assert all(p["new_tokens"] == 4 and p["positions"] == p["prompt_tokens"] + 4 for p in r["per_prompt"])


def test_different_weights_differ(tiny_checkpoint, tmp_path, capsys):
    other = save_checkpoint(random_state_dict(get_preset("tiny"), seed=6, std=0.3), get_preset("tiny"),
                            tmp_path / "other")
    code, out, _ = run(["compare", str(tiny_checkpoint), str(other), "--prompt-ids", "5,17,300,2", "--max-new-tokens",
                        "3"], capsys)
    assert code == EXIT_DIFFER
    assert out.rstrip().splitlines()[-1].startswith("DIFFER: ")


def test_converted_mtj_checkpoint_against_its_hf_original(tmp_path, capsys):
    """The slim checkpoint, converted by gptj, computes the HF original's logits bit for bit (the
    writer's round trip is exact by construction)."""
    cfg = get_preset("tiny").replace(vocab_size=1024, n_positions=64, bos_token_id=0, eos_token_id=0)
    sd = random_state_dict(cfg, seed=3, std=0.3)
    original = save_checkpoint(sd, cfg, tmp_path / "hf")
    write_mtj_slim(sd, tmp_path / "step_1", n_shards=4, files=2, bf16=False)
    assert main(["convert", str(tmp_path / "step_1"), "--out", str(tmp_path / "conv"), "--config",
                 str(original / "config.json"), "--quiet"]) == 0
    capsys.readouterr()
    code, out, _ = run(["compare", str(original), str(tmp_path / "conv"), "--prompt-ids", "5,17,300,2,9,41",
                        "--max-new-tokens", "5", "--json"], capsys)
    r = json.loads(out)
    assert code == 0 and r["max_abs_diff"] == 0.0 and r["top1_agreement"] == 1.0 and r["first_divergence"] is None
    # and the slim checkpoint itself (--config names its config; the HF side keeps its own)
    code, out, _ = run(["compare", str(tmp_path / "step_1"), str(original), "--config", str(original / "config.json"),
                        "--prompt-ids", "5,17,300,2,9,41", "--max-new-tokens", "5", "--json"], capsys)
    assert code == 0 and json.loads(out)["max_abs_diff"] == 0.0


def test_a_quantized_copy_has_quant_reports_numbers(tiny_checkpoint, tmp_path):
    """compare against an int8 copy written by `gptj convert` measures what quant-report measures for
    int8 on the same prompts (both float32 activations, teacher-forced on the prompt alone)."""
    q8 = convert(tiny_checkpoint, tmp_path / "q8", quantize="int8", progress=False)
    r = compare(gptj_side(tiny_checkpoint, torch.float32, CPU), gptj_side(q8, torch.float32, CPU), PROMPTS,
                new_tokens=0)
    assert r["formats"] == ["float32", "int8"]
    q = quantization_report(tiny_checkpoint, modes=["int8"], prompts=PROMPTS, dtype=torch.float32, speed=False)
    int8 = q["modes"]["int8"]
    assert r["positions"] == q["positions"]
    assert r["top1_agreement"] == int8["top1_agreement"]
    assert r["max_abs_diff"] == pytest.approx(int8["max_abs_logit_error"], rel=1e-6)
    assert r["mean_abs_diff"] == pytest.approx(int8["mean_abs_logit_error"], rel=1e-6)
    assert 0 < r["max_abs_diff"] <= r["tolerance"] and r["verdict"] == "agree"


def test_hf_transformers_against_gptj(tiny_checkpoint, capsys):
    pytest.importorskip("transformers")
    code, out, _ = run(["compare", str(tiny_checkpoint), "--hf", "--prompts", "1", "--max-new-tokens", "4", "--json"],
                       capsys)
    r = json.loads(out)
    assert code == 0 and r["a"].startswith("HF transformers") and r["formats"] == ["float32", "float32"]
    # two float32 implementations: within the project's HF bound, with the same greedy tokens
    assert r["max_abs_diff"] <= 1e-4 * r["max_abs_logit_a"] and r["first_divergence"] is None


def test_quantize_on_load_is_b(tiny_checkpoint, capsys):
    code, out, _ = run(["compare", str(tiny_checkpoint), "--quantize", "int4", "--prompt-ids", "5,17,300,2",
                        "--max-new-tokens", "2", "--json"], capsys)
    r = json.loads(out)
    assert r["formats"] == ["float32", "int4"] and r["max_abs_diff"] > 0 and code in (0, EXIT_DIFFER)


def side(fmt: str, logits: torch.Tensor, greedy=None) -> Side:
    """A made-up model whose logits at each position are the rows of `logits`."""
    return Side(fmt, lambda: Model(fmt, lambda ids: logits[:len(ids)], greedy), decodes=greedy is not None)


def test_tolerance_from_the_formats():
    assert tolerance_rel("float32", "float32") == FLOOR
    assert tolerance_rel("float32", "bfloat16") == SAFETY * 2**-8
    assert tolerance_rel("int4", "int8") == SAFETY * FORMAT_UNIT["int4"]


def test_verdict_is_the_tolerance_and_flips_are_near_ties():
    """A top-1 flip where A's two best logits are closer than the tolerance agrees; a difference past
    the tolerance differs."""
    a = torch.tensor([[10.0, 0.0, 0.0], [0.0, 5.0, 4.9999]])
    near = a.clone()
    near[1, 2] += 0.0002  # flips position 1's argmax across a 1e-4 margin
    r = compare(side("bfloat16", a), side("bfloat16", near), [[1, 2]], new_tokens=0)
    assert r["top1_agreement"] == 0.5 and r["verdict"] == "agree"
    assert r["widest_disagreeing_margin"] == pytest.approx(1e-4, abs=1e-5)
    far = a.clone()
    far[0, 1] += 0.63  # past bfloat16's 16 * 2^-8 of the largest |logit| (10): 0.625
    r = compare(side("bfloat16", a), side("bfloat16", far), [[1, 2]], new_tokens=0)
    assert r["tolerance"] == pytest.approx(0.625) and r["top1_agreement"] == 1.0 and r["verdict"] == "differ"


def test_first_divergence_is_where_b_leaves_as_greedy_path():
    a = torch.zeros(6, 4)
    a[:, 1] = 1.0  # A always picks token 1
    b = a.clone()
    b[4, 2] = 2.0  # B's argmax differs at position 4: the third new token after a 2-token prompt
    r = compare(side("float32", a, lambda ids, n: [1] * n), side("float32", b), [[0, 0]], new_tokens=4)
    assert r["first_divergence"] == 3 and r["per_prompt"][0]["diverging_tokens"] == [1, 2]
    # the same when only B decodes (A is HF transformers): B draws the path, the pair stays [A's, B's]
    b2 = torch.zeros(6, 4)
    b2[:, 1] = 1.0
    a2 = b2.clone()
    a2[4, 3] = 2.0
    r = compare(side("float32", a2), side("float32", b2, lambda ids, n: [1] * n), [[0, 0]], new_tokens=4)
    assert r["first_divergence"] == 3 and r["per_prompt"][0]["diverging_tokens"] == [3, 1]


@pytest.mark.parametrize("argv, message", [
    (["compare", "{m}"], "give a second model B"),
    (["compare", "{m}", "{m}", "--hf"], "either a second model B or --hf"),
    (["compare", "{m}", "--hf", "--quantize", "int8"], "--quantize applies to B"),
    (["compare", "{m}", "{m}", "--prompt-ids", "1", "--max-prompt-tokens", "1", "--max-new-tokens", "0", "--prompt", ""],
     "prompt 1 is empty"),
])
def test_bad_input_is_one_line(tiny_checkpoint, capsys, argv, message):
    code, _, err = run([a.format(m=tiny_checkpoint) for a in argv], capsys)
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1


def test_compare_says_each_step_on_stderr(tiny_checkpoint, capsys):
    """A 6B compare runs for minutes: each step (loading A, continuing the prompts, the logits,
    loading B) is said on stderr as it starts; stdout keeps only the report."""
    code, out, err = run(["compare", str(tiny_checkpoint), "--quantize", "int8", "--prompt-ids", "5,17,300",
                          "--max-new-tokens", "2", "--json"], capsys)
    assert code in (0, EXIT_DIFFER) and json.loads(out)["prompts"] == 1
    lines = err.strip().splitlines()
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == ["loading", "continuing", "teacher-forced",
                                                                   "loading", "teacher-forced"], err
    assert all(line.startswith("gptj compare: ") and line.endswith(" s)") for line in lines)
    assert str(tiny_checkpoint) in lines[0] and "(int8 on load)" in lines[3]
