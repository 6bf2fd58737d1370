"""`PLOTS` (kind -> renderer of the kind's data, no model work) and `plot(kind, source, session)`, what `!plot KIND PATH`
calls.

The package docstring (`h3lab.research.plots`) is the contract of every figure."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from matplotlib.figure import Figure

from .adapters import _newest, _trajectory, latent_steps, step_norms
from .drift import drift_heatmaps, drift_inputs
from .figure import PlotError
from .latents import latent_strip, norm_curves
from .tables import ablation_table, sigma_grids

# =================================================================================================== PLOTS
def _plot_latents(source: Any, session: Any = None) -> Figure:
    steps = latent_steps(source)
    return latent_strip(steps.video, steps.audio, step_labels=steps.step_labels)


def _plot_norms(source: Any, session: Any = None) -> Figure:
    norms, labels = step_norms(source)
    return norm_curves(norms, step_labels=labels)


def _plot_drift(source: Any, session: Any = None) -> Figure:
    if isinstance(source, (list, tuple)):
        raise PlotError("!plot drift renders a DriftReport: compute it with session.drift(a, b) and pass it")
    if not (hasattr(source, "step_layer_max_abs") or isinstance(source, Mapping) and "step_layer_max_abs" in source):
        raise PlotError(f"{type(source).__name__}: expected a DriftReport (or its to_dict())")
    return drift_heatmaps(**drift_inputs(source))


def _is_ablation_rows(source: Any) -> bool:
    return isinstance(source, (list, tuple)) and bool(source) and all(
        isinstance(r, Mapping) and "passed" in r or hasattr(r, "passed") for r in source)


def _plot_ablation(source: Any, session: Any = None) -> Figure:
    if not _is_ablation_rows(source):
        raise PlotError("!plot ablation renders the rows of ablation.run_matrix(): run the matrix and pass its rows")
    return ablation_table(source)


def _plot_sigmas(source: Any, session: Any = None) -> Figure:
    from ...run.sampler import AUDIO_SHIFT, VIDEO_SHIFT, DualSchedule

    if isinstance(source, (list, tuple)):
        source = _newest(source, "sigmas")
    if isinstance(source, int) and not isinstance(source, bool):
        vs = getattr(session, "video_shift", VIDEO_SHIFT)
        as_ = getattr(session, "audio_shift", AUDIO_SHIFT)
        source = DualSchedule.from_passes(source, vs, as_)
    elif not isinstance(source, DualSchedule):
        source = _trajectory(source).schedule
    return sigma_grids(source.video.sigmas, source.audio.sigmas, video_shift=source.video.shift,
                       audio_shift=source.audio.shift, title=f"sigma grids ({source.num_passes} passes)")


PLOTS: dict[str, Callable[..., Figure]] = {
    "latents": _plot_latents,
    "norms": _plot_norms,
    "drift": _plot_drift,
    "ablation": _plot_ablation,
    "sigmas": _plot_sigmas,
}


def plot(kind: str, source: Any, session: Any = None) -> Figure:
    """`PLOTS[kind](source, session)` with a one-line error for an unknown kind."""
    fn = PLOTS.get(kind)
    if fn is None:
        raise PlotError(f"plot kind {kind!r}: must be one of {', '.join(PLOTS)}")
    return fn(source, session)
