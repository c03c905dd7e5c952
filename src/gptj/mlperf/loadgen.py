"""LoadGen's test run so that Ctrl-C reaches gptj (StartTest on a thread of its own: its C++ loop holds
the thread that calls it), and what an interrupted test leaves in the log folder.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during LoadGen's test. `finished`: LoadGen ended its test (its logs are whole);
    otherwise its test still runs on its threads, and the process must end with os._exit, since an
    interpreter shutting down under them crashes (docs: the caller exits)."""

    def __init__(self, log_dir: Path, finished: bool) -> None:
        self.log_dir, self.finished = log_dir, finished
        what = "LoadGen's logs" if finished else "LoadGen's logs up to the interrupt"
        super().__init__(f"{what} and summary.md in {log_dir}")


# After a Ctrl-C, how long LoadGen may take to end its test once every sample is answered. Offline
# has one query, so it always ends, once LoadGen has issued it and taken the answers (seconds for a
# query of 10^5 samples); Server keeps its schedule's arrival times, and SingleStream issues as many
# queries as it expected (2 x min duration / expected latency), so these may not end in time.
INTERRUPT_GRACE_S = {"Offline": 60.0, "Server": 3.0, "SingleStream": 3.0}
_LOADGEN_FLUSH_S = 0.1  # LoadGen's logging thread writes and flushes its logs every 10 ms


def run_loadgen(sut, qsl, settings, log_settings, scenario: str, audit: Path) -> bool:  # noqa: ANN001
    """LoadGen's StartTest on a thread of its own, so that Ctrl-C reaches this (main) thread: its
    C++ loop holds the thread that calls it, where Python could not run the signal handler.

    Returns whether the test finished. On Ctrl-C the SUT answers everything at once and LoadGen
    gets INTERRUPT_GRACE_S[scenario] to end (a second Ctrl-C stops waiting); if it has not, the SUT stops
    answering, so the logs stop growing, and the caller must not tear LoadGen down."""
    import mlperf_loadgen as lg

    errors: list[BaseException] = []
    # Not Thread.is_alive(): a join() that Ctrl-C interrupts can leave the thread marked as stopped
    # while it still runs (CPython 3.11), and LoadGen would be torn down under its test.
    done = threading.Event()

    def start() -> None:
        try:
            lg.StartTestWithLogSettings(sut.sut, qsl.qsl, settings, log_settings, str(audit))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=start, name="gptj-loadgen", daemon=True).start()
    try:
        while not done.wait(0.1):
            pass
    except KeyboardInterrupt:
        sut.interrupt()
        deadline = time.monotonic() + INTERRUPT_GRACE_S[scenario]
        try:
            while not done.wait(0.05) and time.monotonic() < deadline:
                pass
        except KeyboardInterrupt:
            pass  # a second Ctrl-C: stop waiting
        if not done.is_set():
            sut.abandon()
            time.sleep(_LOADGEN_FLUSH_S)
            return False
    if errors:
        sut.stop()
        qsl.destroy()
        raise errors[0]
    return True


def interrupted_logs(log_dir: Path, finished: bool) -> dict:
    """What an interrupted run left in its folder. With LoadGen's test still running, its accuracy
    log is a JSON array it has not closed: gptj closes it (LoadGen writes no more entries, as the SUT
    answers nothing more) so it parses."""
    info: dict = {"loadgen_finished": finished}
    if finished:
        info["note"] = "LoadGen ended its test after the interrupt: its logs are whole; samples answered empty " \
                       "after the interrupt make the run INVALID and its scores meaningless"
        return info
    incomplete = []
    acc = log_dir / "mlperf_log_accuracy.json"
    try:
        text = acc.read_text(encoding="utf-8")
        if text.strip() and not text.rstrip().endswith("]"):
            with open(acc, "a", encoding="utf-8") as f:
                f.write("\n]\n")
            incomplete.append(f"{acc.name} (the entries logged before the interrupt; closed by gptj)")
    except OSError:
        pass
    summary = log_dir / "mlperf_log_summary.txt"
    if not summary.is_file() or summary.stat().st_size == 0:
        incomplete.append(f"{summary.name} (empty: LoadGen writes it when a test ends)")
    incomplete.append("mlperf_log_detail.txt (up to the interrupt)")
    info["incomplete"] = incomplete
    info["note"] = "LoadGen's test was still running (its schedule had time left) when gptj exited"
    return info
