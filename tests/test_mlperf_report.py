"""The results bundle's pieces that need no LoadGen run: the latency picture."""

import matplotlib.pyplot as plt
import numpy as np
import pytest

from gptj.mlperf.report import _percentile, latency_figure, latency_plot


def long_tail(n=200, seed=0):
    """Most samples near 80 ms, a tenth near 5 s: on a linear axis the main mode is one bar."""
    rng = np.random.default_rng(seed)
    main = rng.lognormal(np.log(0.08), 0.2, n - n // 10)
    tail = rng.lognormal(np.log(5.0), 0.3, n // 10)
    return list(rng.permutation(np.concatenate([main, tail])))


@pytest.mark.parametrize("with_times", [False, True])
def test_latency_is_a_cdf_on_a_log_axis_and_over_time_when_issue_times_are_given(with_times):
    lat = long_tail()
    issued = list(np.cumsum(np.full(len(lat), 0.1))) if with_times else None
    fig = latency_figure(lat, [], "gptj Server: 200 samples", issued)
    try:
        axes = fig.get_axes()
        assert len(axes) == (2 if with_times else 1)
        cdf = axes[0]
        assert cdf.get_xscale() == "log"  # the 80 ms mode and the 5 s tail both readable
        x, y = cdf.get_lines()[0].get_data()
        assert np.all(np.diff(x) >= 0) and np.all(np.diff(y) > 0) and y[-1] == pytest.approx(1.0)
        assert sorted(np.asarray(lat) * 1000) == pytest.approx(list(x))
        marks = [line.get_xdata()[0] for line in cdf.get_lines()[1:]]  # p50, p90, p99
        assert marks == pytest.approx([_percentile(list(np.sort(lat) * 1000), q) for q in (50, 90, 99)])
        if with_times:
            over = axes[1]
            assert over.get_yscale() == "log" and "issued at" in over.get_xlabel()
            offsets = over.collections[0].get_offsets()
            assert len(offsets) == len(lat) and offsets[0][0] == pytest.approx(0.0)
    finally:
        plt.close(fig)


def test_latency_plot_is_a_png():
    png = latency_plot(long_tail(20), [0.01] * 20, "t", list(range(20)))
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


# LoadGen's summary of an INVALID run, in its own layout (the lines that say why)
OFFLINE_SHORT = """================================================
MLPerf Results Summary
================================================
SUT name : PySUT
Scenario : Offline
Mode     : PerformanceOnly
Samples per second: 61.5
Result is : INVALID
  Min duration satisfied : NO
  Min queries satisfied : Yes
  Early stopping satisfied: Yes
Recommendations:
 * Increase expected QPS so the loadgen pre-generates a larger (coalesced) query.

================================================
Additional Stats
================================================
"""

SERVER_LATE = """Scenario : Server
Mode     : PerformanceOnly
Completed samples per second    : 2.10
Result is : INVALID
  Performance constraints satisfied : NO
  Min duration satisfied : Yes
  Min queries satisfied : Yes
  Early stopping satisfied: NO
Recommendations:
 * Reduce target QPS to improve latency.
Early Stopping Result:
 * Run unsuccessful.
 * Processed 480 queries.
 * Would need to run at least 1200 more queries,
 with the run being successful if every additional
 query were under latency.

================================================
Additional Stats
================================================
99.00 percentile latency (ns)   : 31000000000
"""


@pytest.mark.parametrize("scenario, text, expected", [
    ("Offline", OFFLINE_SHORT, ["min duration not satisfied: the query of 90 samples was done before 2000 ms, at 61.5 "
                                "samples/s; give --target-qps above that"]),
    ("Server", SERVER_LATE, ["early stopping not satisfied (LoadGen: Run unsuccessful. Processed 480 queries. Would "
                             "need to run at least 1200 more queries, with the run being successful if every "
                             "additional query were under latency); give --min-query-count 1680",
                             "performance constraints not satisfied: the latency percentile is over the target "
                             "latency (31.00 s against a bound of 20 s); give a lower --target-qps (the system "
                             "completed 2.10 samples/s)"]),
])
def test_an_invalid_summary_names_each_unmet_condition_and_its_fix(tmp_path, scenario, text, expected):
    from types import SimpleNamespace

    from gptj.mlperf.report import invalid_reasons, parse_loadgen_summary

    (tmp_path / "mlperf_log_summary.txt").write_text(text)
    summary = parse_loadgen_summary(tmp_path / "mlperf_log_summary.txt")
    used = {"min_duration_ms": 2000, "samples_per_query": 90, "target_latency_ns": 20_000_000_000,
            "result_query_count": 480}
    reasons = invalid_reasons(SimpleNamespace(scenario=scenario), summary, {"asked": {}, "loadgen": used})
    assert len(reasons) == len(expected)
    for reason, start in zip(reasons, expected):
        assert reason.startswith(start), reason
    valid = text.replace("Result is : INVALID", "Result is : VALID")
    (tmp_path / "mlperf_log_summary.txt").write_text(valid)
    again = parse_loadgen_summary(tmp_path / "mlperf_log_summary.txt")
    assert invalid_reasons(SimpleNamespace(scenario=scenario), again, {"asked": {}, "loadgen": used}) == []


def test_an_offline_summary_counts_the_samples_its_query_held(tmp_path):
    """LoadGen rounds an Offline query up to whole passes over the performance samples: 40 asked, 60
    held and answered. The summary's count is the 60 (its detail log's generated_samples_per_query)."""
    import json
    from types import SimpleNamespace

    from gptj.mlperf.report import _settings_lines, invalid_reasons, loadgen_effective

    records = [("effective_samples_per_query", 40), ("generated_query_count", 1),
               ("generated_samples_per_query", 60), ("result_query_count", 1), ("effective_min_duration_ms", 2000)]
    (tmp_path / "mlperf_log_detail.txt").write_text("".join(
        f':::MLLOG {json.dumps({"key": k, "value": v})}\n' for k, v in records))
    used = loadgen_effective(tmp_path)
    assert used["generated_samples_per_query"] == 60 and used["samples_per_query"] == 40
    cfg = SimpleNamespace(scenario="Offline", mode="performance")
    result = SimpleNamespace(settings={"asked": {}, "loadgen": used}, stats=SimpleNamespace(samples=60))
    assert "- queries issued: 1 (60 samples)" in _settings_lines(cfg, result)
    (tmp_path / "summary.txt").write_text(OFFLINE_SHORT)
    from gptj.mlperf.report import parse_loadgen_summary

    (reason,) = invalid_reasons(cfg, parse_loadgen_summary(tmp_path / "summary.txt"), {"asked": {}, "loadgen": used})
    assert reason.startswith("min duration not satisfied: the query of 60 samples"), reason
