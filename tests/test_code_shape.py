"""The size limits of src/gptj (issue 58): no Python file over MAX_FILE_LINES lines, no function or
method over MAX_FUNCTION_LINES (def to its last line, decorators not counted), and no source comment
that dates what it says (a measurement belongs in docs/PERFORMANCE.md, with its date, and a comment
links there). Read with `ast` and `tokenize`, nothing imported; each check is also run on a sample
that breaks it, so a check that found nothing anywhere would fail."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "gptj"
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 100

# A date in a comment: 2026-11 or 2026-11-28 (ISO), or a month and year (Nov 2026, November 2026).
MONTHS = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec"
DATED = re.compile(rf"\b(19|20)\d\d-(0[1-9]|1[0-2])\b|\b({MONTHS})[a-z]*\.? (19|20)\d\d\b")


def long_file(path: Path) -> int | None:
    """The file's line count where it is over MAX_FILE_LINES, else None."""
    lines = len(path.read_text(encoding="utf-8").splitlines())
    return lines if lines > MAX_FILE_LINES else None


def long_functions(path: Path) -> list[tuple[str, int]]:
    """(name, lines) of each function or method in the file (nested ones too) over MAX_FUNCTION_LINES."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def dated_comments(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each comment in the file that carries a date."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    return [(tok.start[0], tok.string) for tok in tokens if tok.type == tokenize.COMMENT and DATED.search(tok.string)]


def sources() -> list[Path]:
    """Every Python file of the package."""
    return sorted(SRC.rglob("*.py"))


def where(path: Path) -> str:
    """A file as the messages name it: gptj/..."""
    return str(path.relative_to(SRC.parent))


def test_no_file_is_over_the_limit():
    found = [f"{where(p)}: {n} lines" for p in sources() if (n := long_file(p)) is not None]
    assert not found, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(found)


def test_no_function_is_over_the_limit():
    found = [f"{where(p)}: {name} ({n} lines)" for p in sources() for name, n in long_functions(p)]
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


def test_no_comment_carries_a_date():
    found = [f"{where(p)}:{line}: {text}" for p in sources() for line, text in dated_comments(p)]
    assert not found, "dated comments (the measurement goes to docs/PERFORMANCE.md):\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for(tmp_path):
    """A sample with a function over the limit (a decorated async method), one at it, and more lines
    than a file may have; a file at the limit; comments with and without a date."""

    def statements(n: int, indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    sample = tmp_path / "sample.py"
    sample.write_text("class C:\n    @staticmethod\n    async def over():\n" + statements(MAX_FUNCTION_LINES, " " * 8)
                      + "\n\ndef at_limit():\n" + statements(MAX_FUNCTION_LINES - 1, " " * 4)
                      + "# more\n" * MAX_FILE_LINES, encoding="utf-8")
    assert long_functions(sample) == [("over", MAX_FUNCTION_LINES + 1)]
    assert long_file(sample) == len(sample.read_text(encoding="utf-8").splitlines()) > MAX_FILE_LINES
    exact = tmp_path / "exact.py"
    exact.write_text("x = 1\n" * MAX_FILE_LINES, encoding="utf-8")
    assert long_file(exact) is None
    dated = tmp_path / "dated.py"
    dated.write_text("x = 1  # 2.1x faster (2026-11-28)\n# measured in Nov 2026: 12 ms\n"
                     '"""2026-11-28 in a string is no comment"""\n# 4096 x 2048 on fp8 e4m3, 2026 tokens\n',
                     encoding="utf-8")
    assert [line for line, _ in dated_comments(dated)] == [1, 2]
