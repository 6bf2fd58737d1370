"""The phases of checked requests, shared by `h3lab.app.generation` (one request) and `h3lab.app.rollout` (many), the encode
phase also by `h3lab.app.clips_in.encode_clip` (a clip's prompt): encode (every text, then every condition), denoise (one
prepared request's spec through the one loop), decode (every video, then every waveform). Each goes through the session's collaborator interface (`Session.encode_text`,
`encode_conditions`, `component`, `phase_done`, `store`) and releases its components after it under phased residency.

Contract
- `encode(session, requests, timings=None) -> [Encoded]`: `requests` [(settings, media)]. First every text (phase
  `text_encode`, cached by the text encoder's `cache_key`), then the text encoder is done; then every request's
  conditions (phase `condition_encode`, cached per item by content), then both VAEs are done. `Encoded.cached` is
  {"text": bool, "conditions": bool | None} (None: no conditioning). A phase whose every request came from the cache
  reports 0 and its key hashing goes to "cache_lookup".
- `denoise(session, prepared, spec, recorder, callback=None, cancel=None) -> (video, audio)`: frees the blocks of the
  prepared DiT a thinned spec does not run (`ComponentStore.release_blocks`; a pinned model stays whole), then runs
  `spec` through the one loop (`h3lab.run.denoise`) with the store's `models` lookup. Not timed here: the caller's
  "denoise" phase also covers preparing the request (the DiT's loading goes to "load").
- `decode(session, items, timings=None) -> (frames, waveforms)`: `items` [(settings, latents, audio_rows)]. Every
  video (phase `decode_video`, `pipeline.decode_video`: frame count checked, upscaled from the render canvas), then
  the video VAE is done; every waveform (phase `decode_audio`, the audio VAE's decode), then the audio VAE is done.
- `PhaseTimer(session, timings, phase)`: the wall time of one phase, CUDA-synchronised, minus the component loading
  it triggered (`Session.load_seconds`), which goes to "load". `timings=None` in the functions above keeps no times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from . import pipeline


@dataclass(frozen=True, eq=False)
class Encoded:
    """One request's encoded conditioning and what the caches served."""

    text: pipeline.TextEntry
    cond: pipeline.CondSet
    cached: dict  # {"text": bool, "conditions": bool | None}


def encode(session: Any, requests: Sequence[tuple[Any, pipeline.Media]],
           timings: dict[str, float] | None = None) -> list[Encoded]:
    """The text and condition phases of `requests` (module docstring)."""
    timings = {} if timings is None else timings
    with PhaseTimer(session, timings, "text_encode"):
        texts = [session.encode_text(s, media) for s, media in requests]
    _book_cache_hit(timings, "text_encode", all(cached for _, cached in texts))
    session.phase_done("text_encoder")

    with PhaseTimer(session, timings, "condition_encode"):
        conds = [session.encode_conditions(media) for _, media in requests]
    _book_cache_hit(timings, "condition_encode", all(cached for _, cached in conds))
    session.phase_done("vae", "audio_vae")
    return [Encoded(text, cond, {"text": text_cached, "conditions": cond_cached})
            for (text, text_cached), (cond, cond_cached) in zip(texts, conds)]


def denoise(session: Any, prepared: Any, spec: Any, recorder: Any, callback: Any = None, cancel: Any = None):
    """`spec` on the prepared request's DiT through the one loop; returns its final (video, audio) rows."""
    from ..run import denoise as run_loop

    if "blocks" in spec.preset:  # a pinned model stays whole
        session.store.release_blocks(prepared.variant, prepared.model, spec.preset["blocks"])
    return run_loop(spec, prepared.model, recorder, callback, cancel,
                    models=session.store.models_for(prepared.variant, prepared.model))


def decode(session: Any, items: Sequence[tuple[Any, torch.Tensor, torch.Tensor]],
           timings: dict[str, float] | None = None) -> tuple[list, list]:
    """The decode phases of `items` (module docstring): (frames per item, waveform per item)."""
    timings = {} if timings is None else timings
    with PhaseTimer(session, timings, "decode_video"):
        frames = [pipeline.decode_video(session.component("vae"), latents, s) for s, latents, _ in items]
    session.phase_done("vae")
    with PhaseTimer(session, timings, "decode_audio"):
        waveforms = [session.component("audio_vae").decode(rows) for _, _, rows in items]
    session.phase_done("audio_vae")
    return frames, waveforms


class PhaseTimer:
    """Wall time of one phase, CUDA-synchronised, minus the component loading it triggered (booked as "load")."""

    def __init__(self, session: Any, timings: dict[str, float], phase: str):
        self.device, self.session, self.timings, self.phase = session.device, session, timings, phase

    def __enter__(self):
        self._sync()
        self.t0 = time.perf_counter()
        self.load0 = self.session.load_seconds
        return self

    def __exit__(self, *exc):
        self._sync()
        loading = self.session.load_seconds - self.load0
        self.timings[self.phase] = self.timings.get(self.phase, 0.0) + time.perf_counter() - self.t0 - loading
        self.timings["load"] = self.timings.get("load", 0.0) + loading
        return False

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _book_cache_hit(timings: dict[str, float], phase: str, cached: bool) -> None:
    """A phase served entirely from the cache encoded nothing: it reports 0, and the key hashing it took is booked
    under "cache_lookup"."""
    if cached:
        timings["cache_lookup"] = timings.get("cache_lookup", 0.0) + timings[phase]
        timings[phase] = 0.0
