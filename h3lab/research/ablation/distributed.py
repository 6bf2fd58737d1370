"""The ablation matrix's distributed rows, run on local gloo ranks (`launch.spawn`, CPU; strict kernels through
Triton's interpreter there): A4, A7, C0, H17, H-C4, H-C5 (RFC section 6). `h3lab.research.ablation` declares them and judges
the result against each row's signature; this module runs their arms.

A row is one or more comparisons of two arms on the ablation bench's spec and model, each arm one process
(`None`) or a placement wrapped, for the fault probes, in a `faults.FaultyPlacement`:

  H-C4  one process vs tp T for every T in {2, 4, 8} the bench's config admits (<= 4 local ranks): trajectory scope
  H-C5  one process vs cp C for every C in {2, 3, 4} it admits (uneven row shards): trajectory scope
  C0    one process vs tp 2 with the other row-parallel partition (n_split: output columns per rank, every rank the
        whole-K tree; heads stay on their ranks): forward scope
  A4    one process vs cp 2 whose ranks hold each other's rows (and their metadata): the forward's ownership check
        refuses it on every rank before any work -> REJECTED (non-comparable)
  H17   one process vs cp 2 with the hidden rows sharded and the per-row metadata not: drift at the first local
        AdaLN use (blocks.0.modulate1), in rows of rank 1
  A7    cp 2 ring-attention plan, KV blocks merged in canonical order on every rank, vs the same plan merged in
        rank order (each rank starts at its own shard): drift at blocks.0.attention, in rows of rank 1

Rank 0 runs `drift.compare(a, b)`; the placement's hook view shows every rank the one-process tensors, so with two
distributed arms every rank runs the same compare and makes the same decisions, and with a one-process arm A (which
reuses the parent's cached reference capture, `bench.reference_capture`) the other ranks run only B's forwards with
the same capture hooks. Rank 0's report comes back as JSON. Spawning: one set of tp * cp processes per comparison (2 for the tiny bench).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from ...distributed.launch import spawn

MAX_LOCAL_RANKS = 4


@dataclass(frozen=True)
class Arm:
    label: str
    placement: dict | None = None  # None: one process
    faults: dict | None = None


@dataclass(frozen=True)
class Comparison:
    a: Arm
    b: Arm
    scope: str


ONE = Arm("one process")


def _tp_degrees(config) -> list[int]:
    from ...distributed.mesh import supported_tp

    return [d for d in (2, 4, 8) if d in supported_tp(config) and d <= MAX_LOCAL_RANKS]


def _cp_degrees(config, rows: int) -> list[int]:
    return [c for c in (2, 3, 4) if config.num_attention_heads % c == 0 and c <= min(rows, MAX_LOCAL_RANKS)]


def plan(name: str, config, rows: int) -> list[Comparison]:
    """The comparisons of distributed row `name` for a bench with this config and packed row count."""
    cp2 = {"cp": 2}
    if name == "H-C4":
        return [Comparison(ONE, Arm(f"tp{d}", {"tp": d}), "trajectory") for d in _tp_degrees(config)]
    if name == "H-C5":
        return [Comparison(ONE, Arm(f"cp{c}", {"cp": c}), "trajectory") for c in _cp_degrees(config, rows)]
    if name == "C0":
        return [Comparison(ONE, Arm("tp2 n_split", {"tp": 2, "row_parallel": "n_split"}), "forward")]
    if name == "A4":
        return [Comparison(ONE, Arm("cp2 rows rotated", cp2, {"rotate_rows": True}), "forward")]
    if name == "H17":
        return [Comparison(ONE, Arm("cp2 metadata not co-sharded", cp2, {"local_metadata": True}), "forward")]
    if name == "A7":
        return [Comparison(Arm("cp2 ring, canonical merge", cp2, {"ring_merge": "canonical"}),
                           Arm("cp2 ring, rank-order merge", cp2, {"ring_merge": "rank"}), "forward")]
    raise KeyError(name)


def run_row(name: str, bench: Any, mode: str) -> list[dict]:
    """Run every comparison of row `name` on `bench` in `mode`; per comparison {"a", "b", "scope", "world",
    "report" (DriftReport.to_dict()) or "rejected" (the refusal)}. Raises if the config admits none."""
    spec = bench.spec(mode)
    comparisons = plan(name, bench.model.config, spec.inputs.seq_len)
    if not comparisons:
        raise ValueError(f"{name}: the bench's config admits no topology for this row on <= {MAX_LOCAL_RANKS} ranks")
    weights = _weights(bench)
    out = []
    for c in comparisons:
        placements = [arm.placement for arm in (c.a, c.b) if arm.placement is not None]
        world = _world(placements[0])
        reference = bench.reference_capture(mode, c.scope) if c.a.placement is None else None
        job = {"spec": spec.to_dict(), "tensors": {k: v.cpu() for k, v in spec.tensors().items()}, "weights": weights,
               "a": c.a, "b": c.b, "scope": c.scope, "reference": reference}
        result = spawn(_rank, world, job)[0]
        entry = {"a": c.a.label, "b": c.b.label, "scope": c.scope, "world": world}
        if "rejected" in result:
            entry["rejected"] = result["rejected"]
        else:
            entry["report"] = json.loads(result["report"])
        out.append(entry)
    return out


def _world(placement: dict) -> int:
    return int(placement.get("tp", 1)) * int(placement.get("cp", 1))


def _weights(bench: Any) -> dict:
    """The bench model as the ranks rebuild it: config, dtype policy, state dict (host copies, shared memory for
    the tiny bench) and its fingerprint, so every arm records the one-process checkpoint identity."""
    from ...hashing import model_fingerprint

    model = bench.model
    return {"config": model.config.to_diffusers(), "policy": getattr(model, "dtype_policy", "released"),
            "state": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "fingerprint": model_fingerprint(model)}


def _load(weights: dict):
    from ...config import H3Config
    from ...model import H3Transformer

    model = H3Transformer(H3Config(**weights["config"]), dtype_policy=weights["policy"])
    model.load_state_dict(weights["state"])
    model.fingerprint = weights["fingerprint"]
    return model.eval().requires_grad_(False)


def _rank(rank: int, world: int, job: dict) -> dict:
    """One rank of a comparison (module docstring)."""
    from ..drift import Execution, compare, execute
    from ...run import RunSpec
    from ...distributed.field import check_placement
    from ...distributed.mesh import init_mesh
    from ...distributed.apply import parallelize
    from ...distributed.placement import OwnershipError
    from .faults import Faults, faulty

    spec = RunSpec.from_dict(job["spec"], job["tensors"])
    mesh = None
    arms = []
    for arm in (job["a"], job["b"]):
        model = _load(job["weights"])
        arm_spec = spec
        if arm.placement is not None:
            value = check_placement(arm.placement)
            if mesh is None:
                mesh = init_mesh(tp=value["tp"], cp=value["cp"], sp=value["sp"], device="cpu",
                                 row_parallel=value["row_parallel"])
            placement = parallelize(model, mesh)
            if arm.faults:
                faulty(placement, Faults(**arm.faults))
            arm_spec = spec.replace(placement=value)
        arms.append(Execution(arm_spec, model, label=arm.label, scope=job["scope"]))
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            if rank > 0 and job["a"].placement is None:  # arm A runs on no other rank: only B's collectives matter
                execute(arms[1], lambda step, point, tensor: None)
                return {}
            report = compare(arms[0], arms[1], reference=job["reference"])
    except OwnershipError as exc:
        return {"rejected": str(exc)}
    if os.environ.get("H3LAB_DEBUG"):
        print(f"rank {rank}: compare {time.perf_counter() - t0:.1f} s", flush=True)
    return {"report": json.dumps(report.to_dict())} if rank == 0 else {}
