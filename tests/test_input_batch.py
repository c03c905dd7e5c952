"""engine/input_batch.py: the decode rows kept from step to step hold, at every step, what the runner
built from the requests themselves before them (their tokens, positions, write slots, block tables),
through joins, leavers, preemption, stalls, beams reordered and copied on write, chunked prefill and
prefix sharing; and a step whose requests did not change writes no row afresh."""

from __future__ import annotations

import pytest

from gptj.decode import GenerationConfig, generate
from gptj.engine import Engine, EngineConfig
from gptj.engine import scheduler as scheduler_module
from test_engine import model, prompts_of  # noqa: F401 - the fixture
from test_speculate import Oracle

B = 8


def from_requests(sched, stairs: bool = False) -> tuple[list, ...]:
    """The step's decode rows built from its requests' own state, as the runner built them each step
    before the batch: tokens, positions, write blocks and offsets, and per group (shared blocks,
    shared tokens, each row's own blocks, own tokens); then each verified request's token i (its
    next token, then its draft) at position L + i, over L + i + 1 tokens: a group of one row each, or
    with `stairs` (the backend's) one group, the full blocks before L shared and each row's own
    tokens (a list) one more than the last's."""
    ids, pos, wb, wo, groups = [], [], [], [], []
    decode = list(sched.decode)
    for req in decode:
        L = req.seqs[0].length
        if req.n_seqs == 1:
            groups.append((req.seqs[0].blocks, L + 1, [[]], 0))
        else:
            s = req.shared
            groups.append((req.seqs[0].blocks[:s], s * B, [q.blocks[s:] for q in req.seqs], L + 1 - s * B))
        for seq in req.seqs:
            wb.append(seq.blocks[L // B])
            wo.append(L % B)
        pos += [L] * req.n_seqs
        ids += req.next_tokens
    for v in sched.verify:
        (seq,) = v.request.seqs
        L, k = seq.length, len(v.tokens)
        if stairs:  # one group: the full blocks before L shared, each row one more own token than the last
            s = L // B
            groups.append((seq.blocks[:s], s * B, [seq.blocks[s:][:-(-(L + 1 + i - s * B) // B)] for i in range(k)],
                           [L + 1 + i - s * B for i in range(k)]))
        for i, token in enumerate(v.tokens):
            at = L + i
            if not stairs:
                groups.append((seq.blocks[:-(-(at + 1) // B)], at + 1, [[]], 0))
            wb.append(seq.blocks[at // B])
            wo.append(at % B)
            pos.append(at)
            ids.append(token)
    return ids, pos, wb, wo, groups


def held(batch) -> tuple[list, ...]:
    """The same, read back from what the batch hands a forward (its DecodeTables as the kernels read
    them: a group's shared blocks from stab at soff, each row's own from its row of otab)."""
    step = batch.step()
    t = step.decode.tables
    row0, soff, slen, olen = (x.tolist() for x in (t.row0, t.soff, t.slen, t.olen))
    stair = t.stair.tolist() if t.stair is not None else [0] * len(soff)
    stab, otab = t.stab.tolist(), t.otab.tolist()

    def own(g):  # each row's own tokens: one count for all, or (stairs) a list
        lens = [olen[g] + (r - row0[g]) * stair[g] for r in range(row0[g], row0[g + 1])]
        return lens if stair[g] else olen[g]

    groups = [(stab[soff[g]:soff[g] - (-slen[g] // B)], slen[g],
               [otab[r][:-(-(olen[g] + (r - row0[g]) * stair[g]) // B)] for r in range(row0[g], row0[g + 1])], own(g))
              for g in range(len(soff))]
    assert t.otab.shape[0] == len(row0) - 1 + sum(len(own) - 1 for _, _, own, _ in groups)  # a row per sequence
    return (step.ids.tolist(), step.positions.tolist(), step.decode.write_blocks.tolist(),
            step.decode.write_offsets.tolist(), groups)


def checked(engine, monkeypatch) -> dict[str, int]:
    """After every update of the engine's batch: it holds what the requests hold. -> counts of what
    the steps did (rows moved past freed or taken rows, decode steps checked)."""
    batch, seen = engine.runner.batch, {"moved": 0, "steps": 0}
    update = batch.update

    def update_and_check(sched, **kwargs):
        before = dict(batch.rows)
        update(sched, **kwargs)
        if sched.decode or sched.verify:
            assert held(batch) == from_requests(sched, batch.stairs)
            seen["steps"] += 1
            seen["verified"] = seen.get("verified", 0) + len(sched.verify)
        seen["moved"] += any(before.get(req, row) != row for req, row in batch.rows.items())

    monkeypatch.setattr(batch, "update", update_and_check)
    return seen


def test_the_rows_hold_the_requests_state_through_preemption_beams_and_chunks(model, monkeypatch):  # noqa: F811
    prompts = prompts_of([30, 12, 25, 7, 18, 33, 9, 21], seed=4)
    gens = [GenerationConfig(max_new_tokens=14, eos_token_id=None),
            GenerationConfig(max_new_tokens=10, num_beams=3, eos_token_id=None),
            GenerationConfig(max_new_tokens=12, do_sample=True, seed=5, eos_token_id=None),
            GenerationConfig(max_new_tokens=9, eos_token_id=None)] * 2
    need = max(Engine(model, EngineConfig(max_seqs=4, block_size=B)).blocks_needed(len(p), g)
               for p, g in zip(prompts, gens))
    engine = Engine(model, EngineConfig(max_seqs=16, block_size=B, kv_blocks=need + 2, prefill_chunk=16))
    seen = checked(engine, monkeypatch)
    reqs = [engine.add_request(p, g) for p, g in zip(prompts, gens)]
    aborted = engine.add_request(prompts[3], GenerationConfig(max_new_tokens=30, eos_token_id=None))
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == 6:
            assert engine.abort(aborted.request_id)  # a leaver the scheduler did not retire
    assert [r.output for r in reqs] == [generate(model, [p], g)[0] for p, g in zip(prompts, gens)]
    assert engine.stats().preemptions > 0 and seen["moved"] > 0 and seen["steps"] > 10


def test_the_rows_hold_the_requests_state_with_prompt_blocks_shared_from_the_prefix_cache(model, monkeypatch):  # noqa: F811
    """Requests arriving while another decodes, their prompts starting with its first three blocks
    (found in the prefix cache): a greedy one and a beam one, whose beams share them too."""
    first = prompts_of([30], seed=6)[0]
    later = [first[:24] + tail for tail in prompts_of([5, 11], seed=7)]
    gens = [GenerationConfig(max_new_tokens=12, eos_token_id=None), GenerationConfig(max_new_tokens=8, eos_token_id=None),
            GenerationConfig(max_new_tokens=8, num_beams=2, eos_token_id=None)]
    engine = Engine(model, EngineConfig(max_seqs=8, block_size=B, prefill_chunk=16))
    seen = checked(engine, monkeypatch)
    reqs = [engine.add_request(first, gens[0])]
    for _ in range(3):
        engine.step()
    reqs += [engine.add_request(p, g) for p, g in zip(later, gens[1:])]
    while engine.has_work:
        engine.step()
    assert [r.output for r in reqs] == [generate(model, [p], g)[0] for p, g in zip([first, *later], gens)]
    assert engine.stats().prefix_hit_tokens == 2 * 24 and seen["steps"] > 5


def test_the_rows_hold_the_requests_state_while_a_younger_request_stalls(model, monkeypatch):  # noqa: F811
    """A stalled request leaves the rows for the steps it waits, and comes back where it was (before
    the rows of a younger request), its tables written afresh."""
    prompts = prompts_of([16, 16, 5], seed=31)
    beams = GenerationConfig(max_new_tokens=24, num_beams=3, eos_token_id=None)
    need = Engine(model, EngineConfig(max_seqs=8, block_size=B)).blocks_needed(16, beams)
    engine = Engine(model, EngineConfig(max_seqs=8, block_size=B, kv_blocks=need + need // 2 + 2, prefix_caching=False))
    seen = checked(engine, monkeypatch)
    gens = [beams, beams, GenerationConfig(max_new_tokens=30, eos_token_id=None)]
    reqs = [engine.add_request(p, g) for p, g in zip(prompts, gens)]
    while engine.has_work:
        engine.step()
    # (the tokens are those of each alone: test_engine_paged's stall test)
    assert all(len(r.output) == g.max_new_tokens for r, g in zip(reqs, gens))
    assert engine.stats().stalls > 0 and seen["moved"] > 0


@pytest.mark.parametrize("gen", [GenerationConfig(max_new_tokens=6, eos_token_id=None),
                                 GenerationConfig(max_new_tokens=6, num_beams=2, eos_token_id=None)],
                         ids=["greedy", "beams"])
def test_steps_with_the_same_requests_write_no_row_afresh(model, monkeypatch, gen):  # noqa: F811
    """Requests that decode side by side from step to step are written into the rows once, when they
    join: the steps after change what changed (tokens, positions, new blocks, beams reordered)."""
    engine = Engine(model, EngineConfig(max_seqs=8, block_size=B))
    batch, written, regrouped = engine.runner.batch, [], []
    write, regroup = batch._write, batch._regroup
    monkeypatch.setattr(batch, "_write", lambda req, row, draft=0: written.append(req) or write(req, row, draft))
    monkeypatch.setattr(batch, "_regroup", lambda reqs, drafts: regrouped.append(len(reqs)) or regroup(reqs, drafts))
    prompts = prompts_of([13, 13, 13], seed=2)
    assert engine.generate(prompts, gen) == [generate(model, [p], gen)[0] for p in prompts]
    assert engine.steps == 1 + gen.max_new_tokens - 1  # a prefill, then a decode step per later token
    assert regrouped == [3] and len(written) == 3  # they joined at the first decode step, together


@pytest.mark.parametrize("stairs", [True, False], ids=["staired", "a-group-a-row"])
def test_the_rows_hold_the_drafts_beside_decoding_requests(model, monkeypatch, stairs):  # noqa: F811
    """Speculating requests (their drafts a row a token, engine/scheduler.Verify; drafted by an oracle
    that knows the answers and spoils every other draft) among greedy and beam ones that decode,
    through a small pool (preemption) and chunked prefill: each step's rows hold what the requests
    hold, a request's rows written afresh when it verifies and the step after; the tokens are those
    decoding one at a time gives. Both layouts: a draft's rows one staired group (the reference and
    native backends) or a group a row (the CUDA backend's)."""
    prompts = prompts_of([30, 12, 25, 7, 18, 33, 9, 21], seed=12)
    spec = GenerationConfig(max_new_tokens=16, eos_token_id=None, prompt_lookup_num_tokens=4)
    gens = [spec, GenerationConfig(max_new_tokens=10, num_beams=3, eos_token_id=None), spec,
            GenerationConfig(max_new_tokens=9, eos_token_id=None)] * 2
    plain = [generate(model, [p], g.replace(prompt_lookup_num_tokens=None))[0] for p, g in zip(prompts, gens)]
    oracle = Oracle({tuple(p): out for p, out in zip(prompts, plain)}, model.config.vocab_size)
    monkeypatch.setattr(scheduler_module, "ngram_draft", oracle)
    need = max(Engine(model, EngineConfig(max_seqs=4, block_size=B)).blocks_needed(len(p), g)
               for p, g in zip(prompts, gens))
    engine = Engine(model, EngineConfig(max_seqs=8, block_size=B, kv_blocks=need + 2, prefill_chunk=16))
    monkeypatch.setattr(engine.runner.attention, "stairs", stairs)  # (the reference backend computes either)
    seen = checked(engine, monkeypatch)
    reqs = [engine.add_request(p, g) for p, g in zip(prompts, gens)]
    while engine.has_work:
        engine.step()
    assert [r.output for r in reqs] == plain
    stats = engine.stats()
    assert seen["verified"] > 5 and stats.draft_tokens > stats.accepted_tokens > 0 and stats.preemptions + stats.stalls > 0
