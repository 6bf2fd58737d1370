"""Train the embedded default snapshot "h3-shapes" from a seed: the tiny H3 on procedural shapes and tones.

    python scripts/train_shapes.py --out OUT [--device cuda|cpu] [--seed 0] [--quick] [--vae-seconds S] [--audio-seconds S] [--dit-seconds S] [--ref-seconds S]
        [--audio-crop SAMPLES] [--partial-variants K] [--vaes-from SNAPSHOT] [--text-words] [--text-branch-scale S]

What it does, in order (every draw from `--seed`; nothing is downloaded):
1. data: `h3lab.shapes` clips for the 48 training (colour, shape, direction) triples x `--variants` seeds (64x64,
   22 frames, 29,600 stereo samples at 32 kHz); the 12 held-out triples are never rendered here. Its digest is the
   SHA-256 over every clip's spec, frames and waveform bytes in order.
2. a random tiny base snapshot (`make_tiny_snapshot(seed=0)`): the tokenizer, processor, schedulers and the Qwen3-VL
   text encoder, random (its layer-50 features are still prompt-specific). With `--text-words` the tokenizer gains
   the shapes vocabulary as whole-word tokens, and `--text-branch-scale S` multiplies the encoder's residual
   branches by S (`h3lab.shapes.words.tune_text_encoder`: a word's row is then mostly its own embedding, so a
   held-out mix of words is made of rows seen in training; sealed as `text_encoder`).
3. video VAE (`AutoencoderKLMiniMaxH3`, `VAE` below: the tiny structure with wider channels) trained as an
   autoencoder: reparameterised posterior sample -> decode, MSE in the pipeline's ImageNet-normalised pixel space
   with foreground pixels weighted `FG_WEIGHT` x, plus `KL_WEIGHT` x the per-element KL. Then the audio VAE
   (`AutoencoderKLMiniMaxH3Audio`, `AUDIO_VAE`: the tiny structure with an 8-wide encoder and a 256-wide decoder of
   five upsampling stages, so it ends 8 channels wide) on hop-aligned `--audio-crop` windows of the waveforms (each
   channel a batch item, as the pipeline does): posterior mean -> decode; the loss (`audio_loss`) sees pitch and
   pan: multi-resolution STFT magnitudes (spectral convergence + log magnitude above a floor, at `STFT_SIZES`) +
   `ENERGY_WEIGHT` x the log AC-RMS envelope per latent of each channel (the pan over time; the window mean is taken
   out, so a DC level cannot pass for a tone) + `DC_WEIGHT` x the windows' mean + waveform L1, plus `latent_terms`:
   `SCALE_WEIGHT` x a unit-scale term on each clip's time-mean latent standardised ACROSS the batch's clips (the
   latents must differ between clips) and `TRUNK_WEIGHT` x (log RMS of the encoder trunk)^2 (the trunk feeds a
   LayerNorm, nothing else bounds it: the second run's grew to ~1e7 and lost the loudness). After training,
   `audio_check` round-trips 12 training clips and reads their tone and pan back with `h3lab.shapes.measure`
   (sealed). Each VAE's `latents_mean` / `latents_std` are then the per-channel statistics of its training latents
   (4 decimals), so the transformer sees unit-scale latents. `text_check` seals how far apart the text features of
   prompts differing in one word are.
4. the transformer (`TRANSFORMER`: >= 6 blocks, released classes and dtype policy) with the flow-matching objective of
   `h3lab.training.objective` on the latents the session would feed it (t2va and fl2va layouts from
   `h3lab.run.layout.build_layout`, text from the snapshot's text encoder on the CPU, fl2va anchors through
   `VideoVAE.encode_condition`, targets the VAE posterior means through the wrappers' normalisation): sigma from
   `shifted_sigma` on the released shifts, `noise_mix`, conditioning rows at CONDITION_T, target x0 - noise on the
   generated rows. With `--partial-variants K`, the clips of seeds < K also train as t2va requests whose prompt
   (`h3lab.shapes.partial_prompt`) says a seeded proper subset of (colour, shape, direction), the rest generic: each
   word is then learned on its own, not only inside the 48 training mixes. Departures from `h3lab.training.train_step`, for speed: the run is in `off` mode (strict
   training on the CPU interpreter is far too slow), each step is one batched forward of `--batch` clips of one
   layout sharing one sigma draw (H3's forward takes one timestep table per batch; the strict step's per-request
   micro-batches are ~15x slower here), the weights train in float32 with torch AdamW and an EMA (decay
   `EMA_DECAY`, one `_foreach_lerp_` a step), and are stored in the released dtypes (bfloat16 except the float32 modules). `transformer_ref/` (same
   config) starts from the trained transformer and is tuned `--ref-steps` on ref2va requests (the shape's centred
   still, `h3lab.shapes.reference_image`, as the image reference) of `--ref2va-variants` seeds per triple.
5. the snapshot folder `OUT/h3-shapes/` (released layout) with `h3lab_training.json` (the seal: command, device,
   versions, git revision, data digest, steps run, losses, seconds, weight hashes) and `h3lab_manifest.json`
   (SHA-256 of every other file), and `OUT/h3-shapes.tar` of it.

`--vae-seconds / --audio-seconds / --dit-seconds / --ref-seconds S` cap each training phase's wall time (the steps actually run are sealed, so the run can be
repeated with `--vae-steps/--audio-steps/--dit-steps` set to them); `--quick` is a smoke run (a few clips and steps)
for checking the script on a CPU. `--vaes-from SNAPSHOT` skips phase 3 and takes both VAEs from an earlier sealed run
trained on the same data (its seal's records and the files' hashes go into this seal). `--verify DIR` re-renders the data and checks a snapshot's seal and manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from h3lab.checkpoint.native import NATIVE  # noqa: E402
from h3lab.checkpoint.tiny import AUDIO_VAE_CONFIG, VAE_CONFIG  # noqa: E402
from h3lab.config import H3Config  # noqa: E402
from h3lab.shapes import ATTRIBUTES, ClipSpec, partial_prompt, prompt, render_clip, training_combos  # noqa: E402
from h3lab.shapes.clips import BACKGROUND, PROMPT_EXAMPLE, PROMPT_FORM  # noqa: E402

SNAPSHOT_NAME = "h3-shapes"
TRAINED_VERSION = "shapes-v1"
SEAL = "h3lab_training.json"
MANIFEST = "h3lab_manifest.json"
# 4 heads: context parallelism (Ulysses) splits heads over 2 or 4 ranks (the second run's 3 refused CP2).
TRANSFORMER = H3Config(
    num_attention_heads=4, attention_head_dim=32, hidden_size=64, num_layers=6, num_refiner_layers=2, ffn_dim=192,
    in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=16, freq_dim=32, time_embed_hidden_dim=64,
    time_embed_dim=32, rope_freq_dim=4,
)
VAE = {**VAE_CONFIG, "block_out_channels": (16, 16, 32, 32), "decoder_num_layers": 2,
       "decoder_num_attention_heads": 4, "decoder_attention_head_dim": 16}
# Five upsampling stages instead of seven, so the 256-wide decoder ends 8 channels wide (not 2) at the sample rate.
AUDIO_VAE = {**AUDIO_VAE_CONFIG, "encoder_dim": 8, "decoder_dim": 256, "decoder_rates": (5, 5, 4, 4, 2),
             "decoder_kernel_sizes": (9, 9, 8, 8, 4)}
STFT_SIZES = (256, 1024, 2048)  # the audio loss's resolutions (2048 at 32 kHz: 15.6 Hz bins, 220/440/880 apart)
ENERGY_WEIGHT = 1.0
DC_WEIGHT = 10.0
SCALE_WEIGHT = 1.0
TRUNK_WEIGHT = 0.1
LOG_FLOOR = 1e-3
FG_WEIGHT = 8.0
KL_WEIGHT = 1e-4
EMA_DECAY = 0.999
PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
# `--partial-variants`: the proper subsets of the attributes a partial prompt may keep (all three is the full prompt).
PARTIAL_KEEPS = [keep for r in range(len(ATTRIBUTES)) for keep in itertools.combinations(ATTRIBUTES, r)]
GEOMETRY = dict(width=64, height=64, frames=22)  # 7 latent frames of 4x4, 37 audio latents per channel


# ------------------------------------------------------------------------------------------------------ data
def _render(spec: ClipSpec):
    return render_clip(spec)


def make_data(variants: int, workers: int, every: int = 1):
    """(specs, frames, audio, digest): every `every`-th training clip (1: all of them; the smoke run takes fewer)."""
    specs = [ClipSpec(c, s, d, seed=k, **GEOMETRY) for (c, s, d) in training_combos() for k in range(variants)]
    specs = specs[::every]
    with Pool(workers) as pool:
        clips = pool.map(_render, specs, chunksize=4)
    frames = np.stack([f for f, _ in clips])  # (N, F, H, W, 3) uint8
    audio = np.stack([a for _, a in clips])  # (N, 2, S) float32
    h = hashlib.sha256()
    for spec, (f, a) in zip(specs, clips):
        h.update(json.dumps([spec.colour, spec.shape, spec.direction, spec.seed]).encode())
        h.update(f.tobytes())
        h.update(a.tobytes())
    return specs, frames, audio, h.hexdigest()


def _pixels(frames: np.ndarray, device) -> torch.Tensor:
    """uint8 (N, F, H, W, 3) -> ImageNet-normalised float32 (N, 3, F, H, W) on `device` (the VAE's pixel space)."""
    x = torch.from_numpy(frames).to(device).permute(0, 4, 1, 2, 3).float().div(255.0)
    mean = torch.tensor(PIXEL_MEAN, device=device).view(1, 3, 1, 1, 1)
    std = torch.tensor(PIXEL_STD, device=device).view(1, 3, 1, 1, 1)
    return (x - mean) / std


def _schedule(opt, step: int, steps: int, lr: float, warmup: int = 100) -> None:
    scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step / steps, 1.0))))
    for group in opt.param_groups:
        group["lr"] = lr * scale


def _update(opt, module: torch.nn.Module, loss: torch.Tensor) -> None:
    """One optimiser step: backward, gradient-norm clip at 1, AdamW."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()


def _channel_stats(z: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per-channel (axis 1) mean and std of latents, 4 decimals (std at least 1e-3): the config's latents_mean/std."""
    dims = tuple(d for d in range(z.ndim) if d != 1)
    mean = [round(float(v), 4) for v in z.mean(dim=dims)]
    std = [round(max(float(v), 1e-3), 4) for v in z.std(dim=dims)]
    return mean, std


class Phase:
    """Step loop bookkeeping: the step cap, the wall-time cap, the loss record."""

    def __init__(self, name: str, steps: int, seconds: float | None):
        self.name, self.steps, self.seconds = name, steps, seconds
        self.t0, self.done, self.losses = time.time(), 0, []

    def running(self) -> bool:
        if self.done >= self.steps:
            return False
        return self.seconds is None or time.time() - self.t0 < self.seconds

    def log(self, loss: float, every: int = int(os.environ.get("H3LAB_LOG_EVERY", "100"))) -> None:
        self.losses.append(loss)
        self.done += 1
        if self.done % every == 0 or self.done == 1:
            print(f"[{self.name}] step {self.done}/{self.steps} loss {np.mean(self.losses[-every:]):.5f} "
                  f"({time.time() - self.t0:.1f} s)", flush=True)

    def record(self) -> dict:
        tail = self.losses[-max(1, min(100, len(self.losses))):]
        return {"steps_run": self.done, "steps_asked": self.steps, "seconds": round(time.time() - self.t0, 2),
                "first_loss": self.losses[0] if self.losses else None, "final_loss": float(np.mean(tail))}


# ------------------------------------------------------------------------------------------------- the VAEs
def train_video_vae(frames: np.ndarray, args, device) -> tuple[torch.nn.Module, dict]:
    from diffusers import AutoencoderKLMiniMaxH3

    torch.manual_seed(args.seed)
    vae = AutoencoderKLMiniMaxH3(**VAE).to(device)
    vae.disable_tiling()
    pixels = _pixels(frames, device)
    bg = torch.tensor(BACKGROUND, device=device, dtype=torch.float32)
    raw = torch.from_numpy(frames).to(device).float()
    weight = 1.0 + (FG_WEIGHT - 1.0) * ((raw - bg).norm(dim=-1) > 30).float()  # (N, F, H, W)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed + 1)
    phase = Phase("video VAE", args.vae_steps, args.vae_seconds)
    while phase.running():
        _schedule(opt, phase.done, args.vae_steps, args.vae_lr)
        idx = torch.randint(0, pixels.shape[0], (args.vae_batch,), generator=g).to(device)
        x = pixels[idx]
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=g).to(device)
        y = vae.decode(z).sample
        w = weight[idx][:, None]
        rec = ((y - x) ** 2 * w).sum() / w.expand_as(y).sum()
        kl = 0.5 * (post.mean ** 2 + post.var - 1.0 - post.logvar).mean()
        loss = rec + KL_WEIGHT * kl
        _update(opt, vae, loss)
        phase.log(float(rec))
    vae.eval()
    with torch.no_grad():
        z = torch.cat([vae.encode(pixels[i:i + 16]).latent_dist.mean for i in range(0, pixels.shape[0], 16)])
    mean, std = _channel_stats(z)
    vae.register_to_config(latents_mean=mean, latents_std=std)
    return vae, {**phase.record(), "latents_mean": mean, "latents_std": std}


def _stft_loss(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Multi-resolution STFT magnitudes over `STFT_SIZES`: spectral convergence (||Y - X|| / ||X||, it sees the
    peak: the pitch) + log-magnitude L1 with a floor of `LOG_FLOOR` x n_fft (bins 40 dB below a tone's peak count
    as silence; a tiny floor made the empty bins of a pure tone dominate and the decoder settled on one hum)."""
    loss = 0.0
    for n_fft in STFT_SIZES:
        window = torch.hann_window(n_fft, device=x.device)
        Y = torch.stft(y, n_fft, n_fft // 4, window=window, return_complex=True).abs()
        X = torch.stft(x, n_fft, n_fft // 4, window=window, return_complex=True).abs()
        floor = LOG_FLOOR * n_fft
        loss = loss + (Y - X).norm() / X.norm().clamp_min(1e-6) + (torch.log(Y + floor) - torch.log(X + floor)).abs().mean()
    return loss / len(STFT_SIZES)


def _envelope(w: torch.Tensor, hop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(AC RMS, mean) per `hop`-sample window of each item: the loudness with the window's offset taken out (a DC
    level must not pass for a tone), and the offset itself."""
    n = w.shape[-1] // hop * hop
    frames = w[..., :n].reshape(*w.shape[:-1], -1, hop)
    mean = frames.mean(-1, keepdim=True)
    return (frames - mean).pow(2).mean(-1).add(1e-10).sqrt(), mean[..., 0]


def _energy_loss(y: torch.Tensor, x: torch.Tensor, hop: int = 800) -> tuple[torch.Tensor, torch.Tensor]:
    """(loudness, offset): L1 of log AC-RMS envelopes per latent of each channel (batch item), so the quiet side
    of a panned tone counts as much as the loud one (the pan is their ratio), and the decoded windows' mean
    (the clips have none)."""
    ey, my = _envelope(y, hop)
    ex, _ = _envelope(x, hop)
    return (torch.log(ey + 1e-3) - torch.log(ex + 1e-3)).abs().mean(), my.abs().mean()


def audio_loss(y: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(loss, parts) of decoded `y` against `x`, both (B, 1, S): STFT magnitudes + `ENERGY_WEIGHT` x loudness +
    `DC_WEIGHT` x offset + waveform L1."""
    energy, offset = _energy_loss(y[:, 0], x[:, 0])
    parts = {"stft": _stft_loss(y[:, 0], x[:, 0]), "energy": energy, "dc": offset, "l1": (y - x).abs().mean()}
    return parts["stft"] + ENERGY_WEIGHT * parts["energy"] + DC_WEIGHT * parts["dc"] + parts["l1"], parts


def latent_terms(z: torch.Tensor, trunk: torch.Tensor) -> dict:
    """The audio VAE's regularisers. scale: each clip's time-mean latent (B, C), standardised ACROSS the clips of
    the batch ((std - 1)^2 + mean^2 per channel): the latents must differ between clips (a per-clip or per-window
    term was met by window-edge effects while every clip encoded the same). trunk: (log RMS of the encoder trunk)^2:
    the trunk feeds a LayerNorm, so nothing else bounds it (the second run's grew to ~1e7, where Snake is linear and
    the LayerNorm removes the loudness, i.e. the pan)."""
    zc = z.mean(dim=2)
    scale = ((zc.std(dim=0) - 1.0) ** 2 + zc.mean(dim=0) ** 2).mean()
    return {"scale": scale, "trunk": torch.log(trunk.pow(2).mean().add(1e-12).sqrt()) ** 2}


def audio_check(avae: torch.nn.Module, audio: np.ndarray, specs, device, count: int = 12) -> dict:
    """Round-trip `count` training clips (spread over the list) through the trained audio VAE and read the decoded
    tone and pan back with `h3lab.shapes.measure` (the eval's measurement): the fraction that say their shape's tone
    and their direction's pan."""
    from h3lab.shapes import matches, measure
    from h3lab.shapes.clips import SAMPLE_RATE

    picks = np.linspace(0, len(specs) - 1, min(count, len(specs))).round().astype(int)
    tone = pan = 0
    with torch.no_grad():
        for i in picks:
            x = torch.from_numpy(audio[i]).to(device)[:, None]
            y = avae.decode(avae.encode(x).latent_dist.mode()).sample[:, 0].cpu().numpy()
            frames = np.zeros((3, 16, 16, 3), np.uint8)
            ok = matches(measure(frames, y, SAMPLE_RATE), specs[i].colour, specs[i].shape, specs[i].direction)
            tone, pan = tone + ok["tone"], pan + ok["pan"]
    return {"clips": len(picks), "tone_fraction": round(tone / len(picks), 4), "pan_fraction": round(pan / len(picks), 4)}


def train_audio_vae(audio: np.ndarray, specs, args, device) -> tuple[torch.nn.Module, dict]:
    from diffusers import AutoencoderKLMiniMaxH3Audio

    torch.manual_seed(args.seed + 2)
    avae = AutoencoderKLMiniMaxH3Audio(**AUDIO_VAE).to(device)
    wave = torch.from_numpy(audio).to(device).reshape(-1, 1, audio.shape[-1])  # (2N, 1, S): channels as items
    trunk: dict[str, torch.Tensor] = {}  # the encoder trunk's output of the current step (latent_terms)
    hook = avae.encoder.register_forward_hook(lambda _m, _i, out: trunk.__setitem__("h", out))
    opt = torch.optim.AdamW(avae.parameters(), lr=args.audio_lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed + 3)
    phase = Phase("audio VAE", args.audio_steps, args.audio_seconds)
    parts_log: dict[str, list] = {"stft": [], "energy": [], "dc": [], "l1": [], "scale": [], "trunk": []}
    while phase.running():
        _schedule(opt, phase.done, args.audio_steps, args.audio_lr)
        idx = torch.randint(0, wave.shape[0], (args.audio_batch,), generator=g).to(device)
        x = wave[idx]
        if args.audio_crop < x.shape[-1]:  # one hop-aligned window of `--audio-crop` samples per step
            start = int(torch.randint(0, (x.shape[-1] - args.audio_crop) // 800 + 1, (1,), generator=g)) * 800
            x = x[..., start:start + args.audio_crop]
        z = avae.encode(x).latent_dist.mode()
        y = avae.decode(z).sample
        loss, parts = audio_loss(y, x)
        parts.update(latent_terms(z, trunk["h"]))
        loss = loss + SCALE_WEIGHT * parts["scale"] + TRUNK_WEIGHT * parts["trunk"]
        _update(opt, avae, loss)
        for k, v in parts.items():
            parts_log[k].append(float(v.detach()))
        phase.log(float(loss))
    hook.remove()
    avae.eval()
    with torch.no_grad():
        z = torch.cat([avae.encode(wave[i:i + 32]).latent_dist.mode() for i in range(0, wave.shape[0], 32)])
    mean, std = _channel_stats(z)
    avae.register_to_config(latents_mean=mean, latents_std=std)
    check = audio_check(avae, audio, specs, device)
    print(f"[audio VAE] latents std {std}; round trip: {check}", flush=True)
    final_parts = {k: round(float(np.mean(v[-100:])), 5) for k, v in parts_log.items() if v}
    return avae, {**phase.record(), "final_parts": final_parts, "latents_mean": mean, "latents_std": std,
                  "round_trip": check}


def load_vaes(snapshot: Path, device) -> tuple[torch.nn.Module, torch.nn.Module, dict, dict]:
    """`--vaes-from`: the video and audio VAEs of an earlier sealed h3-shapes snapshot, in place of phase 3. Their
    records are the source seal's, with the source's data digest, git revision and the files' SHA-256 added (the
    data digest must equal this run's: checked in `main`)."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    seal = json.loads((snapshot / SEAL).read_text())  # `main` refused a snapshot without a seal
    hashes = file_hashes(snapshot)
    records = []
    for sub, cls, phase in (("vae", AutoencoderKLMiniMaxH3, "video_vae"), ("audio_vae", AutoencoderKLMiniMaxH3Audio,
                                                                           "audio_vae")):
        weights = f"{sub}/diffusion_pytorch_model.safetensors"
        if hashes.get(weights) != seal["weights"].get(weights):
            raise SystemExit(f"--vaes-from {snapshot}: {weights} does not match its seal")
        records.append({**seal["phases"][phase], "from": {"snapshot": snapshot.name, "git_rev": seal["git_rev"],
                                                          "data_digest": seal["data_digest"],
                                                          "sha256": hashes[weights]}})
    vae = AutoencoderKLMiniMaxH3.from_pretrained(snapshot / "vae", use_safetensors=True).to(device).eval()
    vae.disable_tiling()
    avae = AutoencoderKLMiniMaxH3Audio.from_pretrained(snapshot / "audio_vae", use_safetensors=True).to(device).eval()
    return vae, avae, records[0], records[1]


# ------------------------------------------------------------------------------------------ the transformer
def build_requests(snapshot: Path, specs, frames, audio, args, device):
    """Layout groups {key: dict(layout, text, video, audio)} of clean latent rows, as the session would feed them."""
    from h3lab.run import layout as L
    from h3lab.components.audio_vae import AudioVAE
    from h3lab.components.references import ImageRef, Keyframe
    from h3lab.components.text_encoder import TextEncoder
    from h3lab.shapes.clips import reference_image
    from h3lab.components.video_vae import VideoVAE, patchify

    text_encoder = TextEncoder.from_pretrained(snapshot, device="cpu")
    vvae = VideoVAE.from_pretrained(snapshot, device=device, tiling=False)
    avae = AudioVAE.from_pretrained(snapshot, device=device)
    groups: dict[tuple, dict] = {}
    t2va_text: dict[str, object] = {}
    t_lat, h_lat, w_lat = 7, GEOMETRY["height"] // 16, GEOMETRY["width"] // 16
    a_lat = audio.shape[-1] // 800
    with torch.no_grad():
        for i, spec in enumerate(specs):
            x = _pixels(frames[i:i + 1], device)
            z = vvae.vae.encode(x).latent_dist.mode().float().cpu()
            z = ((z - vvae.latents_mean) / vvae.latents_std)[0]  # (C, T, h, w), the wrappers' normalisation
            target = patchify(z)
            rows_a = avae.encode(torch.from_numpy(audio[i]))
            tasks = ["t2va"] + (["fl2va"] if spec.seed < args.fl2va_variants else []) + (
                ["ref2va"] if spec.seed < args.ref2va_variants else []) + (
                ["partial"] if spec.seed < args.partial_variants else [])
            for task in tasks:
                anchors, refs, text = (), (), prompt(spec)
                if task == "partial":  # a t2va request whose prompt says a seeded proper subset of the attributes
                    pick = int(np.random.default_rng([args.seed, 7, i]).integers(len(PARTIAL_KEEPS)))
                    task, text = "t2va", partial_prompt(spec, PARTIAL_KEEPS[pick])
                if task == "fl2va":
                    anchors = (Keyframe(frames[i, 0], "first"), Keyframe(frames[i, -1], "last"))
                if task == "ref2va":  # the shape's still, centred, as the reference image (transformer_ref/)
                    refs = (ImageRef(reference_image(spec.colour, spec.shape, GEOMETRY["width"], GEOMETRY["height"]),
                                     source="shapes"),)
                if task == "t2va":  # the text rows of a t2va request depend on the prompt alone
                    if text not in t2va_text:
                        t2va_text[text] = text_encoder.encode(text)
                    enc = t2va_text[text]
                else:  # fl2va / ref2va: the anchors / references are presented to the text encoder too
                    enc = text_encoder.encode(prompt(spec), anchors, refs)
                cond_lat = [vvae.encode_condition(k.image[None]) for k in anchors + refs]
                cond = [patchify(c) for c in cond_lat]
                lay = L.build_layout(task, enc.tags.cpu(), t_lat, h_lat, w_lat, a_lat,
                                     anchors=tuple(k.anchor for k in anchors),
                                     references=tuple(L.Reference.image(c.shape[2], c.shape[3]) for c in cond_lat[len(anchors):]),
                                     patch_size=TRANSFORMER.patch_size)
                key = (task, tuple(enc.tags.tolist()))
                grp = groups.setdefault(key, {"layout": lay, "text": [], "video": [], "audio": []})
                grp["text"].append(enc.embeds.detach().float().cpu()[0])
                grp["video"].append(torch.cat(cond + [target]))
                grp["audio"].append(rows_a)
    return {k: {"layout": g["layout"], **{m: torch.stack(g[m]).to(device) for m in ("text", "video", "audio")}}
            for k, g in groups.items()}


def text_check(snapshot: Path) -> dict:
    """Do the text features of two prompts that differ in one word differ? For each attribute (colour, shape,
    direction), over the training prompts that differ only in it, the smallest mean relative difference of the
    text encoder's rows aligned from the prompt's end (the rows after the differing word; the encoder is causal)."""
    from h3lab.components.text_encoder import TextEncoder

    text_encoder = TextEncoder.from_pretrained(snapshot, device="cpu")
    combos = training_combos()
    feats = {c: text_encoder.encode(prompt(ClipSpec(*c))).embeds.detach().float()[0] for c in combos}
    out = {}
    for axis, name in enumerate(("colour", "shape", "direction")):
        diffs = []
        for a in combos:
            for b in combos:
                if a < b and sum(x != y for x, y in zip(a, b)) == 1 and a[axis] != b[axis]:
                    n = min(len(feats[a]), len(feats[b]), 8)
                    fa, fb = feats[a][-n:], feats[b][-n:]
                    diffs.append(float(((fa - fb).norm(dim=-1) / fb.norm(dim=-1)).mean()))
        out[name] = {"pairs": len(diffs), "min_relative_difference": round(min(diffs), 4),
                     "mean_relative_difference": round(float(np.mean(diffs)), 4)}
    return out


def train_transformer(groups, args, device, *, name="transformer", tasks=("t2va", "fl2va"), steps=None,
                      seconds=None, lr=None, init=None, seed_offset=4) -> tuple[torch.nn.Module, dict]:
    """Flow-matching training on the layout groups of `tasks`: from a seeded init, or from `init` (a state dict:
    transformer_ref/ starts from the trained transformer/ and is tuned on ref2va)."""
    from h3lab import H3Transformer
    from h3lab.execution import runtime
    from h3lab.run.sampler import draw_noise, noise_mix
    from h3lab.training.objective import CONDITION_T, Objective, shifted_sigma

    steps = args.dit_steps if steps is None else steps
    lr = args.dit_lr if lr is None else lr
    objective = Objective()
    torch.manual_seed(args.seed + seed_offset)
    model = H3Transformer(TRANSFORMER).to(device).float().train()
    if init is not None:
        model.load_state_dict(init)
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    ema_list, param_list = list(ema.values()), [p.detach() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    keys = sorted(k for k in groups if k[0] in tasks)
    sizes = torch.tensor([groups[k]["video"].shape[0] for k in keys], dtype=torch.float64)
    inputs = {k: groups[k]["layout"].model_inputs(device) for k in keys}
    g = torch.Generator().manual_seed(args.seed + seed_offset + 1)
    phase = Phase(name, steps, seconds)
    with runtime.use_mode("off"):
        while phase.running():
            _schedule(opt, phase.done, steps, lr, warmup=200 if init is None else 50)
            key = keys[int(torch.multinomial(sizes, 1, generator=g))]
            grp, lay = groups[key], groups[key]["layout"]
            idx = torch.randint(0, grp["video"].shape[0], (args.batch,), generator=g).to(device)
            x0v, x0a, text = grp["video"][idx], grp["audio"][idx], grp["text"][idx]
            # The objective's draws (objective.ClipRequest.sample), one sigma pair shared by the batch.
            u = torch.rand(2, generator=g, dtype=torch.float32)
            t_v = 1.0 - shifted_sigma(u[0], objective.video_shift)
            t_a = 1.0 - shifted_sigma(u[1], objective.audio_shift)
            nv, na = draw_noise(x0v.shape, g, device), draw_noise(x0a.shape, g, device)
            ncv, nca = lay.num_condition_video_rows, lay.num_condition_audio_rows
            video = torch.cat([noise_mix(x0v[:, :ncv], nv[:, :ncv], CONDITION_T),
                               noise_mix(x0v[:, ncv:], nv[:, ncv:], t_v.to(device))], dim=1)
            aud = torch.cat([x0a[:, :nca], noise_mix(x0a[:, nca:], na[:, nca:], t_a.to(device))], dim=1)
            timestep, timestep_indices = lay.row_timesteps(float(t_v), float(t_a))
            v_video, v_audio = model(hidden_states=video, audio_hidden_states=aud, encoder_hidden_states=text,
                                     timestep=timestep.to(device), timestep_indices=timestep_indices.to(device),
                                     **inputs[key])
            loss_v = ((v_video[:, ncv:] - (x0v[:, ncv:] - nv[:, ncv:])) ** 2).mean()
            loss_a = ((v_audio[:, nca:] - (x0a[:, nca:] - na[:, nca:])) ** 2).mean()
            loss = objective.video_weight * loss_v + objective.audio_weight * loss_a
            _update(opt, model, loss)
            decay = min(EMA_DECAY, (1 + phase.done) / (10 + phase.done))
            with torch.no_grad():  # one fused update of every EMA tensor (the per-tensor loop was launch-bound)
                torch._foreach_lerp_(ema_list, param_list, 1 - decay)
            phase.log(float(loss))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(ema[n])
    return model.eval(), {**phase.record(), "ema_decay": EMA_DECAY, "layout_groups": len(keys), "tasks": list(tasks),
                          "lr": lr, "init": "transformer" if init is not None else "seeded"}


# ------------------------------------------------------------------------------------------------ the snapshot
def _save_transformer(folder: Path, state: dict, config: H3Config) -> None:
    from diffusers import MiniMaxH3Transformer3DModel

    from h3lab.checkpoint.loader import released_dtype

    model = MiniMaxH3Transformer3DModel(**config.to_diffusers())
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.endswith("inv_freq")]:
        raise RuntimeError(f"transformer state does not match Diffusers: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = p.data.to(released_dtype(name))
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=1_000_000)


def file_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}


def _git_rev() -> str:
    rev = os.environ.get("H3LAB_GIT_REV")
    if rev:
        return rev
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def assemble(out: Path, base: Path, vae, avae, dit, dit_ref, seal: dict) -> Path:
    snap = out / SNAPSHOT_NAME
    shutil.copytree(base, snap)
    for sub in ("transformer", "transformer_ref", "vae", "audio_vae"):
        shutil.rmtree(snap / sub)
    (snap / MANIFEST).unlink()
    _save_transformer(snap / "transformer", {k: v.detach().cpu() for k, v in dit.state_dict().items()}, TRANSFORMER)
    _save_transformer(snap / "transformer_ref", {k: v.detach().cpu() for k, v in dit_ref.state_dict().items()},
                      TRANSFORMER)
    vae.to("cpu").save_pretrained(snap / "vae", safe_serialization=True)
    avae.to("cpu").save_pretrained(snap / "audio_vae", safe_serialization=True)
    for sub in ("vae", "audio_vae"):  # a --vaes-from load records its source folder there; the release has none
        config = json.loads((snap / sub / "config.json").read_text())
        if config.pop("_name_or_path", None) is not None:
            (snap / sub / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    seal["weights"] = {k: v for k, v in file_hashes(snap).items() if k.endswith(".safetensors")}
    (snap / SEAL).write_text(json.dumps(seal, indent=2, sort_keys=True) + "\n")
    native = {"width": GEOMETRY["width"], "height": GEOMETRY["height"], "frames": GEOMETRY["frames"],
              "prompt_form": PROMPT_FORM, "example": PROMPT_EXAMPLE}  # what the front ends start from
    (snap / NATIVE).write_text(json.dumps(native, indent=2, sort_keys=True) + "\n")
    manifest = {"version": TRAINED_VERSION, "files": file_hashes(snap)}
    (snap / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    with tarfile.open(out / f"{SNAPSHOT_NAME}.tar", "w") as tar:
        tar.add(snap, arcname=SNAPSHOT_NAME)
    return snap


def verify(snapshot: Path, workers: int) -> int:
    """Re-render the data and check the seal's data digest and the manifest's file hashes; 0 when both hold."""
    seal = json.loads((snapshot / SEAL).read_text())
    manifest = json.loads((snapshot / MANIFEST).read_text())
    _, _, _, digest = make_data(seal["variants"], workers)
    ok_data = digest == seal["data_digest"]
    ok_files = manifest["files"] == file_hashes(snapshot)
    ok_weights = all(file_hashes(snapshot)[k] == v for k, v in seal["weights"].items())
    print(f"data digest {'matches' if ok_data else 'DIFFERS'}; files {'match' if ok_files else 'DIFFER'} the "
          f"manifest; weights {'match' if ok_weights else 'DIFFER'} the seal")
    return 0 if ok_data and ok_files and ok_weights else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="output folder (must not exist)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", type=int, default=6, help="seeded clips per training triple")
    p.add_argument("--fl2va-variants", type=int, default=2, help="of them, how many also train as fl2va")
    p.add_argument("--vae-steps", type=int, default=2500)
    p.add_argument("--vae-batch", type=int, default=4)
    p.add_argument("--vae-lr", type=float, default=2e-3)
    p.add_argument("--audio-steps", type=int, default=2000)
    p.add_argument("--audio-batch", type=int, default=32)
    p.add_argument("--audio-lr", type=float, default=1e-3)
    p.add_argument("--audio-crop", type=int, default=8000, help="audio VAE training window, samples (hop multiple)")
    p.add_argument("--dit-steps", type=int, default=6000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dit-lr", type=float, default=1e-3)
    p.add_argument("--ref2va-variants", type=int, default=2, help="of the variants, how many also train as ref2va")
    p.add_argument("--partial-variants", type=int, default=0,
                   help="of the variants, how many also train as t2va with a partial prompt (a seeded proper subset "
                        "of colour, shape, direction said; the rest generic)")
    p.add_argument("--ref-steps", type=int, default=1500, help="transformer_ref/ tuning steps (ref2va)")
    p.add_argument("--ref-lr", type=float, default=3e-4)
    for name in ("vae", "audio", "dit", "ref"):
        p.add_argument(f"--{name}-seconds", type=float, default=None, help=f"wall-time cap of the {name} phase")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--vaes-from", metavar="SNAPSHOT",
                   help="take the video and audio VAEs from this sealed h3-shapes snapshot instead of training them")
    p.add_argument("--text-words", action="store_true",
                   help="give the tokenizer the shapes vocabulary as whole-word tokens (h3lab.shapes.words)")
    p.add_argument("--text-branch-scale", type=float, default=1.0,
                   help="multiply the text encoder's residual branches by this (0, 1]; 1 keeps the random encoder")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 variant, a few steps per phase")
    p.add_argument("--verify", metavar="SNAPSHOT", help="check a trained snapshot's seal against fresh data")
    args = p.parse_args(argv)
    if args.verify:
        return verify(Path(args.verify), args.workers)
    if not args.out:
        p.error("--out is required (or --verify)")
    if args.quick:
        args.variants, args.fl2va_variants = 1, 1
        args.vae_steps, args.audio_steps, args.dit_steps, args.batch, args.vae_batch, args.audio_batch = 2, 2, 3, 2, 1, 2
        args.ref_steps = 2
    out = Path(args.out)
    if out.exists():
        p.error(f"--out {out}: exists; give a fresh folder")
    if not 0 < args.text_branch_scale <= 1:
        p.error(f"--text-branch-scale {args.text_branch_scale}: must be in (0, 1]")
    if args.vaes_from and not (Path(args.vaes_from) / SEAL).is_file():
        p.error(f"--vaes-from {args.vaes_from}: no {SEAL}; give a sealed h3-shapes snapshot")
    device = torch.device(args.device)
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    from h3lab.checkpoint.tiny import make_tiny_snapshot

    specs, frames, audio, digest = make_data(args.variants, args.workers, 8 if args.quick else 1)
    if args.vaes_from and not args.quick:
        source = json.loads((Path(args.vaes_from) / SEAL).read_text()).get("data_digest")
        if source != digest:
            p.error(f"--vaes-from {args.vaes_from}: its VAEs were trained on other data ({str(source)[:16]}, this run "
                    f"{digest[:16]})")
    out.mkdir(parents=True)  # after every refusal: a refused run leaves no folder behind
    print(f"data: {len(specs)} clips {frames.shape} {audio.shape} digest {digest[:16]} ({time.time() - t0:.1f} s)",
          flush=True)
    base = make_tiny_snapshot(out / "base", seed=0)
    text_encoder_rec = None
    if args.text_words or args.text_branch_scale != 1.0:
        from h3lab.shapes.words import tune_text_encoder

        text_encoder_rec = tune_text_encoder(base, words=args.text_words, branch_scale=args.text_branch_scale,
                                             seed=args.seed)
        print(f"text encoder: {len(text_encoder_rec['words'])} word tokens, branches x{args.text_branch_scale}",
              flush=True)
    if args.vaes_from:
        vae, avae, vae_rec, audio_rec = load_vaes(Path(args.vaes_from), device)
    else:
        vae, vae_rec = train_video_vae(frames, args, device)
        avae, audio_rec = train_audio_vae(audio, specs, args, device)
    stage = out / "stage"  # the base with the trained VAEs: the encoders the transformer's data go through
    shutil.copytree(base, stage)
    for sub, model in (("vae", vae), ("audio_vae", avae)):
        shutil.rmtree(stage / sub)
        model.save_pretrained(stage / sub, safe_serialization=True)
    text_rec = text_check(stage)
    print(f"text check: {text_rec}", flush=True)
    groups = build_requests(stage, specs, frames, audio, args, device)
    print(f"requests: {sum(g['video'].shape[0] for g in groups.values())} in {len(groups)} layouts "
          f"({time.time() - t0:.1f} s)", flush=True)
    dit, dit_rec = train_transformer(groups, args, device, seconds=args.dit_seconds)
    dit_ref, ref_rec = train_transformer(groups, args, device, name="transformer_ref", tasks=("ref2va",),
                                         steps=args.ref_steps, seconds=args.ref_seconds, lr=args.ref_lr,
                                         init={k: v.detach().clone() for k, v in dit.state_dict().items()},
                                         seed_offset=6)
    seal = {
        "name": SNAPSHOT_NAME, "version": TRAINED_VERSION, "seed": args.seed, "variants": args.variants,
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "git_rev": _git_rev(), "data_digest": digest, "clips": len(specs),
        "geometry": GEOMETRY, "phases": {"video_vae": vae_rec, "audio_vae": audio_rec, "transformer": dit_rec,
                   "transformer_ref": ref_rec},
        "text_check": text_rec, "text_encoder": text_encoder_rec,
        "configs": {"transformer": TRANSFORMER.to_diffusers(), "vae": {k: list(v) if isinstance(v, tuple) else v
                                                                       for k, v in VAE.items()},
                    "audio_vae": {k: list(v) if isinstance(v, tuple) else v for k, v in AUDIO_VAE.items()}},
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "verify", "workers")},
        "seconds": round(time.time() - t0, 1),
    }
    snap = assemble(out, base, vae, avae, dit, dit_ref, seal)
    shutil.rmtree(out / "base")
    shutil.rmtree(stage)
    print(f"wrote {snap} ({sum(f.stat().st_size for f in snap.rglob('*') if f.is_file()) / 1e6:.2f} MB) in "
          f"{time.time() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
