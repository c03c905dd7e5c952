"""ParallelContext in one process (no process group): what load_model and the engine loop are handed
when no --tp / --pp job runs. The several-rank cases run in test_parallel_tp/pp/serve."""

from __future__ import annotations

import pytest

from gptj.device import rank_device
from gptj.errors import GptjError
from gptj.parallel import lockstep
from gptj.parallel.context import SINGLE, ParallelContext, check_grid
from test_parallel_tp import CFG, full_model


def test_one_process_is_no_job():
    ctx = ParallelContext.join(2, 1)  # no process group: one process, whatever was asked
    assert not ctx.parallel and not SINGLE.parallel
    assert (ctx.world, ctx.tp_rank, ctx.stage) == (2, 0, 0)
    assert SINGLE.least(12345) == 12345  # nothing to agree with
    assert SINGLE.local_rank == 0  # its GPU under a job: cuda -> cuda:LOCAL_RANK
    assert (rank_device("cuda", 3), rank_device("cuda:0", 1), rank_device("cpu", 3)) == ("cuda:3", "cuda:1", "cpu")
    SINGLE.check(1, 1)
    with pytest.raises(GptjError, match=r"--tp 2 --pp 1 runs on 2 ranks: start it with gptj"):
        SINGLE.check(2, 1)
    with pytest.raises(GptjError, match=r"--tp 2 --pp 2 needs 4 ranks, the job has 3"):
        check_grid(2, 2, 3)


def test_one_process_shares_the_whole_model():
    model = full_model()
    assert SINGLE.share(model) is model and model.kv_heads == CFG.n_head


def test_the_engine_loop_builds_with_the_context_and_finish_is_a_no_op():
    seen = []

    def build(ctx):  # noqa: ANN001, ANN202
        from gptj.engine import Engine, EngineConfig

        seen.append(ctx)
        return Engine(full_model(), EngineConfig(max_seqs=2, kernels="off", compile="off"))

    loop = lockstep.engine_loop(build, SINGLE)
    try:
        assert seen == [SINGLE] and loop.leader is None
    finally:
        loop.shutdown()
    lockstep.finish(SINGLE)  # one process: nobody to tell
    assert not SINGLE.stopped and not SINGLE.leading
