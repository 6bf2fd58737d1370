"""Streamed residency (`h3lab.components.streaming`) on the CPU: streamed runs are byte-identical to resident ones
(off and strict), with the copies deferred as a side stream would defer them, with 2 and 3 slots and under a budget;
the ordering rules (a copy never lands in the running slot, it waits for the slot's last use, compute waits for the
copy) are checked on a recording backend, and a backend that skips the wait is caught; the warm start, recovery after
a failing forward, the inference-only guard, restore, the plan, the pinned arena layout and the statistics. On the
CPU "device slots" are tensors on the CPU and copies are synchronous: what only a GPU can show (overlap, throughput,
pinned memory) is measured by benchmarks/benchmark_streaming.py."""

from __future__ import annotations

import json

import pytest
import torch

from h3lab import H3Config, H3Transformer
from h3lab.run import trajectory as T
from h3lab.research.ablation import make_inputs
from h3lab.components import streaming as S
from h3lab.run.layout import build_layout
from h3lab.model.random_init import random_state_dict
from h3lab.run import RunSpec, denoise
from h3lab.run.sampler import DualSchedule

# 1 refiner block + 5 transformer blocks: more units than slots, so the ring wraps inside one forward.
CONFIG = H3Config(num_attention_heads=2, attention_head_dim=8, hidden_size=16, num_layers=5, num_refiner_layers=1,
                  ffn_dim=24, in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=12, freq_dim=8,
                  time_embed_hidden_dim=16, time_embed_dim=12, rope_freq_dim=1)


def fresh_model(seed: int = 3, config: H3Config = CONFIG) -> H3Transformer:
    model = H3Transformer(config)
    model.load_state_dict(random_state_dict(config, seed))
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def spec() -> RunSpec:
    layout = build_layout("fl2va", torch.ones(5, dtype=torch.long), 2, 4, 4, 3, anchors=("first",),
                          patch_size=CONFIG.patch_size)
    schedule = DualSchedule.build(4)  # 3 passes
    return RunSpec(make_inputs(CONFIG, layout, schedule, seed=11), schedule, layout=layout, mode="off")


@pytest.fixture(scope="module")
def resident(spec):
    return T.record(spec, fresh_model())


class DeferredBackend(S.HostBackend):
    """A copy stream that runs late: copies queue up and run (in order) only when compute waits for one of them or
    at a synchronisation, as a side stream may. A streamer that used a slot before waiting would read stale bytes."""

    name = "deferred"

    def __init__(self):
        self.pending: list = []

    def copy(self, dst, src, after):
        ticket = S.Ticket(len(self.pending), None, dst.numel())
        self.pending.append((ticket, dst, src))
        return ticket

    def wait(self, ticket):
        while self.pending and self.pending[0][0].end is None:
            t, dst, src = self.pending.pop(0)
            dst.copy_(src)
            t.end = t.start
            if t is ticket:
                break

    def synchronize(self):
        for t, dst, src in self.pending:
            dst.copy_(src)
            t.end = t.start
        self.pending = []

    def duration(self, ticket):
        return 0.0


class NoWaitBackend(DeferredBackend):
    """The bug the ordering prevents: compute does not wait for the copy."""

    def wait(self, ticket):
        pass


class RecordingBackend(S.HostBackend):
    """Host copies, logging every mark and copy so the test can check the ordering rules."""

    def __init__(self):
        self.streamer = None
        self.log: list = []
        self.violations: list[str] = []

    def mark(self):
        m = ("mark", len(self.log))
        self.log.append(m)
        return m

    def copy(self, dst, src, after):
        s = self.streamer
        running = s._current[1] if s is not None and s._current is not None else None
        if running is not None and running.buffer.data_ptr() == dst.data_ptr():
            self.violations.append("copy into the running slot")
        slot = next(x for x in s.slots if x.buffer.data_ptr() == dst.data_ptr())
        if after is not slot.free:
            self.violations.append(f"copy into slot {slot.index} does not wait for its last use")
        self.log.append(("copy", slot.index, after))
        return super().copy(dst, src, after)


def streamed(model, backend=None, **kw):
    return S.stream_blocks(model, "cpu", backend=backend, **kw)


# ============================================================================================== byte identity
@pytest.mark.parametrize("backend, slots, budget", [
    (None, 2, None), (DeferredBackend, 2, None), (DeferredBackend, 3, None), (None, 2, "half"),
])
def test_streamed_run_is_byte_identical_to_resident(spec, resident, backend, slots, budget):
    model = fresh_model()
    gib = None
    if budget == "half":  # room for the fixed tensors, the slots and some blocks: a mixed plan
        full = S.plan_for_model(model)
        gib = (full.device_bytes + 2 * full.slot_bytes) / S.GiB
    streamer = streamed(model, backend() if backend else None, slots=slots, gpu_memory_gib=gib)
    assert streamer.plan.streamed and (budget is None) == (not streamer.plan.resident)
    streamer.begin_run()
    traj = T.record(spec, model)
    stats = streamer.end_run()
    assert traj.digest == resident.digest
    n = len(streamer.plan.streamed)
    assert stats.uses == 3 * n and stats.on_demand == 1
    if n > slots:  # every use prefetched (one copy each), plus the next run's first slots - 1 units
        assert stats.copies == stats.uses + slots - 1
    else:  # a few streamed units stay in their slots after the first pass
        assert stats.copies <= stats.uses + slots - 1
    # The streamed units live in host buffers between forwards, the others stay where they were.
    for unit in streamer.units:
        assert (unit.host is not None) == (unit.name in streamer.plan.streamed)


def test_strict_streamed_equals_strict_resident():
    # Strict kernels run in Triton's interpreter here: one pass of a 3-unit model (still more units than slots).
    config = H3Config(**{**CONFIG.to_diffusers(), "num_layers": 2})
    layout = build_layout("t2va", torch.ones(4, dtype=torch.long), 2, 2, 4, 2, patch_size=config.patch_size)
    schedule = DualSchedule.build(2)
    strict = RunSpec(make_inputs(config, layout, schedule, seed=5), schedule, layout=layout, mode="strict")
    ref = T.record(strict, fresh_model(config=config))
    model = fresh_model(config=config)
    streamer = streamed(model, DeferredBackend())
    assert len(streamer.plan.streamed) == 3
    assert T.record(strict, model).digest == ref.digest


def test_skipping_the_wait_is_caught(spec, resident):
    """The test above can fail: with compute not waiting for the copies the bytes are stale and the digest moves."""
    model = fresh_model()
    streamed(model, NoWaitBackend())
    assert T.record(spec, model).digest != resident.digest


def test_ordering_rules_on_a_recording_backend(spec, resident):
    backend = RecordingBackend()
    model = fresh_model()
    streamer = streamed(model, backend)
    backend.streamer = streamer
    assert T.record(spec, model).digest == resident.digest
    assert backend.violations == []
    copies = [e for e in backend.log if e[0] == "copy"]
    assert {slot for _, slot, _ in copies} == {0, 1}  # the two slots alternate


# ============================================================================================== pipeline
def test_warm_start_and_one_copy_per_use(spec):
    model = fresh_model()
    streamer = streamed(model)
    n = len(streamer.plan.streamed)
    streamer.begin_run()
    denoise(spec, model)
    first = streamer.end_run()
    assert first.on_demand == 1  # only the very first unit is fetched on demand
    assert first.copies == 3 * n + 1  # every use prefetched once, plus the next run's first unit
    assert first.bytes_moved == 3 * streamer.plan.streamed_bytes + streamer.units[0].nbytes
    streamer.begin_run()
    denoise(spec, model)
    second = streamer.end_run()
    assert second.on_demand == 0 and second.copies == 3 * n  # warm: the first unit was copied during the last
    assert second.exposed_seconds == second.copy_seconds and second.hidden_fraction == 0.0  # CPU: nothing hides


def test_a_failing_forward_leaves_the_streamer_consistent(spec, resident):
    model = fresh_model()
    streamer = streamed(model)

    def boom(point, tensor):
        raise RuntimeError("hook failed")

    handle = model.add_hook(boom, names=["blocks.2.q"])
    with pytest.raises(RuntimeError, match="hook failed"):
        denoise(spec, model)
    handle.remove()
    assert streamer._current is None and not any(s.busy for s in streamer.slots)
    assert all(e.get().data_ptr() == v.data_ptr() for u in streamer.streamed for e, v in zip(u.entries, u.host_views))
    assert T.record(spec, model).digest == resident.digest  # the mispredicted queue is refilled on demand


def test_gradients_need_checkpointing(spec):
    """A forward that records gradients through a streamed block is refused unless the model checkpoints its blocks
    (training under a budget: tests/training/test_streamed_training.py)."""
    model = fresh_model()
    streamed(model)
    with pytest.raises(S.ResidencyError, match="trains only with gradient checkpointing"):
        with torch.enable_grad():
            video = spec.inputs.video.clone().requires_grad_(True)
            from h3lab.run import model_forward

            model_forward(model, spec.inputs, video, spec.inputs.audio, 0)


def test_tensors_added_inside_a_streamed_unit_are_placed_and_kept(spec, monkeypatch):
    """A LoRA-like factor injected into a streamed block after streaming (as `RunSpec.adapters` does for a run)
    is not packed: `begin_run` puts it on the device (here: a move the test observes through `_on`), the packed
    tensors are never touched, and the run equals a resident model carrying the same extra factor."""

    def add_extra(model):
        block = model.transformer_blocks[1]
        torch.manual_seed(0)
        extra = torch.nn.Parameter(torch.randn(CONFIG.hidden_size).to(torch.bfloat16), requires_grad=False)
        block.register_parameter("extra_scale", extra)
        block.register_forward_hook(lambda m, a, out: out * (1 + 0.01 * m.extra_scale).to(out.dtype))
        return extra

    ref_model = fresh_model()
    add_extra(ref_model)
    ref = T.record(spec, ref_model)
    model = fresh_model()
    streamer = streamed(model)
    extra = add_extra(model)
    real_on = S._on
    monkeypatch.setattr(S, "_on", lambda t, device: False if t is extra else real_on(t, device))
    assert streamer.place_extras() == ["transformer_blocks.1.extra_scale"]  # only the new tensor moves
    monkeypatch.setattr(S, "_on", real_on)
    assert T.record(spec, model).digest == ref.digest


def test_remove_restores_a_resident_model(spec, resident):
    model = fresh_model()
    params = {n: p for n, p in model.named_parameters()}
    streamer = streamed(model)
    streamer.remove(restore=True)
    assert S.streamer_of(model) is None and not model.transformer_blocks[0]._forward_pre_hooks
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects
    assert T.record(spec, model).digest == resident.digest


def test_replan_in_place(spec, resident):
    model = fresh_model()
    first = streamed(model)
    full = first.plan
    again = streamed(model, gpu_memory_gib=(full.device_bytes + 2 * full.slot_bytes) / S.GiB)
    assert again is first and again.plan.resident and again.plan != full
    assert T.record(spec, model).digest == resident.digest


# ============================================================================================== plan, layout, stats
def test_plan_residency():
    units = [("token_refiner.refiner_blocks.0", 600)] + [(f"transformer_blocks.{i}", 1000) for i in range(10)]
    everything = S.plan_residency(units, fixed_bytes=100)
    assert len(everything.streamed) == 11 and everything.slot_bytes == 1000
    assert everything.device_bytes == 100 + 2 * 1000 and everything.streamed_bytes == 10600
    assert S.plan_residency(units, 100, gpu_memory_gib=10700 / S.GiB).streamed == ()  # everything fits
    mixed = S.plan_residency(units, 100, gpu_memory_gib=7100 / S.GiB)
    assert mixed.device_bytes <= 7100 and "token_refiner.refiner_blocks.0" in mixed.resident  # refiner first
    idx = [int(n.split(".")[-1]) for n in mixed.streamed]
    assert len(idx) == 6 and max(b - a for a, b in zip(idx, idx[1:])) <= 2  # spread, not a run at one end
    with pytest.raises(S.ResidencyError, match=r"gpu_memory_gib=1e-06: the streamed DiT needs at least"):
        S.plan_residency(units, 100, gpu_memory_gib=1e-6)
    with pytest.raises(S.ResidencyError, match="no blocks to stream"):
        S.plan_residency([], 100)


def test_pinned_arena_layout():
    sizes = [770_725_888] * 2 + [1_291_144_192] * 50  # the released DiT: 2 refiner blocks, 50 blocks
    layout = S.arena_layout(sizes)
    seen = set()
    for arena, members in layout:
        assert arena & (arena - 1) == 0  # powers of two: what the pinned allocator hands out anyway
        spans = sorted((off, off + sizes[i]) for i, off in members)
        assert all(off % S.ALIGN == 0 for off, _ in spans) and spans[-1][1] <= arena
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
        seen |= {i for i, _ in members}
    assert seen == set(range(len(sizes)))
    total = sum(a for a, _ in layout)
    assert total < 1.05 * sum(sizes)  # 64 GiB; one rounded allocation per unit would pin 102 GiB


class FakeEvent:
    def __init__(self, ms):
        self.ms = ms

    def elapsed_time(self, other):
        return other.ms - self.ms


def test_cuda_backend_statistics_from_events():
    """The CUDA backend's formulas on fake events: a copy that ended before compute wanted it is hidden, one that
    ended later exposes the difference."""
    backend = object.__new__(S.CudaBackend)
    early = S.Ticket(FakeEvent(0.0), FakeEvent(20.0), 10**9)
    late = S.Ticket(FakeEvent(20.0), FakeEvent(45.0), 10**9)
    uses = [(early, FakeEvent(30.0)), (late, FakeEvent(40.0))]
    assert backend.duration(late) == pytest.approx(0.025)
    assert backend.exposed([early, late], uses) == pytest.approx(0.005)
    stats = S.StreamStats("cuda", 2 * 10**9, 2, 0, 2, 0.045, 0.005)
    assert stats.throughput == pytest.approx(2e9 / 0.045) and stats.hidden_fraction == pytest.approx(1 - 5 / 45)
    assert "89% hidden" in stats.lines()[0]


def test_cuda_backend_call_sequence_on_fake_streams(spec, resident, monkeypatch):
    """`CudaBackend` driven through a real streamed run with torch.cuda's Stream / Event / stream context replaced
    by fakes that log: the copy stream waits only on compute-stream marks (a slot's last use) before copying, the
    compute stream waits only on copy-stream events before a unit runs, the first fill of each slot waits on nothing,
    and the bytes equal resident (the copies themselves run on CPU tensors)."""
    import contextlib
    import time as _time

    log: list = []

    class FakeEvent:
        count = 0

        def __init__(self, enable_timing=False):
            FakeEvent.count += 1
            self.id, self.stream, self.t = FakeEvent.count, None, None

        def record(self, stream):
            self.stream, self.t = stream.name, _time.perf_counter()
            log.append(("record", self.id, stream.name))

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    class FakeStream:
        def __init__(self, name="copy", device=None):
            self.name = name

        def wait_event(self, event):
            log.append(("wait", self.name, event.id, event.stream))

    compute = FakeStream("compute")
    current = [compute]

    @contextlib.contextmanager
    def use_stream(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream("copy"))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", use_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    model = fresh_model()
    streamer = streamed(model, S.CudaBackend(torch.device("cpu")))
    streamer.begin_run()
    assert T.record(spec, model).digest == resident.digest
    stats = streamer.end_run()
    waits = [e for e in log if e[0] == "wait"]
    copies = [e for e in log if e[0] == "record" and e[2] == "copy"]
    assert all(stream == "compute" for _, who, _, stream in waits if who == "copy")  # slot free marks only
    assert all(stream == "copy" for _, who, _, stream in waits if who == "compute")  # copy ends only
    n_copies = len(copies) // 2  # a start and an end event per copy
    assert sum(1 for w in waits if w[1] == "copy") == n_copies - len(streamer.slots)  # first fills wait on nothing
    assert sum(1 for w in waits if w[1] == "compute") == stats.uses == 3 * len(streamer.streamed)
    assert 0.0 <= stats.hidden_fraction <= 1.0 and stats.copies == stats.uses + 1


# ============================================================================================== the run-spec field
@pytest.mark.parametrize("value, message", [
    ({"policy": "swapped"}, "policy='swapped'"),
    ({"policy": "streamed", "slots": 1}, "slots=1"),
    ({"policy": "streamed", "slots": True}, "slots=True"),
    ({"policy": "streamed", "gpu_memory_gib": -4}, "gpu_memory_gib=-4"),
    ({"policy": "streamed", "gpu_memory_gib": "40"}, "gpu_memory_gib='40'"),
    ({"policy": "streamed", "prefetch": 3}, "key 'prefetch'"),
    ({"policy": "resident", "gpu_memory_gib": 40}, "applies to policy 'streamed' only"),
    ([1], "must be an object"),
])
def test_bad_residency_values_fail_when_the_spec_is_built(spec, value, message):
    with pytest.raises(Exception, match=message) as err:
        spec.replace(residency=value)
    assert len(str(err.value).splitlines()) == 1


def test_the_field_is_sealed_and_replayed(spec, resident, tmp_path):
    assert "residency" not in spec.to_dict()  # default: the description of older specs unchanged
    assert spec.replace(residency={"policy": "resident"}).description_sha256 == spec.description_sha256
    budget = spec.replace(residency={"policy": "streamed", "gpu_memory_gib": 40})
    assert dict(budget.residency) == {"policy": "streamed", "slots": 2, "gpu_memory_gib": 40.0}
    run = spec.replace(residency={"policy": "streamed"})
    assert spec.sha256 == budget.sha256 == run.sha256  # one result hash: residency never changes a byte ...
    assert len({json.dumps(s.run_record(), sort_keys=True) for s in (spec, budget, run)}) == 3  # ... it is recorded
    model = fresh_model()
    traj = T.record(run, model)  # a resident model, streamed for the run and restored after it
    assert traj.digest == resident.digest and S.streamer_of(model) is None
    assert S.last_stats() is not None and S.last_stats().uses > 0
    path = traj.seal(tmp_path / "streamed")
    loaded = T.load(path)
    assert dict(loaded.spec.residency) == dict(run.residency)
    assert T.verify(path, model).ok and S.streamer_of(model) is None
    on_streamed = fresh_model()
    streamed(on_streamed)
    assert T.verify(path, on_streamed).ok and S.streamer_of(on_streamed) is not None


# ============================================================================================== the benchmark
def test_benchmark_tiny_smoke_writes_the_schema(tmp_path, monkeypatch):
    """`benchmarks/benchmark_streaming.py --tiny`: every placement runs, the schema's keys are there, the streamed
    and budget placements are byte-equal to resident. (Strict is covered above: its interpreter forwards would
    triple this test's time.)"""
    import json
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import benchmark_streaming

    out = tmp_path / "streaming.json"
    benchmark_streaming.main(["--tiny", "--no-strict", "--runs", "1", "--repeats", "1", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert {"name", "date", "gpu", "torch", "triton", "git_rev", "command", "results"} <= set(doc)
    rows = {r["residency"]: r for r in doc["results"]}
    assert set(rows) == {"resident", "streamed", "budget"}
    for r in rows.values():
        assert {"shape", "rows", "impl", "median_s", "runs", "peak_mem_gib"} <= set(r) and r["median_s"] > 0
    assert rows["streamed"]["bytes_equal_resident"] and rows["budget"]["bytes_equal_resident"]
    assert rows["streamed"]["resident_blocks"] == 0 and rows["budget"]["resident_blocks"] == 1
    assert rows["streamed"]["bytes_per_forward"] > rows["budget"]["bytes_per_forward"] > 0
    assert rows["streamed"]["dit_gpu_gib"] < rows["resident"]["dit_gpu_gib"]
