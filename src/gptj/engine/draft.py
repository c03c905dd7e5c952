"""Prompt-lookup drafts (n-gram speculation): the tokens that followed the last time the text
ended as it ends now.

A summary copies spans of its article, so once its last few tokens match a span of the prompt (or
of its own output), the tokens after that span are a good guess at what comes next. `ngram_draft`
finds the longest suffix of the tokens so far (up to `max_ngram` tokens, at least `min_ngram`) that
occurred before, takes its most recent occurrence, and returns up to `k` tokens that followed it.
Where those run into the end of the text (it occurred less than `k` tokens ago: the text repeats with
that period), the copy goes on over the tokens it has just drafted, as an overlapping copy does
(LZ77's): a model caught in a loop of p tokens gets drafts of k, not of p.
No second model: the engine verifies the draft in the step's forward (engine/scheduler.py,
engine/update.py), so a wrong guess costs a few extra rows of that forward and changes no token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_draft(tokens: Sequence[int] | np.ndarray, k: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """`k` tokens that followed the most recent earlier occurrence of the longest suffix of `tokens`
    (from `max_ngram` tokens down to `min_ngram`), copied on with overlap past the end of `tokens`
    (so repeating the last L - start tokens); [] when no suffix occurred before."""
    t = np.asarray(tokens, dtype=np.int64)
    L = len(t)
    if k <= 0 or L < 2:
        return []
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        # windows of n tokens starting at 0 .. L - n - 1: every occurrence but the suffix itself
        windows = sliding_window_view(t[:L - 1], n)
        hits = np.flatnonzero((windows == t[L - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # what followed its most recent occurrence
            return np.resize(t[start:], k).tolist()  # fewer than k left: repeated (an overlapping copy)
    return []
