"""Fast paths that may fail where they were not built for — a Triton kernel on a GPU or Triton it
cannot compile for, torch.compile without a C compiler, a CUDA graph that cannot be captured — and
have an exact path to fall back on. `Fallbacks` is the one rule for that: the first failure of a
path logs one warning, one line (what failed, the error's first line, what runs instead), and turns
that path off for the life of its owner; a path that failed once is not tried again (no warning per
step, no retry cost per step).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable


def first_line(error: BaseException) -> str:
    """An error's message as one line: its first (empty for an error without a message)."""
    return str(error).splitlines()[0] if str(error) else ""


class Fallbacks:
    """The paths of one owner (a backend, a graph runner, a module) that failed: `ok(path)` whether a
    path is still on, `fail(path, error, instead)` turns it off (logging once)."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.off: dict[Hashable, Exception] = {}  # path -> the error that turned it off

    def ok(self, path: Hashable) -> bool:
        return path not in self.off

    def fail(self, path: Hashable, what: str, error: Exception, instead: str) -> None:
        """`what` failed with `error`: log "<what> failed (<error type>: <its first line>); <instead>"
        the first time `path` fails, and turn it off."""
        if path in self.off:
            return
        self.off[path] = error
        self.log.warning("%s failed (%s: %s); %s", what, type(error).__name__, first_line(error), instead)
