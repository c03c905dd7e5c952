"""The linear layers' kernels chosen once (gptj.quant.base, gptj.policy.LINEAR_TABLE): a layer asks the
policy at its first call per device and dtype (or where a model is prepared for serving, from one
probe), then switches on its row count alone; every threshold of the table names its figures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from gptj import policy, quant
from gptj.config import GPTJConfig
from gptj.kernels import prepare_for_serving
from gptj.models.gptj import build_model
from gptj.policy import ALL_ROWS, Capabilities, RowPlan
from gptj.quant.base import LinearMethod, choose_methods, pin_path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "PERFORMANCE.md"


def heading_anchors(text: str) -> set[str]:
    """A Markdown file's anchors: GitHub's of its headings (lower case, punctuation dropped, spaces as -)
    and its <a id="..."> tags."""
    headings = {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
                for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}
    return headings | set(re.findall(r'<a (?:id|name)="([^"]+)"', text))


def test_every_threshold_of_the_table_names_its_figures_and_they_exist():
    anchors = heading_anchors(DOCS.read_text())
    for route in policy.LINEAR_TABLE:
        bounded = callable(route.rows) or route.rows != (0, ALL_ROWS)
        assert route.figures or not bounded, f"{route} has a threshold but names no figures"
        for ref in route.figures.split(", "):
            assert not ref.startswith("#") or ref[1:] in anchors, f"{ref} is not a heading of docs/PERFORMANCE.md"
    # ...and the check could fail: a made-up anchor is not there
    assert "policy-no-such-figures" not in anchors


def test_each_kind_ends_in_a_route_for_any_rows_on_any_device():
    """The table's first match always exists: each weight kind's last route takes every row, everywhere."""
    for kind in policy.WEIGHT_KINDS:
        last = [r for r in policy.LINEAR_TABLE if r.weight == kind][-1]
        assert (last.device, last.rows, last.when) == (policy.ANY, (0, ALL_ROWS), policy._always), kind


def test_a_method_switches_on_the_rows_alone():
    plan = RowPlan(((2, 4, "a"), (0, 8, "b"), (0, ALL_ROWS, "c")))
    method = LinearMethod(plan, {p: (lambda layer, x2, p=p: p) for p in "abc"})
    got = [method.apply(None, torch.empty(rows, 3)) for rows in (0, 1, 2, 4, 5, 8, 9, 4096)]
    assert got == ["b", "b", "a", "a", "b", "b", "c", "c"]
    assert [method.path(r) for r in (1, 3, 9)] == ["b", "a", "c"]


@pytest.fixture
def probes(monkeypatch):
    """Counts Capabilities.probe's calls."""
    calls = []
    real = Capabilities.probe.__func__

    def counted(cls, device):
        calls.append(str(device))
        return real(cls, device)

    monkeypatch.setattr(Capabilities, "probe", classmethod(counted))
    return calls


def int8_layer() -> quant.Int8Linear:
    torch.manual_seed(0)
    return quant.Int8Linear.from_float(torch.nn.Linear(64, 48))


def test_a_layer_asks_the_policy_once_per_dtype_until_it_is_prepared_again(probes, monkeypatch):
    m = int8_layer()
    x = torch.randn(3, 64)
    y = m(x)
    assert probes == ["cpu"]
    for rows in (1, 7, 40):  # other row counts: the same method, no new question
        m(torch.randn(rows, 64))
    assert probes == ["cpu"]
    m(x.bfloat16())  # another dtype: its own choice
    assert probes == ["cpu", "cpu"]
    # what the policy says now no longer reaches the layer ...
    with monkeypatch.context() as patched:
        patched.setattr("gptj.quant.base.linear_plan", lambda *a, **k: pytest.fail("asked the policy again"))
        assert torch.equal(m(x), y)
    m.to("cpu")  # ... until a move (or a cast, a load) prepares it again
    m(x)
    assert probes[-1] == "cpu" and len(probes) == 3


def test_preparing_a_model_for_serving_chooses_every_layers_kernels_from_one_probe(probes):
    cfg = GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_inner=128, n_positions=64)
    model = build_model(cfg).eval()
    quant.quantize_model(model, "int8")
    layers = [m for m in model.modules() if isinstance(m, quant.QuantLinear)]
    probes.clear()
    prepare_for_serving(model, "off")  # the kernels' mode "off" keeps the layers, still choosing their kernels
    assert probes == ["cpu"] and all(m._methods for m in layers)
    with torch.no_grad():
        model(torch.randint(0, 100, (2, 5)))
    assert probes == ["cpu"]  # the calls asked nothing
    assert choose_methods(model, torch.bfloat16) == len(layers) and probes == ["cpu", "cpu"]


def test_a_pinned_path_runs_at_every_row_count_until_the_next_prepare():
    m = int8_layer()
    x = torch.randn(5, 64)
    chosen = m.path(x)
    other = policy.DEQUANTIZE if chosen != policy.DEQUANTIZE else policy.WEIGHT_ONLY
    pin_path(m, other, x.dtype)
    assert {m.path(torch.randn(r, 64)) for r in (1, 5, 600)} == {other}
    m.prepare()
    assert m.path(x) == chosen
