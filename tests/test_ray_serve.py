"""Replicas with Ray Serve, on a local Ray instance started as a user would (`ray start --head`):
`gptj serve --ray` with 2 replicas, the openai client through the gateway and the model's own route,
`gptj ls / publish (a --tp 2 replica) / unpublish --ray-address`, a replica killed mid-service,
SIGTERM, user errors."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is an optional extra: pip install -e '.[ray]'")

import openai  # noqa: E402

import gptj.serve as gptj_serve  # noqa: E402
from gptj.cli import main  # noqa: E402
from test_serve import TOK, call, generate_cli, models, text_of  # noqa: E402, F401 - models: the fixture
from test_serve_cli import free_port  # noqa: E402

RAY = str(Path(sys.executable).parent / "ray")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}


def gptj(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "gptj.cli", *args], capture_output=True, text=True, env=ENV,
                          timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray instance (head node on loopback): `ray start --head --block` in a session of its
    own, stopped afterwards, with all its processes, by signalling that process. Not `ray stop`: it
    stops every Ray instance on the machine, test_ray_multinode.py's too when pytest-xdist runs it
    beside this module."""
    temp = tmp_path_factory.mktemp("ray")
    # Ray's token authentication, with a token of this test's own (not ~/.ray/auth_token)
    (temp / "auth_token").write_text(secrets.token_hex(32))
    ENV.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(temp / "auth_token"))
    port = free_port()
    log_path = temp / "ray-start.log"
    with open(log_path, "wb") as log:
        head = subprocess.Popen([RAY, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
                                 "--num-cpus=4", "--include-dashboard=false", "--disable-usage-stats",
                                 "--object-store-memory=100000000", f"--temp-dir={temp}"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                # one node, nowhere to move replicas to: on SIGTERM stop at once, no drain
                                env={**ENV, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
    try:
        deadline = time.monotonic() + 300
        while "Ray runtime started" not in log_path.read_text(errors="replace"):
            assert head.poll() is None and time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()  # SIGTERM: `ray start --block` stops the Ray processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        with contextlib.suppress(ProcessLookupError):  # whatever of its session is left
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def served(cluster, models):
    """`gptj serve --ray` with 2 replicas of tiny; yields (base URL, process)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gptj.cli", "serve", "--ray", "--address", cluster,
                             "--model", f"tiny={models / 'tiny'}", "--replicas", "2", "--port", str(port),
                             "--dtype", "float32"],  # answers compared with `gptj generate`'s (float32)
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                status, body, _ = call(url, "GET", "/health", timeout=5)
            except OSError:
                status = None
            if status == 200 and body["models"] == ["tiny"]:
                break
            time.sleep(0.5)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def ls(cluster):
    return json.loads(gptj("ls", "--ray-address", cluster, "--json").stdout)


def greedy(models, capsys, name, prompt, n):
    (want,) = generate_cli(models / name, capsys, "--prompt", prompt, "--max-new-tokens", str(n), "--temperature", "0")
    return want["token_ids"]


def complete(url, model, prompt, n=8, headers=None):
    status, body, _ = call(url, body={"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                                      "return_token_ids": True}, headers=headers)
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def spawned_children(pid: int) -> list[int]:
    """Process ids of `pid`'s multiprocessing-spawned children (Linux /proc; not its resource tracker)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid and b"spawn_main" in command:
            out.append(int(stat.parent.name))
    return out


def _state_of(pid: int) -> str:
    """A process's state letter (Z: exited, not yet reaped), or "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_ls_on_a_cluster_serve_never_ran_on_lists_nothing(cluster):
    """(first in the module: before `served` starts Serve on the cluster) no Serve instance is no
    published model, not an internal error."""
    proc = gptj("ls", "--ray-address", cluster)  # (--json's rows are the same list: [] at the end of the module)
    assert proc.stdout.split() == ["NAME", "REPLICAS", "STATUS", "ROUTE"] and proc.stderr == ""


def test_openai_client_through_the_gateway_and_the_models_route(served, models, capsys):
    url, _ = served
    prompt = "The quick brown fox"
    want = greedy(models, capsys, "tiny", prompt, 12)
    for base in (url + "/v1", url + "/tiny/v1"):  # the gateway routes by model; /tiny is the model's own route
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"return_token_ids": True})
        assert out.choices[0].token_ids == want and out.choices[0].text == text_of(want)
        assert out.usage.prompt_tokens == len(TOK.encode(prompt))
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, extra_body={"return_token_ids": True}))
        assert len(chunks) > 1  # streamed through the gateway, not gathered
        assert [t for c in chunks for t in (c.choices[0].token_ids or [])] == want
        assert [m.id for m in client.models.list().data] == ["tiny"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt=prompt, max_tokens=2)
    # the gateway's own checks answer in OpenAI's error format
    status, body, _ = call(url, raw=b"{not json")
    assert status == 400 and "malformed JSON" in body["error"]["message"]
    status, body, _ = call(url, body={"prompt": "x"})
    assert status == 400 and body["error"]["param"] == "model"
    status, body, _ = call(url, body={"model": "tiny", "prompt": "x", "max_tokens": -1})  # the replica's 400
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body, _ = call(url, path="/v1/chat/completions",  # routed too: GPT-J's replica has no chat template
                           body={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and body["error"]["code"] == "no_chat_template"


def test_ls_shows_both_replicas(served, cluster):
    (row,) = ls(cluster)
    assert (row["name"], row["status"], row["route"]) == ("tiny", "RUNNING", "/tiny")
    assert row["replicas_running"] == row["replicas_target"] == 2
    assert len({r["pid"] for r in row["replicas"]}) == 2
    table = gptj("ls", "--ray-address", cluster).stdout.splitlines()
    assert table[0].split() == ["NAME", "REPLICAS", "STATUS", "ROUTE"]
    assert table[1].split() == ["tiny", "2/2", "RUNNING", "/tiny"]


def test_publish_and_unpublish(served, cluster, models, capsys):
    """publish with --tp 2: the replica is rank 0 of a tensor-parallel pair, the other rank its child
    process; its answers equal one process's; unpublishing removes the route and stops both ranks."""
    url, _ = served
    out = gptj("publish", "other", str(models / "other"), "--ray-address", cluster, "--replicas", "1",
               "--api-key", "K", "--tp", "2", "--dtype", "float32").stdout
    assert "published other (1 replica, route /other)" in out
    rows = ls(cluster)  # (each `gptj ls` joins the cluster: seconds)
    assert {r["name"]: r["replicas_running"] for r in rows} == {"tiny": 2, "other": 1}
    (replica,) = next(r for r in rows if r["name"] == "other")["replicas"]
    (follower,) = spawned_children(replica["pid"])  # the other rank
    want = greedy(models, capsys, "other", "Hello", 8)
    assert want != greedy(models, capsys, "tiny", "Hello", 8)  # a different model: routing is checked
    key = {"Authorization": "Bearer K"}
    assert complete(url, "other", "Hello", headers=key) == want
    assert complete(url + "/other", "other", "Hello", headers=key) == want
    for base in (url, url + "/other"):  # the replica checks the key, through the gateway too
        status, body, _ = call(base, body={"model": "other", "prompt": "x", "max_tokens": 2})
        assert status == 401 and body["error"]["type"] == "authentication_error"
    assert [m["id"] for m in call(url, "GET", "/v1/models")[1]["data"]] == ["tiny"]
    assert [m["id"] for m in call(url, "GET", "/v1/models", headers=key)[1]["data"]] == ["other", "tiny"]

    again = gptj("publish", "other", str(models / "other"), "--ray-address", cluster, check=False)
    assert again.returncode == 1 and again.stderr.strip() == \
        "gptj publish: error: model 'other' is already published; unpublish it first"

    assert gptj("unpublish", "other", "--ray-address", cluster).stdout.strip() == "unpublished other"
    assert [r["name"] for r in ls(cluster)] == ["tiny"]
    deadline = time.monotonic() + 120
    while Path(f"/proc/{follower}").exists() and _state_of(follower) != "Z":
        assert time.monotonic() < deadline, "the replica's other rank outlived it"
        time.sleep(0.5)
    assert call(url + "/other", body={"model": "other", "prompt": "x", "max_tokens": 2})[0] == 404  # route gone
    status, body, _ = call(url, body={"model": "other", "prompt": "x", "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert complete(url, "tiny", "Hello") == greedy(models, capsys, "tiny", "Hello", 8)


def test_killing_a_replica_the_other_keeps_answering(served, cluster, models, capsys):
    url, _ = served
    want = greedy(models, capsys, "tiny", "Kill", 8)
    (row,) = ls(cluster)
    victim = row["replicas"][0]["pid"]
    os.kill(victim, signal.SIGKILL)
    for _ in range(6):
        assert complete(url, "tiny", "Kill") == want
        assert complete(url + "/tiny", "tiny", "Kill") == want
    deadline = time.monotonic() + 300  # Ray Serve replaces the dead replica
    while True:
        (row,) = ls(cluster)
        pids = {r["pid"] for r in row["replicas"] if r["state"] == "RUNNING"}
        if len(pids) == 2 and victim not in pids:
            break
        assert time.monotonic() < deadline, row
        time.sleep(1)


def test_cluster_user_errors_are_one_line(served, cluster, tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    for args, message in (
            (["publish", "broken", str(tmp_path / "broken"), "--ray-address", cluster], "publishing 'broken' failed"),
            (["unpublish", "ghost", "--ray-address", cluster], "model 'ghost' is not published")):
        proc = gptj(*args, check=False)
        assert proc.returncode == 1, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr
    assert [r["name"] for r in ls(cluster)] == ["tiny"]  # the failed publish left nothing behind


def test_publish_past_its_timeout_says_what_it_asked_for_and_removes_the_application(served, cluster, models):
    """More CPUs per replica than the 4-CPU cluster has: the replica can never be placed. publish
    gives up at --timeout, names the resources asked for and free, and leaves nothing behind."""
    proc = gptj("publish", "starved", str(models / "other"), "--ray-address", cluster, "--cpus-per-replica", "64",
                "--timeout", "3", check=False)
    assert proc.returncode == 1, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "replica(s) were not running within 3 s" in line and "asks for 64 CPU" in line, line
    assert "CPUs free" in line and "the application was removed" in line, line
    assert [r["name"] for r in ls(cluster)] == ["tiny"]


def test_flag_errors_without_a_cluster(models, capsys, monkeypatch):
    for args, message in ((["serve", "--model", str(models / "tiny"), "--replicas", "2"], "--replicas needs --ray"),
                          (["publish", "x", str(models), "--server", "http://127.0.0.1:1", "--replicas", "2"],
                           "--replicas needs --ray-address"),
                          # checked before reaching the cluster (there is none at this address)
                          (["publish", "bad name", str(models), "--ray-address", "127.0.0.1:1"], "model name"),
                          (["publish", "gptj-gateway", str(models), "--ray-address", "127.0.0.1:1"], "reserved")):
        assert main(args) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err
    # no cluster at the address: one line at once (Ray alone retries for minutes, with warnings)
    assert main(["ls", "--ray-address", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("gptj ls: error: cannot reach the Ray cluster at 127.0.0.1:1: connection refused (is `ray "
                           "start --head` running there, and is that its GCS port?)"), err
    # without Ray installed: one line that says how to install it
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.delitem(sys.modules, "gptj.serve.ray_serve", raising=False)
    monkeypatch.delattr(gptj_serve, "ray_serve", raising=False)
    assert main(["ls", "--ray-address", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and 'pip install -e ".[ray]"' in err, err


def test_the_cluster_commands_module_does_not_import_torch():
    """`gptj ls / unpublish --ray-address` import gptj.serve.ray_serve in a process of their own; the
    server's modules (torch) are imported only where a replica or the gateway runs them."""
    probe = "import sys, gptj.serve.ray_serve; print(sorted(m for m in ('torch', 'gptj.engine') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


def test_sigterm_stops_serving_and_removes_the_applications(served, cluster):
    url, proc = served
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 0, proc.communicate()
    assert ls(cluster) == []
