"""engine/graphs.py: decode-only steps from persistent buffers, padded to batch-size buckets. On CPU
(Triton's kernel under its interpreter) the padded step runs eagerly from the same buffers, so the
padding and bucketing are checked here: padded steps give the unpadded engine's tokens. On a GPU the
graphs are captured and replayed (the cuda-marked test)."""

from __future__ import annotations

import pytest
import torch

from gptj import policy
from gptj.decode import GenerationConfig
from gptj.engine import Engine, EngineConfig
from gptj.engine import attention as att
from gptj.engine.graphs import BUCKETS, GraphRunner, bucket_for
from test_attention_backends import DEVICE, SHORT_MIXED, needs_gpu, needs_triton
from test_attention_backends import two_heads  # noqa: F401 - the fixture (the interpreter's tests: half the programs)
from test_engine import MIXED, prompts_of
from test_engine import model  # noqa: F401 - the fixture

pytestmark = pytest.mark.cuda  # gpu_check.py's tests step (-m cuda)


def test_a_step_goes_to_the_smallest_bucket_that_holds_it():
    assert [bucket_for(n, 512) for n in (1, 2, 3, 5, 9, 17, 33, 100, 512)] == [1, 2, 4, 8, 16, 24, 48, 128, 512]
    assert bucket_for(17, 20) == 20 and bucket_for(20, 20) == 20  # max_seqs is the last bucket
    # drafts' rows past max_seqs (the batch holds up to max_rows): max_seqs stays a bucket, then BUCKETS on
    assert [bucket_for(n, 100, 20) for n in (3, 17, 20, 21, 33, 97)] == [4, 20, 20, 24, 48, 100]
    assert list(BUCKETS) == sorted(BUCKETS)


def graphed(net, capture: bool, **config) -> Engine:
    """An engine on the cuda attention backend whose decode-only steps run through a GraphRunner."""
    engine = Engine(net, EngineConfig(block_size=8, kernels="off", **config))
    engine.runner.attention = backend = att.make_backend(policy.AttentionPath("cuda", False))
    engine.runner.graphs = GraphRunner(net, engine.runner.kv, backend, engine.runner.batch, capture=capture)
    return engine


@needs_triton
def test_padded_bucketed_decode_steps_give_the_unpadded_tokens(two_heads, monkeypatch):  # noqa: F811 - the fixture
    """Greedy, sampled and beam requests (up to 10 rows a step, padded up to buckets of 1 to 16)
    give the tokens of the same engine without graphs; the scratch block is the pool's extra one."""
    model = two_heads
    prompts = prompts_of([5, 17, 1, 30, 8, 12])
    engine = graphed(model.to(DEVICE), capture=False, max_seqs=16)
    seen = []
    forward = engine.runner.graphs.forward
    monkeypatch.setattr(engine.runner.graphs, "forward", lambda rows: seen.append(rows) or forward(rows))
    assert engine.runner.kv.k[0].shape[0] == engine.plan.n_blocks + 1
    got = engine.generate(prompts, SHORT_MIXED)
    # the reference backend's tokens (the cuda backend's, unpadded: test_attention_backends)
    assert got == Engine(model, EngineConfig(block_size=8, kernels="off", max_seqs=16)).generate(prompts, SHORT_MIXED)
    assert seen and {bucket_for(n, 16) for n in seen} - set(seen)  # decode steps ran padded
    assert set(engine.runner.graphs.buckets) == {bucket_for(n, 16) for n in seen}


@needs_triton
def test_a_llamas_padded_bucketed_decode_steps_give_the_unpadded_tokens(monkeypatch):
    """The same for a Llama with grouped-query attention (4 query heads on 1 KV head: the Triton decode
    kernel's lanes are a group's rows x a KV head's query heads): greedy, sampled and beam requests,
    padded to buckets, give the tokens of the reference backend's engine without graphs."""
    from test_engine_llama import tiny as tiny_llama

    model = tiny_llama(kv=1)
    prompts = [[t % 200 for t in p] for p in prompts_of([5, 17, 1, 30, 8, 12])]  # (its 200-id vocabulary)
    engine = graphed(model.to(DEVICE), capture=False, max_seqs=16)
    seen = []
    forward = engine.runner.graphs.forward
    monkeypatch.setattr(engine.runner.graphs, "forward", lambda rows: seen.append(rows) or forward(rows))
    gens = [g.replace(eos_token_id=1, pad_token_id=1) for g in SHORT_MIXED]
    got = engine.generate(prompts, gens)
    assert got == Engine(model, EngineConfig(block_size=8, kernels="off", max_seqs=16)).generate(prompts, gens)
    assert seen and {bucket_for(n, 16) for n in seen} - set(seen)  # decode steps ran padded


@needs_triton
def test_a_step_with_prefill_replays_the_decode_graph_and_runs_its_chunks_in_one_forward(
        two_heads, monkeypatch):  # noqa: F811 - the fixture
    """Requests arriving while others decode, prompts cut into chunks of a shared 8-token budget (two
    chunks in some steps): such a step replays the decode rows' graph and runs all its chunks in one
    eager forward; every request gets the tokens of the engine without graphs."""
    model = two_heads
    prompts, gens = prompts_of([5, 17, 30, 12]), [g.replace(max_new_tokens=4) for g in SHORT_MIXED[:4]]
    engine = graphed(model.to(DEVICE), capture=False, max_seqs=16, prefill_chunk=8)
    calls, step_calls = [], []
    forward, eager = engine.runner.graphs.forward, engine.runner._forward
    monkeypatch.setattr(engine.runner.graphs, "forward", lambda rows: calls.append("graph") or forward(rows))
    monkeypatch.setattr(engine.runner, "_forward",
                        lambda d, p, out: calls.append(("eager", len(d), len(p))) or eager(d, p, out))
    reqs = []
    for i, (prompt, gen) in enumerate(zip(prompts, gens)):
        reqs.append(engine.add_request(prompt, gen))
        if i % 2:  # two at a time, then two steps before the next two
            for _ in range(2):
                calls.clear()
                engine.step()
                step_calls.append(list(calls))
    while engine.requests:
        calls.clear()
        engine.step()
        step_calls.append(list(calls))
    want = Engine(model, EngineConfig(block_size=8, kernels="off", max_seqs=16)).generate(prompts, gens)
    assert [r.output for r in reqs] == want
    mixed = [c for c in step_calls if "graph" in c and any(e != "graph" and e[2] for e in c)]
    assert mixed and all(c == [c[0], "graph", ("eager", 0, c[2][2])] and c[0][2] == 0 for c in mixed)
    assert any(c[2][2] > 1 for c in mixed)  # two chunks shared a forward


@needs_triton
def test_a_drafts_rows_ride_in_the_decode_graphs_bucket(two_heads, monkeypatch):  # noqa: F811 - the fixture
    """Speculating requests (an oracle's drafts, some wrong): a step of decode rows and drafts' rows
    alone runs from the graph runner, padded to a bucket past max_seqs where the drafts' rows need
    one (the rows drafts may add, KVPlan.draft_rows), and every request gets the engine's tokens
    without drafts."""
    from gptj.engine import scheduler as scheduler_module
    from test_speculate import Oracle

    model = two_heads.to(DEVICE)
    prompts = prompts_of([5, 17, 9])
    gen = GenerationConfig(max_new_tokens=10, eos_token_id=None)
    plain = Engine(model, EngineConfig(block_size=8, kernels="off", max_seqs=2)).generate(prompts, gen)
    oracle = Oracle({tuple(p): out for p, out in zip(prompts, plain)}, model.config.vocab_size)
    monkeypatch.setattr(scheduler_module, "ngram_draft", oracle)
    engine = graphed(model, capture=False, max_seqs=2)
    seen = []
    forward = engine.runner.graphs.forward
    monkeypatch.setattr(engine.runner.graphs, "forward", lambda rows: seen.append(rows) or forward(rows))
    assert engine.generate(prompts, gen.replace(prompt_lookup_num_tokens=4)) == plain
    assert engine.stats().accepted_tokens == oracle.accepted > 0
    assert max(seen) > 2 and bucket_for(max(seen), engine.runner.batch.max_rows, 2) in engine.runner.graphs.buckets


def test_graphs_need_the_cuda_backend(model):  # noqa: F811 - the fixture
    engine = Engine(model, EngineConfig(kernels="off"))
    with pytest.raises(ValueError, match="needs the cuda attention backend, not 'reference'"):
        GraphRunner(model, engine.runner.kv, engine.runner.attention, engine.runner.batch, capture=False)
    assert engine.runner.graphs is None  # CPU: no graphs unless asked
    with pytest.raises(Exception, match="cuda_graphs must be one of auto, off"):
        EngineConfig(cuda_graphs="on")


@needs_gpu
def test_captured_graphs_replay_the_eager_steps_tokens(model):  # noqa: F811 - the fixture
    """On CUDA the engine captures a graph per bucket and gives the tokens of eager steps."""
    cuda = model.to("cuda")
    prompts = prompts_of([5, 17, 1, 30, 8, 12])
    engine = Engine(cuda, EngineConfig(max_seqs=16, block_size=8))
    assert engine.runner.graphs is not None and engine.attention.name == "cuda"
    got = engine.generate(prompts, MIXED)
    assert engine.runner.graphs.captured > 0
    eager = Engine(cuda, EngineConfig(max_seqs=16, block_size=8, cuda_graphs="off"))
    assert eager.runner.graphs is None and got == eager.generate(prompts, MIXED)
    greedy = GenerationConfig(max_new_tokens=8)
    assert Engine(cuda, EngineConfig(max_seqs=4)).generate(prompts[:1], greedy) == \
        eager.generate(prompts[:1], greedy)


@needs_gpu
def test_a_llamas_captured_graphs_replay_the_eager_steps_tokens():
    """The same for a Llama with grouped-query attention (2 KV heads for 4 query heads)."""
    from test_engine_llama import tiny as tiny_llama

    cuda = tiny_llama(kv=2).to("cuda")
    prompts = [[t % 200 for t in p] for p in prompts_of([5, 17, 1, 30, 8, 12])]
    gens = [g.replace(eos_token_id=1, pad_token_id=1) for g in MIXED]
    engine = Engine(cuda, EngineConfig(max_seqs=16, block_size=8))
    assert engine.runner.graphs is not None and engine.attention.name == "cuda"
    got = engine.generate(prompts, gens)
    assert engine.runner.graphs.captured > 0
    eager = Engine(cuda, EngineConfig(max_seqs=16, block_size=8, cuda_graphs="off"))
    assert got == eager.generate(prompts, gens)


def run_with_a_broken_kernel(model, monkeypatch, caplog, kernel: str, message: str) -> Engine:  # noqa: F811
    """A graphed engine whose gptj.engine.attention.cuda.<kernel> raises RuntimeError(message): it
    generates the reference's tokens; -> the engine (its flags), the warnings in caplog."""
    import logging

    from gptj.engine.attention import cuda

    def broken(*args, **kwargs):
        raise RuntimeError(message + "\nmore detail")

    prompts = prompts_of([5, 17, 1])
    engine = graphed(model.to(DEVICE), capture=False, max_seqs=16)
    monkeypatch.setattr(cuda, kernel, broken)
    with caplog.at_level(logging.WARNING):
        got = engine.generate(prompts, SHORT_MIXED[:3])
    reference = Engine(model, EngineConfig(block_size=8, kernels="off", max_seqs=16))
    assert got == reference.generate(prompts, SHORT_MIXED[:3])
    return engine


@needs_triton
def test_a_kernel_that_fails_falls_back_to_the_reference_with_one_warning(two_heads, monkeypatch, caplog):  # noqa: F811
    """A Triton kernel that cannot run (another Triton, another GPU): one warning, the reference
    backend's forms from then on, unpadded steps, and the reference's tokens."""
    engine = run_with_a_broken_kernel(two_heads, monkeypatch, caplog, "paged_decode", "PTX not supported")
    assert not engine.attention.kernel_ok and not engine.runner.graphs.ready
    assert caplog.text.count("the Triton decode kernel failed (RuntimeError: PTX not supported)") == 1


@needs_triton
def test_a_store_kernel_that_fails_leaves_decode_and_graphs_to_the_kernels(
        two_heads, monkeypatch, caplog):  # noqa: F811 - the fixture
    """The store kernel failing sends only the stores back to indexing (one warning): the decode
    kernel and the graphs go on, and the tokens are the reference's."""
    engine = run_with_a_broken_kernel(two_heads, monkeypatch, caplog, "store_kv", "no e4m3 here")
    assert not engine.attention.store_ok and engine.attention.kernel_ok and engine.runner.graphs.ready
    assert caplog.text.count("the Triton store kernel failed (RuntimeError: no e4m3 here)") == 1


@needs_triton
def test_warming_makes_every_bucket_of_the_groups_rows_and_changes_no_tokens(two_heads):  # noqa: F811 - the fixture
    """Engine.warm runs a short request of the kind and every bucket's padding-only step for groups
    of num_beams rows; only the scratch block is written by the padding steps, the prefix cache and
    the counts start afresh, and the engine then gives the tokens of one never warmed."""
    model = two_heads
    prompts = prompts_of([5, 17])  # 8 beam rows: the largest bucket, full
    beams = GenerationConfig(max_new_tokens=4, num_beams=4, early_stopping=True)
    engine = graphed(model.to(DEVICE), capture=False, max_seqs=8)
    graphs, kv = engine.runner.graphs, engine.runner.kv
    # the short request's one decode step made bucket 4; the warm-up the others that hold 4-row groups
    assert engine.warm(beams) == 1 and sorted(graphs.buckets) == [b for b in BUCKETS if 4 <= b <= 8]
    assert engine.kv.cached == 0 and engine.steps == 0 and engine.stats().prefix_queried_tokens == 0
    before = [t.clone() for t in kv.stacked]
    assert graphs.warm(4) == 0  # all made: nothing more to do
    graphs.buckets.clear()
    graphs.warm(4)
    changed = {int(b) for t, t0 in zip(kv.stacked, before) for b in (t != t0).flatten(2).any(-1).any(0).nonzero()}
    assert changed <= {engine.plan.n_blocks}  # the scratch block only
    fresh = Engine(model, EngineConfig(block_size=8, kernels="off", max_seqs=8))
    assert engine.generate(prompts, beams) == fresh.generate(prompts, beams)
    # greedy and sampled rows (groups of 1: steps of another tile than the warmed one's)
    assert engine.generate(prompts[:2], SHORT_MIXED[:2]) == fresh.generate(prompts[:2], SHORT_MIXED[:2])


@needs_gpu
def test_warming_captures_the_graphs_before_the_steps_need_them(model):  # noqa: F811 - the fixture
    engine = Engine(model.to("cuda"), EngineConfig(max_seqs=16, block_size=8))
    engine.warm(GenerationConfig(max_new_tokens=4))
    captured = engine.runner.graphs.captured
    assert captured >= len([b for b in BUCKETS if b <= 16])
    engine.generate(prompts_of([5, 17, 1]), GenerationConfig(max_new_tokens=6))
    assert engine.runner.graphs.captured == captured


@needs_triton
def test_a_failed_capture_leaves_that_bucket_eager_and_the_others_graphed(model, monkeypatch):  # noqa: F811
    """Warming goes largest bucket first; a capture that fails (logged) leaves only that bucket's steps
    eager (the runner runs them so), the other buckets are still warmed; other errors are raised."""
    from gptj.engine.graphs import CaptureFailed

    engine = graphed(model.to(DEVICE), capture=False, max_seqs=8)
    graphs = engine.runner.graphs
    forward = graphs.forward
    sizes = []

    def capture_fails_at_8(rows, size=None, group_rows=1):
        sizes.append(size)
        if size == 8:
            graphs.fallbacks.off[(8, 1)] = RuntimeError("capture failed")  # what forward does when a capture fails
            raise CaptureFailed("capture failed")
        return forward(rows, size, group_rows)

    monkeypatch.setattr(graphs, "forward", capture_fails_at_8)
    assert graphs.warm(1) == len([b for b in BUCKETS if b <= 8]) - 1 and graphs.ready
    assert sizes == sorted(sizes, reverse=True)  # largest first
    monkeypatch.setattr(graphs, "forward", forward)
    with pytest.raises(CaptureFailed):
        forward(7)  # (7 rows of one sequence each: the 8 bucket)
    # the runner runs such a step eagerly: the tokens of an engine without graphs
    prompts = prompts_of([5, 17, 1, 30, 8])  # 5 rows: the 8 bucket
    gen = GenerationConfig(max_new_tokens=2)
    assert engine.generate(prompts, gen) == Engine(model, EngineConfig(block_size=8, kernels="off", max_seqs=8)
                                                   ).generate(prompts, gen)
    monkeypatch.setattr(graphs, "forward", lambda *args: 1 / 0)
    graphs.buckets.clear()
    with pytest.raises(ZeroDivisionError):
        graphs.warm(1)


def test_build_engine_warms_only_where_graphs_are_captured(model, monkeypatch):  # noqa: F811
    """runtime.build_engine(warm=gen) warms the engine for gen where its decode steps replay graphs
    (CUDA), and leaves a CPU engine as built (no request run, nothing captured)."""
    from gptj.runtime.build import build_engine

    warmed = []
    monkeypatch.setattr(Engine, "warm", lambda self, gen: warmed.append(gen))
    gen = GenerationConfig(max_new_tokens=2)
    model = model.to("cpu")  # the module's model: earlier tests here moved it to the GPU, where graphs are captured
    engine = build_engine(model, EngineConfig(max_seqs=4), warm=gen)
    assert engine.runner.graphs is None and warmed == [] and engine.steps == 0
    init = Engine.__init__

    def with_graphs(self, *args, **kwargs):  # noqa: ANN002, ANN003 - Engine's
        init(self, *args, **kwargs)
        self.runner.graphs = object()  # as on CUDA

    monkeypatch.setattr(Engine, "__init__", with_graphs)
    monkeypatch.setattr(Engine, "probe", lambda self: None)  # (its step would replay the stand-in graphs)
    build_engine(model, EngineConfig(max_seqs=4), warm=gen)
    assert warmed == [gen]
    build_engine(model, EngineConfig(max_seqs=4))
    assert warmed == [gen]


@needs_triton
def test_a_graphed_step_reads_only_its_buckets_buffers_the_kv_pool_the_weights_and_its_own_results(
        two_heads, monkeypatch):  # noqa: F811 - the fixture
    """What a captured step reads at replay is what it read at capture: the bucket's rows of the
    engine's persistent input buffers (engine/input_batch.py, refilled each step), the KV pool, the weights, or tensors the step itself made. A tensor
    made before the forward outside those (a table built per step, a stale index) would be baked into
    the graph. Every torch op's and every Triton launch's tensor inputs of the eager padded steps
    (the same code, from the same buffers) are checked against those storages."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from torch.utils._pytree import tree_leaves
    from triton.runtime.interpreter import InterpretedFunction

    model = two_heads.to(DEVICE)
    engine = graphed(model, capture=False, max_seqs=8)
    graphs, kv = engine.runner.graphs, engine.runner.kv

    def storages(tensors) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}

    fixed = storages([*model.parameters(), *model.buffers(), *kv.k, *kv.v, *kv.stacked])
    stray: list[str] = []
    made: set[int] = set()

    def check(what: str, args) -> None:
        for t in tree_leaves(args):
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in fixed | made:
                stray.append(f"{what}: {t.dtype} {tuple(t.shape)}")

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            check(str(func), (args, kwargs))
            out = func(*args, **(kwargs or {}))
            made.update(storages(tree_leaves(out)))
            return out

    launch = InterpretedFunction.run

    def kernel(self, *args, grid, warmup, **kwargs):  # noqa: ANN001
        check(self.fn.__name__, (args, kwargs))
        with _disable_current_modes():  # the interpreter's own tensor work is not the step's
            return launch(self, *args, grid=grid, warmup=warmup, **kwargs)

    run = graphs._run

    def checked_run(step):  # noqa: ANN001
        fixed.update(storages([graphs.batch.longs.device_tensor, graphs.batch.ints.device_tensor]))
        made.clear()
        monkeypatch.setattr(InterpretedFunction, "run", kernel)
        try:
            with Reads():
                return run(step)
        finally:
            monkeypatch.setattr(InterpretedFunction, "run", launch)

    monkeypatch.setattr(graphs, "_run", checked_run)
    got = engine.generate(prompts_of([5, 17, 9]), [GenerationConfig(max_new_tokens=3),
                                                   GenerationConfig(num_beams=2, max_new_tokens=3),
                                                   GenerationConfig(max_new_tokens=3, do_sample=True, seed=1)])
    assert all(len(t) == 3 for t in got) and graphs.buckets
    assert not stray, "a graphed step reads tensors made before it:\n" + "\n".join(sorted(set(stray)))
