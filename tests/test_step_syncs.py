"""The step path never makes the host wait for the GPU, except where the allow-list says why.

On CUDA the host runs ahead of the device: while the GPU works through one step's kernels (a
replayed decode graph, a prefill's launches), the host prepares the next. Any of these stops it
until the stream catches up:

    torch.tensor(x, device=d)       a blocking host-to-device copy (it waits for the stream first)
    t.to(d), t.cuda()               the same, without non_blocking=True
    t.to(d, non_blocking=True)      from pageable memory the driver stages the copy, and may wait:
                                    only a pinned source is asynchronous, so such a copy goes
                                    through gptj.device.to_device (pinned first), or reads
                                    `x.pin_memory().to(d, non_blocking=True)` in place
    t.copy_(h, non_blocking=True)   the same, into an existing tensor
    .item() .tolist() .cpu() .numpy()  a device-to-host read: waits for everything before it
    .synchronize()                  a device, stream or event wait

The step path: every module under gptj/engine (attention backends included), and the functions of
gptj.beam, gptj.decode and gptj.device that it calls (found from its imports, then what those call in turn).
The check reads the source with `ast`, running nothing, so it holds on a machine without a GPU.
Triton kernels (`@triton.jit`) are device code and are skipped: their `.to` is a cast.

It cannot see syncs that read like ordinary code (`int(t)`, `if t:`, `t[mask]`, `t.nonzero()`),
nor calls into modules outside the path (gptj.models, gptj.lora): those are for a GPU profile.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from gptj.device import to_device
from gptj.engine import attention as att
from test_attention_backends import DEVICE, groups_of, make_pool

SRC = Path(__file__).resolve().parents[1] / "src"
ENGINE = SRC / "gptj" / "engine"
STEP_IMPORTS = ("gptj.beam", "gptj.decode", "gptj.device", "gptj.lora")  # lower modules whose functions the step calls
# functions a step runs inside the model's forward (no import of the engine's names them)
STEP_FORWARDS = {"gptj.lora": {"MultiLoRALinear.forward"}}

HOST_READS = ("item", "tolist", "cpu", "numpy", "nonzero")  # nonzero: its size is the data's, read back

# (file under src/gptj, enclosing function's qualified name, the call's source text) -> why it stays.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("engine/sampler.py", "choose", "flat.tolist()"):
        "THE sync of a step: every request's choice comes to the host in one copy (greedy drafts' rows too)",
    ("engine/draft.py", "ngram_draft", "np.resize(t[start:], k).tolist()"):
        "a numpy array of the request's tokens, on the host: no device is involved",
    ("engine/sampler.py", "verify", "(torch.isfinite(total) & (total > 0)).tolist()"):
        "a step with sampled drafts: whether each row is a distribution, then one draw per row (int(), "
        "a read each) until the first that is not the draft's: the draws must be plain decoding's",
    ("engine/update.py", "token_logprobs", "lp.gather(1, index[:, None])[:, 0].tolist()"):
        "log-probabilities asked for (logprobs / prompt_logprobs): the host must read them",
    ("engine/update.py", "token_logprobs", "ids.tolist()"): "the top-k log-probabilities asked for",
    ("engine/update.py", "token_logprobs", "values.tolist()"): "the top-k log-probabilities asked for",
    **{("beam.py", "BeamSearch.ranked", f"self.fin_{part}[b].tolist()"):
       "a beam request's end (once per request): its hypotheses come to the host"
       for part in ("valid", "lens", "tokens", "scores")},
    **{("beam.py", "BeamSearch.best", f"self.fin_{part}[:, 0].tolist()"):
       "gptj.decode.beam_search's end (not the engine's); BeamSearch is checked as a whole"
       for part in ("lens", "tokens", "scores")},
    ("device.py", "to_device", "host.to(device)"):
        "not CUDA (a CPU tensor's .to(cpu) is itself): no stream to run ahead of",
    ("engine/attention/cuda.py", "copy_blocks", "table.to(device)"):
        "not CUDA (Triton's interpreter on CPU tensors): no stream to run ahead of",
    ("engine/input_batch.py", "InputBatch._writable", "self.copied.synchronize()"):
        "the pinned host arrays are rewritten only after the last step's copies out of them "
        "(already done once that step's choices were read: a wait of nothing)",
    ("engine/input_batch.py", "_Buffer.copy",
     "self.device_tensor[start:end].copy_(self.host_tensor[start:end], non_blocking=True)"):
        "host_tensor is allocated pinned on CUDA (_Buffer.__init__), its reuse fenced by InputBatch.copied",
    ("engine/input_batch.py", "_numpy", "t.numpy()"):
        "a host tensor's own memory as a numpy array, made once per buffer: no device is read",
    ("engine/graphs.py", "GraphRunner.replay_ms", "end.synchronize()"):
        "a measurement after a run (never called in a step): it must wait to read the time",
}

# Whole files, for modules whose tensors never leave the host.
ALLOWED_FILES: dict[str, str] = {
    "engine/attention/cpu_native.py": "CPU tensors only: no device to wait for",
}


@dataclass(frozen=True)
class Finding:
    file: str  # under src/gptj
    function: str  # the enclosing function's qualified name ("<module>" at module level)
    call: str  # the call's source text
    rule: str  # what it does to the host

    def __str__(self) -> str:
        return f"{self.file}:{self.function}: {self.call}  [{self.rule}]"


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _is_pinned(node: ast.expr) -> bool:
    """`x.pin_memory()`: a source that is pinned by construction."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "pin_memory"


def _is_dtype(node: ast.expr) -> bool:
    """Whether `.to(node)` reads as a cast: torch.<dtype>, x.dtype, a name ending in dtype. Anything
    else (a device, a name the lint cannot tell) counts as a transfer."""
    text = ast.unparse(node)
    return (isinstance(node, ast.Attribute) and text.startswith("torch.")) or text.endswith("dtype")


def _moves(call: ast.Call) -> bool:
    """Whether a `.to(...)` / `.cuda(...)` call moves its tensor to a device."""
    if call.func.attr == "cuda":
        return True
    keywords = {k.arg for k in call.keywords}
    return "device" in keywords or (bool(call.args) and not _is_dtype(call.args[0]))


def rule_of(call: ast.Call) -> str | None:
    """Why this call makes the host wait, or None."""
    func = call.func
    keywords = {k.arg: k.value for k in call.keywords}
    non_blocking = _is_true(keywords.get("non_blocking"))
    if ast.unparse(func) in ("torch.tensor", "torch.as_tensor"):
        device = keywords.get("device")
        if device is not None and not (isinstance(device, ast.Constant) and device.value in (None, "cpu")):
            return "host data built on the device: a blocking copy"
        return None
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr in HOST_READS:
        return f".{func.attr}(): a device-to-host read"
    if func.attr == "synchronize":
        return "waits for the device"
    if func.attr in ("to", "cuda") and _moves(call):
        if not non_blocking:
            return "a blocking host-to-device copy"
        if not _is_pinned(func.value):
            return "non_blocking from memory not known to be pinned (use gptj.device.to_device)"
    if func.attr == "copy_" and non_blocking and call.args and not _is_pinned(call.args[0]):
        return "non_blocking copy_ from memory not known to be pinned"
    return None


class _Lint(ast.NodeVisitor):
    def __init__(self, file: str, only: set[str] | None) -> None:
        self.file, self.only = file, only
        self.scope: list[str] = []
        self.found: list[Finding] = []

    def _enter(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        if any(ast.unparse(d).split("(")[0].endswith("jit") for d in node.decorator_list):
            return  # a Triton kernel: device code
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_Call(self, node: ast.Call) -> None:
        name = ".".join(self.scope) or "<module>"
        rule = rule_of(node)
        if rule and (self.only is None or any(name == q or name.startswith(q + ".") for q in self.only)):
            self.found.append(Finding(self.file, name, ast.unparse(node), rule))
        self.generic_visit(node)


def lint(source: str, file: str = "<string>", only: set[str] | None = None) -> list[Finding]:
    """The findings in `source`: all of them, or those inside the functions named in `only`
    (qualified names; a class name takes its methods)."""
    linter = _Lint(file, only)
    linter.visit(ast.parse(source))
    return linter.found


def _called(module: ast.Module, roots: set[str]) -> set[str]:
    """roots (top-level names of `module`), and the module's functions and methods they call, in
    turn: a class stands for all its methods; a call is followed where it names one of the module's
    functions or classes, `Class.method`, or `self.method` / `cls.method` inside a class."""
    defs: dict[str, ast.AST] = {}
    for node in module.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defs[node.name] = node
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        defs[f"{node.name}.{item.name}"] = item
    seen: set[str] = set()
    todo = [r for r in roots if r in defs]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        node = defs[name]
        if isinstance(node, ast.ClassDef):
            todo += [f"{name}.{item.name}" for item in node.body if isinstance(item, ast.FunctionDef)]
            continue
        owner = name.split(".")[0] if "." in name else None
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            f = call.func
            if isinstance(f, ast.Name):
                todo.append(f.id)
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                base = owner if f.value.id in ("self", "cls") else f.value.id
                todo.append(f"{base}.{f.attr}")
        todo = [t for t in todo if t in defs]
    return seen


def step_path() -> list[Finding]:
    """The findings of the whole step path (see the module's docstring)."""
    found: list[Finding] = []
    imported: dict[str, set[str]] = {m: set(STEP_FORWARDS.get(m, ())) for m in STEP_IMPORTS}
    for path in sorted(ENGINE.rglob("*.py")):
        source = path.read_text()
        found += lint(source, str(path.relative_to(SRC / "gptj")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module in imported:
                imported[node.module] |= {alias.name for alias in node.names}
    for module, names in imported.items():
        path = SRC / Path(*module.split(".")).with_suffix(".py")
        tree = ast.parse(path.read_text())
        found += lint(path.read_text(), str(path.relative_to(SRC / "gptj")), only=_called(tree, names))
    return found


def _allowed(f: Finding) -> bool:
    return f.file in ALLOWED_FILES or (f.file, f.function, f.call) in ALLOWED


def test_the_step_path_makes_no_host_wait_outside_the_allow_list():
    unexplained = [str(f) for f in step_path() if not _allowed(f)]
    assert not unexplained, "host waits on the step path:\n  " + "\n  ".join(unexplained)


def test_every_allow_list_entry_still_matches_a_call():
    found = step_path()
    stale = [key for key in ALLOWED if key not in {(f.file, f.function, f.call) for f in found}]
    stale += [file for file in ALLOWED_FILES if not any(f.file == file for f in found)]
    assert not stale, f"allow-list entries that match nothing (remove them): {stale}"


def test_the_step_path_reaches_the_sampler_the_beams_update_and_decodes_helpers():
    """The walk covers what it must: the engine's files, and BeamSearch's per-step pass."""
    called = _called(ast.parse((SRC / "gptj" / "beam.py").read_text()), {"BeamSearch", "stacked_rows"})
    assert {"BeamSearch.advance", "BeamSearch.ranked", "_Stack.gather", "_scores", "_Rows.of", "_restack"} <= called
    called = _called(ast.parse((SRC / "gptj" / "decode.py").read_text()), {"penalty_args", "penalize"})
    assert "penalty_args" in called
    assert "greedy_or_sample" not in called  # gptj.decode's own generate loop is not the engine's step
    files = {p.relative_to(SRC / "gptj").as_posix() for p in ENGINE.rglob("*.py")}
    assert {"engine/sampler.py", "engine/update.py", "engine/runner.py", "engine/attention/base.py"} <= files


BANNED = {
    "torch.tensor(xs, device=self.device)": "host data built on the device",
    "torch.tensor(xs, dtype=torch.long, device='cuda')": "host data built on the device",
    "t.item()": ".item()",
    "t.tolist()": ".tolist()",
    "t.cpu()": ".cpu()",
    "t.numpy()": ".numpy()",
    "torch.cuda.synchronize()": "waits for the device",
    "event.synchronize()": "waits for the device",
    "t.to(device)": "a blocking host-to-device copy",
    "t.to(self.device)": "a blocking host-to-device copy",
    "t.to('cuda')": "a blocking host-to-device copy",
    "t.to(device=dev, dtype=torch.long)": "a blocking host-to-device copy",
    "t.cuda()": "a blocking host-to-device copy",
    "t.to(device, non_blocking=True)": "non_blocking from memory not known to be pinned",
    "torch.tensor(xs).to(dev, non_blocking=True)": "non_blocking from memory not known to be pinned",
    "t.cuda(non_blocking=True)": "non_blocking from memory not known to be pinned",
    "buf.copy_(host, non_blocking=True)": "non_blocking copy_ from memory not known to be pinned",
}

FINE = [
    "to_device(host_tensor(xs), device)",
    "host.pin_memory().to(device, non_blocking=True)",
    "buf.copy_(host.pin_memory(), non_blocking=True)",
    "torch.tensor(xs, dtype=torch.long)",  # a host tensor
    "torch.tensor(xs, device='cpu')",
    "torch.zeros(n, device=device)",  # made on the device: nothing copied
    "t.to(torch.int32)",  # casts
    "t.to(q.dtype)",
    "t.to(dtype)",
    "t.to(dtype=torch.float32)",
    "buf.copy_(other)",  # device to device, in stream order
    "t.tolist",  # not a call
]


@pytest.mark.parametrize("code", list(BANNED))
def test_the_lint_finds_each_banned_pattern(code):
    source = f"def step(self, t, xs, device, dev, host, buf, event):\n    return {code}\n"
    (finding,) = lint(source)
    assert finding.call == code and finding.function == "step" and BANNED[code] in finding.rule


@pytest.mark.parametrize("code", FINE)
def test_the_lint_passes_pinned_transfers_casts_and_device_made_tensors(code):
    assert lint(f"def step(t, xs, device, host, buf, other, q, dtype):\n    return {code}\n") == []


def test_the_lint_names_the_enclosing_method_and_skips_triton_kernels():
    source = '''
class Runner:
    def forward(self, tokens):
        def inner():
            return torch.tensor(tokens, device=self.device)
        return inner()

@triton.jit
def _kernel(x_ptr):
    x = tl.load(x_ptr).to(tl.int64).to(device)
'''
    (finding,) = lint(source, "engine/runner.py")
    assert (finding.file, finding.function) == ("engine/runner.py", "Runner.forward.inner")
    assert lint(source, only={"other"}) == [] and len(lint(source, only={"Runner"})) == 1


def test_the_runners_old_input_tensors_would_be_found():
    """The transfers this test was written against (ModelRunner._forward before one pinned copy per
    step): re-adding one fails the step-path test."""
    source = '''
class ModelRunner:
    def _forward(self, decode, prefill, out):
        ids = torch.tensor(tokens, device=self.device)[None]
        logits = self.model(ids, logits_to_keep=torch.tensor(keep, device=self.device))[0]
'''
    found = lint(source, "engine/runner.py")
    assert [f.call for f in found] == ["torch.tensor(tokens, device=self.device)",
                                       "torch.tensor(keep, device=self.device)"]
    assert not any(_allowed(f) for f in found)


@pytest.mark.cuda
def test_the_runners_rows_ride_in_the_steps_one_copy():
    """build_step(rows=...): the runner's ids, positions, keep and adapters come back as int64 views of
    the same device tensor as the write slots (one transfer), the DecodeTables' values with them."""
    kv = make_pool(2, 16, 8, 20, "float", torch.float32, seed=0)
    rows = [[11, 12, 13], [40, 41, 42], [0, 2], [1, 1, 0]]
    meta = att.build_step(kv, groups_of(8, list(range(20))), list(range(7)), [0] * 7,
                          [att.PrefillSegment([15, 16], 5, 3)], rows=rows)
    assert [r.tolist() for r in meta.rows] == rows
    assert all(r.dtype == torch.long and r.device.type == DEVICE for r in meta.rows)
    one_copy = meta.write_blocks.untyped_storage().data_ptr()
    assert all(r.untyped_storage().data_ptr() == one_copy for r in meta.rows + [meta.slots[0].positions])
    assert meta.tables.row0.tolist() == [0, 1, 2, 5, 7] and meta.tables.otab.dtype == torch.int32
    assert att.build_step(kv, [], [], [], []).rows == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.py runs it there)")
def test_on_cuda_to_device_returns_while_the_gpu_is_busy_and_a_blocking_copy_does_not():
    """The point of the pinned copy, timed: with ~0.5 s of work queued (torch.cuda._sleep), to_device
    returns at once and its values arrive in stream order; torch.tensor(x, device=) waits for the
    queue (so the timing can tell the two apart)."""
    import time

    def host_time(copy) -> float:
        torch.cuda.synchronize()
        torch.cuda._sleep(10 ** 9)  # spins the GPU ~0.5 s (1e9 cycles at 2 GHz)
        t0 = time.perf_counter()
        out = copy()
        elapsed = time.perf_counter() - t0
        assert out.tolist() == list(range(1000))
        return elapsed

    host_time(lambda: to_device(torch.arange(1000), "cuda"))  # (CUDA's and the host allocator's first use)
    assert host_time(lambda: to_device(torch.arange(1000), "cuda")) < 0.05
    assert host_time(lambda: torch.tensor(list(range(1000)), device="cuda")) > 0.2
