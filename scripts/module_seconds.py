"""Write tests/module_seconds.json, the seconds each test module took, from a pytest log run with `--durations=0`.

    TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -n 2 --dist loadscope --durations=0 > suite.log
    .venv/bin/python scripts/module_seconds.py suite.log

tests/conftest.py hands the heaviest modules out first (`pytest_collection_modifyitems`), so the weights only need to
be roughly right; a module that is not in the file counts as light. Durations under pytest's 0.005 s display floor
are not printed and do not count. The file is replaced atomically.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from h3lab.io_utils import atomic_write_text

LINE = re.compile(r"^\s*(?P<seconds>\d+(?:\.\d+)?)s\s+(?:call|setup|teardown)\s+(?P<node>tests/\S+?\.py)(?:::|\s|$)")
OUT = Path(__file__).resolve().parent.parent / "tests" / "module_seconds.json"


def module_seconds(log: str) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        match = LINE.match(line)
        if match:
            totals[match["node"]] += float(match["seconds"])
    return {node: round(seconds, 1) for node, seconds in sorted(totals.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: module_seconds.py PYTEST_LOG (a log of a run with --durations=0)", file=sys.stderr)
        return 2
    path = Path(argv[0])
    if not path.is_file():
        print(f"error: {path}: no such file", file=sys.stderr)
        return 2
    totals = module_seconds(path.read_text(encoding="utf-8", errors="replace"))
    if not totals:
        print(f"error: {path}: no '--durations' lines (run pytest with --durations=0)", file=sys.stderr)
        return 2
    atomic_write_text(OUT, json.dumps(totals, indent=1) + "\n")  # heaviest first, as a reader scans it
    print(f"{OUT}: {len(totals)} modules, {sum(totals.values()):.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
