"""One front door: the same flags give the same engine through generate, serve, mlperf and bench.

Each command's flags are parsed by the real CLI parser and turned into its ModelSpec and
EngineConfig by the command's own path (cli.generate_setup, cli._server_config,
cli.mlperf_config + mlperf.run.engine_config, bench.latency.bench_config); their KV plans are
then made by the one sizing rule within a fixed free memory, so the comparison is deterministic.
"""

import dataclasses

import pytest

from gptj.bench.latency import bench_config
from gptj.cli import _server_config, build_parser, generate_setup, main, mlperf_config
from gptj.config import get_preset
from gptj.engine.config import EngineConfig
from gptj.errors import GptjError
from gptj.mlperf import run as mlperf_run
from gptj.runtime.flags import SERVE_PREFILL_CHUNK
from gptj.runtime.spec import ModelSpec, kv_plan
from gptj.weights.checkpoint import resolve_config
from gptj.weights.io import random_state_dict, save_checkpoint

FREE = 1 << 30  # bytes of free memory every plan is made within
LONGEST = 40  # mlperf: the longest prompt of its data set (what run() measures)

SAME = ["--dtype", "bfloat16", "--quantize", "int8", "--kernels", "off", "--compile", "off", "--max-seqs", "6",
        "--max-model-len", "96", "--block-size", "32", "--no-prefix-caching", "--prefill-chunk", "64",
        "--kv-memory-fraction", "0.25", "--kv-blocks", "20"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = get_preset("tiny")
    return save_checkpoint(random_state_dict(cfg, seed=0), cfg, tmp_path_factory.mktemp("front") / "tiny")


def parse(*argv):
    return build_parser().parse_args([str(a) for a in argv])


def through(command: str, model, *flags) -> tuple[ModelSpec, EngineConfig]:
    """`command`'s ModelSpec and EngineConfig for these flags, by the command's own path."""
    if command == "generate":
        _, _, _, spec, engine = generate_setup(parse("generate", "--model", model, "--prompt-ids", "1,2,3", *flags))
        return spec, engine
    if command == "serve":
        cfg = _server_config(parse("serve", "--model", f"tiny={model}", *flags), (("tiny", str(model)),))
        return cfg.model.at(model), cfg.engine
    if command == "mlperf":
        cfg = mlperf_config(parse("mlperf", "--model", model, *flags))
        return cfg.spec.at(model), mlperf_run.engine_config(cfg, LONGEST)
    assert command == "bench"
    return bench_config(parse("bench", "latency", "--model", model, *flags))


def plan(model, spec: ModelSpec, engine: EngineConfig):
    return kv_plan(spec, resolve_config(model), engine, free_bytes=FREE, device="cpu")


COMMANDS = ("generate", "serve", "mlperf", "bench")


def test_the_same_flags_give_the_same_spec_engine_and_plan_through_every_command(tiny):
    built = {c: through(c, tiny, *SAME) for c in COMMANDS}
    spec, engine = built["generate"]
    assert spec == ModelSpec(path=str(tiny), dtype="bfloat16", quantize="int8")
    assert (engine.max_seqs, engine.max_len, engine.block_size, engine.prefix_caching, engine.prefill_chunk,
            engine.memory_fraction, engine.kernels, engine.compile, engine.kv_blocks) == \
        (6, 96, 32, False, 64, 0.25, "off", "off", 20)
    for command, (other_spec, other_engine) in built.items():
        assert other_spec == spec, command
        assert other_engine == engine, command
        assert plan(tiny, other_spec, other_engine) == plan(tiny, spec, engine), command
    p = plan(tiny, spec, engine)
    assert (p.block_size, p.max_len, p.max_seqs, p.n_blocks) == (32, 96, 6, 20)
    # without --kv-blocks, the plan is the memory's: 6 sequences of 3 blocks (bench adds room: below)
    no_blocks = [a for a in SAME if a not in ("--kv-blocks", "20")]
    assert plan(tiny, *through("generate", tiny, *no_blocks)).n_blocks == 6 * 3
    assert plan(tiny, *through("serve", tiny, *no_blocks)) == plan(tiny, *through("mlperf", tiny, *no_blocks))


def test_serve_max_num_seqs_and_max_batch_size_are_max_seqs(tiny):
    """serve's --max-num-seqs (vLLM's name) and the deprecated --max-batch-size: --max-seqs."""
    assert through("serve", tiny, "--max-num-seqs", "5") == through("serve", tiny, "--max-seqs", "5")
    assert through("serve", tiny, "--max-batch-size", "5") == through("serve", tiny, "--max-seqs", "5")
    assert through("serve", tiny, "--max-batch-size", "5")[1].max_seqs == 5


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag, value, field, planned", [
    ("--kv-blocks", "7", "kv_blocks", "n_blocks"),
    ("--block-size", "64", "block_size", "block_size"),
    ("--max-seqs", "3", "max_seqs", "max_seqs"),
    ("--max-model-len", "200", "max_len", "max_len"),
])
def test_a_flag_given_to_one_command_changes_that_commands_plan(tiny, command, flag, value, field, planned):
    base = ["--dtype", "float32", "--max-seqs", "4", "--max-model-len", "64", "--block-size", "16", "--kv-blocks", "30"]
    spec, before = through(command, tiny, *base)
    _, after = through(command, tiny, *base, flag, value)  # (the last of a repeated flag wins)
    assert getattr(after, field) == int(value) != getattr(before, field)
    assert dataclasses.replace(after, **{field: getattr(before, field)}) == before  # nothing else moved
    assert getattr(plan(tiny, spec, after), planned) == int(value) != getattr(plan(tiny, spec, before), planned)


def test_what_no_flag_says_comes_from_each_commands_work(tiny):
    """Without --max-seqs / --max-model-len: generate runs all its prompts at once, mlperf a batch of
    samples x beams, bench its batch; serve as many as the KV memory holds."""
    _, engine = through("generate", tiny, "--prompt-ids", "4,5", "--num-beams", "2", "--max-new-tokens", "10")
    assert (engine.max_seqs, engine.max_len) == (2 * 2, None)  # two prompts x 2 beams; the model's context
    _, engine = through("mlperf", tiny, "--max-batch-size", "3")
    assert (engine.max_seqs, engine.max_len) == (3 * 4, LONGEST + 128)  # official: 4 beams, 128 new tokens
    _, engine = through("bench", tiny, "--batch-size", "5", "--prompt-len", "20", "--max-new-tokens", "8")
    assert (engine.max_seqs, engine.max_len) == (5, 28)
    # bench admits its whole batch in one step: its blocks, plus the room the scheduler keeps free
    assert engine.kv_blocks > 5 * 2
    spec, engine = through("serve", tiny)
    assert (engine.max_seqs, engine.max_len, engine.prefill_chunk) == (None, None, SERVE_PREFILL_CHUNK)
    p = plan(tiny, spec, engine)
    assert p.max_len == resolve_config(tiny).n_positions and p.max_seqs >= 1


def test_a_model_spec_is_checked_once_in_one_line(tiny):
    assert ModelSpec(path=tiny, dtype="bf16").dtype == "bfloat16"
    for bad, message in (({"dtype": "float8"}, "unknown dtype"), ({"quantize": "int3"}, "quantization mode"),
                         ({"tp": 0}, "tp must be")):
        with pytest.raises(GptjError, match=message):
            ModelSpec(path=tiny, **bad)
    # how the engine computes has one home, EngineConfig, checked there
    for bad, message in (({"kernels": "on"}, "kernels must be"), ({"compile": "yes"}, "compile must be"),
                         ({"cuda_graphs": "always"}, "cuda_graphs must be")):
        with pytest.raises(GptjError, match=message):
            EngineConfig(**bad)
        with pytest.raises(TypeError):
            ModelSpec(path=tiny, **bad)


@pytest.mark.parametrize("argv", [["--block-size", "12"], ["--kv-memory-fraction", "0"], ["--max-seqs", "0"],
                                  ["--quantize", "int3"], ["--compile", "yes"]])
def test_bad_engine_flags_are_one_line_usage_errors(tiny, capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(tiny), "--prompt-ids", "1", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and argv[0] in err, err


def test_the_built_engine_is_the_plan(tiny):
    """runtime.build: the engine it makes has the plan's size (it sizes nothing again)."""
    from gptj.runtime.build import build_engine, load_model, plan_for

    spec, engine = through("generate", tiny, "--dtype", "float32", "--max-seqs", "3", "--max-model-len", "50")
    model = load_model(spec)
    p = plan_for(model, engine, free_bytes=FREE)
    stats = build_engine(model, engine, free_bytes=FREE).stats()
    assert (stats.max_seqs, stats.max_len, stats.blocks_total) == (p.max_seqs, p.max_len, p.n_blocks) == (3, 50, 12)


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    """A tiny checkpoint stored in bfloat16 (config.json: torch_dtype bfloat16)."""
    import torch

    cfg = get_preset("tiny")
    return save_checkpoint(random_state_dict(cfg, seed=0, dtype=torch.bfloat16), cfg,
                           tmp_path_factory.mktemp("front") / "tiny-bf16")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_defaults_to_the_checkpoints_dtype(tiny, tiny_bf16, tmp_path, command):
    """One --dtype default, auto, through generate, serve, mlperf and bench: the dtype the checkpoint's
    config.json records (as HF transformers 5 and vLLM read "auto"), float32 when it records none; so
    `gptj generate` and `gptj serve` give the same text for the same prompt."""
    import json
    import shutil

    assert through(command, tiny)[0].dtype == "float32"
    assert through(command, tiny_bf16)[0].dtype == "bfloat16"
    assert through(command, tiny_bf16, "--dtype", "auto")[0].dtype == "bfloat16"
    assert through(command, tiny_bf16, "--dtype", "float32")[0].dtype == "float32"  # a named dtype wins
    bare = shutil.copytree(tiny_bf16, tmp_path / "bare")  # a config.json that records no dtype
    config = json.loads((bare / "config.json").read_text())
    del config["torch_dtype"]
    (bare / "config.json").write_text(json.dumps(config))
    assert through(command, bare)[0].dtype == "float32"


def test_every_command_that_runs_a_model_takes_auto_by_default():
    """One default: each subcommand's --dtype is auto (calibrate and quant-report were bfloat16), but for
    the weight tools, which write a dtype and never guess one (init: float32; convert: as stored)."""
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    defaults = {name: action.default for name, parser in sub.choices.items() for action in parser._actions
                if "--dtype" in action.option_strings}
    for nested in ("bench",):  # `gptj bench latency`: a subcommand of its own
        inner = next(a for a in sub.choices[nested]._actions if isinstance(a, argparse._SubParsersAction))
        defaults |= {f"{nested} {name}": action.default for name, parser in inner.choices.items()
                     for action in parser._actions if "--dtype" in action.option_strings}
    assert {"calibrate", "quant-report", "generate", "serve", "mlperf", "compare"} <= set(defaults)
    assert {name: d for name, d in defaults.items() if d != "auto"} == {"init": "float32", "convert": None}


def test_a_served_template_resolves_auto_per_model(tiny, tiny_bf16):
    """gptj serve's spec is a template until each --model's folder is known: auto stays auto there."""
    template = _server_config(parse("serve", "--model", f"a={tiny}"), (("a", str(tiny)),)).model
    assert template.dtype == "auto" and template.path is None
    assert template.at(tiny).dtype == "float32" and template.at(tiny_bf16).dtype == "bfloat16"
    with pytest.raises(GptjError, match="checkpoint"):
        template.torch_dtype


def test_an_unknown_recorded_dtype_is_one_line(tmp_path, tiny):
    import json
    import shutil

    odd = shutil.copytree(tiny, tmp_path / "odd")
    (odd / "config.json").write_text(json.dumps(json.loads((odd / "config.json").read_text())
                                                | {"torch_dtype": "float64"}))
    with pytest.raises(GptjError, match="float64.*--dtype"):
        ModelSpec(path=odd)


@pytest.mark.parametrize("command", COMMANDS)
def test_dtype_fast_is_one_rule_through_every_command(tiny, command):
    """--dtype fast reaches every command's ModelSpec resolved by gptj.policy.fast_dtype (bfloat16 where
    this CPU computes it fast, float32 elsewhere); the weight tools refuse both rules."""
    from gptj import policy

    want = str(policy.fast_dtype("cpu")).removeprefix("torch.")
    spec, _ = through(command, tiny, "--dtype", "fast")
    assert spec.dtype == want
    with pytest.raises(SystemExit):
        parse("init", "--out", str(tiny), "--dtype", "auto")  # a checkpoint's dtype is never guessed
    with pytest.raises(SystemExit):
        parse("init", "--out", str(tiny), "--dtype", "fast")


def test_the_dtype_default_is_no_flag_given(tiny_bf16):
    """gptj mlperf --server names the flags that did not apply: the default dtype (auto, here the
    checkpoint's bfloat16) is none of them; a --dtype that differs from it is."""
    from gptj.runtime.flags import flags_given

    cfg = mlperf_config(parse("mlperf", "--model", tiny_bf16, "--server", "http://127.0.0.1:1"))
    assert cfg.spec.dtype == "bfloat16" and "--dtype" not in flags_given(cfg.spec, cfg.engine)
    cfg = mlperf_config(parse("mlperf", "--model", tiny_bf16, "--server", "http://127.0.0.1:1", "--dtype", "float32"))
    assert "--dtype" in flags_given(cfg.spec, cfg.engine)
