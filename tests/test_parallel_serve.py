"""`gptj serve` and `gptj mlperf` with --tp 2 / --pp 2: rank 0 leads, rank 1 follows its engine step by
step (gptj.parallel.lockstep); answers equal the single-process ones."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys

import openai
import pytest

from gptj.cli import main
from test_mlperf_run import read_accuracy_log
from test_serve import _open_stream, call, generate_cli
from test_serve_cli import free_port, start, wait_healthy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("par-models") / "tiny"
    assert main(["init", "--preset", "tiny", "--out", str(out), "--seed", "3"]) == 0
    return out


_WANT: dict = {}


def want_ids(tiny, capsys, *args):
    """`gptj generate`'s (float32) token ids for args: the same for every parallel flag, run once."""
    key = (str(tiny), args)
    if key not in _WANT:
        _WANT[key] = generate_cli(tiny, capsys, *args)[0]["token_ids"]
    return _WANT[key]


def ids(url, **body):
    status, out, _ = call(url, body={"model": "tiny", "return_token_ids": True, **body})
    assert status == 200, out
    return [c["token_ids"] for c in out["choices"]]


@pytest.mark.parametrize("flag", ["--tp", "--pp"])
def test_serve_parallel_equals_one_process(tiny, capsys, flag):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # float32: the served answers are compared with `gptj generate`'s (float32), token for token
    proc = start(["--model", f"tiny={tiny}", "--port", str(port), flag, "2", "--log-level", "warning",
                  "--dtype", "float32"])
    try:
        wait_healthy(proc, url)
        prompt = "The quick brown fox"
        for body, flags in (({"temperature": 0}, ["--temperature", "0"]),
                            ({"temperature": 0, "n": 2, "best_of": 3, "use_beam_search": True},
                             ["--num-beams", "3"]),
                            ({"temperature": 0.9, "top_k": 20, "seed": 11},
                             ["--temperature", "0.9", "--top-k", "20", "--seed", "11"])):
            want = want_ids(tiny, capsys, "--prompt", prompt, "--max-new-tokens", "10", *flags)
            assert ids(url, prompt=prompt, max_tokens=10, **body)[0] == want, body

        # unseeded sampling: rank 0 seeds it for every rank; the ranks agree, so the answer comes back
        (sampled,) = ids(url, prompt=prompt, max_tokens=10, temperature=1.0, ignore_eos=True)
        assert len(sampled) == 10

        # a dropped stream is aborted on every rank (else the next steps would disagree and hang)
        conn, resp = _open_stream(url, {"model": "tiny", "prompt": "drop me", "max_tokens": 200,
                                        "temperature": 0, "ignore_eos": True})
        assert resp.readline().startswith(b"data: ")
        conn.close()

        # concurrent requests batch together on every rank and equal their solo answers
        prompts = [f"Request number {i}" for i in range(6)]
        solo = [want_ids(tiny, capsys, "--prompt", p, "--max-new-tokens", "8", "--temperature", "0") for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda p: ids(url, prompt=p, max_tokens=8, temperature=0)[0], prompts))
        assert got == solo
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        chunks = list(client.completions.create(model="tiny", prompt=prompts[0], max_tokens=8, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks) == client.completions.create(
            model="tiny", prompt=prompts[0], max_tokens=8, temperature=0).choices[0].text

        proc.send_signal(signal.SIGTERM)  # to gptj: rank 0 drains, then stops rank 1
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def mlperf_common(tiny):
    return ["mlperf", "--model", str(tiny), "--scenario", "Offline", "--mode", "accuracy", "--max-examples", "3",
            "--num-beams", "2", "--max-new-tokens", "10", "--min-new-tokens", "2", "--quiet"]


@pytest.fixture(scope="module")
def mlperf_one_process(tiny, tmp_path_factory):
    """The one-process run every grid is compared with, made once."""
    log_dir = tmp_path_factory.mktemp("mlperf") / "one"
    assert main([*mlperf_common(tiny), "--log-dir", str(log_dir)]) == 0
    return log_dir


@pytest.mark.parametrize("grid", [["--tp", "2"], ["--tp", "2", "--pp", "2"]], ids=["tp2", "tp2xpp2"])
def test_mlperf_parallel_equals_one_process(tiny, mlperf_one_process, tmp_path, capsys, grid):
    proc = subprocess.run([sys.executable, "-m", "gptj.cli", *mlperf_common(tiny), "--log-dir", str(tmp_path / "two"),
                           *grid], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "summary.md" in proc.stdout  # rank 0 reports, once
    assert proc.stdout.count("summary.md") == 1
    one, two = read_accuracy_log(mlperf_one_process)[0], read_accuracy_log(tmp_path / "two")[0]
    assert sorted(one) == [0, 1, 2] and two == one
    accuracy = [json.loads((d / "accuracy.json").read_text()) for d in (mlperf_one_process, tmp_path / "two")]
    for a in accuracy:
        a.pop("log_path")
    assert accuracy[0] == accuracy[1]


@pytest.mark.parametrize("args, message", [
    (["serve", "--model", "a={m}", "--model", "b={m}", "--tp", "2"], "serve one model"),
    (["serve", "--model", "{m}", "--tp", "2", "--admin-token", "t"], "serve one model"),
    (["serve", "--model", "{m}", "--tp", "2", "--ray", "--device", "cuda"], "needs --gpus-per-replica 2"),
    (["publish", "x", "{m}", "--server", "http://127.0.0.1:1", "--tp", "2"], "need --ray-address"),
    (["serve", "--model", "{m}", "--tp", "2", "--pp", "3"], "needs at least 3 layers"),  # before any rank starts
    (["mlperf", "--server", "http://127.0.0.1:1", "--tp", "2"], "with --server"),
])
def test_parallel_flag_errors_are_one_line(tiny, capsys, args, message):
    assert main([a.format(m=tiny) for a in args]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
