"""First-drift localisation: planted perturbations found at the right pass, layer, operator, packed row and modality
(H5 full-head RoPE, strict and off); the drift matrices' shapes, labels and values; byte-equal executions; Diffusers'
module taps against the H3 hook points; row maps for permuted and batched arms; sealed-trajectory comparison."""

import json
import math

import numpy as np
import pytest
import torch

from h3lab.research import drift as D
from h3lab.execution import runtime
from h3lab.research.ablation import _full_head_rope, make_inputs, run_ablation, tiny_bench
from h3lab.research.arms import diffusers_twin
from h3lab.config import AUDIO
from h3lab.hashing import model_fingerprint
from h3lab.run import RunSpecError
from h3lab.run.trajectory import record


@pytest.fixture(scope="module")
def bench(tiny_snapshot):
    return tiny_bench(str(tiny_snapshot))


def planted_full_head_rope(model, step, layer):
    """A hook that replaces `blocks.{layer}.q_rope` at pass `step` by full-head RoPE of the same normed q."""
    seen = {}

    def hook(point, t):
        if point.name in ("rope_cos", "rope_sin", f"blocks.{layer}.q_norm"):
            seen[point.name] = t
        elif point.name == f"blocks.{layer}.q_rope" and model.hook_context.get("step") == step:
            return _full_head_rope(seen[f"blocks.{layer}.q_norm"], seen["rope_cos"], seen["rope_sin"])
        return None

    return hook


def expected_first_row(inputs):
    """The first packed row whose rotation changes: full-head and partial RoPE agree where every angle is 0."""
    nonzero = (inputs.position_ids != 0).any(dim=1)
    return int(torch.nonzero(nonzero).flatten()[0])


def test_planted_full_head_rope_is_localised_to_pass_layer_operator_and_row(bench):
    a = bench.reference("off")
    b = a.replace(spec=a.spec.with_custom(hooks=(planted_full_head_rope(bench.model, step=1, layer=1),)),
                  label="H5 at pass 1, block 1")
    report = D.compare(a, b)
    f = report.first
    assert not report.equal and report.metadata == []
    assert (f.step, f.point, f.layer, f.op, f.rows) == (1, "blocks.1.q_rope", 1, "rope", "packed")
    row = expected_first_row(bench.inputs)
    assert f.row == f.packed_row == row and f.modality == "text"  # the text rows sit on the t axis at 0, 1, 2, ...
    assert f.max_abs > 0 and f.rel_l2 > 0 and f.rows_differing == bench.inputs.seq_len - row
    assert report.first_in_block.point == "blocks.1.q_rope"
    assert report.a_repeatable is True

    # matrices: labels, shapes, and zero drift everywhere before the plant
    S = bench.inputs.seq_len
    assert report.step_labels == [0, 1]
    assert report.layer_labels == ["pack", "blocks.0", "blocks.1", "final_modulate"]
    assert len(report.row_labels) == S
    streams = {int(r): "text" for r in bench.inputs.text_indices}
    streams.update({int(r): "video" for r in bench.inputs.video_indices})
    streams.update({int(r): "audio" for r in bench.inputs.audio_indices})
    assert report.row_labels == [f"{r}:{streams[r]}" for r in range(S)]
    for m in (report.step_layer_max_abs, report.step_layer_rel_l2):
        assert m.shape == (2, 4) and not np.isnan(m).any()
        assert (m[0] == 0).all() and (m[1, :2] == 0).all() and (m[1, 2:] > 0).all()
    for m in (report.row_max_abs, report.row_rel_l2):
        assert m.shape == (2, 4, S) and not np.isnan(m).any()
    lr_abs, lr_rel = report.layer_row()
    assert lr_abs.shape == lr_rel.shape == (4, S) and report.matrix_step == 1
    assert (lr_abs[:2] == 0).all() and (lr_abs[2, :row] == 0).all() and (lr_abs[2, row:] > 0).all()
    assert math.isclose(lr_abs[2].max(), report.step_layer_max_abs[1, 2])
    # the pass outputs: pass 0 byte-equal, pass 1 drifts in velocity and latent
    assert report.per_step[0]["video_out"] == {"max_abs": 0.0, "rel_l2": 0.0}
    assert report.per_step[1]["scheduler.video"]["max_abs"] > 0
    json.dumps(report.to_dict())  # JSON-ready (NaN -> None)


def test_full_head_rope_in_strict_mode_is_found_at_the_first_rotation(bench):
    """The H5 row itself (op override) in strict mode: pass 0, block 0, q_rope, first rotated row."""
    row = run_ablation("H5", bench, mode="strict")
    assert row["passed"] is True, row["observed"]
    f = row["first_drift"]
    assert (f["step"], f["point"], f["layer"], f["op"]) == (0, "blocks.0.q_rope", 0, "rope")
    assert f["packed_row"] == expected_first_row(bench.inputs) and f["modality"] == "text"
    assert row["report"]["a_repeatable"] is True


def test_identical_executions_are_equal_and_the_trace_is_untouched(bench):
    a = bench.reference("off")
    report = D.compare(a, a.replace(label="again"))
    assert report.equal and report.first is None and report.differing == 0 and report.a_repeatable is None
    assert report.compared == 2 + 2 * (3 + len(bench.model.hook_points()) + 2)  # schedules + per pass points
    assert (report.step_layer_max_abs == 0).all() and report.uncompared == []


def test_diffusers_taps_match_h3_hook_points_byte_for_byte(bench):
    """off mode is bit-equal to Diffusers: every point a Diffusers module exposes matches the H3 hook point."""
    p = diffusers_twin(bench.model)
    a = D.Execution(bench.spec("off").replace(variant="diffusers", fingerprint=model_fingerprint(p)), p,
                    label="diffusers")
    b = bench.reference("off")
    report = D.compare(a, b)
    assert report.equal, report.summary()
    tapped = {"video_proj_in", "refiner.0.q_norm", "refiner.1.residual2", "time_sinusoid", "time_mlp", "rope_cos",
              "blocks.0.adaln_table", "blocks.1.ffn_up", "blocks.1.swiglu", "final_table", "final_modulate",
              "video_head", "video_out", "audio_out"}
    captured = {k[1] for k in D.capture(a).digests}
    assert tapped <= captured
    assert {"blocks.0.modulate1", "blocks.0.q_rope", "blocks.0.attention", "pack"} <= set(report.uncompared)


def test_row_maps_put_permuted_and_batched_arms_in_the_reference_frame(bench):
    """A tag flip planted on canonical row r of a permuted layout is reported at canonical row r; a batched arm is
    compared through its batch item."""
    r = int(bench.inputs.video_indices[-1])
    perm = torch.randperm(bench.inputs.seq_len, generator=torch.Generator().manual_seed(3))
    layout = bench.layout.permute(perm)
    inputs = bench.inputs_for(layout=layout)
    tags = inputs.token_tags.clone()
    tags[int(torch.nonzero(perm == r)[0])] = AUDIO  # canonical row r, wherever the permutation put it
    a = bench.reference("off")
    b = a.with_spec(inputs=inputs.replace(token_tags=tags), layout=layout).replace(
        row_map=D.RowMap(packed_order=layout.canonical_order()))
    report = D.compare(a, b)
    assert (report.first.point, report.first.packed_row, report.first.modality) == ("blocks.0.modulate1", r, "video")
    assert [m["name"] for m in report.metadata] == ["token_tags"] and report.metadata[0]["rows"] == [r]

    # batch maps: both arms run the same batch of two; comparing item 1 with item 1 is equal, item 1 with item 0
    # (another request) drifts at the first input. (Whether a request alone equals its row in a batch is the
    # strict promise C1 / H-C1 of the matrix: torch's CPU GEMM is not batch-invariant, e.g. at audio_proj_in.)
    x = bench.inputs
    g = torch.Generator().manual_seed(4)
    batched = x.replace(**{k: torch.cat([torch.randn(getattr(x, k).shape, generator=g), getattr(x, k)])
                           for k in ("text", "video", "audio")})
    fwd = bench.reference("off", "forward").with_spec(inputs=batched).replace(row_map=D.RowMap(batch_index=1))
    assert D.compare(fwd, fwd.replace(label="again")).equal
    other = D.compare(fwd, fwd.replace(row_map=D.RowMap(batch_index=0)))
    assert other.first.point == "input.text" and other.first.batch == 0


def test_sealed_trajectories_compare_by_manifest_and_by_rerun(bench):
    ta = record(bench.spec("off"), bench.model)
    other = make_inputs(bench.model.config, bench.layout, bench.schedule, seed=bench.parts["seed"] + 1)
    tb = record(bench.spec("off").replace(inputs=other), bench.model)
    assert D.diff_steps(ta, ta) is None
    assert D.diff_steps(ta, tb) == {"step": 0, "field": "velocity_video"}
    report = D.compare_trajectories(ta, tb, bench.model)
    assert (report.first.step, report.first.point) == (0, "input.text")


def test_bad_comparisons_raise(bench):
    a = bench.reference("off")
    with pytest.raises(D.DriftError, match="scopes differ"):
        D.compare(a, bench.reference("off", "forward"))
    with pytest.raises(D.DriftError, match="scope"):
        a.replace(scope="epoch")
    with pytest.raises(D.DriftError, match="grad=True"):
        a.replace(grad=True)
    with pytest.raises(D.DriftError, match="forward_pass"):
        bench.reference("off", "forward").replace(forward_pass=5)
    with pytest.raises(D.DriftError, match="add_hook"):
        D.Execution(bench.spec("off").with_custom(hooks=(lambda p, t: None,)), diffusers_twin(bench.model))
    with pytest.raises(RunSpecError, match="mode"):
        a.with_spec(mode="turbo")
    assert runtime.current_mode() == "off"


def test_layout_differences_read_as_lines_not_dicts():
    """`!drift`'s "layout differs" lines."""
    from h3lab.research.drift import metadata_line
    from h3lab.app.session import _drift_lines

    assert metadata_line({"name": "row_timestep", "step": 2, "rows": [0, 5]}) == \
        "row_timestep (pass 3): differs at canonical rows 0, 5"  # step 2 is the third pass
    assert metadata_line({"name": "token_tags", "step": None, "rows": list(range(16))}).endswith("14, 15 ...")
    assert metadata_line({"name": "position_ids", "step": None, "shape_a": [9, 3], "shape_b": [7, 3]}) == \
        "position_ids: shape (9, 3) vs (7, 3)"
    assert metadata_line({"name": "num_passes", "a": 2, "b": 3}) == "num_passes: 2 vs 3"

    class Report:
        first = first_in_block = a_repeatable = None
        metadata = [{"name": "video_indices", "step": None, "rows": [4]}]

        def summary(self):
            return "summary"

    assert _drift_lines(Report()) == ["summary", "layout differs: video_indices: differs at canonical row 4"]


def test_printed_pass_numbers_count_from_one():
    """The progress bar counts passes from 1, so every printed drift location does too (the step
    index of the API and the JSON stays 0-based; -1 is the scheduler's construction)."""
    point = D.DriftPoint(step=0, point="blocks.0.q_rope", layer=0, op="rope", rows="packed", packed_row=3,
                         modality="video")
    assert str(point).startswith("pass 1 blocks.0.q_rope (layer 0, op rope), packed row 3 (video)")
    assert point.to_dict()["step"] == 0
    schedule = D.DriftPoint(step=-1, point="schedule.video_sigmas", layer=None, op="sigma_schedule", rows="sigma")
    assert str(schedule).startswith("scheduler construction schedule.video_sigmas")
    assert D.metadata_line({"name": "row_timestep", "step": 2, "rows": [4]}) == \
        "row_timestep (pass 3): differs at canonical row 4"
    assert [D.pass_label(s) for s in (-1, 0, 9)] == ["scheduler construction", "pass 1", "pass 10"]
