"""Paged KV memory: block tables, sharing between beams and between requests, preemption, eviction."""

import pytest
import torch

from gptj.config import GPTJConfig
from gptj.decode import GenerationConfig, generate
from gptj.engine import Engine, EngineConfig
from gptj.engine import attention as att
from gptj.engine.kv import KVCacheManager, block_keys
from gptj.policy import attention_path
from test_engine import CFG, MIXED, all_free, held_blocks, prompts_of  # noqa: F401 - the model fixture too
from test_engine import model  # noqa: F401

GREEDY = GenerationConfig(max_new_tokens=10, eos_token_id=None)


def test_many_lengths_together_equal_each_alone_across_block_boundaries(model):
    # lengths below, at and across block boundaries (block_size 8), with every kind of request
    lengths = [1, 7, 8, 9, 16, 23, 31, 40, 3]
    prompts = prompts_of(lengths, seed=3)
    gens = (MIXED * 2)[:len(lengths)]
    engine = Engine(model, EngineConfig(max_seqs=32, block_size=8))
    together = engine.generate(prompts, gens)
    assert max(engine.decode_batch_sizes) > 6
    for prompt, gen, got in zip(prompts, gens, together):
        assert got == generate(model, [prompt], gen)[0]
    assert all_free(engine)


def test_beams_share_their_prompt_blocks_and_own_what_they_write(model):
    engine = Engine(model, EngineConfig(max_seqs=8, block_size=8, prefix_caching=False))
    req = engine.add_request(prompts_of([20])[0], GenerationConfig(max_new_tokens=12, num_beams=4, eos_token_id=None))
    engine.step()  # prefill (3 blocks for 20 tokens), then the first token: 4 beams on the same blocks
    assert len(req.seqs) == 4 and all(s.blocks == req.seqs[0].blocks for s in req.seqs)
    assert len(req.seqs[0].blocks) == 3 and held_blocks(engine) == 3
    engine.step()  # the first decode step writes into the partial block: 3 beams copy it first
    assert len(req.seqs) == 4 and req.shared == 2
    shared = req.seqs[0].blocks[:2]
    assert all(s.blocks[:2] == shared for s in req.seqs) and all(engine.kv.ref[b] == 4 for b in shared)
    # the prompt's partial last block was copied on write; after the step, beams that continue the
    # same beam share its block again (held once per beam) until one of them writes
    own = [s.blocks[2] for s in req.seqs]
    assert all(engine.kv.ref[b] == own.count(b) for b in own)
    assert held_blocks(engine) == 2 + len(set(own))  # not 4 copies of the prompt
    while not req.done:
        engine.step()
    assert req.output == generate(model, [req.prompt], req.gen)[0]
    assert all_free(engine)


def test_more_requests_than_blocks_wait_or_are_preempted_and_all_complete(model):
    prompts = prompts_of([30, 12, 25, 7, 18, 33, 9, 21], seed=4)
    gens = [GenerationConfig(max_new_tokens=14, eos_token_id=None),
            GenerationConfig(max_new_tokens=10, num_beams=3, eos_token_id=None),
            GenerationConfig(max_new_tokens=12, do_sample=True, seed=5, eos_token_id=None),
            GenerationConfig(max_new_tokens=9, eos_token_id=None)] * 2
    need = max(Engine(model, EngineConfig(max_seqs=4, block_size=8)).blocks_needed(len(p), g)
               for p, g in zip(prompts, gens))
    engine = Engine(model, EngineConfig(max_seqs=16, block_size=8, kv_blocks=need + 2))
    reqs = [engine.add_request(p, g) for p, g in zip(prompts, gens)]
    most_running = 0
    while engine.has_work:
        engine.step()
        most_running = max(most_running, engine.stats().running)
        engine.kv.check()
    assert [r.output for r in reqs] == [generate(model, [p], g)[0] for p, g in zip(prompts, gens)]
    assert most_running >= 2 and engine.stats().preemptions > 0  # memory ran out while they grew
    assert all_free(engine)


def test_cancel_returns_every_block(model):
    engine = Engine(model, EngineConfig(max_seqs=8, block_size=8))
    other = engine.add_request(prompts_of([11], seed=9)[0], GenerationConfig(max_new_tokens=30, eos_token_id=None))
    engine.step()
    before = engine.stats().blocks_free
    reqs = [engine.add_request(p, g) for p, g in zip(prompts_of([19, 26], seed=8),
                                                    [GenerationConfig(max_new_tokens=30, num_beams=3), GREEDY])]
    for _ in range(4):
        engine.step()
    assert engine.stats().blocks_free < before
    for r in reqs:
        assert engine.abort(r.request_id)
    assert engine.stats().blocks_free == before and other.status == "running"
    engine.kv.check()


def test_a_shared_prefix_is_computed_once_and_gives_the_same_tokens(model):
    prefix = prompts_of([40], seed=11)[0]
    prompts = [prefix + tail for tail in prompts_of([5, 9, 3], seed=12)]
    no_sharing = Engine(model, EngineConfig(max_seqs=8, block_size=8, prefix_caching=False))
    want = no_sharing.generate(prompts, GREEDY)
    engine = Engine(model, EngineConfig(max_seqs=8, block_size=8))
    got = [engine.generate([p], GREEDY)[0] for p in prompts]  # one after another: the first fills the cache
    assert got == want
    stats = engine.stats()
    # the 40-token prefix is 5 full blocks: computed for the first request only
    assert stats.prefix_hit_tokens == 2 * 40
    assert stats.prefill_tokens == sum(map(len, prompts)) - 2 * 40
    assert no_sharing.stats().prefill_tokens == sum(map(len, prompts))
    # beams reuse it too
    beam = GenerationConfig(max_new_tokens=8, num_beams=2)
    assert engine.generate([prefix + [7, 8]], beam) == no_sharing.generate([prefix + [7, 8]], beam)
    assert engine.stats().prefix_hit_tokens == 3 * 40


def test_a_prompt_found_whole_in_the_cache_still_computes_its_last_token(model):
    prompt = prompts_of([24], seed=13)[0]  # exactly 3 blocks
    engine = Engine(model, EngineConfig(max_seqs=4, block_size=8))
    first = engine.generate([prompt], GREEDY)
    again = engine.generate([prompt], GREEDY)
    assert first == again == generate(model, [prompt], GREEDY)[0:1]
    assert engine.stats().prefix_hit_tokens == 16  # 2 of 3 blocks: the last is computed for its logits


def test_eviction_never_frees_a_block_in_use(model):
    """Memory filled with cached prefixes, then requests that need most of it: old prefixes are
    evicted, held ones never, and every request's tokens are right."""
    engine = Engine(model, EngineConfig(max_seqs=8, block_size=8, kv_blocks=24))
    prefixes = prompts_of([16, 16, 16, 16], seed=20)
    for p in prefixes:  # 8 cached blocks, nobody holds them
        engine.generate([p + [1]], GenerationConfig(max_new_tokens=2))
    assert engine.stats().blocks_cached >= 8 and all_free(engine)
    # a running request shares prefix 0; new ones need more blocks than are uncached
    holder = engine.add_request(prefixes[0] + [2, 3], GenerationConfig(max_new_tokens=40, eos_token_id=None))
    engine.step()
    assert holder.cached_tokens == 16
    shared = holder.seqs[0].blocks[:2]
    others = [engine.add_request(p, GenerationConfig(max_new_tokens=6, eos_token_id=None))
              for p in prompts_of([40, 33, 47], seed=21)]
    while engine.has_work:
        engine.step()
        engine.kv.check()
        if not holder.done:
            assert holder.seqs[0].blocks[:2] == shared and all(engine.kv.ref[b] >= 1 for b in shared)
    assert holder.output == generate(model, [holder.prompt], holder.gen)[0]
    assert [o.output for o in others] == [generate(model, [o.prompt], o.gen)[0] for o in others]


def test_block_manager_lru_and_reference_counts():
    kv = KVCacheManager(4, 2)
    a = kv.allocate(2)
    keys = block_keys([1, 2, 3, 4], 2)
    for b, k in zip(a, keys):
        kv.register(b, k)
    kv.release(a)  # cached, unheld: evicted last, the later block first
    assert kv.free == 4 and kv.lookup(keys) == a
    fresh = kv.allocate(2)  # never-cached blocks go first
    assert set(fresh).isdisjoint(a) and kv.lookup(keys) == a
    kv.hold(a[:1])  # a hit: held again
    (evicted,) = kv.allocate(1)
    assert evicted == a[1] and kv.lookup(keys) == a[:1]  # the held block survives
    with pytest.raises(RuntimeError):
        kv.allocate(1)
    kv.release(fresh + [evicted] + a[:1])
    kv.check()
    with pytest.raises(RuntimeError, match="released more often"):
        kv.release([a[0]])


def test_block_keys_chain_the_whole_prefix():
    a = block_keys([1, 2, 3, 4, 5], 2)
    b = block_keys([9, 2, 3, 4], 2)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different prefix
    assert block_keys([1, 2, 3, 4], 2) == a


def fill_pool(kv, storage: str) -> None:
    """Random keys and values in every block: bfloat16 N(0, 1); or int8 with a power-of-two scale per
    token and head (2^-8 .. 2^-4) and 127 in each head vector, so that q * scale is a bfloat16 number
    (the fallback's gathered bfloat16 and the kernel's float32 see the same values) and storing a
    dequantized vector again gives back the same q and scale."""
    if storage == "bfloat16":
        kv.k[0].normal_()
        kv.v[0].normal_()
        return
    for q, s in ((kv.k[0], kv.k_scale[0]), (kv.v[0], kv.v_scale[0])):
        q.copy_(torch.randint(-127, 128, q.shape, dtype=torch.int8))
        q[..., 0] = 127
        s.copy_(2.0 ** torch.randint(-8, -3, s.shape).float())


def backend_for(kv, head_dim):
    """The engine's attention backend for a bfloat16 model over this pool (kernels "auto")."""
    return att.make_backend(attention_path("cpu", kv.k[0].dtype, "auto", "off", torch.bfloat16, head_dim))


def pool_values(kv, blocks, length):
    """(keys, values) (H, length, D) of a block table in float32: what the pool stands for."""
    if not kv.quantized:
        return (x.float() for x in kv.gather(0, torch.tensor(blocks), length))
    index = torch.tensor(blocks)
    H, D = kv.k[0].shape[1], kv.k[0].shape[3]
    return (att.dequantize_heads(c[index], sc[index], torch.float32).transpose(0, 1).reshape(H, -1, D)[:, :length]
            for c, sc in ((kv.k[0], kv.k_scale[0]), (kv.v[0], kv.v_scale[0])))


@pytest.mark.parametrize("storage", ["bfloat16", "int8"])
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("heads", [(4, 16), (3, 48), (2, 256)], ids=lambda hd: f"{hd[0]}x{hd[1]}")
def test_paged_attention_matches_the_gathered_reference(kernel_path, block_size, heads, storage):
    """Decode attention over scattered blocks (native kernel or the fallback) = attention over the
    same keys gathered into one tensor, in float32 arithmetic, for a bfloat16 model with bfloat16 or
    int8 KV. Head sizes: the test model's 16, one with a 16-wide tail past 32s (48), GPT-J 6B's 256."""
    torch.manual_seed(0)
    H, D, n_blocks = *heads, 40
    cfg = GPTJConfig(n_layer=1, n_embd=H * D, n_head=H, rotary_dim=8, n_inner=4 * H * D, n_positions=256)
    kv = att.PagedKV(cfg, n_blocks, block_size, getattr(torch, storage), "cpu", n_head=H, compute=torch.bfloat16)
    fill_pool(kv, storage)
    perm = torch.randperm(n_blocks).tolist()
    groups = [att.DecodeGroup(perm[:3], 3 * block_size - 5, [[]], 0),  # one sequence, partial last block
              att.DecodeGroup(perm[3:5], 2 * block_size, [perm[5:7], perm[7:9], perm[9:11]], block_size + 3)]
    q = torch.randn(4, H, 1, D, dtype=torch.bfloat16)
    decode = backend_for(kv, D)
    assert (decode.name == "cpu-native") == (kernel_path != "fallback")
    # this step's token: the last of each row (group 0 at 3B - 6: block 2; group 1 at own B + 2: own block 1)
    meta = decode.build(kv, groups, write_blocks=[perm[2], perm[6], perm[8], perm[10]],
                        write_offsets=[block_size - 6, 2, 2, 2])
    batch = att.PagedBatch(kv, decode, meta)
    # write nothing new: this step's k, v are what the blocks already hold at those positions
    now = [[x[:, -1] for x in pool_values(kv, [b], o + 1)]
           for b, o in zip(meta.write_blocks.tolist(), meta.write_offsets.tolist())]
    k_now, v_now = (torch.stack([kv_[i] for kv_ in now])[:, :, None].bfloat16() for i in (0, 1))
    got = batch.attend(0, q, k_now, v_now, None)[:, :, 0].float()
    rows = []
    for g in groups:
        for own in g.own:
            pk, pv = pool_values(kv, g.shared + own, g.shared_len + g.own_len)
            rows.append((pk, pv))
    for n, (k, v) in enumerate(rows):
        qn = q[n, :, 0].float()
        s = (qn[:, None, :] * k).sum(-1) / D ** 0.5  # (H, L)
        p = torch.softmax(s, -1)
        want = (p[..., None] * v).sum(-2)
        # Each path's roundings, at most: scores to bfloat16 (the eager fallback's matmul: 2^-9 of each,
        # delta <= 2^-9 max|s|; the kernels sum in float32, far less), and for int8 blocks on the kernel
        # q to int16 per head (each score by <= sum|k| max|q| / 65534 / sqrt(D)): the probabilities move
        # by factors within e^(+-2 delta), the output by <= 2.01 delta max|v|. Then probabilities rounded
        # to bfloat16 (2^-8 p.|v|), the output's rounding (2^-8 of it), float32 sums (2^-20 max|v|).
        delta = 2.0**-9 * s.abs().amax(-1)
        if storage == "int8" and decode.name == "cpu-native":
            delta = delta + k.abs().sum(-1).amax(-1) * qn.abs().amax(-1) / 65534 / D ** 0.5
        vmax = v.abs().amax((1, 2))[:, None]
        bound = 2.0**-8 * (want.abs() + p @ v.abs()) + (2.01 * delta[:, None] + 2.0**-20) * vmax
        assert ((got[n] - want).abs() <= bound).all(), float(((got[n] - want).abs() / bound).max())


def test_a_request_alone_in_exactly_the_memory_it_can_need_completes(model):
    """kv_blocks = the bound validate() uses: the request never waits on itself (no preemption)."""
    prompt, gen = prompts_of([21], seed=30)[0], GenerationConfig(max_new_tokens=19, num_beams=4, eos_token_id=None)
    need = Engine(model, EngineConfig(max_seqs=4, block_size=8)).blocks_needed(len(prompt), gen)
    engine = Engine(model, EngineConfig(max_seqs=4, block_size=8, kv_blocks=need))
    assert engine.generate([prompt], gen) == generate(model, [prompt], gen)
    assert engine.stats().preemptions == 0 and all_free(engine)
    with pytest.raises(Exception, match="needs"):
        Engine(model, EngineConfig(max_seqs=4, block_size=8, kv_blocks=need - 1)).add_request(prompt, gen)


def test_a_younger_request_waits_for_blocks_keeping_them_and_nothing_is_computed_twice(model):
    """Two beam requests fit at admission but not as they grow: the younger waits (stalls) while
    the older finishes, keeping its blocks; nothing is preempted or recomputed."""
    prompts = prompts_of([16, 16], seed=31)
    gen = GenerationConfig(max_new_tokens=24, num_beams=3, eos_token_id=None)
    need = Engine(model, EngineConfig(max_seqs=8, block_size=8)).blocks_needed(16, gen)
    # the older always fits beside what the younger can hold when the blocks run out
    engine = Engine(model, EngineConfig(max_seqs=8, block_size=8, kv_blocks=need + need // 2, prefix_caching=False))
    reqs = [engine.add_request(p, gen) for p in prompts]
    while engine.has_work:
        engine.step()
        engine.kv.check()
    st = engine.stats()
    assert [r.output for r in reqs] == [generate(model, [p], gen)[0] for p in prompts]
    assert st.stalls > 0 and st.preemptions == 0
    assert st.prefill_tokens == 32  # each prompt computed once
    assert all_free(engine)


@pytest.mark.parametrize("storage", ["bfloat16", "int8"])
@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("heads", [(4, 16), (3, 48), (2, 256)], ids=lambda hd: f"{hd[0]}x{hd[1]}")
@pytest.mark.parametrize("start", [0, 13])
def test_paged_prefill_matches_the_reference(kernel_path, block_size, heads, start, storage):
    """A prompt chunk's causal attention over paged blocks (native kernel or the SDPA fallback) =
    float32 attention over the same keys: from position 0, and after 13 stored tokens; bfloat16 or
    int8 KV (fill_pool's: the chunk's keys stored again come back unchanged). 37 queries span tiles
    of 16 and a partial one."""
    torch.manual_seed(1)
    (H, D), T = heads, 37
    cfg = GPTJConfig(n_layer=1, n_embd=H * D, n_head=H, rotary_dim=8, n_inner=4 * H * D, n_positions=256)
    kv = att.PagedKV(cfg, 40, block_size, getattr(torch, storage), "cpu", n_head=H, compute=torch.bfloat16)
    fill_pool(kv, storage)
    end = start + T
    blocks = torch.randperm(40)[:-(-end // block_size)].tolist()
    if storage == "bfloat16":
        qkv = torch.randn(1, T, 3, H, D, dtype=torch.bfloat16)  # as the fused block's projection lays them out
    else:  # this chunk's keys and values: what the pool holds at its positions (stored again unchanged)
        held = [x.transpose(0, 1)[start:end] for x in pool_values(kv, blocks, end)]  # (T, H, D)
        qkv = torch.stack([torch.randn(T, H, D), *held], 1)[None].bfloat16()
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (1, H, T, D) views
    decode = backend_for(kv, D)
    batch = att.PagedBatch(kv, decode, decode.build(kv, segments=[att.PrefillSegment(blocks, start, T)]))
    got = batch.attend(0, q, k, v, None)[0].float()  # stores k, v at start .. end - 1, then attends
    keys, values = pool_values(kv, blocks, end)  # (H, end, D), this chunk's included
    torch.testing.assert_close(keys[:, start:], k[0].float())
    s = q[0].float() @ keys.transpose(1, 2) / D ** 0.5  # (H, T, end)
    s = s.masked_fill(torch.arange(end)[None, :] > torch.arange(start, end)[:, None], float("-inf"))
    p = torch.softmax(s, -1)
    want = p @ values
    # Probabilities rounded to bfloat16 before the sum over the values (HF's rule; the fallback's SDPA
    # may too): each moves by <= 2^-8 of itself, so the sum by <= 2^-8 p.|v|; then the output's own
    # rounding to bfloat16 (2^-8 of it). Scores and sums in float32 add ~2^-20 of max|v|.
    u = 2.0**-8
    bound = u * (p @ values.abs()) + u * want.abs() + 2.0**-20 * values.abs().max()
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())


def test_blocks_to_admit_is_the_fewest_blocks_free_beyond_the_watermark():
    from gptj.engine.config import admission_watermark, blocks_to_admit

    for needed in (1, 2, 50, 98, 99, 100, 101, 1000, 12345):
        n = blocks_to_admit(needed)
        assert n - admission_watermark(n) >= needed  # room for them beyond what the scheduler keeps free
        assert (n - 1) - admission_watermark(n - 1) < needed  # and no block more


def test_an_engine_sized_by_blocks_to_admit_admits_its_whole_batch_in_one_step(model):
    """The scheduler's admission rule and blocks_to_admit agree: with blocks_to_admit(needed) blocks
    a batch is admitted in one step; with one block fewer its last request waits."""
    from gptj.engine.config import blocks_to_admit

    prompts = prompts_of([20, 9, 31, 14], seed=40)
    gen = GenerationConfig(max_new_tokens=6, eos_token_id=None)
    probe = Engine(model, EngineConfig(max_seqs=4, block_size=8))
    # the last admission binds: every prompt's blocks, and a spare block for the last one's first token
    needed = sum(probe.kv.blocks_for(len(p)) for p in prompts) + 1
    for kv_blocks, admitted in ((blocks_to_admit(needed), 4), (blocks_to_admit(needed) - 1, 3)):
        engine = Engine(model, EngineConfig(max_seqs=4, block_size=8, kv_blocks=kv_blocks, prefix_caching=False))
        reqs = [engine.add_request(p, gen) for p in prompts]
        engine.step()
        assert engine.stats().running == admitted and sum(bool(r.output) for r in reqs) == admitted
