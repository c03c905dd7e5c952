"""Memory of the serving kernels' repacking (gptj.kernels.prepare_for_serving), layer by layer.

Two properties, each from the arithmetic of the shapes rather than a machine's numbers:

- bytes allocated while a model is prepared never exceed the bytes before it plus one unit in
  flight (the largest of a layer's weights and lm_head's), plus the few biases fusion adds; the
  old copy of each layer is freed before the next is repacked. Counted by torch's profiler
  (every allocation and free of torch's CPU allocator, with its running total).
- a checkpoint loaded from safetensors maps each tensor's own pages, so once a layer is repacked
  its pages leave memory: after preparation the file's mapped bytes are those of the tensors that
  still view it (wte, LayerNorms, biases, ...), not the whole file.

benchmarks/load_memory.py measures the resulting peak RSS on gptj-6b's shapes (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import gc
import json
import mmap
import os
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from gptj import quant
from gptj.config import GPTJConfig
from gptj.kernels import prepare_for_serving
from gptj.weights.io import load_model, model_from_state_dict, random_state_dict, save_checkpoint

# Layers dominate (a small vocab): a layer is 12 E^2 weights, lm_head E x V; 4 layers make holding
# them all (the old behaviour) 4x the bound.
CFG = GPTJConfig(vocab_size=512, n_positions=64, n_embd=256, n_layer=4, n_head=8, rotary_dim=16, n_inner=1024,
                 bos_token_id=0, eos_token_id=0)


def _unit_bytes(cfg: GPTJConfig, elem: int) -> int:
    """The largest part repacked at once: one layer's matrices or lm_head's weight."""
    E, inner = cfg.n_embd, cfg.inner_dim
    return max(4 * E * E + 2 * E * inner, E * cfg.vocab_size) * elem


def _bias_slack(cfg: GPTJConfig, elem: int) -> int:
    """Fusion adds zero biases for q, k, v and concatenates the biases of each layer: at most every
    layer's bias-sized vectors (q, k, v, fc_in, fc_out) twice over."""
    return 2 * cfg.n_layer * (4 * cfg.n_embd + cfg.inner_dim) * elem


def _most_in_flight(prof, name: str) -> int:
    """The most bytes allocated at once inside range `name` beyond what was allocated when it began:
    the running sum of the allocations and frees the profiler recorded in it. (Not its "Total
    Allocated": that is the CPU allocator's process-wide count, which frees of blocks allocated while
    no profile ran leave too high or too low; in one CI run it read 0 just before the range.)"""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"gptj-memory-trace-{os.getpid()}.json"
    prof.export_chrome_trace(str(path))
    try:
        events = json.loads(path.read_text())["traceEvents"]
    finally:
        path.unlink(missing_ok=True)
    (span,) = [e for e in events if e.get("name") == name and e.get("ph") == "X"]
    start, end = span["ts"], span["ts"] + span["dur"]
    inside = sorted((e for e in events if e.get("name") == "[memory]" and start <= e["ts"] <= end),
                    key=lambda e: e["ts"])
    assert inside, "the profiler recorded no CPU allocations"
    running = peak = 0
    for e in inside:
        running += e["args"]["Bytes"]
        peak = max(peak, running)
    return peak


@pytest.mark.parametrize(("quantize", "max_rows"), [(None, 1), (None, 64), ("int8", 64)])
def test_preparing_holds_at_most_one_layer_more(quantize, max_rows):
    # max_rows 1: the native layout where gptj.native builds (oneDNN's otherwise); 64: oneDNN's
    # reordered copy. int8: fused quantized blocks (concatenated int8 rows and scales).
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = model_from_state_dict(CFG, random_state_dict(CFG, dtype=torch.bfloat16))
        if quantize:
            quant.quantize_model(model, quantize, skip=("lm_head",))
        gc.collect()
        with record_function("prepare"):
            counts = prepare_for_serving(model, "auto", max_rows=max_rows)
    assert counts["fused_blocks"] == CFG.n_layer
    peak = _most_in_flight(prof, "prepare")
    elem = torch.empty((), dtype=torch.bfloat16).element_size()
    assert 0 < peak <= _unit_bytes(CFG, elem) + _bias_slack(CFG, elem), peak
    with torch.inference_mode():  # still a working model
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()


def _mapped_ranges(file: Path) -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of `file` (from /proc/self/maps)."""
    ino = file.stat().st_ino
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and int(parts[4]) == ino and Path(parts[5]) == file.resolve():
            a, b = parts[0].split("-")
            out.append((int(a, 16), int(b, 16)))
    return out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
@pytest.mark.parametrize("max_rows", [1, 64])
def test_repacked_layers_leave_the_file_mapping(tmp_path, max_rows):
    ckpt = save_checkpoint(random_state_dict(CFG, dtype=torch.bfloat16), CFG, tmp_path / "m", with_tokenizer=False)
    file = ckpt / "model.safetensors"
    model = load_model(ckpt, dtype=torch.bfloat16)
    mapped = sum(b - a for a, b in _mapped_ranges(file))
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert mapped >= weights  # loaded in place: the weights are the file's pages

    prepare_for_serving(model, "auto", max_rows=max_rows)
    gc.collect()
    ranges = _mapped_ranges(file)
    viewing = [t for t in list(model.parameters()) + list(model.buffers())
               if not t.is_mkldnn and any(a <= t.data_ptr() < b for a, b in ranges)]
    page = mmap.ALLOCATIONGRANULARITY
    # Each tensor still viewing the file maps its own bytes, rounded out to pages.
    allowed = sum(t.numel() * t.element_size() + 2 * page for t in viewing)
    assert sum(b - a for a, b in ranges) <= allowed
    E = CFG.n_embd
    layer = (4 * E * E + 2 * E * CFG.inner_dim) * 2
    assert sum(t.numel() * t.element_size() for t in viewing) <= weights - CFG.n_layer * layer  # no layer matrix
