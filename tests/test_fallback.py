"""gptj.fallback: a fast path that fails is logged once, in one line, and stays off."""

from __future__ import annotations

import logging

from gptj.fallback import Fallbacks


def test_a_path_that_fails_is_logged_once_in_one_line_and_stays_off(caplog):
    log = logging.getLogger("gptj.test_fallback")
    paths = Fallbacks(log)
    assert paths.ok("decode") and paths.ok((8, 1))
    with caplog.at_level("WARNING", logger=log.name):
        for _ in range(3):  # the callers' retries: one warning, the first error kept
            paths.fail("decode", "the Triton decode kernel", RuntimeError("PTX not supported\nmore detail"),
                       "attention runs the reference backend's forms")
        paths.fail((8, 1), "CUDA-graph capture of 8 rows", ValueError(""), "those steps run eagerly")
    assert not paths.ok("decode") and not paths.ok((8, 1)) and paths.ok("store")
    assert [r.getMessage() for r in caplog.records] == [
        "the Triton decode kernel failed (RuntimeError: PTX not supported); attention runs the reference backend's "
        "forms",
        "CUDA-graph capture of 8 rows failed (ValueError: ); those steps run eagerly"]
    assert str(paths.off["decode"]).startswith("PTX not supported")
