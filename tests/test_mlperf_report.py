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
