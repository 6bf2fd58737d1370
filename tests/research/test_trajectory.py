"""Sealed trajectories: the one denoise loop against the released pipeline's loop, seal / load / verify, tamper
detection, the hash schemes, cancellation, callbacks and velocity reuse. `off` mode (torch) on the tiny snapshot; the
strict replay is covered by the ablation matrix (A0, H-C2)."""

import json

import pytest
import torch
from h3kernels import digest
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep
from safetensors.torch import load_file, save_file

from h3lab import hashing as H
from h3lab.run import trajectory as T
from h3lab.research.ablation import make_inputs, tiny_bench
from h3lab.research.arms import diffusers_twin
from h3lab.run import DenoiseCancelled, RunSpec, RunSpecError, denoise
from h3lab.run.sampler import DualSchedule


@pytest.fixture(scope="module")
def bench(tiny_snapshot):
    return tiny_bench(str(tiny_snapshot))


def pipeline_loop(p_model, inputs, num_points):
    """The released loop, spelled out from Diffusers' modular pipeline (denoise.py / before_denoise.py): its own
    schedulers and row-timestep builder, latents as (rows, C) tensors stepped in place after the conditioning rows."""
    sv, sa = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    sv.set_timesteps(num_points)
    sa.set_timesteps(num_points)
    latents, audio = inputs.video[0].clone(), inputs.audio[0].clone()
    nv, na = inputs.num_condition_video_rows, inputs.num_condition_audio_rows
    out = []
    with torch.no_grad():
        for i, t in enumerate(sv.timesteps):
            unique_t, idx = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                inputs.video_indices, inputs.audio_indices, nv, na, inputs.text_indices.numel(), float(t),
                float(sa.timesteps[i]), max(float(t), 0.999), 1.0,
            )
            v, a = p_model(
                hidden_states=latents[None], audio_hidden_states=audio[None], encoder_hidden_states=inputs.text,
                timestep=unique_t, timestep_indices=idx, token_tags=inputs.token_tags, position_ids=inputs.position_ids,
                video_indices=inputs.video_indices, audio_indices=inputs.audio_indices,
                text_indices=inputs.text_indices, return_dict=False,
            )
            latents[nv:] = sv.step(v[0, nv:].float(), t, latents[nv:], return_dict=False)[0]
            audio[na:] = sa.step(a[0, na:].float(), sa.timesteps[i], audio[na:], return_dict=False)[0]
            out.append((v, a, latents.clone(), audio.clone()))
    return out


def test_denoise_is_bit_equal_to_the_released_loop(bench):
    records = []
    video, audio = denoise(bench.spec("off"), bench.model, callback=records.append)
    oracle = pipeline_loop(diffusers_twin(bench.model), bench.inputs, bench.schedule.num_points)
    assert len(records) == len(oracle) == bench.schedule.num_passes == 2
    for rec, (v, a, lat, aud) in zip(records, oracle):
        assert torch.equal(rec.velocity_video, v) and torch.equal(rec.velocity_audio, a)
        assert torch.equal(rec.video[0], lat) and torch.equal(rec.audio[0], aud)
    # conditioning rows are never written; the generated rows moved
    nv = bench.inputs.num_condition_video_rows
    assert torch.equal(video[:, :nv], bench.inputs.video[:, :nv])
    assert not torch.equal(video[:, nv:], bench.inputs.video[:, nv:])
    assert torch.equal(video, records[-1].video) and torch.equal(audio, records[-1].audio)


def test_seal_load_verify_round_trip(bench, tmp_path):
    traj = T.record(bench.spec("off"), bench.model, keep=("latents", "velocities"), keep_steps=[1])
    path = traj.seal(tmp_path / "run")
    assert sorted(p.name for p in path.iterdir()) == [T.INPUTS_FILE, T.MANIFEST, T.TENSORS_FILE]
    m = json.loads((path / T.MANIFEST).read_text())
    assert m["format"] == T.FORMAT and m["mode"] == "off" and m["hash_scheme"] == "sha256"
    assert m["checkpoint"]["fingerprint"] == bench.model.fingerprint != ""
    assert m["code"]["revision"].startswith(("git:", "h3lab-"))
    assert m["layout"]["sha256"] == bench.layout.sha256()
    assert m["seeds"] == bench.inputs.seeds
    for name, sched in (("video", bench.schedule.video), ("audio", bench.schedule.audio)):
        assert m["schedule"][name]["sha256"] == sched.sha256
        assert m["schedule"][name]["sigmas"] == [float(s) for s in sched.sigmas]
    assert [s["index"] for s in m["steps"]] == [0, 1]
    assert all(len(s[f]) == 64 for s in m["steps"] for f in T.STEP_FIELDS)
    assert m["trace"]["forwards"] == 2 and m["trace"]["ops"]["attention"] == {"torch": 8}
    assert sorted(m["kept"]) == ["audio.0001", "velocity_audio.0001", "velocity_video.0001", "video.0001"]
    assert m["digest"] == T.digest_lines(m["steps"]) == traj.digest
    assert m["result_sha256"] == bench.spec("off").sha256 and m["spec"]["factors"] == [] and m["spec"]["sealable"]
    assert m["run"] == {"stepper": "euler", "reuse": 1, "reuse_mode": "linear"}

    loaded = T.load(path)
    assert loaded.digest == traj.digest and loaded.schedule == bench.schedule
    assert loaded.spec.sha256 == traj.spec.sha256 and loaded.spec.layout == bench.layout
    for k, v in traj.kept.items():
        assert torch.equal(loaded.kept[k], v)
    for k, v in bench.inputs.tensors().items():
        got = loaded.inputs.tensors()[k]
        assert got.dtype == v.dtype and torch.equal(got, v)
    report = T.verify(path, bench.model)
    assert report.ok and report.passes_checked == 2 and report.replay_digest == traj.digest, str(report)
    assert report.fingerprint_match

    # sealing again over the same path replaces it atomically and leaves no temp folders
    again = T.record(bench.spec("off"), bench.model)
    again.seal(path)
    assert T.load(path).manifest["kept"] == {} and not (path / T.TENSORS_FILE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_verify_reports_the_first_tampered_pass(bench, tmp_path):
    path = T.record(bench.spec("off"), bench.model).seal(tmp_path / "run")
    manifest = json.loads((path / T.MANIFEST).read_text())

    # an edited per-pass hash alone breaks the digest: load refuses
    edited = json.loads(json.dumps(manifest))
    edited["steps"][1]["audio"] = "0" * 64
    (path / T.MANIFEST).write_text(json.dumps(edited))
    with pytest.raises(T.TrajectoryError, match="digest"):
        T.load(path)

    # a forged, self-consistent manifest: verify replays and names pass 1, tensor "audio"
    edited["digest"] = T.digest_lines(edited["steps"])
    (path / T.MANIFEST).write_text(json.dumps(edited))
    report = T.verify(path, bench.model)
    assert not report.ok and report.first_step == 1 and report.field == "audio"
    assert report.expected == "0" * 64 and report.got == manifest["steps"][1]["audio"]

    # a tampered sealed input is caught on load, by name
    (path / T.MANIFEST).write_text(json.dumps(manifest))
    tensors = load_file(str(path / T.INPUTS_FILE))
    tensors["audio"] = tensors["audio"].clone()
    tensors["audio"].view(-1)[3] += 1e-3
    save_file(tensors, str(path / T.INPUTS_FILE))
    with pytest.raises(T.TrajectoryError, match="'audio'"):
        T.load(path)


def test_a_kept_tensor_changed_with_its_manifest_entry_is_refused(bench, tmp_path):
    """The `kept` digests are outside `digest`; each kept latent / velocity must still be the
    tensor its pass's sealed hash names."""
    from h3lab.hashing import tensor_digest

    path = T.record(bench.spec("off"), bench.model, keep=("latents",), keep_steps=[1]).seal(tmp_path / "run")
    manifest = json.loads((path / T.MANIFEST).read_text())
    kept = load_file(str(path / T.TENSORS_FILE))
    kept["video.0001"] = kept["video.0001"] + 1e-3
    save_file(kept, str(path / T.TENSORS_FILE))
    manifest["kept"]["video.0001"] = tensor_digest(kept["video.0001"], "sha256")
    (path / T.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(T.TrajectoryError, match="kept tensor 'video.0001' is not the pass-1 video"):
        T.load(path)


def test_verify_names_the_first_pass_a_different_model_changes(bench, tmp_path):
    path = T.record(bench.spec("off"), bench.model).seal(tmp_path / "run")
    report = T.verify(path, bench.variant)
    assert not report.ok and report.first_step == 0 and report.field == "velocity_video"
    assert not report.fingerprint_match and "pass 0" in str(report)


def test_hash_schemes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 11, generator=g).to(torch.bfloat16)
    for scheme in ("sha256", "device"):
        d = H.tensor_digest(x, scheme)
        assert d == H.tensor_digest(x.clone(), scheme) == H.tensor_digest(x.view(11, 37), scheme)
        flipped = x.clone()
        flipped.view(torch.int16).view(-1)[100] ^= 1  # one bit
        assert H.tensor_digest(flipped, scheme) != d
        assert H.tensor_digest(x.view(torch.int16), scheme) != d  # same bytes, other dtype
    assert H.tensor_digest(x, "device") != H.tensor_digest(x, "sha256")
    assert H.resolve_scheme("auto", "cpu") == "sha256" and H.resolve_scheme("auto", "cuda") == "device"
    with pytest.raises(H.HashError, match="hash scheme"):
        H.tensor_digest(x, "md5")


def test_device_lanes_follow_the_documented_formula():
    """L_k = sum_i (w_i * c_k(i) mod p) mod p over unsigned 16-bit words, c_k from the splitmix finaliser; the
    reference below is plain python integers, independent of torch's int64 arithmetic."""
    M = (1 << 64) - 1

    def coeff(i: int, k: int) -> int:
        x = (i + (digest.LANE_SEEDS[k] & ((1 << 62) - 1))) & M
        for mul, shift in ((0x9E3779B97F4A7C15, 30), (0xBF58476D1CE4E5B9, 27), (0x94D049BB133111EB, 31)):
            x = (x * mul) & M
            signed = x - (1 << 64) if x >> 63 else x
            x = (signed ^ (signed >> shift)) & M  # arithmetic shift, as torch's >> on int64
        return x & ((1 << 31) - 1)

    g = torch.Generator().manual_seed(1)
    t = torch.randn(9, 5, generator=g)  # 45 float32 = 90 words
    words = [w & 0xFFFF for w in t.view(torch.int16).flatten().tolist()]
    p = (1 << 31) - 1
    want = tuple(sum((w * coeff(i, k)) % p for i, w in enumerate(words)) % p for k in range(2))
    assert H.device_lanes(t) == want
    # more words than one chunk: chunk sums are exact integers, so the result cannot depend on the split
    big = torch.randint(-(2**15), 2**15, ((1 << 22) + 7,), dtype=torch.int16, generator=g)
    lanes = H.device_lanes(big)
    w = big.to(torch.int64) & 0xFFFF
    idx = torch.arange(w.numel())
    assert lanes == tuple(int(((w * digest._reference_coefficients(idx, k)) % p).sum() % p) for k in range(2))


@pytest.mark.parametrize("dtype, numel", [(torch.bfloat16, 3), (torch.float32, 16384), (torch.float16, 40001),
                                          (torch.int64, 9000), (torch.bool, 33)])
def test_device_lanes_kernel_equals_the_torch_formulation(dtype, numel):
    """The Triton pass (interpreted here) returns the exact integers of the torch formulation: sizes below one
    tile, exactly one program's span, several programs with a ragged end, and an odd byte count (bool)."""
    g = torch.Generator().manual_seed(numel)
    if dtype == torch.bool:
        t = torch.rand(numel, generator=g) > 0.5
    elif dtype == torch.int64:
        t = torch.randint(-(2**62), 2**62, (numel,), generator=g)
    else:
        t = torch.randn(numel, generator=g).to(dtype)
    assert H.device_lanes(t, impl="kernel") == H.device_lanes(t, impl="torch")
    flipped = t.clone().view(torch.uint8)
    flipped[-1] ^= 1
    assert H.device_lanes(flipped.view(t.dtype), impl="kernel") != H.device_lanes(t, impl="kernel")


def test_device_lanes_kernel_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="1-D int16"):
        digest.lanes(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(H.HashError, match="impl"):
        H.device_lanes(torch.ones(3), impl="numpy")
    with pytest.raises(ValueError, match="digest.lanes: device meta"):
        digest.lanes(torch.empty(4, dtype=torch.int16, device="meta"))
    assert digest.lanes(torch.empty(0, dtype=torch.int16)) == (0, 0)


def test_weights_fingerprint_is_cached_until_a_weight_changes():
    """A model without a loader fingerprint is hashed over its weights; the digest is reused while no tensor changed
    and recomputed after an in-place update (version counter) or a replaced tensor (storage)."""
    from h3lab import H3Config, H3Transformer

    torch.manual_seed(3)
    model = H3Transformer(H3Config.tiny())
    calls = []
    real = H.tensor_digest

    def counting(t, scheme="sha256"):
        calls.append(1)
        return real(t, scheme)

    H.tensor_digest = counting
    try:
        first = H.model_fingerprint(model)
        n = len(calls)
        assert n == len(model.state_dict()) and H.model_fingerprint(model) == first and len(calls) == n
        weight = model.transformer_blocks[0].attn.to_q.weight
        saved = weight.detach().clone()
        with torch.no_grad():
            weight.add_(1.0)
        second = H.model_fingerprint(model)
        assert second != first and len(calls) == 2 * n
        with torch.no_grad():
            weight.copy_(saved)  # the same bytes again: the same digest, recomputed
        assert H.model_fingerprint(model) == first
        model.transformer_blocks[0].attn.to_q.weight = torch.nn.Parameter(weight.detach().clone() * 2)
        assert H.model_fingerprint(model) not in (first, second)
    finally:
        H.tensor_digest = real


def test_cancel_callback_and_reuse(bench):
    seen = []

    class Cancel:
        def is_set(self):
            return len(seen) >= 1

    with pytest.raises(DenoiseCancelled, match="pass 1"):
        denoise(bench.spec("off"), bench.model, callback=seen.append, cancel=Cancel())
    assert [r.index for r in seen] == [0]

    schedule = DualSchedule.build(5)  # 4 passes; reuse 2 evaluates passes 0, 2, 3
    inputs = make_inputs(bench.model.config, bench.layout, schedule, seed=3)
    calls = []
    handle = bench.model.add_hook(lambda p, t: calls.append(p.name) if p.name == "video_out" else None)
    spec = RunSpec(inputs, schedule, reuse=2)
    try:
        traj = T.record(spec, bench.model)
    finally:
        handle.remove()
    assert [s["evaluated"] for s in traj.steps] == [True, False, True, True] and len(calls) == 3
    assert traj.manifest["trace"]["forwards"] == 3 and traj.manifest["run"]["reuse"] == 2
    report = T.verify(traj, bench.model)  # the replay reuses as recorded
    assert report.ok and report.replay_digest == traj.digest
    full = T.record(spec.replace(reuse=1), bench.model)
    assert traj.steps[0] == full.steps[0] and traj.steps[1]["video"] != full.steps[1]["video"]


def test_bad_inputs_raise(bench, tmp_path):
    x = bench.inputs
    with pytest.raises(RunSpecError, match="batch sizes"):
        x.replace(text=torch.cat([x.text, x.text]))
    with pytest.raises(RunSpecError, match="num_condition_video_rows"):
        x.replace(num_condition_video_rows=x.video.shape[1] + 1)
    with pytest.raises(RunSpecError, match="schedule has 3"):
        RunSpec(x, DualSchedule.build(4))
    with pytest.raises(T.TrajectoryError, match="keep"):
        T.TrajectoryRecorder(keep=("activations",))
    with pytest.raises(T.TrajectoryError, match="not a sealed trajectory"):
        T.load(tmp_path)
    (tmp_path / "file").write_text("x")
    traj = T.record(bench.spec("off"), bench.model)
    with pytest.raises(T.TrajectoryError, match="not a directory"):
        traj.seal(tmp_path / "file")
