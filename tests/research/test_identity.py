"""A run spec's identity splits into a result hash (what can change a byte) and a run record (where
and how it ran). Moving the LoRA file, streaming the blocks or naming a one-process topology keep the result hash;
the mode, the steps and the adapter's bytes change it. `verify` checks the result hash and reports the run record;
a trajectory in the v1 form (a checked-in fixture: one `spec_sha256` over the whole description) still loads and
verifies."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from h3lab import H3Config, H3Transformer
from h3lab.run import trajectory as T
from h3lab.research.ablation import tiny_bench
from h3lab.model import random_state_dict
from h3lab.run import RunSpecError
from h3lab.run.sampler import DualSchedule

FIXTURE = Path(__file__).parent / "fixtures" / "trajectory-v1-streamed"
STREAMED = {"policy": "streamed"}


@pytest.fixture(scope="module")
def bench(tiny_snapshot):
    import h3lab.components.store  # noqa: F401 - provides RunSpec.residency

    return tiny_bench(str(tiny_snapshot))


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """(entry at one path, the same bytes' entry at another path, under another name), and a third of other bytes."""
    from h3lab.training import add_lora, save_adapter
    from h3lab.adapters.field import adapter_entry

    root = tmp_path_factory.mktemp("adapters")
    model = H3Transformer(H3Config.tiny())
    model.load_state_dict(random_state_dict(model.config, 1))
    add_lora(model, 2, 4.0, seed=2)
    path, _ = save_adapter(model, root / "fox-lora")
    moved = shutil.copytree(path, root / "elsewhere" / "renamed-lora")
    other_model = H3Transformer(H3Config.tiny())
    other_model.load_state_dict(random_state_dict(model.config, 1))
    add_lora(other_model, 2, 4.0, seed=3)
    other, _ = save_adapter(other_model, root / "other-lora")
    return adapter_entry(path), adapter_entry(moved), adapter_entry(other)


def test_the_run_record_never_enters_the_result_hash(bench, adapter):
    spec = bench.spec("off")
    here, moved, other = adapter
    assert here["sha256"] == moved["sha256"] and here["path"] != moved["path"] and here["name"] != moved["name"]
    a, b = spec.replace(adapters=[here]), spec.replace(adapters=[moved])
    assert a.sha256 == b.sha256 != spec.sha256  # moving (and renaming) the file keeps the result
    assert a.run_record()["adapters"] != b.run_record()["adapters"]
    assert a.description_sha256 != b.description_sha256  # the v1 single identity holds the path
    assert spec.replace(adapters=[other]).sha256 != a.sha256  # other bytes: another result
    assert spec.replace(adapters=[{**here, "scale": 0.5}]).sha256 != a.sha256

    streamed = spec.replace(residency=STREAMED)
    budget = spec.replace(residency={**STREAMED, "gpu_memory_gib": 40})
    one_rank = spec.replace(placement={"tp": 1})
    assert streamed.sha256 == budget.sha256 == one_rank.sha256 == spec.sha256  # streamed vs resident: one result
    assert streamed.run_record()["residency"] == {"policy": "streamed", "slots": 2}
    assert one_rank.run_record()["placement"]["tp"] == 1 and spec.run_record()["placement"] == {}

    assert spec.replace(mode="strict").sha256 != spec.sha256
    longer = DualSchedule.build(4)
    from h3lab.research.ablation import make_inputs

    more_steps = spec.replace(schedule=longer, inputs=make_inputs(H3Config.tiny(), bench.layout, longer, seed=0))
    assert more_steps.sha256 != spec.sha256
    assert spec.replace(reuse=2).sha256 != spec.sha256 and spec.replace(factors=("H5",)).sha256 != spec.sha256

    with pytest.raises(RunSpecError, match="another result"):
        a.with_record(adapters=[other])
    assert a.with_record(adapters=[moved], residency=STREAMED).sha256 == a.sha256


# The class of the machine that sealed the fixture (its manifest predates the run record's arithmetic class).
FIXTURE_CLASS = "cpu_avx512"


def test_a_v1_trajectory_loads_and_verifies(bench):
    """Relies on: the fixture's arithmetic class's bytes (it was sealed in mode off on a `FIXTURE_CLASS` CPU; off
    bytes hold within one class). On that class it verifies byte for byte; on any other the loading, the result hash
    and the run record hold, and a drift, if any, is reported as a matter of the class, not of the run."""
    from h3lab.execution.arithmetic import arithmetic_class

    manifest = json.loads((FIXTURE / T.MANIFEST).read_text())
    assert "spec_sha256" in manifest and "result_sha256" not in manifest  # the v1 form, as it was sealed
    traj = T.load(FIXTURE)
    assert traj.spec.description_sha256 == manifest["spec_sha256"]
    assert traj.spec.sha256 == bench.spec("off").sha256  # streamed when sealed: the resident run's result hash
    report = T.verify(traj, bench.model)
    assert report.record_differences == [] and report.result_sha256 == traj.spec.sha256
    assert report.run_record["residency"] == {"policy": "streamed", "slots": 2}
    resident = T.verify(traj, bench.model, execution={"residency": {}})
    assert resident.record_differences == ["residency"] and resident.digest == traj.digest
    assert "another run record: residency" in str(resident) and "-> resident" in str(resident)
    if arithmetic_class("cpu") == FIXTURE_CLASS:
        assert report.ok and resident.ok
    else:
        for r in (report, resident):
            assert r.ok or "sealed without naming its arithmetic class" in str(r), str(r)


def test_verify_says_when_off_bytes_were_compared_across_arithmetic_classes(bench, tmp_path):
    """A non-strict trajectory's run record names its arithmetic class; a drift replayed on another class says so
    (off/auto bytes hold within one class), a strict one's never blames the class."""
    traj = T.load(T.record(bench.spec("off"), bench.model).seal(tmp_path / "traj"))
    here = traj.manifest["run_record"]["machine"]["arithmetic_class"]
    assert here.startswith("cpu_") and T.verify(traj, bench.model).ok
    traj.manifest["run_record"]["machine"]["arithmetic_class"] = "cpu_elsewhere"  # as sealed on another class,
    traj.steps[0]["velocity_audio"] = "0" * 64  # whose off bytes differ
    report = T.verify(traj, bench.model)
    assert not report.ok and "machine.arithmetic_class" in report.record_differences
    assert f"sealed on arithmetic class cpu_elsewhere, replayed on {here}" in str(report)
    strict = dataclasses.replace(report, mode="strict")
    assert "arithmetic class" not in strict.class_note()


def test_verify_checks_the_result_hash_and_reports_the_run_record(bench, adapter, tmp_path):
    here, moved, _ = adapter
    work = tmp_path / "lora"
    shutil.copytree(here["path"], work)
    from h3lab.adapters.field import adapter_entry

    entry = adapter_entry(work)
    spec = bench.spec("off").replace(adapters=[entry], residency=STREAMED)
    path = T.record(spec, bench.model).seal(tmp_path / "traj")
    manifest = json.loads((path / T.MANIFEST).read_text())
    assert manifest["result_sha256"] == spec.sha256 and "spec_sha256" not in manifest
    assert manifest["run_record"]["residency"] == {"policy": "streamed", "slots": 2}
    assert manifest["run_record"]["adapters"] == [{"name": "lora", "path": entry["path"]}]
    assert manifest["run_record"]["machine"]["device"] == "cpu"

    shutil.rmtree(work)  # the adapter file moved: the same bytes elsewhere replay the same result
    report = T.verify(path, bench.model, execution={"residency": {}, "adapters": [moved]})
    assert report.ok and report.record_differences == ["residency", "adapters"], str(report)
    assert report.result_sha256 == spec.sha256 and report.replay_record["adapters"][0]["path"] == moved["path"]

    edited = json.loads(json.dumps(manifest))
    edited["run_record"]["residency"] = {}
    (path / T.MANIFEST).write_text(json.dumps(edited))
    with pytest.raises(T.TrajectoryError, match="run record"):
        T.load(path)
    edited = json.loads(json.dumps(manifest))
    edited["spec"]["mode"] = edited["mode"] = "strict"
    (path / T.MANIFEST).write_text(json.dumps(edited))
    with pytest.raises(T.TrajectoryError, match="result hash"):
        T.load(path)
