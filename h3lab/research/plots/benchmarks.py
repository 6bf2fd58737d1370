"""Benchmark figures: `load_benchmarks` (a results folder, the DESIGN "Evidence" schema), `benchmark_summary`,
`benchmark_figure(s)`, `impl_colors`, `case_labels`.

The package docstring (`h3lab.research.plots`) is the contract of every figure."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from .figure import (
    BASELINE_IMPLS,
    BENCHMARK_KEYS,
    BENCHMARK_RESULT_KEYS,
    FONT_PT,
    IMPL_COLORS,
    MAX_WIDTH_IN,
    PlotError,
    _wrap,
    finish,
    new_figure,
)

# =============================================================================================== benchmarks
def load_benchmarks(folder: str | os.PathLike) -> tuple[list[dict], list[str]]:
    """Read every `*.json` in `folder` (sorted by name). Returns (documents that follow the schema, with the result
    entries that do; one line per file that was skipped or partly skipped: "NAME: why", e.g. "x.json: 84 results
    lack shape, impl"). A document none of whose results follows the schema is skipped whole. A missing or empty folder gives ([], [one line]): never an error.
    Result entries with an `error` instead of timings are kept (drawn as failures)."""
    root = Path(folder)
    if not root.is_dir():
        return [], [f"{root}: no such folder (no benchmark results yet)"]
    docs, problems = [], []
    for path in sorted(root.glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            problems.append(f"{path.name}: not readable JSON ({str(err).splitlines()[0]})")
            continue
        if not isinstance(doc, dict):
            problems.append(f"{path.name}: top level is {type(doc).__name__}, not an object")
            continue
        missing = [k for k in BENCHMARK_KEYS if k not in doc]
        if missing or not isinstance(doc.get("results"), list):
            problems.append(f"{path.name}: lacks {', '.join(missing) or 'a results list'}")
            continue
        kept, lacking_keys = [], {}
        for entry in doc["results"]:
            need = ("shape", "impl", "error") if isinstance(entry, dict) and "error" in entry else BENCHMARK_RESULT_KEYS
            lacking = [k for k in need if not isinstance(entry, dict) or k not in entry]
            if lacking:
                for k in lacking:
                    lacking_keys[k] = lacking_keys.get(k, 0) + 1
                continue
            kept.append(entry)
        total = len(doc["results"])
        if total and len(kept) < total:
            what = f"{total} results" if not kept else f"{total - len(kept)} of {total} results"
            problems.append(f"{path.name}: {what} lack {', '.join(lacking_keys)}")
        if kept or not total:
            docs.append({**doc, "results": kept, "file": path.name})
    if not docs and not problems:
        problems.append(f"{root}: no *.json results yet")
    return docs, problems


def skipped_line(problems: Sequence[str]) -> str:
    """The problems of `load_benchmarks` in one line ("" when none)."""
    if not problems:
        return ""
    return "skipped (not in the DESIGN schema): " + "; ".join(problems)


_CASE_KEYS = ("proj", "op", "product", "case", "pass", "what", "metric", "rows", "factor_dtype", "fp32_variant", "gc",
              "precision", "split")  # `backend` goes with the impl


def case_labels(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """One label per result entry that tells the cases of a file apart: the shape plus every descriptive key
    (`_CASE_KEYS`; `rows` as "N rows") whose value varies within the file, a repeated value said once; entries of
    one implementation that would still share a label get " #2", " #3", ..."""
    varying = [k for k in _CASE_KEYS if len({str(e.get(k)) for e in results}) > 1]
    labels = []
    for e in results:
        parts = [str(e["shape"])] if "shape" in e else []
        for k in varying:
            value = f"{e.get(k)} rows" if k == "rows" else str(e.get(k, "-"))
            if k == "split" and k in e:
                value = "split" if e[k] else "one program"
            if value not in parts:
                parts.append(value)
        labels.append(" ".join(parts) or "?")
    seen: dict[tuple[str, str], int] = {}
    out = []
    for label, e in zip(labels, results):
        key = (label, str(e.get("impl")))
        seen[key] = seen.get(key, 0) + 1
        out.append(label if seen[key] == 1 else f"{label} #{seen[key]}")
    return out


def impl_colors(docs: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """implementation -> colour, the same in every benchmark figure (`IMPL_COLORS`, then tab10 by name)."""
    import matplotlib

    impls = sorted({str(e["impl"]) for d in docs for e in d["results"]})
    free = [c for c in (matplotlib.colors.to_hex(c) for c in matplotlib.colormaps["tab10"].colors)
            if c not in IMPL_COLORS.values()]
    out, i = {}, 0
    for impl in impls:
        if impl in IMPL_COLORS:
            out[impl] = IMPL_COLORS[impl]
        else:
            out[impl] = free[i % len(free)]
            i += 1
    return out


def baseline_impl(doc: Mapping[str, Any]) -> str | None:
    """The implementation a file's times are divided by: the first of `BASELINE_IMPLS` it has that timed a case
    another implementation timed too, else None (then its figure shows seconds). None for a document labelled
    "bytes only" (shared-device ranks: its times are host-staged, never scaling)."""
    if str(doc.get("label", "")).startswith("bytes only"):  # shared-device runs: times are never a ratio
        return None
    results = doc["results"]
    cases: dict[str, set[str]] = {}
    for label, e in zip(case_labels(results), results):
        if _median(e) is not None:
            cases.setdefault(str(e["impl"]), set()).add(label.split(" #")[0])
    for base in BASELINE_IMPLS:
        if base in cases and any(cases[base] & c for impl, c in cases.items() if impl != base):
            return base
    return None


def _median(e: Mapping[str, Any]) -> float | None:
    m = e.get("median_s")
    return float(m) if isinstance(m, (int, float)) and not isinstance(m, bool) and math.isfinite(m) else None


def benchmark_rows(docs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows (benchmark, file, case, impl, median_s, baseline, ratio = median / the baseline's median of the same
    case in the same file, vs_diffusers, peak GiB, error) for a text table; a value that does not exist is None."""
    out = []
    for doc in docs:
        labels = case_labels(doc["results"])
        base_impl = baseline_impl(doc)
        base: dict[str, float] = {}
        for label, e in zip(labels, doc["results"]):
            if str(e["impl"]) == base_impl and _median(e) is not None:
                base.setdefault(label.split(" #")[0], _median(e))
        for label, e in zip(labels, doc["results"]):
            med = _median(e)
            ref = base.get(label.split(" #")[0])
            ratio = med / ref if med is not None and ref else None
            peak = e.get("peak_mem_gib")
            out.append({
                "benchmark": doc["name"], "file": doc.get("file", ""), "case": label, "impl": e["impl"],
                "median_s": med, "baseline": base_impl, "ratio": ratio,
                "vs_diffusers": ratio if base_impl == "diffusers" else None,
                "peak_mem_gib": float(peak) if isinstance(peak, (int, float)) and math.isfinite(peak) else None,
                "error": e.get("error"),
            })
    return out


def _seconds(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def benchmark_figure(doc: Mapping[str, Any], *, colors: Mapping[str, str] | None = None,
                     max_cases: int = 48, page: int = 0) -> Figure:
    """One benchmark file: a horizontal bar per (case, implementation). With a baseline (`baseline_impl`) the bar is
    time / the baseline's time of the same case, measured in the same run (a line at 1); without one it is the
    median time in seconds. Both on a linear axis from 0; every bar is labelled with its seconds; failed entries are
    marked "x" at 0. More than `max_cases` cases are split into pages (`page`, 0-based; the title says which)."""
    colors = dict(colors or impl_colors([doc]))
    rows = benchmark_rows([doc])
    base = baseline_impl(doc)
    cases = list(dict.fromkeys(r["case"].split(" #")[0] if base else r["case"] for r in rows))
    pages = max(1, math.ceil(len(cases) / max_cases))
    if not 0 <= page < pages:
        raise PlotError(f"page={page}: {doc.get('file', doc['name'])} has {pages} page(s) of {max_cases} cases")
    cases = cases[page * max_cases:(page + 1) * max_cases]
    impls = [i for i in dict.fromkeys(str(r["impl"]) for r in rows) if i != base]
    if base is None:
        impls = list(dict.fromkeys(str(r["impl"]) for r in rows))
    case_of = (lambda r: r["case"].split(" #")[0]) if base else (lambda r: r["case"])
    per_case = {c: [i for i in impls if any(case_of(r) == c and str(r["impl"]) == i for r in rows)] for c in cases}
    widest = max(len(v) for v in per_case.values())
    fig = new_figure(MAX_WIDTH_IN, 1.4 + 0.26 * len(cases) * max(1, widest) ** 0.6)
    ax = fig.add_subplot(1, 1, 1)
    top = 0.0
    for impl in impls:
        ys, xs, hs, texts, fails = [], [], [], [], []
        for r in rows:
            case = case_of(r)
            if str(r["impl"]) != impl or case not in cases:
                continue
            present = per_case[case]  # bars of the implementations this case has, side by side
            bar_h = 0.8 / len(present)
            y = cases.index(case) - 0.4 + bar_h * (present.index(impl) + 0.5)
            value = r["ratio"] if base else r["median_s"]
            if r["error"] or value is None:
                fails.append(y)
                continue
            ys.append(y)
            xs.append(value)
            hs.append(bar_h)
            texts.append(f"{value:.3g}x ({_seconds(r['median_s'])})" if base else _seconds(value))
        ax.barh(ys, xs, height=hs, color=colors[impl], label=impl)
        for y, x, t in zip(ys, xs, texts):
            ax.text(x, y, " " + t, va="center", ha="left", fontsize=FONT_PT)
        if fails:
            ax.plot([0.0] * len(fails), fails, "x", color="red", markersize=7, label=f"{impl} failed")
        top = max([top] + xs)
    if base:
        ax.axvline(1.0, color=colors.get(base, "black"), linewidth=1.2, linestyle="--", label=f"{base} = 1")
        ax.set_xlabel(f"time / {base} time of the same case, same run (linear, from 0)", fontsize=FONT_PT)
    else:
        ax.set_xlabel("median time, seconds (linear, from 0)", fontsize=FONT_PT)
    ax.set_xlim(0, max(top, 1.0 if base else 0.0) * 1.35 or 1.0)  # room for the bar labels
    ax.set_yticks(range(len(cases)), cases, fontsize=FONT_PT)
    ax.set_ylim(len(cases) - 0.5, -0.5)
    ax.tick_params(axis="x", labelsize=FONT_PT)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=FONT_PT, loc="lower right")
    part = f" (page {page + 1} of {pages})" if pages > 1 else ""
    bytes_only = " - BYTES ONLY (shared device), not scaling" if str(doc.get("label", "")).startswith(
        "bytes only") else ""
    fig.suptitle(_wrap(f"{doc['name']} ({doc.get('file', '')}){part}{bytes_only} - {doc['gpu']} - "
                       f"torch {doc['torch']} triton {doc['triton']} - rev {str(doc['git_rev'])[:10]} - "
                       f"{doc['date']}", 120), fontsize=9)
    return finish(fig)


def benchmark_figures(docs: Sequence[Mapping[str, Any]], max_cases: int = 48) -> list[Figure]:
    """`benchmark_figure` of every document (every page), one colour per implementation across all of them; a document
    with no timed rows (every section failed, or a CPU diagnosis) draws no figure."""
    colors = impl_colors(docs)
    out = []
    for doc in docs:
        cases = len(set(r["case"].split(" #")[0] for r in benchmark_rows([doc])))
        if not cases:
            continue
        for page in range(max(1, math.ceil(cases / max_cases))):
            out.append(benchmark_figure(doc, colors=colors, max_cases=max_cases, page=page))
    return out


def benchmark_summary(docs: Sequence[Mapping[str, Any]], *, title: str = "benchmarks") -> Figure:
    """One row per (benchmark file, implementation other than the file's baseline): the median over the file's cases
    of time / baseline time of the same case (same run), a line from the smallest to the largest ratio, on a linear
    axis from 0 with a line at 1. Files without a baseline are listed by name below the axes. With no documents, one
    axes that says so."""
    if not docs:
        fig = new_figure(6.0, 2.0)
        ax = fig.add_subplot(1, 1, 1)
        ax.axis("off")
        ax.text(0.5, 0.5, "no benchmark results yet", ha="center", va="center", fontsize=11)
        fig.suptitle(title, fontsize=10)
        return fig
    colors = impl_colors(docs)
    entries, no_base = [], []
    for doc in docs:
        base = baseline_impl(doc)
        rows = benchmark_rows([doc])
        if base is None:
            no_base.append(doc.get("file", doc["name"]))
            continue
        for impl in dict.fromkeys(str(r["impl"]) for r in rows):
            ratios = [r["ratio"] for r in rows if str(r["impl"]) == impl and r["ratio"] is not None]
            if impl != base and ratios:
                entries.append((f"{doc['name']} ({doc.get('file', '')}) vs {base}", impl, ratios))
    fig = new_figure(MAX_WIDTH_IN, 1.6 + 0.3 * max(1, len(entries)))
    ax = fig.add_subplot(1, 1, 1)
    labels = []
    for y, (label, impl, ratios) in enumerate(entries):
        med = float(np.median(ratios))
        ax.barh([y], [med], color=colors[impl], height=0.7, label=impl if impl not in ax.get_legend_handles_labels()[1] else None)
        ax.plot([min(ratios), max(ratios)], [y, y], color="black", linewidth=1)
        ax.text(max(ratios), y, f"  median {med:.3g}x over {len(ratios)} case(s), {min(ratios):.3g}-{max(ratios):.3g}",
                va="center", fontsize=FONT_PT)
        labels.append(label)
    ax.axvline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_yticks(range(len(labels)), labels, fontsize=FONT_PT)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    top = max([1.0] + [max(r) for _, _, r in entries])
    ax.set_xlim(0, top * 1.6)
    ax.set_xlabel("time / baseline time of the same case, same run (bar: median over cases, line: range; 1 = baseline)",
                  fontsize=FONT_PT)
    ax.tick_params(axis="x", labelsize=FONT_PT)
    ax.grid(alpha=0.3, axis="x")
    if entries:
        ax.legend(fontsize=FONT_PT, loc="lower right")
    if no_base:
        fig.supxlabel(_wrap("no baseline implementation (absolute times in their own figures): " + ", ".join(no_base),
                            110), fontsize=FONT_PT)
    fig.suptitle(title, fontsize=10)
    return finish(fig)
