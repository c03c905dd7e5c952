"""gptj.threads: the compute threads, and letting a thread's OpenMP team go."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from gptj.threads import openmp_runtimes, release_openmp_threads


def _tids() -> set[int]:
    return {int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")}


def _team_of_this_thread() -> set[int]:
    """Run a parallel region on the calling thread (torch's reduction over 2 threads) after letting the
    thread's team go: the threads that appeared are its new team's workers."""
    release_openmp_threads()
    before = _tids()
    torch.ones(1 << 22).sum()
    return _tids() - before


@pytest.fixture
def two_threads():
    if not os.path.isdir(f"/proc/{os.getpid()}/task"):
        pytest.skip("no /proc/<pid>/task to count threads in")
    if not openmp_runtimes():
        pytest.skip("torch runs no OpenMP runtime in this process")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_release_openmp_threads_ends_the_calling_threads_team(two_threads):
    seen: dict[str, object] = {}

    def worker() -> None:
        seen["team"] = _team_of_this_thread()
        seen["released"] = release_openmp_threads()
        seen["after"] = _tids()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    if not seen["team"]:
        pytest.skip("torch's reduction started no worker thread here")
    assert seen["released"] >= 1
    assert not seen["team"] & seen["after"]  # its workers are gone while the thread itself lives on


def test_engine_loop_lets_the_calling_threads_team_go(two_threads):
    from gptj.config import get_preset
    from gptj.engine import Engine, EngineLoop
    from gptj.engine.config import EngineConfig
    from gptj.model import build_model

    torch.manual_seed(0)
    engine = Engine(build_model(get_preset("tiny")).eval(), EngineConfig(max_seqs=2))
    team = _team_of_this_thread()  # as loading a model on this thread leaves it
    if not team:
        pytest.skip("torch's reduction started no worker thread here")
    loop = EngineLoop(engine)
    try:
        assert not team & _tids()
    finally:
        loop.shutdown()
