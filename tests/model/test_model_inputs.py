"""Bad forward inputs raise one clear `ModelInputError` (an `H3Error`, so a `ValueError`); Diffusers' own two checks
keep Diffusers' exact messages. Also construction: meta device + assign + `reset_buffers`, the dtype policies, and
`from_pretrained` delegating to the checkpoint loader."""

import sys
import types

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from model_cases import CONFIGS, random_state_dict, small_case

from h3lab import H3Transformer
from h3lab.errors import H3Error
from h3lab.model import DtypePolicyError, ModelInputError

CONFIG = CONFIGS["tiny"]


@pytest.fixture(scope="module")
def models():
    state = random_state_dict(CONFIG, 0)
    ours = H3Transformer(CONFIG, dtype_policy="float32")
    ours.load_state_dict(state)
    ref = MiniMaxH3Transformer3DModel(**CONFIG.to_diffusers())
    ref.load_state_dict(state)
    return ours, ref


def test_diffusers_checks_keep_diffusers_messages(models):
    ours, ref = models
    good = small_case(CONFIG, batch=1)
    seq = good["position_ids"].shape[0]
    for change in (
        {"position_ids": good["position_ids"][:, :2]},
        {"position_ids": good["position_ids"].reshape(-1)},
        {"token_tags": good["token_tags"][:-1]},
        {"timestep_indices": good["timestep_indices"][None]},
    ):
        bad = {**good, **change}
        with pytest.raises(ValueError) as ref_err:
            ref(**bad)
        with pytest.raises(ModelInputError) as our_err:
            ours(**bad)
        assert str(our_err.value) == str(ref_err.value)
    assert seq > 0


def _case(**change):
    good = small_case(CONFIG, batch=2)
    bad = dict(good)
    for key, fn in change.items():
        bad[key] = fn(good[key])
    return bad


BAD = [
    ("hidden_states", lambda x: x[..., :-1],
     r"hidden_states has 15 features per row: .*video_patch_dim = in_channels\*prod\(patch_size\) = 4\*1\*2\*2 = 16"),
    ("audio_hidden_states", lambda x: torch.cat([x, x], -1),
     "audio_hidden_states has 16 features per row: .*audio_in_channels = 8"),
    ("encoder_hidden_states", lambda x: x[..., :5], "encoder_hidden_states has 5 features per row: .*text_dim = 16"),
    ("hidden_states", lambda x: x[0], r"hidden_states has shape \[.*\]: must be \(batch, rows, 16\)"),
    ("audio_hidden_states", lambda x: x[:1], r"batch sizes differ across inputs .*'audio_hidden_states': 1"),
    ("encoder_hidden_states", lambda x: x.long(), "encoder_hidden_states dtype torch.int64: must be a floating-point"),
    ("video_indices", lambda x: x.int(), "video_indices dtype torch.int32: index tensors must be int64"),
    ("timestep_indices", lambda x: x.int(), "timestep_indices dtype torch.int32: index tensors must be int64"),
    ("token_tags", lambda x: x.to(torch.int16), "token_tags dtype torch.int16"),
    ("audio_indices", lambda x: x[:-1],
     r"audio_indices has shape \[.*\]: must be \(.*\), one packed position per row of audio_hidden_states"),
    ("text_indices", lambda x: x + 1000,
     r"text_indices holds \d+: each value must be a packed position in \[0, seq_len\)"),
    ("video_indices", lambda x: x - x.max() - 1, r"video_indices holds -\d+: each value must be a packed position"),
    ("timestep_indices", lambda x: x + 5, r"timestep_indices holds \d+: each value must be an index into timestep"),
    ("token_tags", lambda x: torch.where(x == 2, 3, x), r"token_tags holds 3: each value must be a modality tag"),
    ("timestep", lambda x: x[None], r"timestep has shape \[1, \d\]: must be \(num_timesteps,\)"),
    ("timestep", lambda x: (x * 0).long(), "timestep dtype torch.int64: must be a floating-point"),
    ("position_ids", lambda x: x.bool(), "position_ids dtype torch.bool"),
    ("hidden_states", lambda x: x.numpy(), "hidden_states is a ndarray: must be a torch.Tensor"),
]


@pytest.mark.parametrize("key, change, message", BAD, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD)])
def test_bad_inputs_raise_clearly(models, key, change, message):
    ours, _ = models
    with pytest.raises(ModelInputError, match=message) as err:
        ours(**_case(**{key: change}))
    assert isinstance(err.value, H3Error) and "\n" not in str(err.value)


def test_meta_construction_assign_and_reset_buffers(models):
    ours, _ = models
    released = H3Transformer(CONFIG)
    released.load_state_dict(ours.state_dict())
    with torch.device("meta"):
        lazy = H3Transformer(CONFIG)
    assert all(p.is_meta for p in lazy.parameters()) and lazy.rope.inv_freq.is_meta
    lazy.load_state_dict(released.state_dict(), assign=True)
    inputs = small_case(CONFIG, batch=1)
    with pytest.raises(ModelInputError, match="reset_buffers"):
        lazy(**inputs)
    lazy.reset_buffers()
    assert lazy.rope.inv_freq.device.type == "cpu" and lazy.rope.inv_freq.dtype == torch.float32
    assert torch.equal(lazy.rope.inv_freq, released.rope.inv_freq)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(lazy(**inputs), released(**inputs)))


def test_dtype_policies(models):
    ours, _ = models
    model = H3Transformer(CONFIG, dtype_policy="float32")
    model.load_state_dict(ours.state_dict())
    params = dict(model.named_parameters())
    model.apply_dtype_policy("released")
    assert model.dtype_policy == "released"
    assert all(params[k] is p for k, p in model.named_parameters()), "parameter objects must be kept"
    assert model.proj_in.weight.dtype == torch.float32 and model.context_embedder.weight.dtype == torch.bfloat16
    assert model.rope.inv_freq.dtype == torch.float32
    direct = H3Transformer(CONFIG)
    direct.load_state_dict(ours.state_dict())
    inputs = small_case(CONFIG, batch=1)
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model(**inputs), direct(**inputs)))
    with pytest.raises(DtypePolicyError, match="dtype_policy='bf16'"):
        H3Transformer(CONFIG, dtype_policy="bf16")
    model.to(torch.bfloat16)  # casts inv_freq too: refused at the next forward
    with pytest.raises(ModelInputError, match="inv_freq is torch.bfloat16"):
        model(**inputs)


def test_from_pretrained_delegates_to_the_checkpoint_loader(monkeypatch):
    calls = []
    fake = types.ModuleType("h3lab.checkpoint.loader")
    fake.load_transformer = lambda cls, path, **kw: calls.append((cls, path, kw)) or "loaded"
    monkeypatch.setitem(sys.modules, "h3lab.checkpoint.loader", fake)
    assert H3Transformer.from_pretrained("/snap", subfolder="transformer_ref", device="cpu") == "loaded"
    expected = {"subfolder": "transformer_ref", "device": "cpu", "dtype_policy": "released"}
    assert calls == [(H3Transformer, "/snap", expected)]


def test_diffusers_call_convention(models):
    ours, _ = models
    inputs = small_case(CONFIG, batch=1)
    with torch.no_grad():
        plain = ours(**inputs)
        assert all(torch.equal(a, b) for a, b in zip(plain, ours(**inputs, attention_kwargs=None, return_dict=False)))
    with pytest.raises(ModelInputError, match="no LoRA layers"):
        ours(**inputs, attention_kwargs={"scale": 0.5})
    with pytest.raises(ModelInputError, match="return_dict=True"):
        ours(**inputs, return_dict=True)


def test_index_checks_of_unchanged_tensors_read_nothing_back_and_a_changed_one_is_read_again(monkeypatch):
    """The range and key_order checks are kept per live tensor and `_version` (runtime.derived): the same layout
    tensors again cost no device read; an in-place write, new storage or a new tensor is checked again."""
    from h3lab.model.inputs import check_inputs, check_key_order

    case = small_case(CONFIG, batch=1)
    names = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "timestep_indices",
             "token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")
    args = [case[n] for n in names]
    seq = case["position_ids"].shape[0]
    key_order = torch.randperm(seq, generator=torch.Generator().manual_seed(4))
    check_inputs(CONFIG, *args)
    check_key_order(key_order, case["position_ids"])

    def refuse(*a, **k):
        raise AssertionError("a device read for an unchanged tensor")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", refuse)
        m.setattr(torch, "equal", refuse)
        check_inputs(CONFIG, *args)
        check_key_order(key_order, case["position_ids"])
    tags = args[5]
    tags[3] = 7  # in place: a new _version
    with pytest.raises(ModelInputError, match="token_tags holds 7"):
        check_inputs(CONFIG, *args)
    tags[3] = 0
    check_inputs(CONFIG, *args)
    tags.data = torch.full_like(tags, 5)  # new storage, same object and _version
    with pytest.raises(ModelInputError, match="token_tags holds 5"):
        check_inputs(CONFIG, *args)
    key_order[[0, 1]] = key_order[[1, 1]]  # no longer a permutation
    with pytest.raises(ModelInputError, match="key_order is not a permutation"):
        check_key_order(key_order, case["position_ids"])
