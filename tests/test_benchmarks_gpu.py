"""benchmarks/gpu_check.py's rehearsal on CPU (--smoke: every step of the GPU session's plan but the
quantized Offline and Server runs, which are those loops with accuracy's flags; int8 in fp8's place), in a module of its own: test_benchmarks.py's scripts run one after another on one
pytest-xdist worker (--dist loadfile), and this one, the longest, now runs beside them."""

from __future__ import annotations

from test_benchmarks import JOBS, OWN_MODULE, outcome, start, tiny  # noqa: F401 - tiny: the fixture


def test_gpu_check_rehearses_its_steps_on_cpu(tiny, tmp_path):  # noqa: F811 - the fixture
    assert OWN_MODULE == ("gpu_check.py",)
    out, err = outcome("gpu_check.py", start(JOBS["gpu_check.py"], tiny, tmp_path))
    JOBS["gpu_check.py"].check(out, err)


def _gpu_check():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    import sys

    sys.path.insert(0, str(path.parent))  # its `from _smoke import ...`
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def test_gpu_check_table_shows_the_graphs_share_of_a_step():
    """bench latency's graph_step_ms (the step's CUDA graph replayed alone) is shown against the whole
    step, for batch 1, each precision and batch 32; a run without it (CPU) shows none."""
    gc = _gpu_check()
    b1 = {"decode_tok_s": 200.0, "decode_step_ms": 5.0, "weights_gb_s": 2400.0, "graph_step_ms": 3.25, "batch": 1}
    res = {"bandwidth": {"device": "NVIDIA H200", "torch": "2.11", "copy_gb_s": 4000.0}, "latency-b1": b1,
           "latency-b1-int8": {**b1, "decode_tok_s": 250.0, "decode_step_ms": 4.0, "graph_step_ms": 2.5},
           "latency-b32": {**b1, "batch": 32, "decode_tok_s": 3200.0, "decode_step_ms": 10.0, "graph_step_ms": 7.0}}
    lines = gc.table(res)
    assert any("batch-1 decode " in s and "graph 3.25 of 5.00 ms a step" in s and "60% of copy" in s for s in lines)
    assert any("int8" in s and "graph 2.50 of 4.00 ms" in s and "1.25x bf16" in s for s in lines)
    assert any("batch-32" in s and "graph 7.00 of 10.00 ms" in s for s in lines)
    del b1["graph_step_ms"]
    assert not any("graph" in s for s in gc.table({**res, "latency-b1-int8": {}, "latency-b32": {}}))


def test_gpu_check_collects_only_the_modules_that_mark_cuda_tests():
    """The tests step names the modules that mark tests `cuda` (the others may import test extras a
    GPU machine lacks), and every module with such a mark is among them."""
    from pathlib import Path

    gc = _gpu_check()
    files = gc.cuda_test_files()
    tests = Path(__file__).resolve().parent
    marked = {f"tests/{p.name}" for p in tests.glob("test_*.py")
              if any(line.startswith(("@pytest.mark.cuda", "pytestmark = pytest.mark.cuda",
                                      "pytestmark = [pytest.mark.cuda")) for line in p.read_text().splitlines())}
    assert marked and set(files) == marked
    assert "tests/test_serve.py" not in files and "tests/test_quant_cuda.py" in files


def test_gpu_check_asks_a_server_run_no_more_than_offline_showed_it_can_do(tmp_path):
    """The Server rate: TensorRT-LLM's share for the GPU, capped at 80 % of the same mode's Offline
    samples/s from this invocation or a results*.json an earlier one left in OUT."""
    gc = _gpu_check()
    assert gc.earlier_offline({}, tmp_path, "offline-q") is None
    (tmp_path / "results-offline.json").write_text('{"offline": {"samples_s": 2.0}, "offline-q": {"samples_s": 1.5}}')
    (tmp_path / "results-b1.json").write_text("not json")
    assert gc.earlier_offline({}, tmp_path, "offline-q") == 1.5
    assert gc.earlier_offline({"offline-q": {"samples_s": 9.0}}, tmp_path, "offline-q") == 9.0
    srv = {"result": "VALID", "target_qps": 1.2, "qps_from": "80% of Offline's", "trt_llm_qps": 34.9, "quant": "",
           "p99_s": 3.0, "completed_qps": 1.2}
    line = next(s for s in gc.table({"server": srv}) if s.startswith("MLPerf Server"))
    assert "3% of TensorRT-LLM's 34.9; 80% of Offline's samples/s" in line
