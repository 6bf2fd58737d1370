"""Child process of tests/stochastic/test_consistency.py (see that file): a batched
flow_sde rollout of GROUP requests on the tiny snapshot's bench in strict and in off mode, then for the request at
position ITEM a batch-1 forward of every pass at the recorded inputs and its log-density recomputed. Writes JSON.

usage: python consistency_worker.py SNAPSHOT OUT.json
"""

import json
import sys

import torch

from h3lab.execution import runtime
from h3lab.run import trajectory as T
from h3lab.research.ablation import Bench
from h3lab.run import model_forward
from h3lab.stochastic import recorded_transition
from stochastic_helpers import batched, item

GROUP, ITEM = 2, 1
PARAMS = {"level": 0.7, "seed": 11}


def measure(bench, mode):
    spec = bench.spec(mode)
    spec = spec.replace(inputs=batched(spec.inputs, GROUP), stepper="flow_sde", stepper_params=PARAMS)
    traj = T.record(spec, bench.model, keep=("latents", "velocities"))
    alone = item(traj.inputs, ITEM)
    rows = []
    for i in range(traj.inputs.num_passes):
        entering = {m: (getattr(alone, m) if i == 0 else traj.kept[f"{m}.{i - 1:04d}"][ITEM:ITEM + 1])
                    for m in ("video", "audio")}
        with runtime.use_mode(mode), torch.no_grad():
            v = dict(zip(("video", "audio"), model_forward(bench.model, alone, entering["video"],
                                                            entering["audio"], i)))
        for m in ("video", "audio"):
            rec = recorded_transition(traj, i, ITEM, m)
            logp_mean, logp_sum, _, _ = rec.logprob(v[m][:, rec.num_condition_rows:].float())
            rows.append({
                "pass": i, "modality": m, "request": rec.request,
                "velocity_equal": torch.equal(v[m], traj.kept[f"velocity_{m}.{i:04d}"][ITEM:ITEM + 1]),
                "rollout": [rec.logp_mean, rec.logp_sum],
                "batch1": [float(logp_mean[0]), float(logp_sum[0])],
            })
    return {"digest": traj.digest, "rows": rows}


def main(snapshot, out):
    bench = Bench.tiny(snapshot, num_points=3)  # 2 passes
    result = {mode: measure(bench, mode) for mode in ("strict", "off")}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
