"""No function or method under `h3lab/` is longer than `LIMIT` lines (rooms a person can hold in their
head). `kernels/` is outside `h3lab/` and not checked: a Triton kernel reads top to bottom.

A function's length is the lines from its `def` to its last statement (`end_lineno - lineno + 1`, docstring and
comments included, decorators not); nested functions and methods are measured on their own as well, and an outer
function counts the lines of what it nests. The files are read with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 80


def long_functions(root: Path, limit: int = LIMIT) -> list[str]:
    """"path:line name (N lines)" of every function or method under `root` longer than `limit` lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)")
    return out


def test_no_function_under_h3lab_is_longer_than_the_limit():
    offenders = long_functions(ROOT / "h3lab")
    assert not offenders, f"functions over {LIMIT} lines (split them into named steps):\n" + "\n".join(offenders)


def test_the_check_measures_functions_methods_and_nested_functions(tmp_path):
    """The scanner itself: a function of exactly `limit` lines passes, one more line fails, wherever it sits."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(4))  # def + 4 lines = 5
    (pkg / "a.py").write_text(f"def fits():\n{body}\n")
    assert long_functions(pkg, limit=5) == []
    (pkg / "a.py").write_text(f"def fits():\n{body}\n    return x0\n")
    assert long_functions(pkg, limit=5) == ["pkg/a.py:1 fits (6 lines)"]
    (pkg / "a.py").write_text(textwrap.dedent("""\
        class K:
            @property
            def m(self):
                def inner():
                    a = 1
                    b = 2
                    c = 3
                    return a + b + c
                return inner()
        """))
    assert long_functions(pkg, limit=5) == ["pkg/a.py:3 m (7 lines)"]
    assert long_functions(pkg, limit=4) == ["pkg/a.py:3 m (7 lines)", "pkg/a.py:4 inner (5 lines)"]
