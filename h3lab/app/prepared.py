"""`PreparedRequest`: everything one denoise of a checked request needs, made by one function from the session's
declared state -- the shared step of `h3lab.app.generation` (one request) and `h3lab.app.rollout` (G requests per prompt).

Contract
- `prepare(session, settings, media, encoded, schedule=None, policy_adapter=False) -> PreparedRequest`: the request's
  dual schedule (`schedule`, else `DualSchedule.from_passes(steps, video_shift, audio_shift)`), the DiT of its
  variant with the blocks its `layers` need (`session.store.dit`, loaded on first use), the patch, the
  `PackedLayout` (`pipeline.build_layout`), the adapter entries its specs record and the store's execution plan.
  `encoded` is the request's `phases.Encoded` (text and conditioning, encoded through the session's caches).
  Adapters: the session's (`Session.load_lora`); with `policy_adapter=True` and no session adapter, the adapter
  injected in the model itself (a GRPO policy, `training.adapters.in_place_entry`, hashed here once).
- `PreparedRequest` is frozen; its methods build, never store:
  `draw(seed=None)` the request's `DenoiseInputs` in the released order (`pipeline.draw_inputs`; `seed` replaces the
  settings' seed), `spec(inputs, **fields)` its `RunSpec` (`pipeline.build_spec`, then `fields` replaced, e.g. a
  rollout's stepper), `final(inputs, video, audio)` the target rows of batch item 0 of the loop's output as (C, T, h, w)
  video latents and (2A, C) audio rows, float32 CPU (`pipeline.final_latents`).
- `sealed_dit(session, variant, presets) -> (model, models)`: the DiT a sealed spec re-runs on (the blocks every
  preset in `presets` needs, `presets.needed_blocks`) and the `models` lookup its factors resolve against
  (`ComponentStore.models_for`) -- the one step drift, verify, the attention view and `keep` share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import pipeline
from ..schema.generation_settings import GenerationSettings


@dataclass(frozen=True, eq=False)
class PreparedRequest:
    """One checked request ready to denoise (module docstring)."""

    settings: GenerationSettings
    media: pipeline.Media
    text: pipeline.TextEntry
    cond: pipeline.CondSet
    cached: dict  # {"text": bool, "conditions": bool | None}: what the encode phases served from the caches
    schedule: Any  # sampler.DualSchedule
    variant: str  # "transformer" | "transformer_ref"
    model: Any  # the H3Transformer of `variant`
    patch: tuple  # (pt, ph, pw)
    layout: Any  # layout.PackedLayout
    adapters: tuple  # the adapter entries every spec of this request records
    execution: Any  # components.execution.ExecutionPlan: placement and residency of the run record
    device: Any  # torch.device the inputs go to

    def draw(self, seed: int | None = None):
        """The request's `DenoiseInputs`: its noise in the released order from the settings' seed, or `seed`."""
        s = self.settings if seed is None else self.settings.replace(seed=seed)
        return pipeline.draw_inputs(s, self.layout, self.schedule, self.text, self.cond, self.model.config,
                                    self.device)

    def spec(self, inputs, **fields: Any):
        """The `RunSpec` of `inputs` (`pipeline.build_spec`), with `fields` replaced."""
        spec = pipeline.build_spec(self.settings, self.model, self.layout, self.schedule, inputs,
                                   adapters=self.adapters, execution=self.execution)
        return spec.replace(**fields) if fields else spec

    def final(self, inputs, video, audio):
        """(latents (C, T, h, w), audio rows (2A, C)) of batch item 0 of the loop's output, float32 CPU."""
        return pipeline.final_latents(self.settings, inputs, video, audio, self.patch)


def prepare(session: Any, s: GenerationSettings, media: pipeline.Media, encoded: Any, schedule: Any = None,
            policy_adapter: bool = False) -> PreparedRequest:
    """The prepared request of checked settings `s` (module docstring)."""
    from ..run.sampler import DualSchedule

    if schedule is None:
        schedule = DualSchedule.from_passes(s.steps, session.video_shift, session.audio_shift)
    variant = pipeline.variant_for(s.task)
    model = session.store.dit(variant, layers=s.layers)
    patch = tuple(model.config.patch_size)
    layout = pipeline.build_layout(s, media, encoded.text, encoded.cond, patch)
    return PreparedRequest(settings=s, media=media, text=encoded.text, cond=encoded.cond, cached=encoded.cached,
                           schedule=schedule, variant=variant, model=model, patch=patch, layout=layout,
                           adapters=_adapters(session, model, policy_adapter), execution=session.store.plan,
                           device=session.device)


def _adapters(session: Any, model: Any, policy_adapter: bool) -> tuple:
    """The session's adapter entries; with `policy_adapter` and none loaded, the one injected in `model`."""
    if session.adapters or not policy_adapter:
        return tuple(session.adapters)
    from ..adapters.field import in_place_entry

    entry = in_place_entry(model)
    return () if entry is None else (entry,)


def sealed_dit(session: Any, variant: str, presets: list) -> tuple[Any, Any]:
    """(the DiT of `variant` with the blocks `presets` need, its `models` lookup): module docstring."""
    from ..presets import needed_blocks

    model = session.store.dit(variant, *needed_blocks(presets))
    return model, session.store.models_for(variant, model)
