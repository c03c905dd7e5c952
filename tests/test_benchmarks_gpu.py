"""benchmarks/gpu_check.py's rehearsal on CPU (--smoke: every step of the GPU session's plan, int8 in
fp8's place), in a module of its own: test_benchmarks.py's scripts run one after another on one
pytest-xdist worker (--dist loadfile), and this one, the longest, now runs beside them."""

from __future__ import annotations

from test_benchmarks import JOBS, OWN_MODULE, outcome, start, tiny  # noqa: F401 - tiny: the fixture


def test_gpu_check_rehearses_its_steps_on_cpu(tiny, tmp_path):  # noqa: F811 - the fixture
    assert OWN_MODULE == ("gpu_check.py",)
    out, err = outcome("gpu_check.py", start(JOBS["gpu_check.py"], tiny, tmp_path))
    JOBS["gpu_check.py"].check(out, err)
