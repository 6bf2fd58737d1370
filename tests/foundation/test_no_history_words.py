"""Names and words that describe the domain, not the calendar.

No file name, identifier, option value, comment, docstring or document under the code, test, benchmark, script and
documentation trees dates itself: no stage of development named by ordinal or number, no wave, no issue number, no
"before / after <event>" (the redesign, the merge, the fix). A comment says what a thing is and why; history lives in
`docs/history.md` and the commit messages, and superseded results in `benchmarks/results/archive/` (both exempt). The
result files' JSON contents keep the command lines they recorded (data, not prose); their names are checked.

`WORDS` holds the patterns of the shared before-stop hook and is stricter: `_` / `-` separators, plural issues, later
ordinals, and before/after an event. The examples below are joined from their words at run time, so this file passes
its own check.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TREES = ("h3lab", "kernels", "benchmarks", "scripts", "tests", "docs", "notebooks", "replays", "README.md", "Makefile")
EXEMPT = ("docs/history.md", "benchmarks/results/archive/")
RECORDED_DATA = ("benchmarks/results/",)  # JSON contents are recorded data: names checked, contents not
TEXT_SUFFIXES = {".py", ".md", ".sh", ".h3", ".ipynb", ".toml", ".txt", ".cfg", ".json", ".yaml", ".yml", ""}

ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            "fourteenth|fifteenth")
WORDS = re.compile(
    rf"\b(?:{ORDINALS}|this|last|next|previous|earlier|later|prior) sessions?\b"  # a stage of development by ordinal
    r"|\bsessions?[ _-]?#?[0-9]+"  # ... or by number, with or without a separator
    r"|\bwaves?[ _-]?#?[0-9]+"
    r"|\bissues? ?#?[0-9]+"
    r"|\brounds? of (?:work|review)\b"
    r"|\b(?:before|after)[ _-](?:the[ _-])?(?:redesign|refactor|rewrite|merge|merged tree|gc[ _-]fix|fix|fixes)\b",
    re.IGNORECASE)
NAMES = re.compile(
    r"(?:^|[_./-])(?:before|after)[_-]"  # forward_after_merge.json, lora_before_fp32.json
    r"|[_-](?:final|rerun|confirm|old|new|v[0-9]+_old)(?:[_.-]|$)"  # lora_step_graph_final.json
    r"|sessions?[_-]?[0-9]|waves?[_-]?[0-9]",
    re.IGNORECASE)


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", *TREES], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    return sorted({p for p in out.splitlines() if p and (REPO / p).is_file() and not p.startswith(EXEMPT)})


def _joined(*phrases: tuple[str, ...]) -> list[str]:
    return ["".join(words) for words in phrases]


def test_the_history_patterns_catch_what_they_name():
    dated = _joined(("the tenth ", "session's run"), ("This ", "session"), ("session", " 10"), ("session", "10"),
                    ("wave", " 3"), ("wave", "-3"), ("wave", "2"), ("issue", " 21"), ("issue", " #24"),
                    ("issues", " 11"), ("after the ", "redesign"), ("before the ", "merge"), ("rounds ", "of work"))
    for text in dated:
        assert WORDS.search(text), text
    for text in ("the session's device", "Session(path)", "h3lab-session", "a wave of sound", "the audio wave",
                 "before any model loads", "tissue" + " 3"):
        assert not WORDS.search(text), text
    names = _joined(("forward_every_length_", "session", "10.json"), ("forward_after_", "wave", "3_merge.json"),
                    ("lora_before_fp32.json",), ("lora_step_graph_final.json",), ("forward_every_length_rerun.json",))
    for name in names:
        assert NAMES.search(name), name
    for name in ("session_full.json", "final_latents.py", "forward_every_length_short.json"):
        assert not NAMES.search(name), name


def test_no_file_name_carries_history():
    found = [p for p in _tracked() if NAMES.search(Path(p).name)]
    assert not found, "file names that date themselves (name what they measure or hold): " + ", ".join(found)


def test_no_text_dates_itself():
    found = []
    for path in _tracked():
        if Path(path).suffix not in TEXT_SUFFIXES or path.startswith(RECORDED_DATA):
            continue
        try:
            text = (REPO / path).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            match = WORDS.search(line)
            if match:
                found.append(f"{path}:{number}: {match.group(0)!r}: {line.strip()[:120]}")
    assert not found, ("these lines speak of development history (say what the thing is and why; history goes to "
                       "docs/history.md):\n" + "\n".join(found))
