"""The `RunSpec.placement` field: the topology a run ran on, sealed with it and applied by the one loop.

Value (JSON, normalised by `check_placement`): `{"tp": T, "cp": C, "sp": bool, "row_parallel": "auto" |
"k_chunks" | "n_split"}`; `{}` (the default) is one process on the device of the model and the inputs. Any other
value -- `{"tp": 1}` included, the world-size-1 run through the distributed code path -- is normalised to all four
keys, so two specs of one topology hash alike.

`apply(value, run)` checks that the run's model was parallelized (`parallelize(model, mesh)`) on exactly that
topology (tp, cp, sp and the row-parallel strategy the weights were sharded for) and fails closed with one line
otherwise: a spec never runs on another topology than the one it names, so a sealed run replays its topology and
`verify` of a distributed run needs that mesh. The loop then runs as always; the sharding lives in the model's
placement. In lead mode (`follow.lead`, a torchrun front end) the run is announced to the other ranks, which
resolve the same spec and run each announced pass through their run's own forward (per-pass transforms such as core
reuse decide alike on every rank: `follow.passing`); a spec carrying custom callables cannot be announced and is
refused there.

The bytes do not depend on the topology: the trajectory digest of a distributed run equals the one-process strict
digest of the same spec without placement, and so is the spec's result hash (`RunSpec.sha256`): the placement is
in its run record (`RunSpec.run_record`), where it ran, not what came out.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..run import FieldProvider, ResolvedRun, register_field
from . import follow
from .errors import TopologyError
from .mesh import check_degrees
from .placement import placement_of, row_owner

KEYS = ("tp", "cp", "sp", "row_parallel")


def check_placement(value: Any) -> dict[str, Any]:
    """The normalised placement value, or a one-line `TopologyError` naming the value and the rule."""
    if not isinstance(value, dict):
        raise TopologyError(f"placement={value!r}: must be an object with keys {', '.join(KEYS)}")
    unknown = sorted(set(value) - set(KEYS))
    if unknown:
        raise TopologyError(f"placement key(s) {unknown}: a placement names {', '.join(KEYS)}")
    t = check_degrees(value.get("tp", 1), value.get("cp", 1), value.get("sp", False), value.get("row_parallel", "auto"))
    return {"tp": t.tp, "cp": t.cp, "sp": t.sp, "row_parallel": t.row_parallel}


def describe(value: dict[str, Any]) -> str:
    t = check_degrees(value["tp"], value["cp"], value["sp"], value["row_parallel"])
    return f"{t.name} ({t.strategy})"


@contextlib.contextmanager
def apply_placement(value: dict[str, Any], run: ResolvedRun) -> Iterator[ResolvedRun]:
    placement = placement_of(run.model)
    asked = describe(value)
    if placement is None:
        raise TopologyError(
            f"placement {asked}: the run's model is not parallelized; build the mesh and apply the plan first "
            f"(h3lab.distributed.parallelize(model, init_mesh(tp={value['tp']}, cp={value['cp']}, sp={value['sp']})), "
            f"or torchrun --nproc-per-node {value['tp'] * value['cp']} -m h3lab --tp {value['tp']} --cp {value['cp']})"
        )
    held = placement.spec_value()
    if describe(held) != asked:
        raise TopologyError(f"placement {asked}: the run's model is parallelized on {describe(held)}; a spec runs on "
                            "the topology it names")
    with follow.announce_run(run, placement):
        yield run.replace(forward=follow.passing(run.forward))  # each forward's pass goes with its announcement


register_field("placement", FieldProvider(validate=check_placement, apply=apply_placement, locate=row_owner),
               replace=True)
