"""Speed presets on a mesh: `Session(path, mesh=mesh)` leading on rank 0 and a follower on rank 1 (the
torchrun front end's code path, `frontend.run_on_mesh`, 2 gloo CPU ranks), on a snapshot whose DiT has 6 blocks
(so `--layers 5` drops one and token reduction reduces blocks 4 and 5). Each admitted preset's trajectory digest
equals the one-process strict run's on the same request: core reuse (the follower takes rank 0's per-pass
decisions), layer thinning (TP ranks rank the blocks on the whole AdaLN weights read from the checkpoint), token
reduction on TP, whole-velocity reuse; on CP the 256x256 RoPE halving (on the 2-block tiny snapshot: 64 video rows
a latent frame, and the halving acts on the inputs, before block 0). Token reduction on a CP mesh is refused on
every rank alike with one line, before any model loads."""

from __future__ import annotations

import json

import pytest
from harness import run_ranks

from h3lab.app.session import Session

REQUEST = dict(width=32, height=32, frames=5, steps=3, mode="strict", seed=7)
ONE_PASS = dict(steps=1)  # layer thinning and token reduction change every pass: one shows it
PAIRS = dict(width=64, height=64)  # token reduction pairs horizontal tokens: 2 x 2 tokens per latent frame
HALVED = dict(width=256, height=256, frames=1)  # the 256x256 RoPE halving (automatic at that canvas), one latent frame


def _mesh_rank(rank: int, world: int, snapshot: str, tp: int, cp: int, sp: bool, knobs: str) -> dict:
    """Rank 0 generates once per knob set of `knobs` (JSON list) on the mesh and leads; rank 1 follows."""
    from h3lab.distributed import init_mesh
    from h3lab.distributed.frontend import MeshFailure, run_on_mesh

    mesh = init_mesh(tp=tp, cp=cp, sp=sp, device="cpu")
    sessions: list = []

    def factory():
        if not sessions:
            sessions.append(Session(snapshot, device="cpu", mesh=mesh))
        return sessions[0]

    out: dict = {}

    def action() -> int:
        session, hashes, presets = factory(), [], []
        try:
            for knob in json.loads(knobs):
                result = session.generate("a red fox", **{**REQUEST, **knob})
                hashes.append(result.trajectory_hash)
                presets.append(dict(result.trajectory.manifest["spec"]["preset"]))
        finally:
            out.update(hashes=json.dumps(hashes), presets=json.dumps(presets), loaded=json.dumps(session.store.loaded))
        return 0

    try:
        out["rc"] = str(run_on_mesh(None, mesh, action, factory))
    except MeshFailure as exc:
        out.update(rc="raised", error=str(exc))
    return out


def _one_process(snapshot, knobs: list[dict]) -> tuple[list[str], list[dict]]:
    session = Session(snapshot, device="cpu")
    results = [session.generate("a red fox", **{**REQUEST, **knob}) for knob in knobs]
    return [r.trajectory_hash for r in results], [dict(r.trajectory.manifest["spec"]["preset"]) for r in results]


@pytest.mark.parametrize("tp, cp, sp, knobs", [
    (2, 1, False, [{"core_reuse": 2}, {"layers": 5, **ONE_PASS}, {"token_reduction": True, **ONE_PASS, **PAIRS}]),
    (1, 2, False, [{"core_reuse": 2, "layers": 5}, {"reuse": 2}]),
    (2, 1, True, [{"core_reuse": 3}]),
])
def test_presets_on_a_mesh_equal_one_process(deep_snapshot, tp, cp, sp, knobs):
    want_hashes, want_presets = _one_process(deep_snapshot, knobs)
    assert len(set(want_hashes)) == len(knobs)  # each knob set moves the numbers: equality below is not vacuous
    results = run_ranks(_mesh_rank, tp * cp, str(deep_snapshot), tp, cp, sp, json.dumps(knobs), timeout=300)
    assert [r["rc"] for r in results] == ["0", "0"], results
    assert json.loads(results[0]["presets"]) == want_presets  # the same sealed preset (layers: the same blocks)
    assert json.loads(results[0]["hashes"]) == want_hashes


def test_rope_halving_on_cp_equals_one_process(tiny_snapshot):
    knobs = [{**HALVED, **ONE_PASS}]
    want_hashes, want_presets = _one_process(tiny_snapshot, knobs)
    assert want_presets[0].get("rope") == "halved", want_presets
    results = run_ranks(_mesh_rank, 2, str(tiny_snapshot), 1, 2, False, json.dumps(knobs), timeout=300)
    assert [r["rc"] for r in results] == ["0", "0"], results
    assert json.loads(results[0]["presets"]) == want_presets and json.loads(results[0]["hashes"]) == want_hashes


def test_token_reduction_on_cp_is_refused_on_every_rank_before_any_load(deep_snapshot):
    results = run_ranks(_mesh_rank, 2, str(deep_snapshot), 1, 2, False, json.dumps([{"token_reduction": True}]),
                        timeout=120)
    line = ("token_reduction on tp1xcp2: refused (it pairs target-video rows across the packed stream and changes "
            "the row count after block 0, where the CP / SP row cut is made for the full rows); use a TP mesh with "
            "--cp 1 and without --sp")
    assert [r["rc"] for r in results] == ["raised", "raised"]
    assert [r["error"] for r in results] == [line, line]
    assert json.loads(results[0]["loaded"]) == []  # no model (and no text encoder) was loaded


def test_token_reduction_spec_on_a_cp_placement_is_refused():
    """The run-level rule (a sealed spec replayed or built by hand): the preset's check names the placement."""
    from h3lab.presets import PresetError
    from h3lab.presets.token_reduction import refuse_row_cut

    refuse_row_cut({"tp": 2, "cp": 1, "sp": False, "row_parallel": "auto"})  # TP: admitted
    refuse_row_cut({})  # one process
    with pytest.raises(PresetError, match=r"^token_reduction on tp2xcp1\+sp: refused"):
        refuse_row_cut({"tp": 2, "cp": 1, "sp": True, "row_parallel": "auto"})
