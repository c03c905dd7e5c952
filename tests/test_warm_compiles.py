"""Engine.warm compiles, before timed work, every Triton kernel specialization a run launches later.

Triton compiles a kernel for each specialization of its arguments (their dtypes; integers equal to 1,
or divisible by 16; pointers 16-byte aligned) at its first launch: 1-3 s each on a GPU, inside
LoadGen's timed window if warm-up missed one. Under Triton's interpreter (this machine: no GPU) the
kernels run on CPU tensors; benchmarks/gpu_compile.interpreted_keys records, for each launch, what
Triton's launcher would compile on a GPU (its own binder, for sm_90a). An Offline-shaped run (beam
search, prompts of odd lengths, copy-on-write of the prompt's last block, prompt chunks) must launch
nothing warm-up did not."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from gptj import policy
from gptj.engine import Engine, EngineConfig
from gptj.engine import attention as att
from gptj.decode import GenerationConfig
from gptj.models.gptj import build_model
from test_engine import CFG, prompts_of

pytest.importorskip("triton", reason="the CUDA backend's kernels are Triton's")
pytestmark = pytest.mark.cuda

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_compile.py"


def gpu_compile():
    spec = importlib.util.spec_from_file_location("gpu_compile", SCRIPT)
    module = sys.modules.setdefault("gpu_compile", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(dataclasses.replace(CFG, n_head=2)).eval()


def names(keys) -> list[str]:
    """Each key as its kernel, its constexprs and the arguments specialized as 16-divisible."""
    out = set()
    for key in keys:
        kernel, signature, constexprs, attrs, options = json.loads(key)
        args = list(signature)
        aligned = [args[int(k.strip("(,)"))] for k, v in attrs if "divisibility" in v]
        out.add(f"{kernel} {dict(constexprs)} 16-divisible: {', '.join(aligned)} {options}")
    return sorted(out)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_warm_compiles_every_specialization_an_offline_run_launches(model, kv_dtype):
    gc = gpu_compile()
    engine = Engine(model, EngineConfig(max_seqs=8, block_size=16, kernels="off", kv_dtype=kv_dtype,
                                        prefill_chunk=16))
    engine.runner.attention = att.make_backend(policy.AttentionPath("cuda", False))
    gen = GenerationConfig(num_beams=4, max_new_tokens=4, min_new_tokens=2, early_stopping=True)
    with gc.interpreted_keys() as warmed:
        engine.warm(gen)
    with gc.interpreted_keys() as used:
        engine.generate(prompts_of([21, 35]), gen)  # odd lengths, in two and three chunks
    assert engine.runner.attention.kernel_ok and engine.runner.attention.store_ok
    launched = {json.loads(k)[0] for k in used}
    assert launched == {"_paged_decode_kernel", "_paged_decode_dot_kernel", "_paged_prefill_kernel", "_store_kernel",
                        "_copy_kernel"}  # beams beside single rows, chunks after the first, copy-on-write
    missing = set(used) - set(warmed)
    assert not missing, "launched after warm-up, not compiled by it:\n" + "\n".join(names(missing))
