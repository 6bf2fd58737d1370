"""A generation's per-pass tensors after the fact: `!trajectory save PATH --keep latents` when the generation ran
with hashes only (`Session.keep` empty, the default).

Contract
- `kept_trajectory(session, result, keep) -> (trajectory, rerun)`: the result's trajectory when it already holds every
  kind in `keep` (`trajectory.kept_kinds`; rerun False); else its sealed `RunSpec` re-run exactly (the session's DiT
  of the spec's variant and the blocks its preset needs, `prepared.sealed_dit`, as `Session.verify` runs it) with a recorder keeping `keep`
  and the result's own manifest `meta` (rerun True). The re-run must reproduce the generation's digest -- the
  trajectory's per-pass hashes do not depend on what is kept -- else a one-line `ValidationError` says the run did
  not repeat here (and that `--keep` before generating keeps the tensors of the run that happened).
"""

from __future__ import annotations

from typing import Any

from ..errors import ValidationError


def kept_trajectory(session: Any, result: Any, keep: tuple[str, ...]) -> tuple[Any, bool]:
    from ..run import trajectory as T
    from .prepared import sealed_dit

    old = result.trajectory
    if set(keep) <= set(T.kept_kinds(old)):
        return old, False
    spec = old.spec
    with session.lock:
        model, models = sealed_dit(session, spec.variant, [spec.preset])
        new = T.record(spec, model, keep=keep, meta=old.manifest.get("meta"), models=models)
    if new.digest != old.digest:
        raise ValidationError(f"--keep {','.join(keep)}: re-running the last generation gave digest {new.digest[:12]}, "
                              f"not {old.digest[:12]} (mode {spec.mode} did not repeat here); set --keep before "
                              "generating to keep the tensors of the run that happened")
    return new, True
