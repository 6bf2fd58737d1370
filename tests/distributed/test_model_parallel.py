"""`parallelize(model, mesh)` on the whole model: strict velocities and 2-pass trajectories on N gloo ranks (Triton
interpreter) byte-equal to one process, for a covering set of topologies and layouts; the sealed run records its
topology and replays on it; the trace reads back topology, rank, collectives and fallback state; the hook view
shows every rank the one-process tensors.

Covering set (12 heads; 1 block, 2 for the SP case, so block-to-block hand-over of the sharded stream is covered
there and by the ablation rows' 2-block bench; no row count a multiple of the CP size, SP shards uneven):

  topology      layout  rows  row shards
  tp2           t2va    11    -
  tp4           fl2va   15    -
  cp2           ref2va  17    9 + 8
  cp3           t2va    11    4 + 4 + 3
  tp2xcp2       fl2va   15    8 + 7
  tp2xcp2+sp    ref2va  17    9 + 8, SP 5 + 4 / 4 + 4   (+ every hook point of a batch-of-2 forward)

Each case compares every pass's video and audio velocities (pass 0 = one strict forward) and latents, on every
rank, with the one-process strict run of the same spec, and the trajectory digest. The cases of one world size run
in one launch (2 ranks: tp2, cp2; 3: cp3; 4: tp4, tp2xcp2, tp2xcp2+sp), one after the other on the same ranks,
each on its own mesh and model; each case's test checks its own results. Sealing a distributed run and
replaying it on its topology (digest = one process) is tested through the torchrun front end
(test_frontend.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from dist_helpers import CONFIG, build_model, build_spec
from harness import run_ranks
from rank_cases import of_case, prefixed

from h3lab.distributed import init_mesh, parallelize
from h3lab.run.trajectory import record

CASES = {  # name: (placement, layout, blocks)
    "tp2": ({"tp": 2}, "t2va", 1),
    "tp4": ({"tp": 4}, "fl2va", 1),
    "cp2": ({"cp": 2}, "ref2va", 1),
    "cp3": ({"cp": 3}, "t2va", 1),
    "tp2xcp2": ({"tp": 2, "cp": 2}, "fl2va", 1),
    "tp2xcp2+sp": ({"tp": 2, "cp": 2, "sp": True}, "ref2va", 2),
}
KEEP = ("latents", "velocities")


def _world(placement: dict) -> int:
    return placement.get("tp", 1) * placement.get("cp", 1)


LAUNCHES = {}  # world size: the cases that run in its one launch, in CASES order
for _name, (_placement, _, _) in CASES.items():
    LAUNCHES.setdefault(_world(_placement), []).append(_name)
# Two passes: pass 1 runs on latents the sharded pass 0 stepped, the hand-over a longer trajectory repeats.
PASSES = 2
_references: dict = {}
_launched: dict = {}  # world size: each rank's results of its launch, keyed "<case>.<key>"


def reference(layout: str, layers: int):
    """The one-process strict trajectory of a layout (kept tensors), computed once per test session."""
    if (layout, layers) not in _references:
        _references[layout, layers] = record(build_spec(layout, PASSES), build_model(layers), keep=KEEP)
    return _references[layout, layers]


def _trajectory(rank: int, world: int, placement: dict, layout: str, layers: int, hook_points: bool) -> dict:
    mesh = init_mesh(tp=placement.get("tp", 1), cp=placement.get("cp", 1), sp=placement.get("sp", False),
                     device="cpu", config=CONFIG)
    model = build_model(layers)
    parallelize(model, mesh)
    spec = build_spec(layout, PASSES).replace(placement=placement)
    traces = []
    traj = record(spec, model, keep=KEEP, callback=lambda rec: traces.append(rec.trace))
    out = dict(traj.kept)
    trace = traces[0]
    out.update(digest=traj.digest, spec=json.dumps(traj.spec.to_dict()["placement"]),
               trace=json.dumps({"placement": trace.placement, "collectives": trace.collectives.to_dict(),
                                 "actual": sorted({r.actual for r in trace.records}),
                                 "kernels": sorted({r.kernel_id for r in trace.records if r.op == "linear_tree"}),
                                 "manifest_trace": traj.manifest["trace"]}))
    if hook_points:  # the hook view: one batch-of-2 forward captured at every hook point through the placement
        out["hooks"], out["batch_video"], out["batch_audio"] = _batch2(model, spec)
    return out


def _cases(rank: int, world: int, names: list) -> dict:
    """Every case of one world size on the same ranks, one after the other (a fresh mesh and model each)."""
    out = {}
    for name in names:
        placement, layout, layers = CASES[name]
        out.update(prefixed(name, _trajectory(rank, world, placement, layout, layers, name == "tp2xcp2+sp")))
    return out


def launched(name: str) -> list:
    """Each rank's results of case `name`, from the one launch of its world size (run once per test session)."""
    world = _world(CASES[name][0])
    if world not in _launched:
        _launched[world] = run_ranks(_cases, world, LAUNCHES[world], timeout=240 * len(LAUNCHES[world]))
    return of_case(_launched[world], name)


def _batch2(model, spec):
    """Pass 0 of the spec's request at batch position 1 of 2 (item 0 another seeded request), one strict forward
    captured at every capture point (`drift.capture`, forward scope): (the points' digests as JSON, the video and
    audio velocities of both items: what the model call returns, taken by a torch forward hook registered after
    the placement's own)."""
    from h3lab.research.drift import Execution, capture

    x = spec.inputs
    g = torch.Generator().manual_seed(9)
    two = {k: torch.cat([torch.randn(t.shape, generator=g).to(t.dtype), t]) for k, t in
           (("text", x.text), ("video", x.video), ("audio", x.audio))}
    outputs = []

    def returned(module, args, out):
        outputs.append(tuple(t.detach().clone() for t in (out[:2] if isinstance(out, tuple) else
                                                          (out.sample, out.audio_sample))))

    handle = model.register_forward_hook(returned)
    try:
        cap = capture(Execution(spec.replace(inputs=x.replace(**two)), model, scope="forward"))
    finally:
        handle.remove()
    ((video, audio),) = outputs  # one model call
    return json.dumps({f"{k[0]}|{k[1]}": v for k, v in cap.digests.items()}), video, audio


@pytest.mark.parametrize("name", list(CASES))
def test_trajectory_is_byte_equal_to_one_process(name):
    placement, layout, layers = CASES[name]
    results = launched(name)
    assert len(results) == _world(placement)
    ref = reference(layout, layers)
    assert sorted(ref.kept) == [f"{k}.{i:04d}" for k in ("audio", "velocity_audio", "velocity_video", "video")
                                for i in range(PASSES)]
    for rank, res in enumerate(results):
        for key, tensor in ref.kept.items():
            assert torch.equal(res[key], tensor), (name, rank, key)
        assert res["digest"] == ref.digest, (name, rank)
        trace = json.loads(res["trace"])
        assert trace["actual"] == ["strict"], (name, rank)  # no production path in a strict sharded trace
        p = trace["placement"]
        assert (p["rank"], p["topology"]["tp"], p["topology"]["cp"]) == (rank, placement.get("tp", 1),
                                                                          placement.get("cp", 1))
        assert p["topology"]["sp"] == placement.get("sp", False)
        summary = trace["collectives"]["summary"]
        assert all(r["fallback"] == "" for r in trace["collectives"]["records"])
        if placement.get("tp", 1) > 1:
            tree = summary["row_parallel_tree"]
            assert tree.get("all_gather + tree") and trace["kernels"] == [
                "h3lab.distributed.row_parallel_tree[k_chunks]/h3kernels.gemm.tree"]
            if placement.get("sp"):
                assert tree["all_to_all + tree"] == 2 * layers  # block O-proj and FFN down to SP rows
            assert summary["gather_columns"]["all_gather + grouped concat"] == layers + 1
        if placement.get("cp", 1) > 1:
            assert summary["rows_to_heads"]["all_to_all(uneven rows)"] == 3 * layers
            assert summary["scatter_rows"]
        # The sealed manifest reads the topology and the collectives back too.
        sealed_trace = trace["manifest_trace"]
        assert sealed_trace["placement"]["topology"]["name"] == p["topology"]["name"]
        assert sealed_trace["non_strict_calls"] == 0 and sealed_trace["forwards"] == PASSES
        for collective, algorithms in summary.items():  # PASSES forwards of the same collectives
            assert sealed_trace["collectives"][collective] == {a: PASSES * n for a, n in algorithms.items()}
        assert json.loads(res["spec"]) == {"tp": placement.get("tp", 1), "cp": placement.get("cp", 1),
                                           "sp": placement.get("sp", False), "row_parallel": "auto"}
    if name == "tp2xcp2+sp":
        hooks, video, audio = _batch2(build_model(layers), build_spec(layout, PASSES))
        want = json.loads(hooks)
        assert torch.equal(video[1:], ref.kept["velocity_video.0000"])  # batch invariance of the reference
        assert torch.equal(audio[1:], ref.kept["velocity_audio.0000"])
        for res in results:
            got = json.loads(res["hooks"])
            assert got == want and len(got) == 73  # every capture point of one forward, every rank: one process's bytes
            assert torch.equal(res["batch_video"], video) and torch.equal(res["batch_audio"], audio)
