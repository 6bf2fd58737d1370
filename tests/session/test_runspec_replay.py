"""The session re-runs exactly what ran, from the run's sealed `RunSpec`: `!drift` after `!reuse 3` evaluates the
passes the generation evaluated, `verify` replays ablated generations with their factors and reused ones as they
ran, and a tampered factor list is caught (refused or reported as drift)."""

import json

import pytest

from h3lab.run.trajectory import MANIFEST, TrajectoryError

SMALL = dict(width=64, height=64, frames=22, steps=2, mode="off")


def count_forwards(model):
    """A hook that counts transformer forwards (one `video_out` per forward); returns (counter list, handle)."""
    calls = []

    def hook(point, t):
        calls.append(point.name)

    return calls, model.add_hook(hook, names=("video_out",))


def test_drift_after_reuse_evaluates_the_passes_the_generation_evaluated(session):
    """20 passes with reuse 3 evaluate 8 (docs/presets.md): drift's re-runs must evaluate the same 8, not all 20, and a
    reused run differs from a full one from its first extrapolated pass on."""
    steps = {**SMALL, "steps": 20}
    reused = session.generate("drift after reuse", reuse=3, **steps)
    assert reused.evaluations == 8
    calls, handle = count_forwards(session.transformer("transformer"))
    try:
        report = session.drift(reused, reused)
    finally:
        handle.remove()
    assert report.equal and len(calls) == 2 * 8, len(calls)

    full = session.generate("drift after reuse", **steps)
    report = session.drift(full, reused)
    assert not report.equal and (report.first.step, report.first.point) == (1, "scheduler.video")


@pytest.mark.parametrize("factors", [("A2", "H5"), ("H9",), ("H11",), ("H16",), ("H1",)],
                         ids=lambda f: "+".join(f))
def test_verify_replays_an_ablated_generation_byte_for_byte(session, tmp_path, factors):
    """Op overrides (A2, H5), a stepper (H9), a schedule and plan rebuilt from the layout (H11), the other
    transformer (H16), a permuted layout (H1): each is re-derived from the sealed factor names."""
    plain = session.generate("ablated verify", **SMALL)
    r = session.generate("ablated verify", ablations=factors, **SMALL)
    assert r.trajectory_hash != plain.trajectory_hash
    report = session.verify(r.trajectory.seal(tmp_path / "ablated"))
    assert report.ok and report.replay_digest == r.trajectory_hash, str(report)
    assert sorted(r.trajectory.manifest["spec"]["factors"]) == sorted(factors)


def test_a_tampered_factor_list_is_refused_or_reported(session, tmp_path):
    r = session.generate("tampered factors", ablations=("A2", "H5"), **SMALL)
    path = r.trajectory.seal(tmp_path / "run")
    assert session.verify(path).ok
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["spec"]["factors"] = ["A2"]  # H5 dropped, spec hash left as it was: load refuses
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(TrajectoryError, match="the spec was edited"):
        session.verify(path)
    from safetensors.torch import load_file

    from h3lab.run import RunSpec

    forged = RunSpec.from_dict(manifest["spec"], load_file(str(path / "inputs.safetensors")))
    manifest["result_sha256"] = forged.sha256  # a forged, self-consistent spec: replayed, and it drifts
    (path / MANIFEST).write_text(json.dumps(manifest))
    report = session.verify(path)
    assert not report.ok and report.first_step == 0 and report.field == "velocity_video"


def test_verify_replays_a_reused_generation_byte_for_byte(session, tmp_path):
    r = session.generate("reused verify", reuse=2, **{**SMALL, "steps": 5})
    assert [s["evaluated"] for s in r.trajectory.steps] == [True, False, True, False, True]
    assert r.trajectory.manifest["spec"]["reuse"] == {"k": 2, "mode": "linear"}
    report = session.verify(r.trajectory.seal(tmp_path / "reused"))
    assert report.ok and report.replay_digest == r.trajectory_hash and report.passes_checked == 5
