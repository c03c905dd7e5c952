"""gptj.models.llama against transformers' LlamaForCausalLM: logits, greedy decoding, config, state dicts.

Each pair shares random weights drawn with a larger std than HF's 0.02 (0.3; norms 1 + 0.1 noise)
so logits are far from flat. HF runs its eager attention (the float32 math gptj reproduces op for
op) unless a test says otherwise.
"""

from __future__ import annotations

import pytest
import torch

from gptj.errors import CheckpointError, ConfigError
from gptj.generation_config import GenerationConfig
from gptj.models.base import position_ids_from_mask
from gptj.models.llama import LLAMA_3_1_8B, LlamaConfig, build_model, load_hf_state_dict, rope_frequencies

transformers = pytest.importorskip("transformers")

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            head_dim=16, vocab_size=200, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=4096,
            bos_token_id=0, eos_token_id=1)
# With head_dim 16 and theta 5e5 the wavelengths 2 pi / inv_freq are 6.3, 32, 167, 862, 4443, ...:
# against original 2048 / high 4 = 512 and 2048 / low 1 = 2048, three are kept, one blended, four
# slowed down by the factor: every branch of the llama3 rule runs.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 2048}
# (rope scaling, tied embeddings, KV heads): every pair of the three choices occurs once; kv 2 < 4 heads
# is grouped-query attention, kv 4 multi-head.
CASES = [(None, False, 2), (LLAMA3, True, 2), (LLAMA3, False, 4), (None, True, 4)]
IDS = ["plain-untied-gqa", "llama3-tied-gqa", "llama3-untied-mha", "plain-tied-mha"]
U = 2.0 ** -24  # float32's unit roundoff


def hf_dict(scaling=None, tie=False, kv=2) -> dict:
    return {**TINY, "rope_scaling": scaling, "tie_word_embeddings": tie, "num_key_value_heads": kv}


@torch.no_grad()
def make_pair(scaling=None, tie=False, kv=2, attn="eager", seed=0):
    d = hf_dict(scaling, tie, kv)
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in d.items() if k != "model_type"}, attn_implementation=attn)
    hf = transformers.LlamaForCausalLM(hf_cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in hf.named_parameters():  # a tied lm_head is the embedding: drawn once
        noise = torch.randn(p.shape, generator=g)
        p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
    ours = build_model(LlamaConfig.from_hf_dict(d), device="meta")
    load_hf_state_dict(ours, hf.state_dict())
    return ours.eval(), hf


def bound(logits: torch.Tensor, layers: int = 2, reduction: int = 128) -> float:
    """What float32 rounding allows between two evaluations of the same math whose sums may be
    ordered differently: a reordered sum of K terms moves by at most K u times the sum of their
    magnitudes; each layer has three reduction stages (projections, attention, MLP), the head one
    more, each of at most `reduction` terms (here I = 128 > E = 64 > S), taken relative to the
    largest logit (first order, the RMSNorms rescaling each stage to unit size)."""
    return (3 * layers + 1) * reduction * U * float(logits.abs().max())


def left_pad(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(map(len, prompts))
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], mask[b, T - len(p):] = torch.tensor(p), 1
    return ids, mask


PROMPTS = [[5, 17, 42, 99, 3], [7, 150, 23, 64, 88, 120, 9, 31, 77]]  # batch of 2, the first left-padded by 4
NEW = 24


@pytest.mark.parametrize("scaling,tie,kv", CASES, ids=IDS)
def test_float32_logits_match_hf(scaling, tie, kv):
    ours, hf = make_pair(scaling, tie, kv)
    assert torch.equal(ours.inv_freq, hf.model.rotary_emb.inv_freq)  # the same float32 ops: the same bits
    assert (ours.lm_head.weight is ours.transformer.wte.weight) == tie
    ids, mask = left_pad(PROMPTS)
    pos = position_ids_from_mask(mask, ids.shape[1]) + 1500  # far out, where the scaled frequencies turn
    with torch.no_grad():
        got = ours(ids, attention_mask=mask, position_ids=pos)
        want = hf(ids, attention_mask=mask, position_ids=pos).logits
    assert got.dtype == torch.float32 and got.shape == (2, 9, 200)
    real = mask.bool()  # padding positions' logits are nobody's business
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=bound(want))


def test_float32_logits_match_hf_sdpa():
    """HF's default attention (torch SDPA) orders its sums differently: still within float32's bound."""
    ours, hf = make_pair(LLAMA3, False, 2, attn="sdpa")
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        got, want = ours(ids), hf(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=bound(want))


def no_cache_greedy(model, ids: torch.Tensor, mask: torch.Tensor, n: int) -> list[list[int]]:
    """Greedy without a cache: the whole sequence through the model at every step."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids, attention_mask=mask, logits_to_keep=1)[:, -1].argmax(-1)  # (B,)
            out.append(nxt)
            ids, mask = torch.cat([ids, nxt[:, None]], 1), torch.cat([mask, mask.new_ones(len(mask), 1)], 1)
    return torch.stack(out, 1).tolist()


@pytest.mark.parametrize("scaling,tie,kv", CASES, ids=IDS)
def test_greedy_is_token_identical_to_hf_with_and_without_cache(scaling, tie, kv):
    from gptj.decode import greedy_or_sample

    ours, hf = make_pair(scaling, tie, kv)
    ids, mask = left_pad(PROMPTS)
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                           pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:].tolist()
    assert all(len(row) == NEW for row in want)
    gen = GenerationConfig(max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    assert greedy_or_sample(ours, ids, mask, gen) == want  # gptj's decode loop, on the model's KV cache
    assert no_cache_greedy(ours, ids, mask, NEW) == want
    cache = ours.new_cache(2, 8)
    assert cache.k[0].shape == (2, kv, 8, 16)  # the cache holds the KV heads only


@pytest.mark.parametrize("scaling,tie,kv", CASES[1:3], ids=IDS[1:3])
def test_beam_search_is_token_identical_to_hf(scaling, tie, kv):
    """gptj's beam search (its cache rows reordered per step) on the Llama model: HF's hypotheses."""
    from gptj.decode import beam_search

    ours, hf = make_pair(scaling, tie, kv)
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(num_beams=3, max_new_tokens=NEW, length_penalty=1.0, early_stopping=True)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None,
                          return_dict_in_generate=True, output_scores=True, **kwargs)
    got, scores = beam_search(ours, ids, mask, GenerationConfig(**kwargs, eos_token_id=None, pad_token_id=0))
    assert got == out.sequences[:, ids.shape[1]:].tolist()
    # a score sums NEW log-softmaxes over 200 logits, each summed in its own order: NEW * 200 * u
    assert scores == pytest.approx(out.sequences_scores.tolist(), rel=NEW * 200 * U)


def test_tiny_llama3_frequencies_cover_every_branch():
    """The tiny config's llama3 table: three frequencies kept, one blended, four divided by the factor."""
    cfg = LlamaConfig.from_hf_dict(hf_dict(LLAMA3))
    plain = rope_frequencies(cfg.replace(rope_scaling=None))
    ratio = (plain / rope_frequencies(cfg)).tolist()
    assert ratio[:3] == [1.0] * 3 and 1.0 < ratio[3] < 8.0
    assert ratio[4:] == [8.0] * 4  # x / 8 is exact in binary floating point, and so is x / (x / 8)


def test_preset_is_llama_3_1_8b_and_round_trips():
    c = LLAMA_3_1_8B
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.rope_theta, c.max_position_embeddings) == \
        (4096, 14336, 32, 32, 8, 128, 128256, 500000.0, 131072)
    assert (c.rope_scaling.factor, c.rope_scaling.low_freq_factor, c.rope_scaling.high_freq_factor,
            c.rope_scaling.original_max_position_embeddings) == (8.0, 1.0, 4.0, 8192)
    assert (c.n_layer, c.n_head, c.head_dim, c.n_positions) == (32, 32, 128, 131072)  # GPT-J's names
    assert LlamaConfig.from_hf_dict(c.to_hf_dict()) == c
    # through transformers' own config (transformers 5 writes rope_parameters instead of rope_scaling)
    hf = transformers.LlamaConfig(**{k: v for k, v in c.to_hf_dict().items() if k != "model_type"})
    assert LlamaConfig.from_hf_dict(hf.to_dict()) == c
    inv_freq, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf)
    assert torch.equal(rope_frequencies(c), inv_freq)


DROP = object()  # a change that removes the field


@pytest.mark.parametrize("change,field", [
    ({"num_key_value_heads": 3}, "num_key_value_heads"),  # does not divide 4 heads
    ({"num_key_value_heads": 8}, "num_key_value_heads"),  # more KV heads than heads
    ({"head_dim": 15}, "head_dim"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"eos_token_id": []}, "eos_token_id"),
    ({"eos_token_id": [1, 200]}, "eos_token_id"),  # outside the vocabulary
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {**LLAMA3, "rope_type": "yarn"}}, "rope_scaling"),
    ({"rope_scaling": {**LLAMA3, "low_freq_factor": 4.0}}, "low_freq_factor"),
    ({"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "factor"}}, "rope_scaling.factor"),
    ({"model_type": "gptj"}, "model_type"),
    ({"hidden_size": DROP}, "hidden_size"),
])
def test_a_bad_config_field_is_refused_in_one_line(change, field):
    d = {k: v for k, v in {**hf_dict(LLAMA3), **change}.items() if v is not DROP}
    with pytest.raises(ConfigError) as e:
        LlamaConfig.from_hf_dict(d, source="x/config.json")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("x/config.json: ") and field in msg, msg


def test_state_dict_is_loaded_strictly():
    _, hf = make_pair(None, False, 2)
    sd = hf.state_dict()
    cfg = LlamaConfig.from_hf_dict(hf_dict(None, False, 2))
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight' \(1 missing\)"):
        load_hf_state_dict(build_model(cfg, device="meta"), missing)
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.2.input_layernorm.weight'"):
        load_hf_state_dict(build_model(cfg, device="meta"),
                           {**sd, "model.layers.2.input_layernorm.weight": sd["model.norm.weight"]})
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has shape \(63,\)"):
        load_hf_state_dict(build_model(cfg), {**sd, "model.norm.weight": sd["model.norm.weight"][:63]})
    # tied: save_pretrained leaves lm_head.weight out; a different lm_head is refused
    tied_cfg = cfg.replace(tie_word_embeddings=True)
    no_head = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    model = build_model(tied_cfg)
    load_hf_state_dict(model, no_head)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.lm_head.weight, sd["model.embed_tokens.weight"])
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_hf_state_dict(build_model(tied_cfg), sd)


def test_several_eos_ids_end_a_sequence_as_in_hf():
    """Llama 3.1 Instruct's generation_config lists three EOS ids: any of them ends a sequence. Greedy
    and beam search (gptj.decode) and the engine stop where HF's generate stops with the same list."""
    from gptj.decode import beam_search, generate, greedy_or_sample
    from gptj.engine import Engine, EngineConfig

    ours, hf = make_pair(LLAMA3, False, 2)
    ids, mask = left_pad(PROMPTS)
    with torch.no_grad():
        free = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[:, ids.shape[1]:].tolist()
    eos = [free[0][3], free[1][6], 199]  # each row meets a different one first; the last never comes
    assert free[0][3] not in free[0][:3] + free[1][:7] and free[1][6] not in free[1][:6]

    def cut(row):  # HF pads a finished row with pad_token_id: up to its first EOS
        return next((row[: i + 1] for i, t in enumerate(row) if t in eos), row)

    with torch.no_grad():
        want = [cut(r) for r in hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                            pad_token_id=0, eos_token_id=eos)[:, ids.shape[1]:].tolist()]
    assert [len(r) for r in want] == [4, 7]
    gen = GenerationConfig(max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    assert gen.eos_ids == tuple(eos) and GenerationConfig(eos_token_id=[7]).eos_token_id == 7
    assert greedy_or_sample(ours, ids, mask, gen) == want
    assert Engine(ours, EngineConfig(max_seqs=4, block_size=8)).generate(PROMPTS, gen) == want
    kwargs = dict(num_beams=3, max_new_tokens=NEW, length_penalty=1.0, early_stopping=True, min_new_tokens=2)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=eos, **kwargs)
    beams = GenerationConfig(**kwargs, eos_token_id=eos, pad_token_id=0)
    got, _ = beam_search(ours, ids, mask, beams)
    assert [cut(r) for r in got] == [cut(r) for r in out[:, ids.shape[1]:].tolist()]
    engine_beams = Engine(ours, EngineConfig(max_seqs=6, block_size=8)).generate(PROMPTS, beams)
    assert engine_beams == generate(ours, PROMPTS, beams) and engine_beams[1][-1] in eos  # a beam ended at an EOS
