"""`gptj mlperf --benchmark llama3.1-8b | llama3.1-8b-edge` with the real LoadGen (issue 59): a tiny Llama
with its own tokenizer, the bundled llama stand-in, greedy answers as int32 token ids with their token counts,
first tokens reported as the engine makes them, Interactive, the scenarios each benchmark allows, the default
benchmark by architecture."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gptj.cli import main
from test_mlperf_llama import SPECIALS, llama_bpe

pytestmark = pytest.mark.usefixtures("keep_torch_threads")

VOCAB = 512  # llama-tiny's


def _llama_tokenizer(path):
    """A Llama-3-shaped byte-level BPE of llama-tiny's 512 ids (509 learned, 3 specials last), BOS added by
    its post-processor; generation_config.json names two EOS ids, as Llama 3.1 Instruct names three."""
    tok = llama_bpe(VOCAB - len(SPECIALS))
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": SPECIALS[2],
        "model_max_length": 131072, "clean_up_tokenization_spaces": True}))
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.token_to_id(SPECIALS[0]),
        "eos_token_id": [tok.token_to_id(SPECIALS[1]), tok.token_to_id(SPECIALS[2])]}))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "m"
    assert main(["init", "--preset", "llama-tiny", "--out", str(path)]) == 0
    _llama_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def short_set(tmp_path_factory):
    """The bundled llama stand-in's first 4 records, each article cut to its first 300 characters: prompts of
    about 100 tokens, so that a performance run's steps stay short."""
    from gptj.mlperf.dataset import DEFAULT_LLAMA_DATASET

    records = json.loads(DEFAULT_LLAMA_DATASET.read_text())[:4]
    path = tmp_path_factory.mktemp("data") / "short.json"
    path.write_text(json.dumps([dict(r, input=r["input"][:300] + "\n\nSummary:") for r in records]))
    return path


def mlperf(llama_dir, log_dir, *extra):
    return main(["mlperf", "--model", str(llama_dir), "--log-dir", str(log_dir), "--quiet", *extra])


def read_log(log_dir):
    """qsl_idx -> (token ids read as int32, LoadGen's token_count) from the accuracy log."""
    entries = json.loads((log_dir / "mlperf_log_accuracy.json").read_text())
    return {e["qsl_idx"]: (np.frombuffer(bytes.fromhex(e["data"]), np.int32).tolist(), e["token_count"])
            for e in entries}, entries


def greedy(llama_dir, prompts, max_new_tokens):
    """The engine-free reference: gptj.decode's greedy answers, up to any of the tokenizer's EOS ids."""
    import torch

    from gptj.decode import generate
    from gptj.mlperf.config import llama_generation
    from gptj.tokenizer import load_tokenizer
    from gptj.weights.io import load_model

    model = load_model(llama_dir)
    gen = llama_generation(load_tokenizer(llama_dir), max_new_tokens=max_new_tokens)
    with torch.inference_mode():
        return [generate(model, [prompt], gen)[0] for prompt in prompts]


def hf_greedy(llama_dir, prompts, max_new_tokens):
    """HF transformers' LlamaForCausalLM on the same folder, greedy as the reference SUT asks (1 to
    max_new_tokens new tokens, any EOS id ends an answer), each answer up to its EOS."""
    import torch

    from gptj.tokenizer import load_tokenizer

    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(llama_dir), attn_implementation="eager").float().eval()
    eos = list(load_tokenizer(llama_dir).eos_token_ids)
    answers = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=1, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0])[0, len(ids):].tolist()
            answers.append(next((out[:i + 1] for i, t in enumerate(out) if t in eos), out))
    return answers


def test_offline_accuracy_run_logs_int32_greedy_answers_that_evaluate_llama_scores(llama_dir, short_set, tmp_path,
                                                                                     capsys):
    from gptj.mlperf.dataset import Dataset
    from gptj.tokenizer import load_tokenizer

    log_dir = tmp_path / "acc"
    assert mlperf(llama_dir, log_dir, "--mode", "accuracy", "--dataset", str(short_set), "--max-new-tokens", "10") == 0
    out = capsys.readouterr().out
    assert "llama3.1-8b: FAIL" in out  # scored against llama3.1-8b's targets (random weights fail them)
    answers, entries = read_log(log_dir)
    assert sorted(answers) == [0, 1, 2, 3] and len(entries) == 4  # each sample once
    for ids, count in answers.values():
        assert count == len(ids) and 1 <= count <= 10  # n_tokens: the answer's token count
    dataset = Dataset.load(short_set, tokenizer=load_tokenizer(llama_dir), benchmark="llama3.1-8b")
    expected = greedy(llama_dir, dataset.input_ids, 10)
    assert [answers[i][0] for i in range(4)] == expected
    assert expected == hf_greedy(llama_dir, dataset.input_ids, 10)  # and per sample, exactly HF's tokens

    run = json.loads((log_dir / "run.json").read_text())
    assert run["benchmark"] == "llama3.1-8b" and run["loadgen_model"] == "llama3_1-8b"
    assert run["settings"]["generation"]["num_beams"] == 1 and run["settings"]["generation"]["min_new_tokens"] == 1
    assert run["sut"]["first_tokens"] == 4 and run["sut"]["new_tokens"] == sum(len(e) for e in expected)
    accuracy = json.loads((log_dir / "accuracy.json").read_text())
    assert accuracy["benchmark"] == "llama3.1-8b" and accuracy["gen_num"] == 4 and accuracy["passed"] is False
    # the log scores the same with `gptj evaluate --log-dtype int32` (the reference's --dtype int32)
    assert main(["evaluate", "--benchmark", "llama3.1-8b", "--tokenizer", str(llama_dir), "--log-dtype", "int32",
                 "--dataset", str(short_set), "--log-dir", str(log_dir), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert {k: again[k] for k in ("rouge1", "rouge2", "rougeL", "rougeLsum", "gen_len", "gen_num")} == \
        {k: accuracy[k] for k in ("rouge1", "rouge2", "rougeL", "rougeLsum", "gen_len", "gen_num")}
    assert (log_dir / "accuracy.txt").read_text().startswith("{'rouge1': '")
    summary = (log_dir / "summary.md").read_text()
    assert summary.startswith("# gptj MLPerf llama3.1-8b — Offline, accuracy")
    assert "not Llama-3.1-8B" in summary and "max_new_tokens=10" in summary and "untruncated" in summary
    assert f"--log-dtype int32 --log-dir {log_dir} --dataset {short_set}`" in summary


def test_interactive_reports_each_first_token_before_its_answer(llama_dir, short_set, tmp_path, monkeypatch):
    """Interactive (LoadGen's Server with llama3_1-8b-interactive's limits): every answer's first token
    reaches LoadGen (FirstTokenComplete) before the answer, as the engine makes it, and the answer carries
    its token count; LoadGen's TTFT and TPOT land in summary.md against Interactive's limits."""
    import ctypes
    import threading

    import mlperf_loadgen as lg

    calls, lock = [], threading.Lock()

    def recorder(kind, real):
        def call(responses, *args):
            with lock:
                for r in responses:
                    calls.append((kind, r.id, r.n_tokens, ctypes.string_at(r.data, r.size) if r.size else b""))
            return real(responses, *args)
        return call

    monkeypatch.setattr(lg, "FirstTokenComplete", recorder("first", lg.FirstTokenComplete))
    monkeypatch.setattr(lg, "QuerySamplesComplete", recorder("done", lg.QuerySamplesComplete))
    log_dir = tmp_path / "inter"
    assert mlperf(llama_dir, log_dir, "--scenario", "Interactive", "--mode", "performance", "--dataset", str(short_set),
                  "--max-new-tokens", "8", "--min-duration-ms", "100", "--min-query-count", "8",
                  "--target-qps", "20") == 0
    done = {c[1]: c for c in calls if c[0] == "done"}
    firsts = {c[1]: i for i, c in enumerate(calls) if c[0] == "first"}
    assert len(done) >= 8
    for i, (kind, sample, n_tokens, data) in enumerate(calls):
        if kind != "done":
            continue
        ids = np.frombuffer(data, np.int32).tolist()
        assert n_tokens == len(ids) >= 1
        assert sample in firsts and firsts[sample] < i  # the first token came before the answer
        first = calls[firsts[sample]]
        assert first[2] == 1 and np.frombuffer(first[3], np.int32).tolist() == ids[:1]
    lg_summary = (log_dir / "mlperf_log_summary.txt").read_text()
    assert "Scenario : Server" in lg_summary and "ttft_latency (ns): 500000000" in lg_summary \
        and "tpot_latency (ns): 30000000" in lg_summary
    run = json.loads((log_dir / "run.json").read_text())
    tokens = run["token_latencies_ns"]
    # LoadGen saw each first token well before its answer's end (8 tokens: 7 more steps after it)
    from gptj.mlperf.report import parse_loadgen_summary

    mean_latency = int(parse_loadgen_summary(log_dir / "mlperf_log_summary.txt")["Mean latency (ns)"])
    assert 0 < tokens["ttft_mean"] < mean_latency and tokens["tpot_mean"] > 0
    assert tokens["ttft_limit"] == 500e6 and tokens["tpot_limit"] == 30e6
    assert run["loadgen_model"] == "llama3_1-8b-interactive" and run["scenario"] == "Interactive"
    summary = (log_dir / "summary.md").read_text()
    assert summary.startswith("# gptj MLPerf llama3.1-8b — Interactive, performance")
    assert "TTFT (time to first token): p99" in summary and "limit p99 500 ms" in summary
    assert "TPOT (time per output token): p99" in summary and "limit p99 30 ms" in summary
    assert "Completed tokens per second" in summary


@pytest.mark.parametrize("benchmark, scenario, model, ttft, tpot, samples", [
    ("llama3.1-8b", "Server", "llama3_1-8b", 2000, 100, 13368),
    ("llama3.1-8b", "Interactive", "llama3_1-8b-interactive", 500, 30, 13368),
    ("llama3.1-8b", "Offline", "llama3_1-8b", None, None, 13368),
    ("llama3.1-8b-edge", "SingleStream", "llama3_1-8b-edge", None, None, 5000),
])
def test_loadgen_settings_are_the_benchmarks(llama_dir, benchmark, scenario, model, ttft, tpot, samples):
    from gptj.mlperf import run as mlperf_run
    from gptj.mlperf.config import MLPerfConfig

    cfg = MLPerfConfig(model=llama_dir, benchmark=benchmark, scenario=scenario, mode="performance")
    assert cfg.loadgen_model == model and cfg.scenario_name == scenario
    settings = mlperf_run.test_settings(cfg, 20000)
    assert settings.use_token_latencies and settings.performance_sample_count_override == samples
    if ttft is not None:
        assert (settings.ttft_latency, settings.tpot_latency) == (ttft * 10**6, tpot * 10**6)


def test_user_conf_keys_are_read_under_the_runs_loadgen_model_name(llama_dir, tmp_path):
    from gptj.mlperf import run as mlperf_run
    from gptj.mlperf.config import MLPerfConfig

    conf = tmp_path / "user.conf"
    conf.write_text("gptj.Server.target_qps = 9\nllama3_1-8b.Server.target_qps = 7\n"
                    "llama3_1-8b-interactive.Server.target_qps = 3\nllama3_1-8b-edge.SingleStream.target_latency = 40\n")

    def settings(**kw):
        cfg = MLPerfConfig(model=llama_dir, mode="performance", user_conf=conf, **kw)
        return cfg, mlperf_run.test_settings(cfg, 100)

    assert settings(scenario="Server")[1].server_target_qps == 7
    assert settings(scenario="Interactive")[1].server_target_qps == 3
    cfg, edge = settings(benchmark="llama3.1-8b-edge", scenario="SingleStream")
    assert edge.single_stream_expected_latency_ns == 40 * 10**6 and not mlperf_run.needs_calibration(cfg)


def test_benchmark_follows_the_architecture_and_a_mismatch_is_one_line(llama_dir, tiny_checkpoint, tmp_path,
                                                                        capsys):
    from gptj.mlperf.config import MLPerfConfig

    assert MLPerfConfig(model=llama_dir).benchmark == "llama3.1-8b"
    assert MLPerfConfig(model=llama_dir).gen.num_beams == 1
    assert MLPerfConfig(model=tiny_checkpoint).benchmark == "gptj-99"
    assert MLPerfConfig(model=tiny_checkpoint).gen.num_beams == 4
    for model, extra, message in [
        (llama_dir, ["--benchmark", "gptj-99"], "--benchmark gptj-99 needs a gptj model"),
        (tiny_checkpoint, ["--benchmark", "llama3.1-8b-edge"], "--benchmark llama3.1-8b-edge needs a llama model"),
        (llama_dir, ["--scenario", "SingleStream"], "llama3.1-8b has no SingleStream scenario (SingleStream is "
                                                    "llama3.1-8b-edge's)"),
        (llama_dir, ["--benchmark", "llama3.1-8b-edge", "--scenario", "Server"], "llama3.1-8b-edge has no Server"),
        (tiny_checkpoint, ["--scenario", "Interactive"], "gptj-99 has no Interactive scenario"),
        (llama_dir, ["--round", "v5.0"], "--round sets gptj-99's round seeds (v5.0)"),
    ]:
        assert mlperf(model, tmp_path / "x", *extra) != 0
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "x").exists()
    # gptj submission takes its benchmark as gptj mlperf does: gptj-99 on a Llama folder is refused before any run
    assert main(["submission", "--model", str(llama_dir), "--out", str(tmp_path / "sub"), "--submitter", "s",
                 "--system-name", "n", "--division", "open", "--category", "edge", "--benchmark", "gptj-99",
                 "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "--benchmark gptj-99 needs a gptj model" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "sub").exists()


def test_an_answer_ends_at_any_of_the_tokenizers_eos_ids(llama_dir, tiny_checkpoint):
    """A llama run generates until any of the tokenizer's EOS ids (generation_config.json's two here, as
    Llama 3.1 Instruct's three), held back for min_new_tokens; a gptj-99 run keeps GPT-J's."""
    import threading

    from gptj.engine.config import EngineConfig
    from gptj.parallel.context import SINGLE
    from gptj.mlperf.config import MLPerfConfig
    from gptj.mlperf.run import with_tokenizer_eos
    from gptj.mlperf.sut import EngineBackend
    from gptj.runtime.build import build_engine
    from gptj.tokenizer import load_tokenizer, tokenizer_for_model
    from gptj.weights.io import load_model

    tok = load_tokenizer(llama_dir)
    gen = with_tokenizer_eos(MLPerfConfig(model=llama_dir), tok).gen
    assert gen.eos_ids == tok.eos_token_ids == (510, 511)  # <|end_of_text|>, <|eot_id|>
    assert (gen.num_beams, gen.min_new_tokens, gen.max_new_tokens, gen.sampling) == (1, 1, 128, False)
    gptj = MLPerfConfig(model=tiny_checkpoint)
    assert with_tokenizer_eos(gptj, tokenizer_for_model(tiny_checkpoint)) is gptj

    prompt = list(range(3, 40))
    free = greedy(llama_dir, [prompt], 12)[0]
    assert len(free) == 12 and not set(free) & {510, 511}  # (random weights: no EOS in 12 tokens)
    model = load_model(llama_dir)

    def answer(eos, min_new_tokens=1):
        backend = EngineBackend(lambda ctx: build_engine(model, EngineConfig(max_seqs=2, max_len=64)), SINGLE)
        got, done = [], threading.Event()
        try:
            backend.submit(prompt, gen.replace(eos_token_id=(511, eos), max_new_tokens=12,
                                               min_new_tokens=min_new_tokens),
                           on_done=lambda tokens, error: (got.append((tokens, error)), done.set()))
            assert done.wait(60)
        finally:
            backend.close()
        return got[0]

    stop_at = next(i for i in range(1, 12) if free[i] not in free[:i])  # a token whose first time is at i
    assert answer(free[stop_at]) == (free[:stop_at + 1], None)
    assert answer(free[0], min_new_tokens=2) != (free[:1], None)  # not at the first token: held back


TEST06 = Path(__file__).resolve().parents[1].parent / "shared" / "mlperf-inference" / "compliance" / "TEST06"


@pytest.mark.skipif(not (TEST06 / "run_verification.py").is_file(),
                    reason=f"MLCommons' compliance TEST06 is not at {TEST06} (github.com/mlcommons/inference)")
def test_compliance_test06_passes(llama_dir, short_set, tmp_path):
    """MLCommons' TEST06 (its audit.config, its run_verification.py) on a Server run: every first token is
    its answer's, no answer ends in two EOS, every token count is right. The audit config's 100 queries are
    cut to 8 here (min_query_count); the rest of it is MLCommons'."""
    audit = tmp_path / "audit.config"
    text = (TEST06 / "audit.config").read_text()
    assert "*.*.min_query_count = 100" in text and "*.*.accuracy_log_sampling_target = 100" in text
    audit.write_text(text.replace("*.*.min_query_count = 100", "*.*.min_query_count = 8"))
    log_dir = tmp_path / "TEST06-run"
    assert mlperf(llama_dir, log_dir, "--scenario", "Server", "--mode", "performance", "--dataset", str(short_set),
                  "--max-new-tokens", "6", "--target-qps", "20", "--audit-config", str(audit)) == 0
    entries = json.loads((log_dir / "mlperf_log_accuracy.json").read_text())
    assert len(entries) >= 8 and all("token_data" in e for e in entries)
    from gptj.tokenizer import load_tokenizer

    eos_ids = load_tokenizer(llama_dir).eos_token_ids
    for e in entries:  # what TEST06 checks, checked here too: at most one EOS, and only last; counts right
        ids = np.frombuffer(bytes.fromhex(e["data"]), np.int32).tolist()
        assert e["token_count"] == len(ids) and not set(ids[:-1]) & set(eos_ids)
        assert np.frombuffer(bytes.fromhex(e["token_data"]), np.int32).tolist() == ids[:1]
    eos = eos_ids[0]
    done = subprocess.run([sys.executable, str(TEST06 / "run_verification.py"), "-c", str(log_dir), "-o",
                           str(tmp_path / "out"), "-s", "Server", "-d", "int32", "-e", str(eos)],
                          capture_output=True, text=True, check=True)
    assert "First token check pass: True" in done.stdout and "EOS check pass: True" in done.stdout
    assert "Sample length check pass: True" in done.stdout and "TEST06 verification complete" in done.stdout


def test_speculate_gives_the_same_answers_is_marked_open_division_and_closed_refuses_it(llama_dir, short_set,
                                                                                       tmp_path, capsys):
    """`gptj mlperf --speculate ngram` (issue 60; MLPerf's open division): in float32 every sample's tokens are
    those of the run without it; the run says it is the open division's and counts its drafts; a closed
    submission and a run against a server refuse it in one line."""
    common = ["--mode", "accuracy", "--dataset", str(short_set), "--max-new-tokens", "24", "--dtype", "float32"]
    assert mlperf(llama_dir, tmp_path / "plain", *common) == 0
    assert mlperf(llama_dir, tmp_path / "spec", *common, "--speculate", "ngram", "--speculate-tokens", "3") == 0
    capsys.readouterr()
    plain, spec = read_log(tmp_path / "plain")[0], read_log(tmp_path / "spec")[0]
    assert sorted(spec) == [0, 1, 2, 3] and spec == plain
    run = json.loads((tmp_path / "spec" / "run.json").read_text())
    assert run["identity"]["generation"]["prompt_lookup_num_tokens"] == 3 and run["official_generation"] is False
    drafts = run["speculation"]
    assert 0 <= drafts["accepted"] <= drafts["drafted"] and drafts["drafted"] > 0
    assert json.loads((tmp_path / "plain" / "run.json").read_text())["speculation"] is None
    summary = (tmp_path / "spec" / "summary.md").read_text()
    assert "for MLPerf's open division only" in summary and f"{drafts['drafted']} drafted tokens" in summary

    args = ["submission", "--model", str(llama_dir), "--out", str(tmp_path / "out"), "--submitter", "s",
            "--system-name", "x", "--division", "closed", "--runs-dir", str(tmp_path / "runs"),
            "--speculate", "ngram"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err == "gptj submission: error: --speculate: MLPerf's closed division does not allow speculative " \
                  "decoding; submit it in --division open"
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()  # refused before any run
    assert main(["mlperf", "--server", "http://127.0.0.1:9", "--speculate", "ngram", "--quiet"]) == 1
    assert "--speculate with --server" in capsys.readouterr().err.strip()


def test_speculate_notes_say_what_a_beam_search_run_ignores():
    from gptj.decode import GenerationConfig
    from gptj.mlperf.config import MLPerfConfig
    from gptj.mlperf.report import notes_for

    beams = MLPerfConfig(model=Path("m"), benchmark="gptj-99",
                         gen=GenerationConfig.mlperf(prompt_lookup_num_tokens=5, max_matching_ngram_size=3))
    assert notes_for(beams, None, [])[0].startswith("--speculate changes nothing here: beam requests")
    greedy = MLPerfConfig(model=Path("m"), benchmark="gptj-99",
                          gen=GenerationConfig.mlperf(num_beams=1, prompt_lookup_num_tokens=5, max_matching_ngram_size=3))
    assert "open division only" in notes_for(greedy, None, [])[0]
    assert not any("speculat" in n for n in notes_for(MLPerfConfig(model=Path("m"), benchmark="gptj-99"), None, []))


@pytest.mark.parametrize("scenario", ["Offline", "Server"])
def test_a_llama_run_over_the_network_equals_the_run_in_process(llama_dir, short_set, tmp_path, capsys, scenario):
    """`gptj mlperf --server URL --model DIR` on a llama3.1-8b run (the folder gives the tokenizer and its EOS
    ids): a gptj server's answers are the in-process run's, token for token, ending at whichever of the
    tokenizer's EOS ids stopped them; Server streams, so every first token reaches LoadGen early."""
    from serve_util import running_server

    common = ["--model", str(llama_dir), "--scenario", scenario, "--mode", "accuracy", "--dataset", str(short_set),
              "--max-new-tokens", "16", "--target-qps", "100", "--dtype", "float32", "--quiet"]
    assert main(["mlperf", "--log-dir", str(tmp_path / "local"), *common]) == 0
    with running_server({"m": llama_dir}, max_batch_size=8) as url:
        assert main(["mlperf", "--server", url, "--log-dir", str(tmp_path / "remote"), "--server-concurrency", "4",
                     *common]) == 0
    capsys.readouterr()
    local, remote = read_log(tmp_path / "local")[0], read_log(tmp_path / "remote")[0]
    assert sorted(local) == [0, 1, 2, 3] and remote == local
    run = json.loads((tmp_path / "remote" / "run.json").read_text())
    assert run["remote"]["model"] == "m" and run["benchmark"] == "llama3.1-8b"
    assert run["sut"]["first_tokens"] == 4 and run["sut"]["duplicate_answers"] == 0
