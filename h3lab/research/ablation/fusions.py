"""The fusion rows of the ablation matrix (F1, F2): a switchable epilogue fusion (`runtime.FUSIONS`) leaves the strict
trajectory byte-equal.

`check_fusion(name)` returns the row's check `check(bench, mode) -> (status, observed, passed, None)`: the bench spec
runs in `mode` through the one loop with `runtime.use_fusions({name})` and no hook (a hook would run the unfused ops,
so the drift localiser's capture cannot see a fused op), recording its trajectory; it passes when the fused op ran
(the forward's trace names it) and the trajectory digest equals the bench's reference trajectory, which was recorded
under the capture's hooks, i.e. unfused. Only the digests are compared (per pass: both velocities and both latents).
"""

from __future__ import annotations

from ...execution import runtime
from ...run import denoise
from ...run.trajectory import TrajectoryRecorder
from .bench import Bench


def check_fusion(name: str):
    runtime.check_fusions([name])

    def check(bench: Bench, mode: str):
        reference = bench.reference_trajectory(mode)  # the capture's hooks keep every op apart
        recorder = TrajectoryRecorder(keep=(), meta={"bench": "ablation.tiny", "fusion": name})
        with runtime.use_mode(mode), runtime.use_fusions([name]):
            denoise(bench.spec(mode), bench.model, recorder, models=bench.models)
        fused = recorder.finish()
        calls = sum(r.op == name for r in runtime.last_trace().records)
        equal = fused.digest == reference.digest
        ok = equal and calls > 0
        observed = (f"{'PASS byte-equal' if equal else 'DRIFT'}: trajectory digest with {name} on "
                    f"{'==' if equal else '!='} the unfused reference {reference.digest[:16]} ({calls} fused calls "
                    "in the last forward)")
        return ("PASS" if ok else "FAIL"), observed, ok, None

    check.__name__ = check.__qualname__ = f"check_fusion_{name}"
    return check
