"""Every name `h3lab.training` takes from the rest of h3lab, in one place.

The model, the run description and the hashing leaf are being reshaped by other rooms (projections as modules,
`RunSpec`, a hashing leaf); after that merge only the imports below should need to move. The training room reads:
the runtime modes, the sampler's conventions, `PackedLayout`, the sealed-trajectory types, `tensor_digest` and the
provenance helpers (code revision, model fingerprint, trace summary); for RL the stochastic transition contract
(`h3lab.stochastic`) and the image reader rewards use (`components.media.read_image`).
"""

from __future__ import annotations

from .. import __version__, runtime
from ..errors import H3Error
from ..io_utils import atomic_save_safetensors, atomic_write_dir, atomic_write_json
from ..layout import PackedLayout
from ..sampler import AUDIO_SHIFT, CONDITION_T, VIDEO_SHIFT, draw_noise, noise_mix
from ..components.media import read_image
from ..stochastic import SDE_KINDS, transition_logprob, transition_mean_std
from ..trajectory import (
    DenoiseInputs,
    TraceSummary,
    Trajectory,
    code_revision,
    model_fingerprint,
    tensor_digest,
)

__all__ = [
    "__version__", "runtime", "H3Error", "atomic_save_safetensors", "atomic_write_dir", "atomic_write_json",
    "PackedLayout", "read_image", "AUDIO_SHIFT", "CONDITION_T", "VIDEO_SHIFT", "draw_noise", "noise_mix",
    "DenoiseInputs", "TraceSummary", "Trajectory", "SDE_KINDS", "transition_logprob", "transition_mean_std",
    "code_revision", "model_fingerprint", "tensor_digest",
]
