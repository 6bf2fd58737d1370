"""`H3Config`: the architecture of one MiniMax-H3 transformer.

Field names are exactly the keys of Diffusers' `MiniMaxH3Transformer3DModel` config, so a snapshot's
`transformer/config.json` loads with `H3Config.from_dict(json)` and `H3Config(**cfg.to_diffusers())` round-trips.
Two presets: `full()` is the released 33B fingerprint; `tiny()` keeps every structural property of it (attention
inner width != hidden width, partial rotary 2*3*rope_freq_dim < head_dim, two refiner layers, the mixed-precision
module list) at a size that runs in milliseconds on a CPU.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

# Rows of the packed sequence carry one of these modality tags; AdaLN row = timestep_index * 3 + tag.
VIDEO, TEXT, AUDIO = 0, 1, 2
MODALITY_NAMES = {VIDEO: "video", TEXT: "text", AUDIO: "audio"}
NUM_MODALITIES = 3

# Released dtype policy: these module-name substrings stay float32, everything else is bfloat16
# (Diffusers' `_keep_in_fp32_modules`; `rope` holds the float32 inv_freq buffer).
FP32_MODULES = ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out", "rope")


class ConfigError(ValueError):
    """A config value breaks a structural rule; the message names the field, the value and the rule."""


@dataclass(frozen=True)
class H3Config:
    num_attention_heads: int = 56
    attention_head_dim: int = 128
    hidden_size: int = 5376
    num_layers: int = 50
    num_refiner_layers: int = 2
    ffn_dim: int = 14336
    in_channels: int = 24
    audio_in_channels: int = 32
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 5120
    freq_dim: int = 256
    time_embed_hidden_dim: int = 5376
    time_embed_dim: int = 2688
    rope_freq_dim: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-5
    final_norm_eps: float = 1e-5
    # Keys Diffusers writes into config.json that are not architecture (`_class_name`, `_diffusers_version`, ...)
    # are dropped by `from_dict`; nothing else is accepted.
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        self.validate()

    # ----------------------------------------------------------------------------------------------- presets
    @classmethod
    def full(cls) -> "H3Config":
        """The released MiniMax-H3 (33,122,992,896 transformer parameters)."""
        return cls()

    @classmethod
    def tiny(cls) -> "H3Config":
        """A few-thousand-parameter H3 with the released structure: inner width 2*16=32 != hidden 24, rotary
        2*3*2=12 of 16 head channels, 2 refiner layers, 2 blocks, 4 latent channels x (1,2,2) patch = 16-wide
        video rows, 8 audio channels (the tiny audio VAE's latent width), text width 16 (the tiny Qwen3-VL)."""
        return cls(
            num_attention_heads=2,
            attention_head_dim=16,
            hidden_size=24,
            num_layers=2,
            num_refiner_layers=2,
            ffn_dim=40,
            in_channels=4,
            audio_in_channels=8,
            patch_size=(1, 2, 2),
            text_dim=16,
            freq_dim=16,
            time_embed_hidden_dim=24,
            time_embed_dim=12,
            rope_freq_dim=2,
            rope_theta=10000.0,
        )

    # --------------------------------------------------------------------------------------------- derived
    @property
    def inner_dim(self) -> int:
        """Attention inner width (heads x head_dim); 7168 in the release, wider than the 5376 residual stream."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def rotary_dim(self) -> int:
        """Head channels rotated by the 3-axis RoPE: 2 * 3 * rope_freq_dim (96 of 128 in the release)."""
        return 2 * 3 * self.rope_freq_dim

    @property
    def video_patch_dim(self) -> int:
        """Width of one packed video row: in_channels x prod(patch_size) (96 in the release)."""
        p = self.patch_size
        return self.in_channels * p[0] * p[1] * p[2]

    @property
    def adaln_dim(self) -> int:
        """Output width of one block's AdaLN projection: 6 x 3 modalities x hidden (96768 in the release)."""
        return 6 * NUM_MODALITIES * self.hidden_size

    def validate(self) -> None:
        positive = (
            "num_attention_heads attention_head_dim hidden_size num_refiner_layers ffn_dim in_channels "
            "audio_in_channels text_dim freq_dim time_embed_hidden_dim time_embed_dim rope_freq_dim"
        ).split()
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"H3Config.{name}={value!r}: must be a positive integer")
        if not isinstance(self.num_layers, int) or self.num_layers < 0:
            raise ConfigError(f"H3Config.num_layers={self.num_layers!r}: must be an integer >= 0")
        if len(self.patch_size) != 3 or any(p <= 0 for p in self.patch_size):
            raise ConfigError(f"H3Config.patch_size={self.patch_size!r}: must be three positive integers (t, h, w)")
        if self.rotary_dim > self.attention_head_dim:
            raise ConfigError(
                f"H3Config.rope_freq_dim={self.rope_freq_dim}: rotary width 2*3*rope_freq_dim={self.rotary_dim} "
                f"exceeds attention_head_dim={self.attention_head_dim}"
            )
        if self.attention_head_dim % 2:
            raise ConfigError(f"H3Config.attention_head_dim={self.attention_head_dim}: must be even")
        if self.freq_dim % 2:
            raise ConfigError(f"H3Config.freq_dim={self.freq_dim}: must be even (sin/cos halves)")
        for name in ("norm_eps", "qk_norm_eps", "final_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"H3Config.{name}={value!r}: must be a positive number")

    # ------------------------------------------------------------------------------------------ conversion
    def to_diffusers(self) -> dict[str, Any]:
        """The kwargs of `MiniMaxH3Transformer3DModel(**kwargs)`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out["patch_size"] = list(self.patch_size)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "H3Config":
        """Build from a Diffusers config.json dict: `_`-prefixed bookkeeping keys are kept in `extra`, unknown
        architecture keys raise."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs, extra = {}, {}
        for key, value in data.items():
            if key in names:
                kwargs[key] = tuple(value) if key == "patch_size" else value
            elif key.startswith("_"):
                extra[key] = value
            else:
                raise ConfigError(f"config key {key!r} is not a MiniMaxH3Transformer3DModel config key")
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_json(cls, path: str) -> "H3Config":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def fingerprint(self) -> dict[str, Any]:
        """The architecture numbers a validation artifact records (RFC section 2)."""
        return {
            **self.to_diffusers(),
            "inner_dim": self.inner_dim,
            "rotary_dim": self.rotary_dim,
            "video_patch_dim": self.video_patch_dim,
            "adaln_dim": self.adaln_dim,
            "fp32_modules": list(FP32_MODULES),
        }
