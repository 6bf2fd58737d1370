"""The ablation matrix: the rows (`ROWS`, `Ablation`, `Expected`) and the runner (`run_ablation`, `run_matrix`,
`summarize`, `format_table`). A factor row's transform comes from `factors.TABLE`, the other rows' probes and checks
from `probes.py`. The contract is the package docstring (`h3lab.research.ablation`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ...execution import runtime
from ..drift import DriftError, DriftPoint, DriftReport, Execution, compare, pass_label
from ...run import ResolvedRun
from .bench import Bench, tiny_bench
from .factors import TABLE, AblationError
from .fusions import check_fusion
from .probes import (
    _check_A5,
    _check_HC7,
    _probe_C1,
    _probe_H15,
    _probe_HC1,
    _probe_HC3,
    _probe_HC6,
    _probe_repeat,
    _probe_sealed_replay,
    factor_probe,
)
from .ratio import check_ratio

KINDS = ("PASS", "DRIFT", "REJECTED", "N/A")


# =================================================================================================== signatures
@dataclass(frozen=True)
class Expected:
    kind: str
    point: str | None = None
    step: int | None = None
    block_point: str | None = None

    def describe(self) -> str:
        if self.kind == "PASS":
            return "PASS byte-equal"
        if self.kind == "DRIFT":
            where = pass_label(self.step)  # passes numbered from 1, as drift prints them
            block = f"; first in-block drift {self.block_point}" if self.block_point else ""
            return f"EXPECTED DRIFT at {self.point} ({where}){block}"
        if self.kind == "REJECTED":
            return "REJECTED as non-comparable"
        return "N/A"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "point": self.point, "step": self.step, "block_point": self.block_point}


PASS = Expected("PASS")


def drift_at(point: str, step: int = 0, block_point: str | None = None) -> Expected:
    return Expected("DRIFT", point, step, block_point)


@dataclass(frozen=True)
class Ablation:
    """One row of the matrix. `probe(bench, mode) -> (reference arm, probe arm)` for comparison rows; `check(bench,
    mode) -> (status, observed, passed, report)` for N/A and control rows without two arms. A factor row also has
    `transform(run) -> run` (a `ResolvedRun` with the perturbation applied) and the things it `changes`; its probe
    is the bench spec with the factor on."""

    name: str
    factor: str
    description: str
    apply: str
    expected: Expected
    mode: str
    scope: str
    rfc: str
    probe: Callable[["Bench", str], tuple[Execution, Execution]] | None = None
    check: Callable[["Bench", str], tuple[str, str, bool | None, DriftReport | None]] | None = None
    transform: Callable[[ResolvedRun], ResolvedRun] | None = None
    changes: tuple[str, ...] = ()
    distributed: str = ""  # a distributed row: what its arms run (h3lab.research.ablation.distributed)



# ================================================================================================== the matrix
def _check_C2(bench, mode):
    """C2 has no prefill/decode handoff in H3: it runs the H-C2 row and reports it."""
    row = run_ablation("H-C2", bench, mode)
    ok = row["passed"] is True
    observed = f"N/A: no autoregressive cache handoff in H3; replaced by H-C2 ({row['observed']})"
    return "N/A" if ok else "FAIL", observed, ok, None


def _row(name, factor, description, apply, expected, mode, scope, rfc, probe=None, check=None) -> Ablation:
    """A row; a factor row (named in `factors.TABLE`) takes its transform and changes from there, its probe is the
    bench spec with the factor on."""
    f = TABLE.get(name)
    if f is not None:
        probe = factor_probe(name)
    return Ablation(name, factor, description, apply, expected, mode, scope, rfc, probe, check,
                    f.transform if f else None, f.changes if f else ())


def _distributed(name, factor, description, expected, scope, rfc, arms) -> Ablation:
    f = TABLE.get(name)
    return Ablation(name, factor, description, "distributed", expected, "strict", scope, rfc,
                    transform=f.transform if f else None, changes=f.changes if f else (), distributed=arms)


ROWS: dict[str, Ablation] = {r.name: r for r in (
    # ---- 6.1 base taxonomy
    _row("A0", "Strict shared replay",
         "the strict reference trajectory sealed to disk, loaded, and replayed from its sealed inputs",
         "control", PASS, "strict", "trajectory", "PASS, byte-equal", probe=_probe_sealed_replay),
    _row("A1", "Position / RoPE", "one target video row moved one unit along h in position_ids", "input change",
         drift_at("rope_cos", 0, "blocks.0.q_rope"), "off", "trajectory",
         "EXPECTED DRIFT at first affected attention layer"),
    _row("A2", "Q/K preprocessing", "block Q/K RMSNorm epsilon 1e-5 -> 0.1 (refiner norms untouched)",
         "op override", drift_at("blocks.0.q_norm"), "off", "trajectory", "EXPECTED DRIFT at Q/K norm or QK"),
    _row("A3", "Mask / sequence boundary", "the packed document split in two halves that do not attend to each other",
         "op override", drift_at("blocks.0.attention"), "off", "trajectory", "EXPECTED DRIFT at attention"),
    _distributed("A4", "TP/CP logical ownership", "CP ranks holding each other's rows (and their metadata)",
                 Expected("REJECTED"), "forward", "REJECTED as non-comparable",
                 "one process vs cp 2 with the row shards rotated (2 gloo ranks)"),
    _row("A5", "KV-cache identity / layout", "no KV cache in H3: checks the model carries no state across calls",
         "control", Expected("N/A"), "off", "forward", "N/A; fail if a runtime silently introduces cache semantics",
         check=_check_A5),
    _row("A6", "Precision / rounding policy",
         "AdaLN modulation computed in float32 and rounded once (cast point moved)",
         "op override", drift_at("blocks.0.modulate1"), "off", "trajectory", "EXPECTED DRIFT at changed boundary"),
    _distributed("A7", "KV block plan / merge order",
                 "a CP ring-attention plan (2 KV blocks per rank, online softmax, bf16 running output) merged in "
                 "canonical block order vs in rank order", drift_at("blocks.0.attention"), "forward",
                 "EXPECTED DRIFT when order changes", "cp 2 ring canonical merge vs cp 2 ring rank-order merge (2 gloo "
                 "ranks); as a factor of one process: two KV blocks with bf16 partials merged in reverse order"),
    _distributed("C0", "TP partition preserving head mapping",
                 "the row-parallel layers partitioned by output columns (n_split) instead of K chunks, heads kept on "
                 "their ranks", PASS, "forward", "PASS, byte-equal", "one process vs tp 2 n_split (2 gloo ranks)"),
    _row("C1", "Sample alone vs packed batch row", "the request at batch position 1 of 2 beside another request",
         "input change", PASS, "strict", "trajectory", "PASS, byte-equal", probe=_probe_C1),
    _row("C2", "Prefill tail vs decode tail", "no autoregressive cache handoff in H3; runs H-C2 instead", "control",
         Expected("N/A"), "strict", "trajectory", "N/A; replaced by H-C2", check=_check_C2),
    # ---- 6.2 H3-specific probes
    _row("H1", "Packed row order", "rows permuted, position_ids left unpermuted (illegal permutation)",
         "layout change", drift_at("rope_cos", 0, "blocks.0.q_rope"), "off", "trajectory",
         "packed_index_copy or first MM-RoPE/AdaLN use"),
    _row("H2", "Modality tag", "one target video row tagged audio", "layout change", drift_at("blocks.0.modulate1"),
         "off", "trajectory", "first block AdaLN modulation"),
    _row("H3", "Timestep-table index", "one target video row's timestep index offset by one (every pass)",
         "layout change", drift_at("blocks.0.modulate1"), "off", "trajectory", "first block AdaLN modulation"),
    _row("H4", "AdaLN table layout", "blocks address the timestep-major table modality-major (tag*T + t_index)",
         "op override", drift_at("blocks.0.modulate1"), "off", "trajectory", "first block AdaLN gather"),
    _row("H5", "Partial MM-RoPE", "standard rotate-half RoPE over all head channels instead of 2*3*F",
         "op override", drift_at("blocks.0.q_rope"), "off", "trajectory", "first layer Q/K after RoPE"),
    _row("H6", "Q/K norm and RoPE order", "RoPE applied before the Q/K RMSNorm", "op override",
         drift_at("blocks.0.q_norm"), "off", "trajectory", "first layer Q/K"),
    _row("H7", "Mixed precision", "the float32 video input projection computed in bfloat16", "op override",
         drift_at("video_proj_in"), "off", "trajectory", "corresponding projection or timestep MLP"),
    _row("H8", "Attention document", "causal mask over the packed document", "op override",
         drift_at("blocks.0.attention"), "off", "trajectory", "first attention softmax/output"),
    _row("H9", "Velocity sign", "x0 = x_t - sigma*v", "sampler change", drift_at("scheduler.video"), "off",
         "trajectory", "first scheduler step"),
    _row("H10", "Timestep convention", "the model sees t = sigma instead of 1 - sigma", "sampler change",
         drift_at("time_sinusoid"), "off", "trajectory", "timestep embedding before first block"),
    _row("H11", "Sigma grid", "generic flow-matching grid: shifted linspace(1, 1/1000) + terminal 0",
         "sampler change", drift_at("schedule.video_sigmas", -1), "off", "trajectory",
         "scheduler construction or first differing step"),
    _row("H12", "Dual scheduler ownership", "audio shares the video grid (shift 12)", "sampler change",
         drift_at("schedule.audio_sigmas", -1), "off", "trajectory", "first modality whose sigma differs"),
    _row("H13", "Euler arithmetic", "x_next = x_t + (sigma - sigma_next) * v (reordered expression)",
         "sampler change", drift_at("scheduler.video"), "off", "trajectory", "scheduler step"),
    _row("H14", "Output-row selection", "stale selection index (every selected row one off)", "op override",
         drift_at("video_out"), "off", "trajectory", "output selection"),
    _row("H15", "Conditioning augmentation", "anchor noise drawn from another seed", "input change",
         drift_at("input.video"), "off", "trajectory", "input latent before transformer", probe=_probe_H15),
    _row("H16", "Variant identity", "the Ref2VA transformer (transformer_ref/) runs the FL2VA layout",
         "model change", drift_at("video_proj_in"), "off", "trajectory", "checkpoint mapping or packed input"),
    _distributed("H17", "Distributed metadata", "hidden rows sharded, per-row metadata not (local row j reads "
                 "global row j)", drift_at("blocks.0.modulate1"), "forward", "first local AdaLN/MM-RoPE use",
                 "one process vs cp 2 with the metadata left unsharded (2 gloo ranks)"),
    # ---- 6.3 controls
    _row("H-C0", "Repeat identical one-step model call", "one strict forward at pass 0, twice", "control", PASS,
         "strict", "forward", "bitwise zero drift", probe=_probe_repeat("forward")),
    _row("H-C1", "Request alone vs same batch row", "one strict forward: the request at batch position 0 of 3",
         "input change", PASS, "strict", "forward", "bitwise zero drift", probe=_probe_HC1),
    _row("H-C2", "Same initial noise, complete trajectory",
         "the whole strict trajectory re-run from the same (sealed) inputs", "control", PASS, "strict", "trajectory",
         "bitwise zero drift at every step", probe=_probe_sealed_replay),
    _row("H-C3", "Canonical vs consistent row permutation",
         "rows and every metadata tensor permuted; keys visited in canonical order", "layout change", PASS, "strict",
         "trajectory", "outputs equal after inverse permutation", probe=_probe_HC3),
    _distributed("H-C4", "TP1 vs TP2/TP4/TP8", "the strict trajectory at every TP degree the config admits (<= 4 "
                 "ranks)", PASS, "trajectory", "bitwise zero drift", "one process vs tp 2/4/8 (gloo ranks)"),
    _distributed("H-C5", "CP1 vs accepted CP topology", "the strict trajectory at every CP degree the config admits, "
                 "uneven row shards", PASS, "trajectory", "bitwise zero drift", "one process vs cp 2/3/4 (gloo ranks)"),
    _row("H-C6", "Gradient checkpointing off vs on", "training forward + backward of a fixed probe loss",
         "model change", PASS, "off", "forward", "byte-equal forward and accepted gradient profile", probe=_probe_HC6),
    _row("H-C7", "FL2VA/Ref2VA repeated preprocessing", "layouts, sealed inputs and component hashes built twice",
         "control", PASS, "off", "-", "identical packed-layout artifact and component hashes", check=_check_HC7),
    # ---- RL on H3
    _row("RL1", "Rollout vs training ratio",
         "flow_sde rollout at batch position 1 of 3 vs the request replayed alone at every SDE pass; in off a planted "
         "batch-position change (items after the first: video_proj_in in bf16)", "control", PASS, "strict",
         "trajectory", "exp(logp_train - logp_rollout) == 1.0 exactly (strict); planted change: ratio moves, drift "
         "names video_proj_in", check=check_ratio),
    # ---- strict kernels: the switchable epilogue fusions keep every byte
    _row("F1", "Fused Q/K norm + RoPE", "the strict trajectory with fusion qk_norm_rope on (one kernel per block for "
         "both Q/K RMSNorms and both RoPEs), against the unfused reference", "kernel variant", PASS, "strict",
         "trajectory", "PASS, byte-equal (the fused kernel rounds where the unfused chain stores)",
         check=check_fusion("qk_norm_rope")),
    _row("F2", "Fused residual + AdaLN pre-norm", "the strict trajectory with fusion residual_norm_modulate on (the "
         "attention's gated residual and the FFN's RMSNorm + modulation in one kernel), against the unfused reference",
         "kernel variant", PASS, "strict", "trajectory",
         "PASS, byte-equal (the fused kernel rounds where the unfused chain stores)",
         check=check_fusion("residual_norm_modulate")),
)}

ORDER = tuple(ROWS)


# ================================================================================================ running rows
def _view(report: Any) -> tuple[bool, Any, Any, int]:
    """(equal, first, first_in_block, compared) of a `DriftReport` or of its `to_dict()` (points as `DriftPoint`s)."""
    if not isinstance(report, dict):
        return report.equal, report.first, report.first_in_block, report.compared

    def point(d):
        if d is None:
            return None
        shapes = {k: tuple(d[k]) if d.get(k) else None for k in ("shape_a", "shape_b")}
        return DriftPoint(**{**d, **shapes})

    return report["equal"], point(report["first"]), point(report["first_in_block"]), report["compared"]


def _observe(expected: Expected, report: Any) -> tuple[str, str, bool]:
    equal, first, first_in_block, compared = _view(report)
    if equal:
        status, observed = "PASS", f"PASS byte-equal ({compared} points compared)"
    else:
        status, observed = "DRIFT", f"DRIFT at {first}"
        if first_in_block is not None and first_in_block.point != first.point:
            observed += f"; first in-block drift {first_in_block.point}"
    if expected.kind == "PASS":
        return status, observed, equal
    if expected.kind == "DRIFT":
        ok = (not equal and first.point == expected.point and first.step == expected.step)
        if ok and expected.block_point is not None:
            ok = first_in_block is not None and first_in_block.point == expected.block_point
        return status, observed, ok
    return status, observed, False


def _run_distributed(row: Ablation, bench: "Bench", mode: str) -> dict[str, Any]:
    """A distributed row: its comparisons on local gloo ranks, each judged against the row's signature."""
    from .distributed import run_row

    comparisons = run_row(row.name, bench, mode)
    passed, statuses, observed, failing = True, [], [], None
    for c in comparisons:
        if "rejected" in c:
            status, text, ok = "REJECTED", f"REJECTED: {c['rejected']}", row.expected.kind == "REJECTED"
        else:
            status, text, ok = _observe(row.expected, c["report"])
        c["observed"] = text
        statuses.append(status)
        observed.append(f"{c['a']} vs {c['b']} ({c['world']} ranks): {text}")
        if not ok and failing is None:
            failing = c
        passed = passed and ok
    shown = failing or comparisons[0]
    report = shown.get("report")
    return {
        "status": statuses[comparisons.index(shown)], "observed": "; ".join(observed), "passed": passed,
        "report": report, "comparisons": comparisons,
        "first_drift": report["first"] if report else None,
        "first_in_block": report["first_in_block"] if report else None,
    }


def _compared(row: Ablation, bench: Bench, mode: str) -> tuple[DriftReport, str | None]:
    """The drift report of a comparison row, cached in the bench per (probe, mode): rows built on the same probe
    (A0 and H-C2 both replay the sealed reference) share one comparison. Also the replay's recorded digest when the
    probe arm records one."""
    key = ("report", row.probe, mode)
    if key not in bench.cache:
        a, b = row.probe(bench, mode)
        reference = None
        plain = not (a.grad or a.checkpointing is not None or a.row_map)
        if plain and a.model is bench.model and a.spec is bench.spec(mode):
            reference = bench.reference_capture(mode, a.scope, a.forward_pass)
        report = compare(a, b, reference=reference)
        bench.cache[key] = (report, b.recorder.finish().digest if b.recorder is not None else None)
    return bench.cache[key]


def run_ablation(name: str, bench: Bench | None = None, mode: str | None = None) -> dict[str, Any]:
    """Run one row (see the module docstring for the result dict). `mode` overrides the row's mode."""
    if name not in ROWS:
        raise AblationError(f"ablation {name!r}: must be one of {', '.join(ORDER)}")
    row = ROWS[name]
    mode = runtime.check_mode(mode) if mode is not None else row.mode
    bench = bench if bench is not None else tiny_bench()
    out: dict[str, Any] = {
        "name": row.name, "factor": row.factor, "description": row.description, "apply": row.apply, "mode": mode,
        "scope": row.scope, "expected": row.expected.describe(), "expected_signature": row.expected.to_dict(),
        "rfc": row.rfc, "observed": "", "status": "", "first_drift": None, "first_in_block": None, "passed": None,
        "report": None, "seconds": 0.0,
    }
    start = time.perf_counter()
    try:
        if row.distributed:
            out.update(_run_distributed(row, bench, mode))
        elif row.check is not None:
            status, observed, passed, report = row.check(bench, mode)
            out.update(status=status, observed=observed, passed=passed,
                       report=report.to_dict() if report is not None else None)
        else:
            report, replay_digest = _compared(row, bench, mode)
            status, observed, passed = _observe(row.expected, report)
            if replay_digest is not None and passed:
                sealed = bench.cache[("sealed", mode)]
                passed = replay_digest == sealed.digest
                observed += f"; replay digest {'==' if passed else '!='} sealed digest {sealed.digest[:16]}"
            out.update(status=status, observed=observed, passed=passed, report=report.to_dict(),
                       first_drift=report.first.to_dict() if report.first else None,
                       first_in_block=report.first_in_block.to_dict() if report.first_in_block else None)
    except DriftError as exc:
        ok = row.expected.kind == "REJECTED"
        out.update(status="REJECTED", observed=f"REJECTED: {exc}", passed=ok)
    except Exception as exc:  # a row that cannot run is reported, never silently passed
        out.update(status="ERROR", observed=f"ERROR {type(exc).__name__}: {exc}", passed=False)
    out["seconds"] = round(time.perf_counter() - start, 3)
    return out


def run_matrix(
    bench: Bench | None = None, names: list[str] | tuple[str, ...] | None = None, modes: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Every row (or `names`) in RFC order; `modes` overrides the mode of named rows."""
    bench = bench if bench is not None else tiny_bench()
    names = ORDER if names is None else tuple(names)
    modes = modes or {}
    return [run_ablation(n, bench, modes.get(n)) for n in names]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts: passed, failed, not run (`passed` None: rows the environment cannot run), and the failed rows."""
    return {
        "rows": len(rows),
        "passed": sum(r["passed"] is True for r in rows),
        "failed": [r["name"] for r in rows if r["passed"] is False],
        "not_run": [r["name"] for r in rows if r["passed"] is None],
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of the matrix (REPL `!ablate`, reports)."""
    lines = [f"{'row':6} {'mode':6} {'ok':5} {'expected':58} observed"]
    for r in rows:
        ok = {True: "yes", False: "NO", None: "-"}[r["passed"]]
        lines.append(f"{r['name']:6} {r['mode']:6} {ok:5} {r['expected'][:58]:58} {r['observed']}")
    return "\n".join(lines)
