"""House rules that a reviewer would otherwise check by hand."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "flashsgd"
MAX_FUNCTION_LINES = 80


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_long_function_without_a_reason():
    """A function over 80 lines says why in its docstring ("Long because ...")."""
    long = [f"{p.relative_to(SRC)}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
            for p in sorted(SRC.rglob("*.py")) for f in _functions(p)
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES
            and "Long because" not in (ast.get_docstring(f) or "")]
    assert long == []


def test_source_cites_papers_and_code_not_project_notes():
    """Docstrings and comments point at papers and code, not at design notes or issue numbers."""
    pattern = re.compile(r"DESIGN\.md|REFERENCES\.md|\bissue \d+", re.IGNORECASE)
    hits = [f"{p.relative_to(SRC)}:{i}: {line.strip()}" for p in sorted(SRC.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
