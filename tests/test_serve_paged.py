"""/metrics reports the engine's paged KV memory: blocks used, cached and total, and the prefix cache."""

from __future__ import annotations

from gptj.cli import main
from serve_util import server_thread
from test_serve import call, metric


def test_metrics_report_kv_blocks_and_prefix_hits(tmp_path):
    assert main(["init", "--preset", "tiny", "--out", str(tmp_path / "tiny"), "--seed", "1"]) == 0
    prompt = "The same long opening instruction, shared by every request of a benchmark. " * 8
    with server_thread({"tiny": tmp_path / "tiny"}) as server:
        total = metric(server.url, "gptj_kv_blocks", model="tiny", state="total")
        assert total >= 1 and metric(server.url, "gptj_kv_blocks", model="tiny", state="used") == 0
        assert metric(server.url, "gptj_prefix_cache_hit_tokens_total", model="tiny") == 0
        for tail in ("first", "second"):
            status, out, _ = call(server.url, body={"model": "tiny", "prompt": prompt + tail, "max_tokens": 2,
                                                    "temperature": 0})
            assert status == 200, out
        hits = metric(server.url, "gptj_prefix_cache_hit_tokens_total", model="tiny")
        queried = metric(server.url, "gptj_prefix_cache_queried_tokens_total", model="tiny")
        # the second request found the first's full blocks of the shared text (16 tokens each)
        assert hits >= 16 and hits % 16 == 0 and queried > hits
        assert metric(server.url, "gptj_prefix_cache_hit_rate", model="tiny") == hits / queried
        assert metric(server.url, "gptj_kv_blocks", model="tiny", state="cached") >= hits // 16
        assert metric(server.url, "gptj_kv_blocks", model="tiny", state="used") == 0  # all returned
        # two requests in ample memory: none waited for a block, none was preempted
        assert metric(server.url, "gptj_kv_stalls_total", model="tiny") == 0
        assert metric(server.url, "gptj_preemptions_total", model="tiny") == 0
