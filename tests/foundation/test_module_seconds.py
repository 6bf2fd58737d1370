"""scripts/module_seconds.py: the per-module seconds of a `--durations=0` log (what tests/conftest.py orders the
modules by), and its refusals; the committed tests/module_seconds.json names only test modules that exist."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import module_seconds  # noqa: E402


def test_durations_lines_sum_per_module():
    log = """
============================ slowest durations =============================
12.50s call     tests/a/test_x.py::test_one[p-1]
2.25s setup    tests/a/test_x.py::test_one[p-1]
0.75s teardown tests/b/test_y.py::TestK::test_two
3.00s call     tests/b/test_y.py::test_three
(3 durations < 0.005s hidden.  Use -vv to show these durations.)
1 passed in 18.4s
"""
    assert module_seconds.module_seconds(log) == {"tests/a/test_x.py": 14.8, "tests/b/test_y.py": 3.8}


def test_refusals_are_one_line_and_exit_2(tmp_path):
    script = REPO / "scripts" / "module_seconds.py"
    empty = tmp_path / "empty.log"
    empty.write_text("1 passed in 0.1s\n")
    for argv, message in (([], "usage"), ([str(tmp_path / "nope.log")], "no such file"),
                          ([str(empty)], "no '--durations' lines")):
        run = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True)
        assert run.returncode == 2 and message in run.stderr and run.stderr.count("\n") == 1, run.stderr


def test_committed_weights_name_existing_modules():
    weights = json.loads((REPO / "tests" / "module_seconds.json").read_text(encoding="utf-8"))
    assert weights and all((REPO / name).is_file() and name.startswith("tests/") for name in weights)
    assert all(seconds >= 0 for seconds in weights.values())  # under 0.05 s rounds to 0.0: light
