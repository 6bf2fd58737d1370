"""The attention probe on a real run (`h3lab.research.views.attention_probe`): re-running a sealed spec with the probe leaves
its strict bytes untouched (the trajectory digest with and without the probe is the same), the view equals the map
of the Q and K the block consumed, and bad requests are one line."""

from __future__ import annotations

import pytest
import torch

from h3lab.run import trajectory as T
from h3lab.research.ablation.bench import Bench, tiny_bench
from h3lab.research.views.attention import U64, AttentionViewError, attention_map
from h3lab.research.views.attention_probe import AttentionProbe, attention_view
from h3lab.research.views.regions import layout_regions


@pytest.fixture(scope="module")
def bench():
    return tiny_bench()


def test_the_probe_leaves_the_strict_run_byte_equal(tiny_snapshot):
    bench = Bench.tiny(tiny_snapshot, num_points=2)  # the random tiny snapshot: 2 blocks, one pass (strict is slow)
    spec = bench.spec("strict")
    plain = T.record(spec, bench.model)
    regions = layout_regions(bench.layout)
    probe = AttentionProbe(bench.model, 1, 0, regions)
    handle = bench.model.add_hook(probe, names=probe.names)
    try:
        probed = T.record(spec, bench.model)
    finally:
        handle.remove()
    assert probed.digest == plain.digest
    assert probe.map is not None and probe.map.block == 1 and probe.map.step == 0
    assert bool(((probe.map.weights.sum(-1) - 1).abs() <= (2 * regions.num_regions + 64) * U64).all())


def test_the_view_is_the_map_of_the_hooked_q_and_k(bench):
    spec = bench.spec("off")
    seen = {}

    def keep(point, tensor):
        if bench.model.hook_context.get("step") == 0:
            seen[point.name] = tensor.detach()[0].clone()

    handle = bench.model.add_hook(keep, names=("blocks.4.q_rope", "blocks.4.k_rope"))
    try:
        T.record(spec, bench.model)
    finally:
        handle.remove()
    view = attention_view(spec, bench.model, 4, step=0, heads=[1, 3], query="video")
    regions = layout_regions(bench.layout)
    direct = attention_map(seen["blocks.4.q_rope"], seen["blocks.4.k_rope"], regions, block=4, step=0,
                           query=regions.of_kind("video"), heads=[1, 3])
    assert torch.equal(view.weights, direct.weights) and view.query_labels == direct.query_labels
    assert view.query_kinds == ("video",) * 2 and view.heads == (1, 3)  # 2 target latent frames
    assert view.key_labels[-2:] == ("frame0", "frame1") and "anchor0:first" in view.key_labels


def test_bad_requests_fail_before_the_run(bench):
    spec = bench.spec("off")
    with pytest.raises(AttentionViewError, match="blocks 0..5"):
        attention_view(spec, bench.model, 6)
    with pytest.raises(AttentionViewError, match="passes 0..1"):
        attention_view(spec, bench.model, 0, step=2)
    with pytest.raises(AttentionViewError, match="reuses an earlier velocity"):
        from h3lab.run import RunSpec
        from h3lab.run.sampler import DualSchedule
        from h3lab.research.ablation.bench import make_inputs

        sched = DualSchedule.build(5)
        reused = RunSpec(make_inputs(bench.model.config, bench.layout, sched, 0, {}), sched, layout=bench.layout,
                         reuse=2)
        attention_view(reused, bench.model, 0, step=1)


def test_a_knocked_out_block_passes_its_input_on(bench):
    from h3lab.research.views.knockout import knocked_out

    seen = {}

    def keep(point, tensor):
        seen[point.name] = tensor.detach().clone()

    spec = bench.spec("off")
    names = ["blocks.1.residual2", "blocks.2.residual2", "blocks.3.residual2"]
    with knocked_out(bench.model, [2, 3]):
        handle = bench.model.add_hook(keep, names=names)  # registered after: sees the replaced values
        try:
            knocked = T.record(spec, bench.model)
        finally:
            handle.remove()
    assert torch.equal(seen["blocks.3.residual2"], seen["blocks.1.residual2"])
    assert knocked.digest != T.record(spec, bench.model).digest
    with pytest.raises(Exception, match=r"name blocks in 0\.\.5"):
        with knocked_out(bench.model, [6]):
            pass
