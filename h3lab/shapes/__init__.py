"""Procedural audio-video clips (one coloured shape moving over a plain background with a panned stereo tone), their
templated prompts, and the measurements that read the same attributes back from decoded media.

- `clips.py`    `ClipSpec`, `render_clip(spec)` (frames + stereo waveform), `prompt(spec)`, its reader
                `read_prompt(text)` and `partial_prompt(spec, keep)`, anchors and reference images, the attribute
                vocabularies, the training / held-out split of attribute combinations
- `measure.py`  `measure(frames, audio)`: dominant colour, centroid-track direction, dominant tone, pan track;
                `matches` per attribute of `READS`

May import: the foundations and `checkpoint`.
"""

from .clips import (ATTRIBUTES, COLOURS, DIRECTIONS, SHAPES, TONES, ClipSpec, first_last, held_out_combos,
                    partial_prompt, prompt, read_prompt, reference_image, render_audio, render_clip, render_frames,
                    training_combos)
from .measure import READS, Measurement, matches, measure

__all__ = ["ATTRIBUTES", "COLOURS", "DIRECTIONS", "SHAPES", "TONES", "ClipSpec", "first_last", "held_out_combos",
           "prompt", "partial_prompt", "read_prompt", "render_clip", "render_frames", "render_audio", "reference_image",
           "training_combos", "READS", "Measurement", "matches", "measure"]
