"""Shared fixtures: run a test once per kernel path, native (gptj.native's kernels, each ISA this
machine runs) and fallback (what runs where they are unavailable), so all are checked on whatever
machine CI lands.

`kernel_path` is parametrized: "native" skips, with the reason, where gptj.native cannot be used;
"native-avx512" and "native-avx2" run those libraries where the CPU's best is another (on an
AVX-512-BF16 machine all three run; "native-avx512" is AVX-512 without BF16's); "native-generic" the
portable one (simd_generic.h: what an ARM CPU would build), on any machine that can build it;
"fallback" switches gptj.native off for the test as `GPTJ_NATIVE=0` does (the environment variable,
for any process the test starts, and the in-process caches that hold the loaded library).
`native_isa` runs a test once per ISA of gptj.native.
"""

from __future__ import annotations

import os

import pytest
import torch

from gptj.native import ISAS

# Without a GPU, Triton kernels (the CUDA attention backend's) run under Triton's interpreter on CPU
# tensors. It is read when a kernel is defined, so before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's command runs two workers) each worker, and every process its tests
# start, keeps to a core of its own: gptj sizes its threads by the cores it may use (gptj.threads),
# so two workers never run two threads each on two cores (torch's spinning workers then wait whole
# time slices behind each other: a training test took 5x its time alone).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and hasattr(os, "sched_setaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    if len(_cores) > 1:
        os.sched_setaffinity(0, {_cores[int(_WORKER[2:]) % len(_cores)]})
        torch.set_num_threads(1)

KERNEL_PATHS = ("native", "native-avx512", "native-avx2", "native-generic", "fallback")  # native: the best ISA's

# The modules that take longest, longest first (by their tests' summed durations in the README's
# run on a 2-core machine: docs/PERFORMANCE.md#test-suite): pytest-xdist (the README's command runs
# two workers, one module per worker at a time) hands out modules in collection order
# (`--no-loadscope-reorder` in pyproject.toml: by default it reorders them by their number of tests),
# so the long ones do not end up last on one worker while the other idles.
LONGEST_FIRST = ("test_benchmarks.py", "test_ray_serve.py", "test_train.py", "test_ray_multinode.py",
                 "test_quant_cuda.py", "test_attention_backends.py", "test_benchmarks_gpu.py", "test_graphs.py",
                 "test_mlperf_submission.py", "test_parallel_serve.py", "test_parallel_tp.py",
                 "test_mlperf_interrupt.py", "test_parallel_pp.py", "test_serve.py", "test_kv_quantized.py",
                 "test_mlperf_run.py", "test_cli.py", "test_serve_cli.py", "test_lora.py", "test_decode.py",
                 "test_warm_compiles.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def unload_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """gptj.native forgets its library until the test ends (load() looks again, as the environment and
    gptj.cpu then say): the loader's state and bound functions, where gptj.native.ops reads them."""
    from gptj.native import loader

    monkeypatch.setattr(loader, "_state", {})
    for bound in loader.BOUND:
        monkeypatch.setattr(loader, bound, None)


def force_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """gptj.native unavailable until the test ends: available() is False, a direct call raises."""
    from gptj import native, quant

    monkeypatch.setenv("GPTJ_NATIVE", "0")
    unload_native(monkeypatch)  # load() looks again, and finds GPTJ_NATIVE=0
    monkeypatch.setattr(quant, "_NATIVE", [])  # quant's own cache of native.available()
    assert not native.available()


def use_isa(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """gptj.native loads the library of ISA `name` until the test ends (GPTJ_NATIVE_ISA); skipped,
    with the reason, where this machine cannot run or build it."""
    from gptj import native

    monkeypatch.setenv("GPTJ_NATIVE_ISA", name)
    unload_native(monkeypatch)  # load() looks again
    reason = native.unavailable_reason()
    if reason is not None:
        pytest.skip(f"the {name} kernels cannot run here: {reason}")
    assert native.isa().name == name and native.available()


@pytest.fixture(params=KERNEL_PATHS)
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """"native" (the best ISA's library), "native-avx512" / "native-avx2" (that library where the best
    is another: an AVX-512-BF16 machine runs all three), "native-generic" (the portable library, on
    any CPU) or "fallback" (torch's ops)."""
    from gptj import native

    if request.param == "native-generic":
        use_isa(monkeypatch, "generic")
    elif request.param.startswith("native"):
        reason = native.unavailable_reason()
        if reason is not None:
            pytest.skip(f"native kernels unavailable: {reason}")
        name = request.param.removeprefix("native-")
        if name != "native":
            if native.isa().name == name:
                pytest.skip(f"{name} is this CPU's best ISA: the native case runs its kernels")
            use_isa(monkeypatch, name)
    else:
        force_fallback(monkeypatch)
    return request.param


@pytest.fixture(params=[i.name for i in ISAS])
def native_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """gptj.native bound to the library of each ISA this machine runs (skipped where it cannot)."""
    use_isa(monkeypatch, request.param)
    return request.param


@pytest.fixture
def keep_torch_threads():
    """`gptj mlperf` and `gptj submission` set torch's thread count for the whole process: the test
    gives the next one its count back. Modules that run them in-process use it for every test."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A checkpoint folder of the tiny preset with random weights, one per test module.

    std 0.3 (not HF's 0.02) keeps the random model's logits far apart, so float rounding
    differences between a batch and a single prompt cannot flip a near-tie."""
    from gptj.config import get_preset
    from gptj.weights.io import random_state_dict, save_checkpoint

    cfg = get_preset("tiny")
    return save_checkpoint(random_state_dict(cfg, seed=5, std=0.3), cfg, tmp_path_factory.mktemp("m") / "tiny")
