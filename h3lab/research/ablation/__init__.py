"""The RFC's ablation matrix (section 6) as declarative perturbations, each checked against its expected signature
by the first-drift localiser.

Contract
--------
`ROWS` holds one `Ablation` per RFC row — A0-A7, C0-C2, H1-H17, H-C0-H-C7 — and RL1 (RL's rollout-vs-training
ratio: 1.0 exactly in strict, a planted batch-position change in `off` moves it and drifts first at `video_proj_in`;
`ratio.py`) and F1 / F2 (a switchable strict epilogue fusion, `runtime.use_fusions`, leaves the strict trajectory
byte-equal: `fusions.py`), each with the factor it changes, how the change is applied (op override / hook / layout
change / sampler change / input change / model change / control / kernel variant), the runtime mode and scope it runs
in, and its `Expected` signature:

  PASS      the two arms are byte-equal at every compared point (the drift report is `equal`);
  DRIFT     the first drift is at exactly `point` in pass `step` (-1 = scheduler construction), and, where given,
            the first drift inside the block stack is at `block_point`;
  REJECTED  the comparison must refuse the pair as non-comparable;
  N/A       the factor does not exist in H3; the row runs a check that it indeed does not (A5, C2).

Distributed rows (A4, A7, C0, H17, H-C4, H-C5; `Ablation.distributed` says what they run) compare arms on several
ranks: `h3lab.research.ablation.distributed` spawns local gloo CPU processes (2 for the tiny bench; one set per
comparison, about 5-15 s each under the interpreter) and runs `drift.compare` on every rank through the placement's
hook view, which shows each rank the one-process tensors. A4 (a rank holding another rank's rows) is REJECTED by
the forward's ownership check; A7 (a ring-attention KV-block plan, merged in canonical vs rank order) drifts at
`blocks.0.attention`; C0 (tp 2 with the other row-parallel partition), H-C4 (tp 2/4/8 the bench admits) and H-C5
(cp 2/3/4, uneven shards) PASS against one process; H17 (hidden rows sharded, metadata not) drifts at
`blocks.0.modulate1`. The drift rows name the rank owning the first differing row (`first_drift["owner"]`). A7 is
also a factor of a one-process run (`factors=("A7",)`: two KV blocks merged in reverse order).

`run_ablation(name, bench=None, mode=None)` and `run_matrix(bench=None, names=None, modes=None)` return per row a
dict: `name`, `factor`, `description`, `apply`, `mode`, `scope`, `expected` (text), `expected_signature`, `rfc`
(the RFC's wording), `observed` (text), `status` (PASS / DRIFT / REJECTED / N/A / ERROR),
`first_drift` and `first_in_block` (`DriftPoint.to_dict()` or None), `passed` (True / False / None), `seconds`,
and `report` (the `DriftReport.to_dict()`, None for rows without a comparison); a distributed row adds
`comparisons` (per comparison: the arms, scope, world size and its own observed text).

Modes. Perturbation rows run in ``off``: on CPU torch is deterministic, so the only drift between the arms is the
planted one, and the signature (where it first shows) is a property of the perturbation, not of the arithmetic.
The invariance promises run in ``strict``: A0 (shared replay from the sealed artifact), C1 / H-C1 (request alone vs
a row of a packed batch — only strict promises batch invariance: torch is not batch-invariant on a GPU, nor on a CPU
with two threads, where the float32 `audio_proj_in` GEMM of a 2-item batch differs in the last bit from the
1-item one), H-C0 / H-C2 (repeat), H-C3 (consistent permutation: the permuted layout's sealed inputs carry its
`key_order()`, so attention visits keys in canonical order and the outputs permute byte for byte). H-C6
(checkpointing) runs in ``off`` by default: on CPU a strict backward through the Triton interpreter costs ~25 s per
step; `run_ablation("H-C6", mode="strict")` runs it strict (GPU).
`modes={"H5": "strict"}` (or `mode=`) overrides any row.

The bench (`Bench.tiny(snapshot)`): the tiny snapshot's `transformer/` (released mixed precision) and its
`transformer_ref/` (the other variant, for H16), an fl2va layout with a first-frame anchor (5 text rows, 4
conditioning rows, 6 audio rows, 8 target video rows = 23 rows: conditioning rows keep at least two distinct
timesteps per pass, which H3/H4 need), a 2-pass dual schedule, and seeded inputs (anchor latents noise-mixed at
t = 0.999, target noise). The bench caches the strict reference runs so rows sharing an arm do not recompute them:
A0 and H-C2 share one replay of the sealed reference (A0 also checks the replay's digest against the sealed one),
C2 reports H-C2, forward-scope rows cut their reference from the trajectory capture.

Factors: declarative transforms of a `RunSpec`. The perturbation rows that change one run (`FACTORS`: A1-A3, A6, A7,
H1-H14, H16) carry a `transform(run) -> run` of the resolved run (`h3lab.run.ResolvedRun`) and the things it
`changes` ("op:rms_norm", "stepper", "plan", "schedule", "model", ...). This module provides the run spec's
`factors` field (`h3lab.run.register_field`): a spec that names factors gets them applied by the one loop's
`resolve`, in canonical order (model changes first, then matrix order), each time it runs -- so everything that
re-runs a spec (verify, drift, arms, the session's `!drift`) re-derives exactly the same perturbation. Two factors
that change one thing, or H1 with any other, are refused when the spec is built. A factor row's probe is the bench
spec with the factor switched on (`bench.reference(mode).with_spec(factors=(name,))`); the other rows' probes are
other transforms of the bench spec (its inputs, layout or execution options) that are not factors of a generation:
the controls, the batch and permutation rows, and H15, which re-noises the anchor rows from their clean latents --
only the bench keeps those (`parts["x0"]`); a generation's sealed inputs hold the augmented rows only.

The steppers of H9 and H13 are registered by name ("negated_velocity", "reordered_euler").

Modules, one job each: `bench.py` (the bench and its seeded inputs), `factors.py` (the factor transforms, their
`TABLE`, the `RunSpec.factors` provider: `check_factors`, `apply_factors`), `probes.py` (how the other rows build
their arms, and the checks of the rows without two arms), `matrix.py` (the rows and the runner), `distributed.py`
(the distributed rows on local gloo ranks: research over the distributed room, so the production room never
imports `drift`), `faults.py` (the A4 / H17 / A7 faults as a wrapper around a placement, never a branch in it),
`ratio.py` (RL1), `fusions.py` (F1, F2). May import: the run spec, drift and trajectory, the model, checkpoint, layout, sampler, runtime;
`distributed.py` and `faults.py` also the distributed room, `ratio.py` the training room (`grpo_step`).
"""

from .bench import Bench, make_inputs, tiny_bench
from .factors import FACTORS, TABLE, AblationError, Factor, _full_head_rope, apply_factors, check_factors
from .matrix import (
    KINDS,
    ORDER,
    PASS,
    ROWS,
    Ablation,
    Expected,
    _observe,
    compare,
    drift_at,
    format_table,
    run_ablation,
    run_matrix,
    summarize,
)
from .probes import factor_probe

__all__ = [
    "FACTORS", "KINDS", "ORDER", "PASS", "ROWS", "TABLE", "Ablation", "AblationError", "Bench", "Expected", "Factor",
    "apply_factors", "check_factors", "drift_at", "factor_probe", "format_table", "make_inputs", "run_ablation",
    "run_matrix", "summarize", "tiny_bench",
]
