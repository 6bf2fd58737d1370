"""The RFC ablation matrix on the tiny snapshot: every row declared, every row run in its declared mode, and every
row's observed signature equal to its expected one (the localiser's first drift *is* the expected operator and pass).
The distributed rows (A4, A7, C0, H17, H-C4, H-C5) run too, on 2 local gloo ranks each (h3lab.distributed), and their
drift rows name the rank that owns the first differing row."""

import json

import pytest

from h3lab.research import ablation as A

RFC_ROWS = (
    [f"A{i}" for i in range(8)] + [f"C{i}" for i in range(3)] + [f"H{i}" for i in range(1, 18)]
    + [f"H-C{i}" for i in range(8)] + ["RL1"]  # RL1: RL's rollout-vs-training ratio
    + ["F1", "F2"]  # the switchable strict epilogue fusions
)
DISTRIBUTED = {"A4", "A7", "C0", "H17", "H-C4", "H-C5"}
KEYS = {"name", "expected", "observed", "first_drift", "passed", "status", "mode", "factor", "description", "apply"}


@pytest.fixture(scope="module")
def bench(tiny_snapshot):
    return A.tiny_bench(str(tiny_snapshot))


@pytest.fixture(scope="module")
def matrix(bench):
    return {row["name"]: row for row in A.run_matrix(bench)}


def test_every_rfc_row_is_declared():
    assert list(A.ORDER) == RFC_ROWS
    for name, row in A.ROWS.items():
        assert row.factor and row.description and row.rfc and row.apply
        assert row.expected.kind in A.KINDS and row.mode in ("off", "strict")
        assert bool(row.distributed) == (name in DISTRIBUTED)
        if row.expected.kind == "DRIFT":
            assert row.expected.point and row.expected.step is not None
        if name not in DISTRIBUTED:
            assert (row.probe is None) != (row.check is None)
        else:  # run by h3lab.distributed.ablation_rows, in strict
            assert row.probe is None and row.check is None and row.mode == "strict"
    # the strict promises run strict
    assert {n for n, r in A.ROWS.items() if r.mode == "strict" and n not in DISTRIBUTED} == {
        "A0", "C1", "C2", "H-C0", "H-C1", "H-C2", "H-C3", "RL1", "F1", "F2"}


def test_factor_rows_take_their_transform_from_the_factor_table():
    """`factors.TABLE` is the one declaration of a factor: its order is the matrix order, and each factor row's
    transform and changes are the table's."""
    assert A.FACTORS == tuple(A.TABLE) == tuple(n for n, r in A.ROWS.items() if r.transform is not None)
    for name, factor in A.TABLE.items():
        assert (A.ROWS[name].transform, A.ROWS[name].changes) == (factor.transform, factor.changes), name
    assert A.check_factors(["H16", "A1"]) == ["H16", "A1"]  # a model change first
    with pytest.raises(A.AblationError, match="changes op:attention, which A3 changes too"):
        A.check_factors(["A3", "H8"])


@pytest.mark.parametrize("name", RFC_ROWS)
def test_row_matches_its_expected_signature(matrix, name):
    row = matrix[name]
    assert KEYS <= set(row)
    json.dumps(row)
    assert row["passed"] is True, f"{name}: expected {row['expected']}, observed {row['observed']}"
    exp = A.ROWS[name].expected
    if exp.kind == "DRIFT":
        f = row["first_drift"]
        assert (f["point"], f["step"]) == (exp.point, exp.step)
        if exp.block_point:
            assert row["first_in_block"]["point"] == exp.block_point
        if f["rows"] in ("packed", "video", "audio", "text"):
            assert f["packed_row"] is not None and f["modality"] in ("text", "video", "audio")
        if exp.step >= 0 and f["note"] != "shapes differ":  # H10: the model sees other distinct timesteps
            assert f["max_abs"] > 0 and f["rel_l2"] > 0
    elif exp.kind == "PASS" and row["report"] is not None:
        assert row["report"]["equal"] and row["first_drift"] is None and row["report"]["compared"] > 80


def test_planted_rows_point_at_the_perturbed_row(matrix, bench):
    row = int(bench.layout.video_indices[bench.layout.num_condition_video_rows])
    for name in ("H2", "H3", "A1"):
        f = matrix[name]["first_drift"]
        assert (f["packed_row"], f["modality"]) == (row, "video"), name
        assert f["rows_differing"] == 1, name
    # H15 changes only the conditioning rows, H14 every selected row
    assert matrix["H15"]["first_drift"]["rows_differing"] == bench.layout.num_condition_video_rows
    assert matrix["H14"]["first_drift"]["rows_differing"] == bench.layout.video_indices.numel()
    # H1 leaves position_ids behind: the metadata comparison says so
    assert {m["name"] for m in matrix["H1"]["report"]["metadata"]} == {"position_ids"}


def test_summary_counts_and_table(matrix):
    rows = [matrix[n] for n in RFC_ROWS]
    s = A.summarize(rows)
    assert s == {"rows": 39, "passed": 39, "failed": [], "not_run": []}
    table = A.format_table(rows)
    assert table.count("\n") == 39 and "needs distributed" not in table


def test_distributed_rows_name_their_arms_and_the_owning_rank(matrix, bench):
    """Every distributed row ran on gloo ranks; A4 was refused before any work; the drift rows' first differing
    row is the first row of CP rank 1 (rank 0 holds rows [0, 12) of 23 in both arms), named with its owner."""
    for name in DISTRIBUTED:
        comparisons = matrix[name]["comparisons"]
        assert comparisons and all(c["world"] >= 2 for c in comparisons), name
    assert "wrong ownership" in matrix["A4"]["observed"] and matrix["A4"]["status"] == "REJECTED"
    first_rank1 = (bench.inputs.seq_len + 1) // 2
    for name in ("A7", "H17"):
        f = matrix[name]["first_drift"]
        assert f["packed_row"] >= first_rank1 and f["owner"]["ranks"] == [1] and f["owner"]["cp"] == 1, name
        assert f["owner"]["local_row"] == f["packed_row"] - first_rank1
    assert [c["b"] for c in matrix["H-C4"]["comparisons"]] == ["tp2"]  # the tiny config's 2 heads admit tp 1, 2
    assert [c["b"] for c in matrix["H-C5"]["comparisons"]] == ["cp2"]


def test_rl1_ratio_is_exact_in_strict_and_moves_under_the_plant(matrix, bench):
    """RL1: the strict ratio is 1.0 exactly at both SDE passes and both modalities; the planted batch-position
    change makes it move in off, and the localiser names the planted op first, in the rows of the generated video."""
    assert matrix["RL1"]["status"] == "PASS" and "== 1.0 exactly" in matrix["RL1"]["observed"]
    strict = bench.cache[("ratio", "strict")]
    assert [r["pass"] for r in strict] == [0, 1] and all(r[m] == 1.0 for r in strict for m in ("video", "audio"))
    planted = bench.cache[("ratio", "planted_off")]
    assert max(abs(r[m] - 1.0) for r in planted for m in ("video", "audio")) > 0
    first = bench.cache[("ratio", "planted_first_drift")]
    assert (first["point"], first["step"], first["modality"]) == ("video_proj_in", 0, "video")
    assert first["max_abs"] > 0


def test_a_wrong_expectation_fails(bench, matrix):
    """The matching is strict: the H5 drift report checked against PASS, or against another operator, fails."""
    report, _ = bench.cache[("report", A.ROWS["H5"].probe, "off")]
    assert A._observe(A.PASS, report)[2] is False
    assert A._observe(A.drift_at("blocks.0.k_rope"), report)[2] is False
    assert A._observe(A.drift_at("blocks.0.q_rope", 1), report)[2] is False
    assert A._observe(A.drift_at("blocks.0.q_rope", 0), report)[2] is True


def test_unknown_row_raises(bench):
    with pytest.raises(A.AblationError, match="H18"):
        A.run_ablation("H18", bench)
    with pytest.raises(ValueError, match="mode"):
        A.run_ablation("H5", bench, mode="turbo")


def test_faults_wrap_a_placement_and_need_cp(bench):
    """Fault injection is a wrapper around a placement (h3lab.research.ablation.faults), refused in one line without CP; the
    production placement has no fault argument."""
    import inspect

    from h3lab.research.ablation.faults import Faults, FaultyPlacement, faulty
    from h3lab.distributed import DistributedError, init_mesh, parallelize, placement_of
    from h3lab.model import H3Transformer

    assert "faults" not in inspect.signature(parallelize).parameters
    model = H3Transformer(bench.model.config)
    placement = parallelize(model, init_mesh(config=model.config))  # world size 1: no process group
    with pytest.raises(DistributedError, match=r"^faults \{'rotate_rows': True\} need cp > 1 \(topology tp1xcp1"):
        faulty(placement, Faults(rotate_rows=True))
    with pytest.raises(DistributedError, match=r"^ring_merge='sideways': must be"):
        Faults(ring_merge="sideways")
    assert placement_of(model) is placement and len(placement.handles) == 2
    wrapped = faulty(placement, Faults())  # no fault: a wrapper that changes nothing, in the placement's place
    assert isinstance(wrapped, FaultyPlacement) and placement_of(model) is wrapped
    assert placement.handles == [] and len(wrapped.handles) == 2


def test_a7_is_still_a_factor_of_one_process(bench):
    """A7 stays a factor (`factors=("A7",)`, `!ablate A7`): two KV blocks with bf16 partials merged in reverse order
    drift at the first block attention in one process too."""
    assert "A7" in A.FACTORS
    a, b = A.factor_probe("A7")(bench, "off")
    report = A.compare(a, b, reference=bench.reference_capture("off"))
    assert (report.first.point, report.first.step) == ("blocks.0.attention", 0)
