"""The memory plan (`h3lab.app.memory_plan`) on the released 33B config, by arithmetic on a meta-device model (nothing
allocated): the AdaLN weights' share of the DiT, what a tables placement keeps on the GPU at the released lengths
(the issue's target: at most 42 GiB of DiT bytes), the tables' rows against the layout's own per-pass timesteps, the
streamed bytes saved, the activation estimate at its calibration points, and the refusal line."""

from __future__ import annotations

import pytest
import torch

from h3lab import H3Config
from h3lab.components.execution import ExecutionPlan
from h3lab.components.residency import table_bytes
from h3lab.run.layout import build_layout
from h3lab.app.memory_plan import GiB, MemoryPlanError, activation_bytes, check_fits, memory_plan, request_shape
from h3lab.run.sampler import AUDIO_SHIFT, VIDEO_SHIFT, DualSchedule, reuse_plan
from h3lab.schema.generation_settings import GenerationSettings

FULL = H3Config.full()
SHIFTS = (VIDEO_SHIFT, AUDIO_SHIFT)
LENGTHS = {"512x512x22f": (512, 512, 22), "1344x768x124f": (1344, 768, 124), "1344x768x362f": (1344, 768, 362)}


def shape(w: int, h: int, frames: int, steps: int = 50, **kw):
    return request_shape(GenerationSettings(width=w, height=h, frames=frames, steps=steps, mode="strict", **kw),
                         FULL, SHIFTS)


def test_adaln_share_of_the_released_dit():
    s = shape(512, 512, 22)
    resident = memory_plan(FULL, s, ExecutionPlan("cpu"))
    tables = memory_plan(FULL, s, ExecutionPlan("cpu", adaln="tables"))
    with torch.device("meta"):
        from h3lab import H3Transformer

        params = sum(p.numel() * p.element_size() for p in H3Transformer(FULL).parameters())
    assert 0 <= resident.weights - params < 600 * 512  # the 512-byte alignment of each tensor only
    adaln = FULL.num_layers * (FULL.time_embed_dim + 1) * FULL.adaln_dim * 2  # bf16 weight + bias per block
    assert 0 <= tables.plan.tables.host_bytes - adaln < 2 * 512 * FULL.num_layers
    assert abs(resident.weights - tables.weights - adaln) < 2 * 512 * FULL.num_layers
    assert 0.38 < adaln / params < 0.40  # about 13B of the 33B parameters
    assert tables.tables == table_bytes(FULL, s.table_rows) == s.table_rows * FULL.adaln_dim * 2 * 50


@pytest.mark.parametrize("name", sorted(LENGTHS))
def test_tables_placement_fits_the_target(name):
    s = shape(*LENGTHS[name])
    plan = memory_plan(FULL, s, ExecutionPlan("cpu", adaln="tables"), card_gib=80)
    assert (plan.weights + plan.tables) / GiB <= 42  # the DiT's bytes on the GPU with AdaLN tables only
    assert plan.fits and plan.peak == plan.weights + plan.tables + max(plan.staging, plan.activations)


def test_table_rows_are_the_layouts_distinct_timesteps():
    for kw in ({}, {"first": "x.png"}):
        settings = GenerationSettings(width=128, height=128, frames=39, steps=12, reuse=2, **kw)
        got = request_shape(settings, FULL, SHIFTS, text_rows=7)
        layout = build_layout(settings.task, torch.ones(7, dtype=torch.long), settings.num_latent_frames,
                              settings.latent_height, settings.latent_width, settings.num_audio_latents,
                              anchors=tuple(n for n, _ in settings.anchors))
        schedule = DualSchedule.from_passes(12, *SHIFTS)
        plan = layout.timestep_plan(schedule.video.timesteps, schedule.audio.timesteps)
        evaluated = [p for p, ev in zip(plan, reuse_plan(12, 2)) if ev]
        assert got.passes == len(evaluated) and got.rows == layout.sequence_length
        assert got.table_rows == sum(t.numel() for t, _ in evaluated)


def test_streamed_bytes_drop_by_the_adaln_share():
    s = shape(512, 512, 22)
    blocks = memory_plan(FULL, s, ExecutionPlan("cpu", residency="streamed")).plan
    tables = memory_plan(FULL, s, ExecutionPlan("cpu", residency="streamed", adaln="tables")).plan
    assert len(blocks.streamed) == len(tables.streamed) == 52
    assert 0.38 < 1 - tables.streamed_bytes / blocks.streamed_bytes < 0.40


def test_activation_estimate_at_its_calibration_points():
    measured = {2066: 0.52, 7272: 1.34, 109205: 17.0}  # GiB over the weights, H200 (memory_plan docstring)
    for rows, gib in measured.items():
        assert abs(activation_bytes(FULL, rows) / GiB - gib) / gib < 0.1


def test_a_request_that_does_not_fit_is_refused_in_one_line():
    s = shape(1344, 768, 362)
    plan = memory_plan(FULL, s, ExecutionPlan("cpu"), card_gib=48, card="a 48 GiB card")
    assert not plan.fits
    with pytest.raises(MemoryPlanError) as err:
        check_fits(plan)
    line = str(err.value)
    assert "\n" not in line and "48.0 GiB" in line and "--adaln tables" in line
    budget = memory_plan(FULL, s, ExecutionPlan("cpu", "streamed", 20, adaln="tables"), card_gib=48)
    assert budget.fits and budget.weights + budget.tables <= 20 * GiB
