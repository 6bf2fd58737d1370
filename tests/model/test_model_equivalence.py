"""`off` mode on CPU is bit-equal to Diffusers' `MiniMaxH3Transformer3DModel`: outputs (and gradients) over several
tiny configs, both dtype policies, batch sizes 1-3, mixed-timestep forwards and t2va / fl2va layouts built by
Diffusers' own layout builders. Also the state-dict keys, the released dtypes and `runtime.attention` vs
`dispatch_attention_fn`."""

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.models.attention_dispatch import dispatch_attention_fn
from model_cases import CONFIGS, forward_inputs, layout, model_pair, small_case, weighted_loss

from h3lab import H3Config, H3Transformer
from h3lab.execution import runtime
from h3lab.config import FP32_MODULES
from h3lab.model.precision import keeps_float32

# (task, anchors, num_text, frames, lat_h, lat_w, num_audio, batch, (video_t, audio_t), bf16 text input)
CASES = [
    ("t2va", (), 5, 2, 4, 4, 3, 1, (0.0, 0.0), False),  # step 0: one distinct timestep
    ("t2va", (), 7, 3, 2, 6, 5, 2, (0.25, 0.6), True),
    ("fl2va", ("first", "last"), 9, 3, 4, 4, 4, 3, (0.42, 0.7), False),  # three distinct timesteps
    ("fl2va", ("first",), 6, 2, 4, 2, 6, 2, (0.8, 0.3333), True),
    ("fl2va", ("last",), 8, 4, 2, 2, 3, 1, (0.9995, 0.5), False),
]


@pytest.fixture(scope="module", params=[(name, policy) for name in CONFIGS for policy in ("released", "float32")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, tmp_path_factory):
    name, policy = request.param
    seed = sorted(CONFIGS).index(name) * 2 + (policy == "released")
    ours, ref = model_pair(CONFIGS[name], policy, seed, tmp_path_factory.mktemp(f"{name}-{policy}"))
    return CONFIGS[name], policy, ours, ref


def test_forward_bytes_equal_diffusers(pair):
    config, policy, ours, ref = pair
    for i, (task, anchors, nt, frames, lh, lw, na, batch, ts, bf16_text) in enumerate(CASES):
        lay = layout(task, nt, frames, lh, lw, na, config.patch_size, seed=i, anchors=anchors)
        text_dtype = torch.bfloat16 if (bf16_text and policy == "released") else torch.float32
        inputs = forward_inputs(config, lay, ts, batch, seed=100 + i, text_dtype=text_dtype)
        with torch.no_grad(), runtime.use_mode("off"):
            video, audio = ours(**inputs)
            ref_video, ref_audio = ref(**inputs, return_dict=False)
        assert video.dtype == ref_video.dtype == torch.float32 and audio.dtype == ref_audio.dtype == torch.float32
        assert video.shape == (batch, lay["video_indices"].numel(), config.video_patch_dim)
        assert audio.shape == (batch, lay["audio_indices"].numel(), config.audio_in_channels)
        assert torch.equal(video, ref_video), f"video differs: {task} {anchors} batch {batch}"
        assert torch.equal(audio, ref_audio), f"audio differs: {task} {anchors} batch {batch}"
        assert video.abs().max() > 0 and audio.abs().max() > 0


@pytest.mark.parametrize("policy", ["released", "float32"])
def test_gradients_bytes_equal_diffusers(policy, tmp_path):
    config = CONFIGS["tiny"]
    ours, ref = model_pair(config, policy, seed=7, tmp_path=tmp_path)
    inputs = small_case(config, batch=2, seed=3)
    grads = []
    for model, kwargs in ((ours, {}), (ref, {"return_dict": False})):
        x = {k: (v.clone().requires_grad_() if k.endswith("hidden_states") else v) for k, v in inputs.items()}
        with runtime.use_mode("off"):
            video, audio = model(**x, **kwargs)
        weighted_loss(video, audio, seed=5).backward()
        named = {k: p.grad for k, p in model.named_parameters()}
        named.update({k: x[k].grad for k in x if k.endswith("hidden_states")})
        grads.append(named)
    assert grads[0].keys() == grads[1].keys()
    for key in grads[0]:
        assert grads[0][key] is not None and torch.equal(grads[0][key], grads[1][key]), key


def test_state_dict_keys_and_released_dtypes():
    for config in CONFIGS.values():
        ours = H3Transformer(config)
        ref = MiniMaxH3Transformer3DModel(**config.to_diffusers())
        assert list(ours.state_dict()) == list(ref.state_dict())
        assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
        assert "rope.inv_freq" not in ours.state_dict() and ours.rope.inv_freq.dtype == torch.float32
        assert torch.equal(ours.rope.inv_freq, ref.rope.inv_freq)
        for name, param in ours.named_parameters():
            # The component match we apply equals the substring match Diffusers' get_parameter_dtype applies.
            assert keeps_float32(name) == any(m in name for m in FP32_MODULES)
            assert param.dtype == (torch.float32 if keeps_float32(name) else torch.bfloat16), name
        assert ours.num_parameters() == sum(p.numel() for p in ref.parameters())
        assert all(p.dtype == torch.float32 for p in H3Transformer(config, dtype_policy="float32").parameters())


def test_full_config_parameter_count_on_meta():
    with torch.device("meta"):
        model = H3Transformer(H3Config.full())
    assert model.num_parameters() == 33_122_992_896
    assert model.config == H3Config.full()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runtime_attention_matches_dispatch_attention_fn(dtype):
    g = torch.Generator().manual_seed(11)
    for seq in (5, 67, 257):
        q, k, v = (torch.randn(2, seq, 3, 16, generator=g).to(dtype) for _ in range(3))
        ours = runtime.attention(q, k, v)
        ref = dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
        assert torch.equal(ours, ref)
