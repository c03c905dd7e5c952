"""Issue 55, item 12: the engine chooses its compute threads from its own step times
(gptj.threads.ThreadTuner), so cores shared with other busy processes do not stall every step, and
quiet cores keep every thread. The tuner is fed step times of a made-up machine here (no clock)."""

from __future__ import annotations

import pytest
import torch

from gptj.decode import GenerationConfig
from gptj.engine import EngineConfig
from gptj.runtime.build import build_engine
from gptj.threads import ThreadTuner
from gptj.weights.io import load_model

# A 2-core machine's decode step by thread count: (ms, utilization: the process's CPU time over the
# step / (wall time x threads)). Quiet, all threads run at once (2 threads 2.8x faster; a waiting
# OpenMP thread spins, which counts as CPU time); beside two busy processes every runnable thread gets
# its share of the cores (4 on 2 cores at 2 threads, 3 at 1), and 2 threads wait on each other at every
# region (as measured: docs/PERFORMANCE.md#contention).
QUIET = {1: (33.0, 1.0), 2: (11.5, 0.98)}
BUSY = {1: (95.0, 0.67), 2: (450.0, 0.5)}


def run(tuner: ThreadTuner, machine: dict[int, tuple[float, float]], steps: int, key: int = 1) -> list[int]:
    """Feed `steps` decode steps; the thread count of each."""
    used = []
    for _ in range(steps):
        n = tuner.threads
        ms, usage = machine[n]
        used.append(n)
        tuner.observe(key, ms / 1000, usage * n * ms / 1000)
    return used


def test_on_quiet_cores_it_keeps_every_thread_and_never_probes():
    tuner = ThreadTuner(2)
    used = run(tuner, QUIET, 3000)
    assert tuner.current == 2 and tuner.moves == 0 and used == [2] * 3000  # the steps cost what they did


def test_when_other_work_takes_the_cores_it_moves_to_one_thread_within_a_few_steps():
    tuner = ThreadTuner(2)
    run(tuner, QUIET, 2000)
    used = run(tuner, BUSY, 40)
    first = used.index(1)
    assert first <= 6, used  # its CPU time falls to half the wall time: it tries fewer threads at once
    assert tuner.current == 1 and used[first:first + 12] == [1] * 12, used


def test_when_the_cores_quiet_down_it_goes_back_to_every_thread():
    tuner = ThreadTuner(2)
    run(tuner, BUSY, 5000)  # long enough for its probes of 2 threads to have backed off to the longest wait
    assert tuner.current == 1 and tuner.interval["now and then"] == tuner.max_interval
    used = run(tuner, QUIET, 40)  # one thread has a whole core again: it tries more at once
    assert tuner.current == 2 and used[-20:] == [2] * 20, used


def test_under_lasting_contention_the_probes_of_more_threads_thin_out():
    tuner = ThreadTuner(2)
    used = run(tuner, BUSY, 4000)
    assert tuner.current == 1
    late = used[2000:]
    assert late.count(2) <= 3 * 3, late.count(2)  # at most a few probes of 3 steps in 2000


def test_one_busy_process_beside_two_threads_keeps_them_when_they_are_still_faster():
    """3 runnable threads on 2 cores: utilization 2/3, but 2 threads still beat 1 here; the probes of
    1 thread lose, and come ever more rarely."""
    machine = {1: (25.0, 1.0), 2: (18.0, 0.67)}
    tuner = ThreadTuner(2)
    used = run(tuner, machine, 3000)
    assert tuner.current == 2 and tuner.moves == 0
    assert used[1000:].count(1) <= 3 * 2


def test_probes_compare_steps_of_one_kind_only():
    """Steps of another size (key) are not compared with the current's: a probe whose kind never
    repeats ends without a move."""
    tuner = ThreadTuner(2)
    run(tuner, BUSY, 5, key=1)  # (shared cores: a probe of 1 thread starts)
    assert tuner.probing == 1
    keys = iter(range(100, 200))
    for _ in range(20):
        tuner.observe(next(keys), 0.001, 0.001)  # a different size each step, all very fast
    assert tuner.current == 2 and tuner.moves == 0 and tuner.probing is None


def test_wider_machines_move_by_halves():
    tuner = ThreadTuner(8)
    machine = {8: (0.30, 0.5), 4: (0.05, 0.95), 2: (0.06, 1.0), 1: (0.09, 1.0)}  # half the cores busy elsewhere
    run(tuner, machine, 400)
    assert tuner.current == 4


def test_one_thread_has_nothing_to_choose():
    tuner = ThreadTuner(1)
    assert set(run(tuner, {1: (5.0, 0.3)}, 100)) == {1}


def test_the_engine_tunes_its_threads_only_when_asked(tiny_checkpoint, keep_torch_threads, monkeypatch):
    import threading

    from gptj import threads

    monkeypatch.setattr(threads, "_tuners", threading.local())
    torch.set_num_threads(2)
    gen = GenerationConfig(max_new_tokens=40)
    fixed = build_engine(load_model(tiny_checkpoint), EngineConfig(max_seqs=4))
    want = fixed.generate([[1, 2, 3]], gen)
    assert fixed.tuner is None and torch.get_num_threads() == 2
    tuned = build_engine(load_model(tiny_checkpoint), EngineConfig(max_seqs=4, adapt_threads=True))
    assert tuned.generate([[1, 2, 3]], gen) == want  # float32: the thread count changes no token here
    tuner = tuned.tuner
    assert tuner is not None and tuner.max_threads == 2 and sum(tuner.steps_at.values()) == 39  # its decode steps
    assert 4 <= len(tuner.usage) <= 8 and all(0 < u < 1.5 for u in tuner.usage)  # CPU time over wall time, read
    assert torch.get_num_threads() == tuner.threads


def test_the_commands_tune_unless_threads_are_given():
    from gptj.cli import _server_config, build_parser
    from gptj.runtime import flags

    parse = build_parser().parse_args
    assert flags.engine_config(parse(["generate", "--model", "m", "--prompt", "x"])).adapt_threads is True
    assert flags.engine_config(parse(["generate", "--model", "m", "--prompt", "x", "--threads", "2"])).adapt_threads \
        is False
    assert _server_config(parse(["serve", "--model", "m"])).engine.adapt_threads is True
    assert _server_config(parse(["serve", "--model", "m", "--threads", "1"])).engine.adapt_threads is False
    assert EngineConfig().adapt_threads is False  # a library caller keeps its thread count


@pytest.mark.parametrize("bad", [0, -1])
def test_a_tuner_needs_a_thread(bad):
    from gptj.errors import GptjError

    with pytest.raises(GptjError):
        ThreadTuner(bad)


def test_an_engine_hands_what_it_learned_to_the_next_on_its_thread(tiny_checkpoint, keep_torch_threads,
                                                                    monkeypatch):
    import threading

    from gptj import threads
    from gptj.threads import tuner_for

    monkeypatch.setattr(threads, "_tuners", threading.local())  # this test's own, gone after it
    torch.set_num_threads(2)
    first = tuner_for(2)
    first.current = 1  # as if an engine before had found the cores shared, and set the thread's count so
    torch.set_num_threads(1)
    engine = build_engine(load_model(tiny_checkpoint), EngineConfig(max_seqs=4, adapt_threads=True))
    engine.generate([[1, 2, 3]], GenerationConfig(max_new_tokens=3))
    assert engine.tuner is first and first.max_threads == 2 and torch.get_num_threads() == 1  # where it was
    assert tuner_for(2) is first  # its ceiling, set again (a caller giving the peers theirs back)
    torch.set_num_threads(4)  # another count: a fresh tuner up to it
    assert tuner_for(4) is not first and tuner_for(4).threads == 4
