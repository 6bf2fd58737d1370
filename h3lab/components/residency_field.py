"""The `RunSpec.residency` provider: a run's blocks streamed, its AdaLN served from tables computed ahead, or both.

Contract
--------
`apply_residency(value, run)` (registered by `store.py` with `residency.check_residency_value`), a context manager
entered around the loop that yields the run unchanged:
- `"policy": "streamed"`: a model a streamer already drives runs as it is (the store streams it with the session's
  plan); a resident model is streamed for the run under the value's budget and slots and restored after it. The
  run's copy statistics become `streaming.last_stats()`.
- `"adaln": "tables"`: a model served from AdaLN tables keeps its placement; a resident model is placed so for the
  run (`adaln_host.keep_on_host`, before any streaming: the streamed units then leave the AdaLN weights out) and
  restored after it.
- Whenever the model is served from tables (whatever the value says: the placement decides, the bytes are the same),
  the tables of the run's evaluated passes (`sampler.reuse_plan`) are computed before the first forward, at once, in
  the run's mode and op overrides (`AdaLNTables.prepare`), and dropped when the run ends.
A resident value on a streamed or tables model runs as the model is placed (bytes are identical either way). A
default value never reaches this provider: a tables model then computes each forward's table on demand.

Refused (`ResidencyError`, one line, before any weight moves): `"adaln": "tables"` with a device mesh (each TP rank
holds a shard of the AdaLN channels) or on a model a streamer drives with its AdaLN weights in the units (place it
with `ExecutionPlan(adaln="tables")`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Mapping

from ..model.adaln_tables import tables_of
from ..run.sampler import reuse_plan
from . import adaln_host, streaming
from .residency import DEFAULT_SLOTS, ResidencyError


def run_timesteps(run: Any) -> list:
    """The (T,) timestep tensor of every pass the run evaluates, in pass order."""
    evaluate = reuse_plan(run.inputs.num_passes, run.reuse)
    return [t for (t, _), ev in zip(run.inputs.plan, evaluate) if ev]


def _check_tables(value: Mapping[str, Any], run: Any) -> None:
    if value.get("adaln") != "tables":
        return
    if dict(run.spec.placement):
        raise ResidencyError(f"residency adaln='tables' with placement {dict(run.spec.placement)}: not composed (each "
                             "TP rank holds a shard of the AdaLN channels); run the mesh with AdaLN resident")
    streamer = streaming.streamer_of(run.model)
    if streamer is not None and tables_of(run.model) is None:
        raise ResidencyError("residency adaln='tables' on a model streamed with its AdaLN weights in the blocks: "
                             "place it with ExecutionPlan(adaln='tables') (h3lab --adaln tables)")


@contextlib.contextmanager
def apply_residency(value: Mapping[str, Any], run):
    """`RunSpec.residency` applied to a run (see the module docstring); yields the run unchanged."""
    _check_tables(value, run)
    model = run.model
    device = run.inputs.video.device
    with contextlib.ExitStack() as stack:
        if value.get("adaln") == "tables" and tables_of(model) is None:
            adaln_host.keep_on_host(model, device)
            stack.callback(adaln_host.release, model, True)
        streamer = streaming.streamer_of(model)
        if streamer is None and value.get("policy") == "streamed":
            streamer = streaming.stream_blocks(model, device, gpu_memory_gib=value.get("gpu_memory_gib"),
                                               slots=value.get("slots", DEFAULT_SLOTS))
            stack.callback(streamer.remove, True)
        if streamer is not None:
            streamer.begin_run()
            stack.callback(streamer.end_run)
        tables = tables_of(model)
        if tables is not None:  # the run's overrides: `resolve` enters them only after the providers
            stack.callback(tables.drop, tables.prepare(run_timesteps(run), overrides=run.overrides))
        yield run
