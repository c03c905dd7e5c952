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

# A 2-core machine's decode step, in ms, by thread count: quiet, all threads run at once (2 threads
# 2.8x faster); beside two busy processes a thread is often descheduled and 2 threads wait on each
# other at every region (as measured: docs/PERFORMANCE.md#contention).
QUIET = {1: 33.0, 2: 11.5}
BUSY = {1: 95.0, 2: 450.0}


def run(tuner: ThreadTuner, machine: dict[int, float], steps: int, key: int = 1) -> list[int]:
    """Feed `steps` decode steps; the thread count of each."""
    used = []
    for _ in range(steps):
        used.append(tuner.threads)
        tuner.observe(key, machine[tuner.threads] / 1000)
    return used


def test_on_quiet_cores_it_keeps_every_thread_and_probes_ever_more_rarely():
    tuner = ThreadTuner(2)
    used = run(tuner, QUIET, 3000)
    assert tuner.current == 2 and tuner.moves == 0
    probes = used.count(1)
    # probes of 3 steps after 3, 6, 12, ... then 1024 steps (each losing probe doubles the wait): ten in 3000
    assert 3 * 5 <= probes <= 3 * 11, probes
    cost = sum(QUIET[n] for n in used) / (QUIET[2] * len(used)) - 1
    assert cost < 0.03, cost  # (each probe step costs 33 / 11.5 - 1 = 1.9 steps more)


def test_when_other_work_takes_the_cores_it_moves_to_one_thread_within_a_few_steps():
    tuner = ThreadTuner(2)
    run(tuner, QUIET, 2000)  # settled at 2, probing rarely (interval at its maximum)
    assert tuner.current == 2 and tuner.interval == tuner.max_interval
    used = run(tuner, BUSY, 40)
    first = used.index(1)
    assert first <= 4, used  # the jump in step times sends it probing at once
    assert tuner.current == 1 and used[first:first + 12] == [1] * 12, used  # (then a probe of 2 now and then)


def test_when_the_cores_quiet_down_it_goes_back_to_every_thread():
    tuner = ThreadTuner(2)
    run(tuner, BUSY, 500)
    assert tuner.current == 1
    used = run(tuner, QUIET, 40)  # one thread's steps get 3x faster: other work went away
    assert tuner.current == 2 and used[-10:] == [2] * 10, used


def test_under_lasting_contention_the_probes_of_more_threads_thin_out():
    tuner = ThreadTuner(2)
    used = run(tuner, BUSY, 4000)
    assert tuner.current == 1
    late = used[2000:]
    assert late.count(2) <= 3 * 3, late.count(2)  # at most a few probes of 3 steps in 2000


def test_probes_compare_steps_of_one_kind_only():
    """Steps of another size (key) are not compared with the current's: a probe whose kind never
    repeats ends without a move."""
    tuner = ThreadTuner(2, min_interval=4)
    run(tuner, QUIET, 8, key=1)
    keys = iter(range(100, 200))
    for _ in range(20):
        tuner.observe(next(keys), 0.001)  # a different size each step, all very fast
    assert tuner.current == 2 and tuner.moves == 0


def test_wider_machines_move_by_halves():
    tuner = ThreadTuner(8)
    machine = {8: 0.30, 4: 0.05, 2: 0.06, 1: 0.09}  # half the cores busy elsewhere: 4 threads best
    run(tuner, machine, 400)
    assert tuner.current == 4


def test_one_thread_has_nothing_to_choose():
    tuner = ThreadTuner(1)
    assert set(run(tuner, {1: 5.0}, 100)) == {1}


def test_the_engine_tunes_its_threads_only_when_asked(tiny_checkpoint, keep_torch_threads):
    torch.set_num_threads(2)
    gen = GenerationConfig(max_new_tokens=40)
    fixed = build_engine(load_model(tiny_checkpoint), EngineConfig(max_seqs=4))
    want = fixed.generate([[1, 2, 3]], gen)
    assert fixed.tuner is None and torch.get_num_threads() == 2
    tuned = build_engine(load_model(tiny_checkpoint), EngineConfig(max_seqs=4, adapt_threads=True))
    assert tuned.generate([[1, 2, 3]], gen) == want  # float32: the thread count changes no token here
    tuner = tuned.tuner
    assert tuner is not None and tuner.max_threads == 2
    assert tuner.steps_at[2] > 0 and tuner.steps_at[1] >= tuner.probe_steps  # 39 decode steps: it probed 1 thread
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
