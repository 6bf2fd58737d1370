"""A session's re-runs of sealed run specs on its own models: the first drift between two of its results and the
replay of a sealed trajectory.

Contract
- `drift(session, a, b) -> DriftReport`: each result's sealed `RunSpec` re-runs exactly as it ran (inputs, schedule,
  mode, ablation factors, reuse) with every operator boundary hashed (`drift.compare`), on the session's DiT of their
  one variant (two variants: a one-line `ValidationError`); arms are labelled `<tag>[+lora]:<hash12>`.
- `drift_lines(report)`: what the REPL prints for it (the summary, the first drift inside a block when it differs,
  a warning when the reference run did not repeat its own hashes, at most three layout notes).
- `verify(session, path)`: replay a sealed trajectory's spec with the session's DiT of its variant
  (`trajectory.verify`); a variant the session does not serve is a one-line `ValidationError`.
The session's lock is held by the caller (`Session.drift`, `Session.verify`) around the model work.
"""

from __future__ import annotations

import os
from typing import Any

from .components.store import VARIANTS
from .drift import pass_label  # noqa: F401 - re-exported: the front ends print pass numbers as drift does
from .errors import ValidationError


def drift(session: Any, a: Any, b: Any):
    """First drift between two `GenerationResult`s of `session` (see the module docstring)."""
    from . import drift as D
    from .presets import needed_blocks

    specs = [r.trajectory.spec for r in (a, b)]
    variants = {spec.variant for spec in specs}
    if len(variants) != 1:
        raise ValidationError(
            f"drift between a {a.settings.task} and a {b.settings.task} run: they use different transformers "
            f"({', '.join(sorted(variants))}); compare two runs of one variant"
        )
    with session._lock:
        variant = variants.pop()
        model = session.store.dit(variant, *needed_blocks([spec.preset for spec in specs]))
        models = session.store.models_for(variant, model)
        arms = [D.Execution(spec, model, label=f"{spec.tag}{'+lora' if spec.adapters else ''}:"
                                                 f"{r.trajectory_hash[:12]}", models=models)
                for spec, r in zip(specs, (a, b))]
        return D.compare(*arms)


def drift_lines(report) -> list[str]:
    lines = [report.summary()]
    if report.first is not None and report.first_in_block is not None and report.first_in_block != report.first:
        lines.append(f"first drift inside a block: {report.first_in_block}")
    if report.a_repeatable is False:
        lines.append("warning: the reference run did not repeat its own hashes (non-deterministic arithmetic)")
    from .drift import metadata_line

    for note in report.metadata[:3]:
        lines.append(f"layout differs: {metadata_line(note)}")
    return lines


def verify(session: Any, path: str | os.PathLike):
    """Replay the sealed trajectory at `path` with `session`'s DiT of its variant (see the module docstring)."""
    from . import trajectory as T
    from .presets import needed_blocks

    traj = T.load(path)
    variant = traj.spec.variant
    if variant not in VARIANTS:
        raise ValidationError(f"trajectory {str(path)!r} ran on model {variant!r}: the session serves "
                              f"{', '.join(VARIANTS)}")
    with session._lock:
        model = session.store.dit(variant, *needed_blocks([traj.spec.preset]))
        return T.verify(traj, model, device=session.device, models=session.store.models_for(variant, model),
                        execution={**session.store.plan.spec_fields(), "adapters": list(session.adapters)})
