"""`ExecutionPlan`: device, placement, residency and streaming budget in one object that both
places the model (the component store delegates to it) and hands the spec its sealed description; its choices are
the spec's run record, never its result hash."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from h3lab import H3Config, H3Transformer
from h3lab.components import ExecutionPlan
from h3lab.components import streaming as S
from h3lab.components.store import ComponentStore
from h3lab.errors import ValidationError
from h3lab.run.layout import build_layout
from h3lab.model import random_state_dict
from h3lab.run import RunSpec
from h3lab.run.sampler import DualSchedule

CPU = torch.device("cpu")


def fake_mesh(tp=2, cp=1):
    """What the plan reads of an `h3lab.distributed` Mesh: its topology."""
    return SimpleNamespace(topology=SimpleNamespace(tp=tp, cp=cp, sp=False, row_parallel="auto"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(residency="swapped"), "residency='swapped'"),
    (dict(residency="resident", gpu_memory=4), "needs residency='streamed'"),
    (dict(residency="streamed", gpu_memory=-1), "gpu_memory_gib=-1"),
    (dict(residency="streamed", mesh=fake_mesh(cp=2)), "residency='streamed' with cp=2: every CP rank holds"),
])
def test_bad_plans_fail_with_one_line(kwargs, message):
    with pytest.raises(ValidationError, match=message) as err:
        ExecutionPlan(CPU, **kwargs)
    assert len(str(err.value).splitlines()) == 1


def test_the_plan_hands_the_spec_its_fields_and_they_keep_the_result_hash():
    resident, phased = ExecutionPlan(CPU), ExecutionPlan(CPU, "phased")
    streamed, budget = ExecutionPlan(CPU, "streamed"), ExecutionPlan(CPU, "streamed", gpu_memory=8)
    sharded = ExecutionPlan(CPU, mesh=fake_mesh(tp=2))
    assert resident.spec_fields() == phased.spec_fields() == {"placement": {}, "residency": {}}
    assert streamed.spec_fields()["residency"] == {"policy": "streamed", "slots": 2}
    assert budget.spec_fields()["residency"] == {"policy": "streamed", "slots": 2, "gpu_memory_gib": 8.0}
    assert sharded.placement_value() == {"tp": 2, "cp": 1, "sp": False, "row_parallel": "auto"}
    cfg = H3Config.tiny()
    layout = build_layout("t2va", torch.ones(4, dtype=torch.long), 2, 4, 4, 2, patch_size=cfg.patch_size)
    from h3lab.research.ablation import make_inputs

    schedule = DualSchedule.build(3)
    base = RunSpec(make_inputs(cfg, layout, schedule, seed=2), schedule, layout=layout)
    specs = [base.replace(**p.spec_fields()) for p in (resident, streamed, budget)]
    assert len({s.sha256 for s in specs}) == 1  # one result, three run records
    assert [s.run_record()["residency"] for s in specs] == [p.residency_value() for p in (resident, streamed, budget)]


def test_the_plan_places_the_model_and_the_store_delegates_to_it(tiny_snapshot):
    model = H3Transformer(H3Config.tiny())
    model.load_state_dict(random_state_dict(model.config, 5))
    plan = ExecutionPlan(CPU, "streamed")
    assert plan.place(model, "transformer") is model and S.streamer_of(model) is not None
    assert plan.describe({"transformer": model})[1].startswith("  transformer: ")
    ExecutionPlan(CPU).place(model, "transformer")
    assert S.streamer_of(model) is None  # resident again: the streamer is removed

    store = ComponentStore(tiny_snapshot, CPU, residency="streamed")
    assert store.plan == ExecutionPlan(CPU, "streamed") and store.residency == "streamed" and store.mesh is None
    dit = store.transformer()
    assert S.streamer_of(dit) is not None
    with pytest.raises(ValidationError, match="needs residency='streamed'"):
        store.set_residency("phased", gpu_memory=2)
    assert store.plan.residency == "streamed" and S.streamer_of(dit) is not None  # a refusal changes nothing
    store.set_residency("resident")
    assert store.plan == ExecutionPlan(CPU) and S.streamer_of(dit) is None
