"""Module docstrings state the module's contract and the reason for it in a few lines: at most 30, the
long explanations are in docs/. Read from the source with ``ast`` (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "autotuner"
MOST_LINES = 30


def long_module_docstrings(root: Path) -> list[str]:
    """``path: N lines`` for each module under ``root`` whose docstring runs past MOST_LINES."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)), clean=False)
        lines = len(text.splitlines()) if text else 0
        if lines > MOST_LINES:
            found.append(f"{path.relative_to(root.parent)}: {lines} lines")
    return found


def test_no_module_docstring_runs_past_30_lines() -> None:
    assert long_module_docstrings(SOURCE) == []


def test_a_long_docstring_is_found(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text('"""One line."""\n')
    (tmp_path / "pkg" / "long.py").write_text('"""' + "line\n" * 31 + '"""\n')
    assert long_module_docstrings(tmp_path / "pkg") == ["pkg/long.py: 31 lines"]
