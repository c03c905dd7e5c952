"""The import graph of src/gptj: no circles, and the lower layers never import the higher ones.

Read from the source with `ast`, nothing imported: every `import` and `from ... import` anywhere in
a module counts (at module level, inside a function, under `if TYPE_CHECKING:`), since a deferred
import still ties the two modules together. Relative imports are resolved; `from gptj.x import y`
is an import of the submodule gptj.x.y where y is one, else of gptj.x; an import of a package is
an import of its __init__.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "gptj"

# The lower layers: the model, its weights, quantization and kernels, and what they stand on. They
# are what engine, runtime, parallel, mlperf, serve, train, bench and cli are built from, and must
# never reach back up to them (top-level names under gptj; a package counts with everything in it).
LOWER = {"config", "errors", "fallback", "files", "tokenizer", "models", "generation_config", "beam", "decode", "quant", "kernels", "native", "weights", "policy",
         "cpu", "device", "threads", "lora"}
HIGHER = {"engine", "runtime", "parallel", "mlperf", "serve", "train", "bench", "cli"}

# Known imports from a lower layer up to a higher one: (importer, imported), each with why it stands.
# An entry here is a debt to pay, not a design. (None today: runtime's shared helpers moved below,
# to gptj.device and gptj.threads; convert's tensor-parallel shards are written by the CLI's hook.)
LAYER_EXCEPTIONS: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package by its __init__)."""
    found = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the package that `name` imports, anywhere in its source."""

    def owner(dotted: str) -> str | None:  # the longest prefix that is one of our modules
        parts = dotted.split(".")
        while parts:
            if ".".join(parts) in known:
                return ".".join(parts)
            parts.pop()
        return None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(filter(None, (owner(alias.name) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from . import x` in package p is `from p import x`
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                target = submodule if submodule in known else owner(base)
                if target is not None:
                    found.add(target)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a -> b -> ... -> a) for each strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle_in(group, graph) for group in groups]


def _circle_in(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start} in {sorted(group)}")  # cannot happen in an SCC


def layer(module: str) -> str:
    """The top-level name under gptj a module belongs to (gptj.quant.ops -> quant)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_import_circle_in_gptj():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles in src/gptj:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_lower_layers_never_import_higher_ones():
    bad = sorted((src, dst) for src, targets in import_graph().items() for dst in targets
                 if layer(src) in LOWER and layer(dst) in HIGHER
                 and (src, dst) not in LAYER_EXCEPTIONS)
    assert not bad, "lower layers importing higher ones:\n" + "\n".join(f"{s} -> {d}" for s, d in bad)


def test_the_layers_name_real_modules():
    """The layer lists and exceptions name what exists, so a rename cannot quietly empty the rule,
    and an exception that is no longer needed is noticed (and removed)."""
    graph = import_graph()
    present = {layer(m) for m in graph}
    assert (LOWER | HIGHER) <= present, sorted((LOWER | HIGHER) - present)
    stale = sorted((s, d) for s, d in LAYER_EXCEPTIONS if d not in graph.get(s, ()))
    assert not stale, f"layer exceptions that no longer occur (remove them): {stale}"


# --- the checker itself, on small made-up graphs and sources ------------------------------------


def test_find_cycles_names_the_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_imports_are_resolved_relative_function_level_and_submodules(tmp_path):
    pkg = tmp_path / "gptj"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import x\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from gptj import other\n    from .. import top\n")
    (pkg / "other.py").write_text("from gptj.sub import leaf\nimport gptj.top\nimport torch\n")
    (pkg / "top.py").write_text("")
    known = {"gptj": pkg / "__init__.py", "gptj.sub": pkg / "sub" / "__init__.py",
             "gptj.sub.leaf": pkg / "sub" / "leaf.py", "gptj.other": pkg / "other.py", "gptj.top": pkg / "top.py"}
    assert imports_of("gptj.sub", known["gptj.sub"], known) == {"gptj.sub.leaf"}
    assert imports_of("gptj.sub.leaf", known["gptj.sub.leaf"], known) == {"gptj.other", "gptj.top"}
    assert imports_of("gptj.other", known["gptj.other"], known) == {"gptj.sub.leaf", "gptj.top"}
