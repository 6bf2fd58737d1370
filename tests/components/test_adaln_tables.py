"""AdaLN tables (`h3lab.model.adaln_tables`, `h3lab.components.adaln_host`) on the CPU: a run whose AdaLN weights stay
in host memory and whose forwards are served from tables computed ahead is byte-identical to the resident run in off
and strict (alone and with streamed blocks), with the same result hash and traces, its record saying where the AdaLN
weights lived; strict tables of many timesteps in one GEMM equal those computed one pass at a time; hooks see the
same tensors; what changes the AdaLN input or cannot compose is refused in one line. On the CPU the "device" is the
CPU too: what only a GPU shows (pinned copies under compute, the memory saved) is benchmarks/benchmark_adaln_tables.py.
"""

from __future__ import annotations

import pytest
import torch

from h3lab import H3Config, H3Transformer
from h3lab.execution import runtime
from h3lab.run import trajectory as T
from h3lab.research.ablation import make_inputs
from h3lab.components import adaln_host, execution, residency_field
from h3lab.components import streaming as S
from h3lab.run.layout import build_layout
from h3lab.model.adaln_tables import AdaLNTablesError, serve_tables, tables_of
from h3lab.model.random_init import random_state_dict
from h3lab.run import RunSpec, denoise, model_forward
from h3lab.run.sampler import DualSchedule

CONFIG = H3Config(num_attention_heads=2, attention_head_dim=8, hidden_size=16, num_layers=3, num_refiner_layers=1,
                  ffn_dim=24, in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=12, freq_dim=8,
                  time_embed_hidden_dim=16, time_embed_dim=12, rope_freq_dim=1)
TABLES = {"policy": "resident", "adaln": "tables"}


def fresh_model(seed: int = 3, config: H3Config = CONFIG) -> H3Transformer:
    model = H3Transformer(config)
    model.load_state_dict(random_state_dict(config, seed))
    return model.eval().requires_grad_(False)


def make_spec(mode: str, passes: int = 3, config: H3Config = CONFIG, seed: int = 11) -> RunSpec:
    layout = build_layout("fl2va", torch.ones(5, dtype=torch.long), 2, 4, 4, 3, anchors=("first",),
                          patch_size=config.patch_size)
    schedule = DualSchedule.build(passes + 1)
    return RunSpec(make_inputs(config, layout, schedule, seed=seed), schedule, layout=layout, mode=mode)


@pytest.fixture(scope="module")
def spec() -> RunSpec:
    return make_spec("off")


@pytest.fixture(scope="module")
def resident(spec):
    return T.record(spec, fresh_model(), keep=("velocities",))


def on_host(model, source) -> bool:
    """Every AdaLN Parameter is a view of the source's host buffers."""
    ok = True
    for i, views in source.host_views.items():
        lin = model.transformer_blocks[i].adaln_proj.linear
        ok &= [lin.weight.data_ptr(), lin.bias.data_ptr()] == [v.data_ptr() for v in views]
    return ok


# ============================================================================================== byte identity
def test_off_tables_run_is_byte_identical_to_resident(spec, resident):
    model = fresh_model()
    source = adaln_host.keep_on_host(model, "cpu")
    assert on_host(model, source) and source.host_bytes > 0
    traj = T.record(spec.with_record(residency=TABLES), model, keep=("velocities",))
    assert traj.digest == resident.digest
    assert traj.manifest["result_sha256"] == resident.manifest["result_sha256"]  # a record, not a result
    assert traj.manifest["run_record"]["residency"] == TABLES
    tables = tables_of(model)
    passes, blocks = spec.inputs.num_passes, CONFIG.num_layers
    assert tables.stats.served == passes * blocks and tables.stats.on_demand == 0 and tables.stats.passes == 1
    assert tables.stats.groups == 0  # the run's tables are dropped when it ends
    assert on_host(model, source)


def test_spec_value_places_a_resident_model_for_the_run(spec, resident):
    model = fresh_model()
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert T.record(spec.with_record(residency=TABLES), model).digest == resident.digest
    assert tables_of(model) is None  # restored after the run
    assert {n: p.data_ptr() for n, p in model.named_parameters() if "adaln_proj" not in n} == \
        {n: v for n, v in params.items() if "adaln_proj" not in n}


def test_tables_with_streamed_blocks(spec, resident):
    model = fresh_model()
    plan = execution.ExecutionPlan("cpu", residency="streamed", adaln="tables")
    plan.place(model, "transformer")
    streamer, source = S.streamer_of(model), adaln_host.source_of(model)
    assert streamer is not None and source is not None
    adaln_bytes = sum(source.nbytes.values())
    packed = {id(e.get()) for u in streamer.units for e in u.entries}
    assert not packed & source.tensor_ids()  # no unit carries an AdaLN weight
    traj = T.record(spec.with_record(residency=plan.residency_value()), model)
    assert traj.digest == resident.digest
    stats = S.last_stats()
    assert stats.bytes_moved < 3 * (streamer.plan.streamed_bytes + adaln_bytes)
    assert on_host(model, source)
    # back to resident blocks with AdaLN resident: every tensor on the device again, same bytes
    execution.ExecutionPlan("cpu").place(model, "transformer")
    assert S.streamer_of(model) is None and adaln_host.source_of(model) is None
    assert T.record(spec, model).digest == resident.digest


def test_strict_tables_run_equals_strict_resident():
    # One strict pass of a 2-block model in the interpreter: the tables of the run's groups in one strict GEMM.
    config = H3Config(**{**CONFIG.to_diffusers(), "num_layers": 2})
    layout = build_layout("t2va", torch.ones(4, dtype=torch.long), 2, 2, 4, 2, patch_size=config.patch_size)
    schedule = DualSchedule.build(3)
    strict = RunSpec(make_inputs(config, layout, schedule, seed=5), schedule, layout=layout, mode="strict")
    ref = T.record(strict, fresh_model(config=config))
    model = fresh_model(config=config)
    execution.ExecutionPlan("cpu", adaln="tables").place(model, "transformer")
    traj = T.record(strict.with_record(residency=TABLES), model)
    assert traj.digest == ref.digest
    assert tables_of(model).stats.served == 2 * 2


# ============================================================================================== batch invariance
def test_strict_tables_at_once_equal_one_pass_at_a_time():
    """The strict contract the tables rely on: one GEMM over every pass's rows gives each pass's rows the bytes of
    its own GEMM (random weights and timesteps, 5 passes of 2-3 distinct timesteps, uneven row counts)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    model = fresh_model(seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    groups = [torch.rand(n, generator=gen).sort().values for n in (2, 3, 2, 3, 2)]
    with runtime.use_mode("strict"):
        once = serve_tables(model)
        batch = once.prepare(groups)
        singles = [serve_tables(model).prepare([g]) for g in groups]
    for i in range(CONFIG.num_layers):
        split = batch.tables[i].split([g.numel() for g in groups])
        for part, single in zip(split, singles):
            assert torch.equal(part, single.tables[i])
    pairs = serve_tables(model)
    with runtime.use_mode("strict"):
        two = [pairs.prepare(groups[k: k + 2]) for k in range(0, len(groups), 2)]
    for i in range(CONFIG.num_layers):
        joined = torch.cat([b.tables[i] for b in two])
        assert torch.equal(joined, batch.tables[i])


# ============================================================================================== what observers see
def _forward_trace(model, spec, i: int):
    model_forward(model, spec.inputs, spec.inputs.video, spec.inputs.audio, i)
    out = runtime.last_trace().to_dict()
    out.pop("versions")
    return out


def test_strict_trace_and_hooks_see_no_difference():
    config = H3Config(**{**CONFIG.to_diffusers(), "num_layers": 1})
    spec = make_spec("strict", passes=2, config=config, seed=int(torch.randint(0, 1000, (1,))))
    seen: dict[str, list] = {"resident": [], "tables": []}
    model = fresh_model(config=config)
    with runtime.use_mode("strict"), torch.no_grad():
        for name in ("resident", "tables"):
            if name == "tables":
                adaln_host.keep_on_host(model, "cpu")
            handle = model.add_hook(lambda p, t, log=seen[name]: log.append((p.name, t.clone())))
            seen[name + "_trace"] = _forward_trace(model, spec, 1)
            handle.remove()
    assert seen["resident_trace"] == seen["tables_trace"]  # every record: backend, kernel id, tile, shapes
    assert [r["kernel_id"] for r in seen["tables_trace"]["records"] if r["point"] == "blocks.0.adaln_table" and r["op"] == "linear"] == \
        ["h3kernels.gemm.linear.kloop.bfloat16"]
    assert [n for n, _ in seen["resident"]] == [n for n, _ in seen["tables"]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(seen["resident"], seen["tables"]))
    assert tables_of(model).stats.served == 1


def test_a_hook_that_changes_the_time_embedding_is_refused(spec, resident):
    model = fresh_model()
    adaln_host.keep_on_host(model, "cpu")
    handle = model.add_hook(lambda p, t: t * 1.5, names=["time_mlp"])
    with pytest.raises(AdaLNTablesError, match="AdaLN input differs"):
        denoise(spec.with_record(residency=TABLES), model)
    handle.remove()
    observer = model.add_hook(lambda p, t: None, names=["time_mlp", "time_sinusoid"])  # observing is fine
    assert T.record(spec.with_record(residency=TABLES), model).digest == resident.digest
    observer.remove()


def test_an_override_of_linear_is_computed_through(spec):
    """An ablation-style override of `linear` (here: every AdaLN projection's output scaled) computes the tables,
    as it computes a resident forward: same bytes, and the trace says "override" at the AdaLN points."""
    def linear(x, weight, bias=None):
        out = runtime.mode_op("linear")(x, weight, bias)
        return out * 0.5 if weight.shape[0] == CONFIG.adaln_dim else out

    perturbed = spec.with_custom(overrides={"linear": linear})
    ref = denoise(perturbed, fresh_model())
    model = fresh_model()
    adaln_host.keep_on_host(model, "cpu")
    out = denoise(perturbed.with_record(residency=TABLES), model)
    assert all(torch.equal(a, b) for a, b in zip(ref, out))
    actual = {r.actual for r in runtime.last_trace().records if r.point.endswith("adaln_table") and r.op == "linear"}
    assert actual == {"override"}


def test_a_forward_outside_a_run_is_served_on_demand(spec, resident):
    model = fresh_model()
    adaln_host.keep_on_host(model, "cpu")
    with torch.no_grad():
        got = model_forward(model, spec.inputs, spec.inputs.video, spec.inputs.audio, 0)
    assert tables_of(model).stats.on_demand == 1
    with torch.no_grad():
        want = model_forward(fresh_model(), spec.inputs, spec.inputs.video, spec.inputs.audio, 0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_changed_weights_drop_stale_tables(spec):
    model = fresh_model()
    tables = serve_tables(model)
    with torch.no_grad():
        tables.prepare([spec.inputs.plan[0][0]])
        model.transformer_blocks[1].adaln_proj.linear.weight.mul_(2)
        got = model_forward(model, spec.inputs, spec.inputs.video, spec.inputs.audio, 0)
        tables.detach()
        want = model_forward(model, spec.inputs, spec.inputs.video, spec.inputs.audio, 0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert tables.stats.on_demand == 1


def test_a_training_forward_with_checkpointing_is_served(spec):
    """Frozen AdaLN under a training forward (gradient checkpointing replays the blocks in backward): the input
    gradients equal the resident model's."""
    grads = []
    for tables in (False, True):
        model = fresh_model()
        model.gradient_checkpointing = True
        if tables:
            adaln_host.keep_on_host(model, "cpu")
        video = spec.inputs.video.clone().requires_grad_(True)
        out = model_forward(model, spec.inputs, video, spec.inputs.audio, 1)
        (out[0].float().square().sum() + out[1].float().square().sum()).backward()
        grads.append(video.grad)
    assert torch.equal(grads[0], grads[1])


# ============================================================================================== refusals
def test_refusals(spec):
    model = fresh_model()
    adaln_host.keep_on_host(model, "cpu")
    model.transformer_blocks[0].adaln_proj.linear.weight.requires_grad_(True)
    with pytest.raises(AdaLNTablesError, match="records gradients"), torch.enable_grad():
        model_forward(model, spec.inputs, spec.inputs.video, spec.inputs.audio, 0)
    with pytest.raises(AdaLNTablesError, match="mode fast"), runtime.use_mode("fast"):
        tables_of(model).prepare([spec.inputs.plan[0][0]])
    with pytest.raises(S.ResidencyError, match="adaln='nope'"):
        S.residency_value("resident", adaln="nope")
    streamed = fresh_model()
    S.stream_blocks(streamed, "cpu")
    with pytest.raises(S.ResidencyError, match="streamed with its AdaLN weights in the blocks"):
        denoise(spec.with_record(residency=TABLES), streamed)


def test_residency_values():
    assert S.residency_value("resident", adaln="tables") == TABLES
    assert S.residency_value("streamed", 40, adaln="tables") == {"policy": "streamed", "slots": 2,
                                                                 "gpu_memory_gib": 40.0, "adaln": "tables"}
    assert S.check_residency_value({"policy": "resident", "adaln": "resident"}) == {}
    assert execution.ExecutionPlan("cpu", adaln="tables").spec_fields()["residency"] == TABLES
    assert residency_field.run_timesteps  # the provider's view of a run's passes


def test_verify_replays_a_tables_run_resident(spec, tmp_path):
    model = fresh_model()
    adaln_host.keep_on_host(model, "cpu")
    T.record(spec.with_record(residency=TABLES), model).seal(tmp_path / "run")
    report = T.verify(tmp_path / "run", fresh_model(), execution={"residency": {}})
    assert report.ok and report.record_differences == ["residency"]


# ============================================================================================== the benchmarks
def test_benchmarks_tiny_smoke(tmp_path, monkeypatch):
    """`benchmark_adaln_tables.py --tiny` writes the schema with every section byte-equal where bytes are promised, and
    `benchmark_streaming.py --tiny --adaln tables` streams fewer bytes than with AdaLN in the blocks, still equal."""
    import json
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import benchmark_adaln_tables
    import benchmark_streaming

    doc = benchmark_adaln_tables.main(["--tiny", "--out", str(tmp_path / "adaln.json")])
    assert {"name", "date", "gpu", "gpu_total_gib", "torch", "triton", "git_rev", "command"} <= set(doc)
    rows = {(r["section"], r["impl"]): r for r in doc["results"]}
    assert set(rows) == {("tables", "h3lab-strict"), ("tables", "h3lab-off"), ("t2va", "h3lab-strict"),
                         ("diffusers", "diffusers")}
    for r in rows.values():
        assert {"shape", "rows", "impl", "median_s", "runs", "peak_mem_gib"} <= set(r)
    strict = rows["tables", "h3lab-strict"]
    assert strict["equal_one_at_a_time"] and strict["equal_two_at_a_time"] and strict["passes"] == 4
    assert rows["t2va", "h3lab-strict"]["bytes_equal_resident"]
    assert rows["diffusers", "diffusers"]["strict_rel_l2_vs_diffusers"] < 0.05
    moved = {}
    for adaln in ("resident", "tables"):
        out = tmp_path / f"streaming-{adaln}.json"
        benchmark_streaming.main(["--tiny", "--no-strict", "--runs", "1", "--repeats", "1", "--adaln", adaln,
                                  "--out", str(out)])
        by = {r["residency"]: r for r in json.loads(out.read_text())["results"]}
        assert by["streamed"]["bytes_equal_resident"] and by["budget"]["bytes_equal_resident"]
        moved[adaln] = by["streamed"]["bytes_per_forward"]
    assert moved["tables"] < moved["resident"]
