"""The consistency gate across placements: a strict `flow_sde` rollout of G = 2 requests batched
(request 1 at batch position 0) run on a TP 2 mesh and on a CP 2 mesh (2 gloo ranks on the CPU, the 12-head
distributed test model, one block, fl2va 15 rows: CP shards 8 + 7), and the GRPO step's training-side log-density
computed on ONE process (batch 1, grad on, a LoRA whose B = 0 so the policy is the rollout's weights):
exp(logp_train - logp_rollout) == 1.0 exactly for every SDE pass, request and modality of both meshes. Two passes,
the SDE in a one-pass MixGRPO window at pass 1 (pass 0's Euler step on the mesh produces its input), so the
training side costs two forward + backward passes under the interpreter. The two meshes'
rollouts are byte-equal (checked), so the training side runs once and is compared with each. Gradient checkpointing
is left to `test_grpo_gate.py` (the strict interpreter's backward dominates this test's time)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from grpo_cases import group_inputs, rollout_batch

from h3lab.run import trajectory as T
from h3lab.run import RunSpec
from h3lab.run.fields import thaw
from h3lab.run.sampler import DualSchedule
from h3lab.training import OptimizerConfig, add_lora, trainable_parameters
from h3lab.training.grpo_step import GrpoConfig, grpo_iteration

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))
from dist_helpers import CONFIG, build_layout, build_model  # noqa: E402
from harness import run_ranks  # noqa: E402

PLACEMENTS = {"tp2": {"tp": 2}, "cp2": {"cp": 2}}
PASSES = 2
SDE_PASS = 1  # MixGRPO window of one pass: pass 0 (Euler, on the mesh) feeds the SDE pass 1 (halves the training)
PARAMS = {"level": 0.7, "seed": 13, "requests": [1, 0], "window": {"start": SDE_PASS, "size": 1}}


def _spec(placement: dict | None = None) -> RunSpec:
    layout = build_layout("fl2va")
    schedule = DualSchedule.from_passes(PASSES)
    spec = RunSpec(group_inputs(CONFIG, layout, schedule, 2, seed=5), schedule, mode="strict", layout=layout,
                   stepper="flow_sde", stepper_params=PARAMS)
    return spec if placement is None else spec.replace(placement=placement)


def _rollout_on_meshes(rank: int, world: int, out_dir: str) -> dict:
    from h3lab.distributed import init_mesh, parallelize

    digests = {}
    for name, placement in PLACEMENTS.items():
        mesh = init_mesh(tp=placement.get("tp", 1), cp=placement.get("cp", 1), device="cpu", config=CONFIG)
        model = build_model(1)
        parallelize(model, mesh)
        traj = T.record(_spec(placement), model, keep=("latents",))
        if rank == 0:
            traj.seal(Path(out_dir) / name)
        digests[name] = traj.digest
    return {"digests": ",".join(f"{k}={v}" for k, v in sorted(digests.items()))}


def test_mesh_rollouts_give_ratio_exactly_one_on_one_process(tmp_path):
    ranks = run_ranks(_rollout_on_meshes, 2, str(tmp_path), timeout=600)
    assert ranks[0]["digests"] == ranks[1]["digests"]  # both ranks recorded the same trajectory
    trajs = {name: T.load(tmp_path / name) for name in PLACEMENTS}
    for name, placement in PLACEMENTS.items():  # where it ran is recorded beside the result ...
        assert {k: thaw(trajs[name].spec.placement)[k] for k in ("tp", "cp")} == {"tp": placement.get("tp", 1),
                                                                                 "cp": placement.get("cp", 1)}
    assert trajs["tp2"].digest == trajs["cp2"].digest  # ... and does not change a byte of it
    batches = {name: rollout_batch(t, [0.3, -0.4]) for name, t in trajs.items()}
    for a, b in zip(batches["tp2"].transitions, batches["cp2"].transitions):
        for ta, tb in zip(a, b):
            assert torch.equal(ta.sample.video, tb.sample.video) and torch.equal(ta.sample.audio, tb.sample.audio)
            assert all(torch.equal(ta.logp_rollout[m], tb.logp_rollout[m]) for m in ta.modalities)
    # The training side on one process, once (both meshes' rollouts are the same bytes, checked above)
    model = build_model(1)
    add_lora(model, 2, 4.0, seed=3)  # B = 0: byte-equal to the base the meshes ran
    cfg = GrpoConfig(group=2, mode="strict", optim=OptimizerConfig(lr=1e-3))
    record = grpo_iteration(model, batches["cp2"], cfg, cfg.optimizer(trainable_parameters(model)))
    epoch = record["epochs"][0]  # on-policy: before any update
    assert sorted((it["request"], it["pass"]) for it in epoch["items"]) == [(0, SDE_PASS), (1, SDE_PASS)]
    for it in epoch["items"]:
        for name, batch in batches.items():
            (t,) = [t for t in batch.transitions[it["request"]] if t.pass_index == it["pass"]]
            for m in ("video", "audio"):
                rollout = float(t.logp_rollout[m].reshape(()))
                ratio = float(torch.exp(torch.tensor(it[m]["logp"], dtype=torch.float32) - t.logp_rollout[m]))
                assert it[m]["logp"] == rollout and ratio == 1.0, (name, it["request"], it["pass"], m, ratio)
                assert it[m]["ratio"] == 1.0
    assert epoch["ratio"]["exactly_one"] == epoch["ratio"]["count"] == 2 * 2, epoch["ratio"]  # requests x modalities
