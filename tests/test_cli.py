"""The gptj command: each subcommand, and one-line errors for bad input."""

import json
import subprocess
import sys

import pytest

from gptj.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "tiny"
    assert main(["init", "--preset", "tiny", "--out", str(out), "--seed", "1"]) == 0
    return out


def run(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_json_and_text(tiny, capsys):
    code, out, err = run(["generate", "--model", str(tiny), "--prompt", "Hello world", "--prompt-ids", "464,2068",
                          "--max-new-tokens", "5", "--json"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt_ids"] for r in rows] == [[15496, 995], [464, 2068]]
    assert all(len(r["token_ids"]) == 5 or r["token_ids"][-1] == 50256 for r in rows)
    code, text, _ = run(["generate", "--model", str(tiny), "--prompt", "Hello world", "--max-new-tokens", "5"], capsys)
    assert code == 0 and text.rstrip("\n") == rows[0]["text"]


def test_generate_is_deterministic_and_beams_run(tiny, capsys):
    args = ["generate", "--model", str(tiny), "--prompt", "A B C", "--max-new-tokens", "6", "--json"]
    greedy = [run(args, capsys)[1] for _ in range(2)]
    assert greedy[0] == greedy[1]
    code, beams, err = run(args + ["--num-beams", "3", "--min-new-tokens", "6"], capsys)
    assert code == 0, err
    assert len(json.loads(beams)["token_ids"]) == 6
    sampled = [run(args + ["--temperature", "1.0", "--seed", str(s)], capsys)[1] for s in (1, 1)]
    assert sampled[0] == sampled[1]


def test_tokenize_detokenize(capsys, monkeypatch):
    code, out, _ = run(["tokenize", "Hello world"], capsys)
    assert code == 0 and out.strip() == "15496,995"
    code, out, _ = run(["detokenize", "15496,995", "50257"], capsys)
    assert out.splitlines() == ["Hello world", "<|extratoken_1|>"]
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO("15496, 995\n[464,2068]\n"))
    code, out, _ = run(["detokenize", "--json"], capsys)
    assert [json.loads(x) for x in out.splitlines()] == ["Hello world", "The quick"]


def test_convert_round_trip(tiny, tmp_path, capsys):
    code, _, err = run(["convert", str(tiny), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16", "--quiet"],
                       capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/nonexistent", "--prompt", "x"], "/nonexistent: no such file or directory"),
    (["generate", "--model", "{tiny}"], "give at least one --prompt"),
    (["generate", "--model", "{tiny}", "--prompt-ids", "1,99999999"], "99999999"),
    (["generate", "--model", "{tiny}", "--prompt", "x", "--max-new-tokens", "5000"], "2048"),
    (["generate", "--model", "{tiny}", "--prompt", "x", "--device", "cuda:0"], "CUDA is not available"),
    (["detokenize", "50400"], "50400"),
    (["init", "--out", "{tiny}"], "already exists"),
    (["convert", "{tiny}", "--from", "mtj", "--out", "{tmp}/x"], "expected a mtj checkpoint"),
])
def test_user_errors_are_one_line(tiny, tmp_path, capsys, args, message):
    if "cuda" in args[-1] and __import__("torch").cuda.is_available():
        pytest.skip("CUDA present")
    args = [a.format(tiny=tiny, tmp=tmp_path) for a in args]
    code, out, err = run(args, capsys)
    assert code == 1
    assert len(err.strip().splitlines()) == 1, err
    assert message in err and "Traceback" not in err


def test_console_script_bad_flag_and_help(tmp_path, capsys):
    bad = subprocess.run([sys.executable, "-m", "gptj.cli", "generate", "--num-beams", "zero"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.count("\n") == 1 and "expected a positive integer" in bad.stderr
    cfg = tmp_path / "m"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({"model_type": "llama"}))
    bad = subprocess.run([sys.executable, "-m", "gptj.cli", "generate", "--model", str(cfg), "--prompt", "x"],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "a llama model without its tokenizer" in bad.stderr
    ok = subprocess.run([sys.executable, "-m", "gptj.cli", "init", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "usage: gptj init" in ok.stdout  # the console entry point; the others in-process
    for cmd in ("convert", "generate", "tokenize", "detokenize"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0 and f"usage: gptj {cmd}" in capsys.readouterr().out


def test_convert_mtj_slim_then_hf_loads_it(tmp_path, capsys):
    """slim checkpoint -> `gptj convert --from mtj` -> HF transformers gives gptj's logits."""
    import torch
    import transformers

    from gptj.config import GPTJConfig
    from gptj.weights.io import load_model
    from mtj_writer import write_mtj_slim

    cfg = GPTJConfig(n_layer=3, n_embd=64, n_head=4, rotary_dim=8, n_inner=256)
    torch.manual_seed(0)
    hf = transformers.GPTJForCausalLM(transformers.GPTJConfig(**cfg.to_hf_dict()))
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items() if not k.endswith(("attn.bias", "masked_bias"))}
    write_mtj_slim(sd, tmp_path / "step_1", n_shards=4, files=3, bf16=False)
    (tmp_path / "config.json").write_text(cfg.to_json_string())
    code, _, err = run(["convert", str(tmp_path / "step_1"), "--from", "mtj", "--config", str(tmp_path / "config.json"),
                        "--out", str(tmp_path / "out"), "--quiet"], capsys)
    assert code == 0, err
    ours = load_model(tmp_path / "out")
    theirs = transformers.GPTJForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.tensor([[15496, 995, 11, 262]])
    with torch.no_grad():
        want = theirs(ids).logits  # float32 in another summation order: 1e-4 of the largest logit (test_model)
        torch.testing.assert_close(ours(ids), want, rtol=0, atol=1e-4 * float(want.abs().max()))
    # the writer folded an embedding bias out of wte and split biases over shards: all restored exactly
    assert torch.equal(ours.transformer.wte.weight, sd["transformer.wte.weight"])
    assert torch.equal(ours.transformer.h[2].mlp.fc_out.bias, sd["transformer.h.2.mlp.fc_out.bias"])


@pytest.mark.parametrize("flag, value", [("--temperature", "-1"), ("--top-p", "0"), ("--top-p", "1.5"),
                                         ("--temperature", "nan")])
def test_generate_refuses_bad_sampling_settings(tiny, capsys, flag, value):
    """A negative temperature used to run greedy silently; the server answers 400 for it."""
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(tiny), "--prompt", "x", "--max-new-tokens", "2", flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert flag in err and value in err


def test_help_shows_defaults():
    """Every option with a default says it in --help (argparse's own formatter hides them)."""
    import argparse

    from gptj.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        for action in parser._actions:
            shown = " ".join(parser._get_formatter()._format_action(action).split())
            if action.option_strings and action.nargs == 0:  # a switch: its stored constant is no default
                assert "(default: True)" not in shown and "(default: False)" not in shown, (name, shown)
            elif action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                assert "default" in shown, (name, shown)
    serve = " ".join(sub.choices["serve"].format_help().split())
    assert "--port PORT (default: 8000)" in serve
    mlperf = " ".join(sub.choices["mlperf"].format_help().split())
    assert "(default: Offline)" in mlperf and "(default: accuracy)" in mlperf
    # --no-prefix-caching turns prefix caching off: its help says it is on by default, in words
    assert "--no-prefix-caching turn prefix caching off (it is on by default" in serve


@pytest.mark.parametrize("command, data", [("tokenize", "hello world " * 20000),
                                           ("detokenize", "15496,995\n" * 20000)])
def test_closed_pipe_exits_quietly(tmp_path, command, data):
    """`gptj tokenize ... | head -c 50` used to end with 'internal error: BrokenPipeError' (exit 2)."""
    (tmp_path / "in.txt").write_text(data)
    with open(tmp_path / "in.txt") as stdin:
        proc = subprocess.Popen([sys.executable, "-m", "gptj.cli", command], stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        head = proc.stdout.read(50)  # like `head -c 50`: read a little, then close the pipe
        proc.stdout.close()
        err = proc.stderr.read().decode()
        code = proc.wait()
    assert len(head) == 50
    assert err == "" and code == 141, (code, err)


def test_distribution_name_is_gptjs_own():
    """PyPI's `gptj` is someone else's package: gptj installs as gptj.DISTRIBUTION, its version read
    from gptj.__version__ (one home), and reports that version, never another package's."""
    import tomllib
    from importlib import metadata
    from pathlib import Path

    import gptj

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert project["project"]["name"] == gptj.DISTRIBUTION != "gptj"
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gptj.__version__"}
    assert metadata.version(gptj.DISTRIBUTION) == gptj.__version__  # installed as the README says


def _help_of(*command):
    import argparse

    from gptj.cli import build_parser

    parser = build_parser()
    for name in command:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser.format_help()


@pytest.mark.parametrize("command, old, new, dest", [
    (["serve", "--model", "m"], "--max-batch-size", "--max-num-seqs", "max_seqs"),
    (["compare", "a", "b"], "--new-tokens", "--max-new-tokens", "new_tokens"),
    (["compare", "a", "b"], "--max-tokens", "--max-prompt-tokens", "max_tokens"),
    (["quant-report", "--model", "m"], "--max-tokens", "--max-prompt-tokens", "max_tokens"),
    (["bench", "latency", "--model", "m"], "--new-tokens", "--max-new-tokens", "new_tokens"),
])
def test_an_old_flag_name_still_works_with_one_warning(capsys, command, old, new, dest):
    """Renamed flags (one name across commands: --max-new-tokens, --max-prompt-tokens; serve's
    --max-num-seqs, vLLM's) keep the old name one release: the same setting, one warning line on
    stderr, hidden from --help."""
    import re

    from gptj.cli import build_parser

    assert getattr(build_parser().parse_args([*command, new, "5"]), dest) == 5
    assert capsys.readouterr().err == ""
    assert getattr(build_parser().parse_args([*command, old, "5"]), dest) == 5
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "warning" in line and f"{old} is deprecated, use {new}" in line
    shown = _help_of(*[c for c in command if not c.startswith("-") and c not in ("m", "a", "b")])
    assert new in shown and not re.search(rf"(?<![\w-]){old}\b", shown)


def test_mlperf_max_batch_size_is_its_own_flag(capsys):
    """gptj mlperf's --max-batch-size counts samples per batch (not serve's running sequences): no warning."""
    from gptj.cli import build_parser

    args = build_parser().parse_args(["mlperf", "--model", "m", "--max-batch-size", "3"])
    assert args.max_batch_size == 3 and args.max_seqs is None and capsys.readouterr().err == ""


def test_generate_labels_each_prompts_text(tiny, capsys):
    """Several prompts: each one's text starts with its number; --json stays one bare object per line."""
    argv = ["generate", "--model", str(tiny), "--prompt", "Hello world", "--prompt-ids", "464,2068",
            "--max-new-tokens", "4"]
    code, out, err = run(argv + ["--json"], capsys)
    assert code == 0, err
    texts = [json.loads(line)["text"] for line in out.splitlines()]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert out == f"[1] {texts[0]}\n[2] {texts[1]}\n"


def test_generate_stream_prints_the_same_text(tiny, capsys, monkeypatch):
    """--stream writes each prompt's text piece by piece, as its tokens come (each prompt in turn,
    labelled), and ends with the text generate prints without it."""
    argv = ["generate", "--model", str(tiny), "--prompt", "Hello world", "--prompt-ids", "464,2068",
            "--max-new-tokens", "6"]
    code, whole, err = run(argv, capsys)
    assert code == 0, err
    writes = []
    real = sys.stdout.write
    monkeypatch.setattr(sys.stdout, "write", lambda text: writes.append(text) or real(text))
    code, streamed, err = run(argv + ["--stream"], capsys)
    assert code == 0, err
    assert streamed == whole
    assert len([w for w in writes if w]) > 4  # pieces, not one line per prompt
    code, _, err = run(argv + ["--stream", "--json"], capsys)
    assert code == 1 and "--stream" in err and len(err.strip().splitlines()) == 1


def test_an_existing_out_is_refused_before_reading_weights(tiny, tmp_path, capsys, monkeypatch):
    """convert and init check --out first: a 6B checkpoint is not read (or made) only to be refused."""
    import gptj.weights.io as io

    out = tmp_path / "taken"
    out.mkdir()
    (out / "file").write_text("x")

    def never(*args, **kwargs):
        raise AssertionError("weights read before --out was checked")

    monkeypatch.setattr(io.Checkpoint, "read", never)
    monkeypatch.setattr(io, "random_state_dict", never)
    for argv in (["convert", str(tiny), "--out", str(out), "--quiet"], ["init", "--out", str(out)]):
        code, _, err = run(argv, capsys)
        assert code == 1 and "already exists" in err and "--force" in err, err


def test_convert_says_when_it_writes_tensor_parallel_shards(tiny, tmp_path, capsys):
    """The shards have no bar of their own: convert says the step on stderr (not with --quiet)."""
    code, _, err = run(["convert", str(tiny), "--out", str(tmp_path / "tp"), "--tp", "2"], capsys)
    assert code == 0 and "gptj convert: writing the tensor-parallel shards of 2 ranks" in err, err
    code, _, err = run(["convert", str(tiny), "--out", str(tmp_path / "tp-quiet"), "--tp", "2", "--quiet"], capsys)
    assert code == 0 and err == ""


def test_generate_takes_the_servers_penalties(tiny, capsys):
    """--repetition-penalty / --frequency-penalty / --presence-penalty reach GenerationConfig as the
    server's fields do: the command's tokens are gptj.decode's with the same settings, and each changes them."""
    from gptj.decode import GenerationConfig, generate
    from gptj.weights.io import load_model

    model = load_model(tiny)
    prompt = [464, 2068, 464, 2068]
    args = ["generate", "--model", str(tiny), "--prompt-ids", "464,2068,464,2068", "--max-new-tokens", "12", "--json"]
    plain = None
    for flags, settings in [([], {}), (["--repetition-penalty", "0.01"], dict(repetition_penalty=0.01)),
                            (["--presence-penalty", "-2"], dict(presence_penalty=-2.0)),
                            (["--frequency-penalty", "-1", "--presence-penalty", "0.5"],
                             dict(frequency_penalty=-1.0, presence_penalty=0.5))]:
        code, out, err = run(args + flags, capsys)
        assert code == 0, err
        tokens = json.loads(out)["token_ids"]
        assert tokens == generate(model, [prompt], GenerationConfig(max_new_tokens=12, **settings))[0]
        if plain is None:
            plain = tokens
        else:
            assert tokens != plain
    code, out, err = run(args + ["--presence-penalty", "3"], capsys)
    assert code != 0 and len(err.strip().splitlines()) == 1 and "presence_penalty" in err, err
