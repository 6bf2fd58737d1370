"""H3Config: Diffusers keys, the released fingerprint, the tiny preset's structural properties, validation errors
that name the field and the rule, and the round trip through a Diffusers config.json."""

import json

import pytest

from h3lab.config import FP32_MODULES, ConfigError, H3Config


def test_full_is_the_released_fingerprint():
    c = H3Config.full()
    assert (c.num_attention_heads, c.attention_head_dim, c.hidden_size, c.num_layers) == (56, 128, 5376, 50)
    assert (c.num_refiner_layers, c.ffn_dim, c.in_channels, c.audio_in_channels) == (2, 14336, 24, 32)
    assert (c.patch_size, c.text_dim, c.freq_dim) == ((1, 2, 2), 5120, 256)
    assert (c.time_embed_hidden_dim, c.time_embed_dim, c.rope_freq_dim, c.rope_theta) == (5376, 2688, 16, 10000.0)
    assert (c.norm_eps, c.qk_norm_eps, c.final_norm_eps) == (1e-5, 1e-5, 1e-5)
    assert (c.inner_dim, c.rotary_dim, c.video_patch_dim, c.adaln_dim) == (7168, 96, 96, 96768)


def test_tiny_keeps_every_structural_property():
    c = H3Config.tiny()
    assert c.inner_dim != c.hidden_size
    assert c.rotary_dim < c.attention_head_dim
    assert c.num_refiner_layers == 2 and c.num_layers >= 2
    assert c.video_patch_dim == c.in_channels * 4
    assert c.time_embed_dim != c.time_embed_hidden_dim


def test_keys_equal_diffusers_config_and_round_trip(tmp_path):
    import inspect

    from diffusers import MiniMaxH3Transformer3DModel

    params = set(inspect.signature(MiniMaxH3Transformer3DModel.__init__).parameters) - {"self"}
    for c in (H3Config.full(), H3Config.tiny()):
        kwargs = c.to_diffusers()
        assert set(kwargs) == params
        path = tmp_path / "config.json"
        path.write_text(json.dumps({"_class_name": "MiniMaxH3Transformer3DModel", "_diffusers_version": "0.42.1", **kwargs}))
        back = H3Config.from_json(str(path))
        assert back == c and back.extra["_class_name"] == "MiniMaxH3Transformer3DModel"


def test_fingerprint_lists_the_precision_policy():
    fp = H3Config.tiny().fingerprint()
    assert fp["fp32_modules"] == list(FP32_MODULES) and fp["rotary_dim"] == 12


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"rope_freq_dim": 3}, r"rope_freq_dim=3: rotary width 2\*3\*rope_freq_dim=18 exceeds attention_head_dim=16"),
        ({"hidden_size": 0}, r"hidden_size=0: must be a positive integer"),
        ({"num_attention_heads": 2.5}, r"num_attention_heads=2.5: must be a positive integer"),
        ({"num_layers": -1}, r"num_layers=-1: must be an integer >= 0"),
        ({"patch_size": (1, 2)}, r"patch_size=\(1, 2\): must be three positive integers"),
        ({"attention_head_dim": 15, "rope_freq_dim": 1}, r"attention_head_dim=15: must be even"),
        ({"freq_dim": 15}, r"freq_dim=15: must be even"),
        ({"norm_eps": 0.0}, r"norm_eps=0.0: must be a positive number"),
    ],
)
def test_validation_names_field_and_rule(changes, match):
    with pytest.raises(ConfigError, match=match):
        H3Config(**{**H3Config.tiny().to_diffusers(), **changes})


def test_unknown_key_is_refused():
    with pytest.raises(ConfigError, match="'num_experts' is not a MiniMaxH3Transformer3DModel config key"):
        H3Config.from_dict({**H3Config.tiny().to_diffusers(), "num_experts": 8})
