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
    from gptj.models.gptj import build_model

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


def _comm(tid: int) -> str:
    with open(f"/proc/{os.getpid()}/task/{tid}/comm") as f:
        return f.read().strip()


def test_the_engine_loops_thread_and_its_team_carry_its_name(two_threads):
    """name_os_thread: the engine loop's OS thread is `gptj-engine`, and so are the OpenMP workers it
    starts (what benchmarks/serve_profile.py counts as the engine's CPU time)."""
    from gptj.config import get_preset
    from gptj.engine import EngineLoop
    from gptj.engine.core import Engine
    from gptj.engine.config import EngineConfig
    from gptj.models.gptj import build_model
    from gptj.decode import GenerationConfig

    torch.manual_seed(0)
    before = _tids()
    loop = EngineLoop(lambda: Engine(build_model(get_preset("tiny")).eval(), EngineConfig(max_seqs=2)))
    try:
        loop.submit([1, 2, 3], GenerationConfig(max_new_tokens=2)).result(60)
        names = {tid: _comm(tid) for tid in _tids() - before}
    finally:
        loop.shutdown()
    assert loop._thread.native_id in names and names[loop._thread.native_id] == "gptj-engine"
    others = [n for tid, n in names.items() if tid != loop._thread.native_id]
    if not others:
        pytest.skip("the engine's steps started no OpenMP worker here")
    assert set(others) == {"gptj-engine"}
