"""The tiny snapshot: a complete MiniMax-H3 snapshot in the released layout, generated from a seed, a few MB.

Contract
- `make_tiny_snapshot(root, seed=0) -> Path` writes, with the **real component classes** and their own
  `save_pretrained`: `model_index.json`; `transformer/` and `transformer_ref/` (`MiniMaxH3Transformer3DModel`,
  `H3Config.tiny()`, the released dtype policy: float32 `proj_in`, `audio_proj_in`, `time_embedder`, `proj_out`,
  `audio_proj_out`, bfloat16 elsewhere; sharded with an index json, like the release); `vae/`
  (`AutoencoderKLMiniMaxH3`, 4 latent channels, float32 as released); `audio_vae/` (`AutoencoderKLMiniMaxH3Audio`,
  8 latent channels = `H3Config.tiny().audio_in_channels`, float32); `text_encoder/`
  (`Qwen3VLForConditionalGeneration`, text hidden 16 = tiny `text_dim`, 51 decoder layers so layer 50 exists,
  1-layer vision tower, bfloat16); `tokenizer/` (a byte-level BPE `Qwen2Tokenizer` with the Qwen special tokens) and
  `processor/` (`Qwen3VLProcessor`: the tokenizer + `Qwen2VLImageProcessor` + `Qwen3VLVideoProcessor` configs; load
  it with `processor.load_processor`, which works without torchvision); `scheduler/` (shift 12) and
  `audio_scheduler/` (shift 3) as `MiniMaxH3Scheduler`; `h3lab_manifest.json` (SHA-256 of every other file and
  the `maker_id()`: this code, the tiny config and the serialising library versions).
- Same seed -> same bytes for every file (in one environment: the files embed the diffusers/transformers versions).
  The build is atomic: it happens in a temp folder beside `root` and is renamed into place.
- Weights are non-trivial: every parameter is redrawn from its own generator, seeded by SHA-256 of
  (version, seed, component, parameter name), so values do not depend on construction order or the global RNG.
  Rule: a parameter the class initialises to a constant (norm weights, LayerScale, snake alpha, register tokens)
  becomes constant + 0.1 N(0,1); a matrix/kernel becomes N(0,1)/sqrt(fan_in); any other vector 0.1 N(0,1);
  weight-norm magnitudes `weight_g` are set to |weight_v| so the effective kernel is `weight_v`; two output layers
  get a fixed gain (`OUTPUT_GAINS`) so the audio waveform is not clamped flat. Buffers (resampling
  filters, masks) are kept as constructed. Forwards of every component are finite and depend on their inputs
  (tests/checkpoint/test_tiny.py checks it, including the VAE decoder's dependence on the latents).
- `make_tiny_snapshot(root, seed=0, preset="interface")`: the same snapshot with the **released interface widths**
  and tiny internals, so a full-size DiT built elsewhere (e.g. on a GPU, `Session.set_transformer`) interlocks with
  its text encoder and VAEs: Qwen3-VL text hidden 5120 (1 attention head of width 8, intermediate 16, 51 layers;
  vision tower merging to 5120), video VAE with 24 latent channels, audio VAE with 32 latent channels (latent_dim
  32), and `transformer/` / `transformer_ref/` = `INTERFACE_CONFIG` (text_dim 5120, in_channels 24 x patch (1,2,2),
  audio 32; the tiny blocks inside). About 20 M parameters, ~40 MB. Its manifest records `"preset": "interface"`.
  The default preset ("tiny") is the snapshot the tests' and replays' digests are recorded on: its bytes are fixed.
- `random_snapshot() -> Path`: `$H3LAB_CACHE` (default `~/.cache/h3lab`) / `tiny-v1-seed0`, built on first use and
  reused while its manifest verifies (a missing, extra or altered file, or another maker_id, triggers a rebuild).
  Builds go to a temp folder
  and are renamed into place, so a crash or a concurrent build never leaves a half-written snapshot. (This was the
  embedded default until the trained one shipped.)
- `default_snapshot() -> Path`: the embedded default, the trained "h3-shapes" snapshot shipped in the package
  (`shipped.shapes_snapshot()`, verified against its manifest); tests that need a seeded model of any shape keep
  using `make_tiny_snapshot` / `random_snapshot`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

from ..config import H3Config
from ..errors import CheckpointError

TINY_VERSION = "tiny-v1"
MANIFEST = "h3lab_manifest.json"
TRANSFORMER_SHARD_BYTES = 40_000  # the tiny transformer (~88 KB) lands in 3 shards + an index, like the release

# facts §8, with the structural numbers of the release (2 resnets/level -> 1 here; ViT decoder with registers).
VAE_CONFIG = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
    spatial_downsample_factors=(2, 2, 2, 2), temporal_downsample_factors=(1, 2, 2, 1), norm_num_groups=4,
    decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
    decoder_num_register_tokens=1,
)
AUDIO_VAE_CONFIG = dict(
    encoder_dim=2, latent_dim=32, latent_channels=8, num_attention_heads=2, decoder_dim=128,
    resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),),
)
TEXT_LAYERS = 51  # the pipeline reads hidden_states[50] and rejects an encoder with <= 50 layers
# The Qwen3-VL text decoder of the default tiny snapshot (text hidden = H3Config.tiny().text_dim).
TEXT_CONFIG = dict(hidden_size=H3Config.tiny().text_dim, intermediate_size=32, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=8)

# The "interface" preset: the widths where components meet are the release's, everything inside stays tiny.
INTERFACE_CONFIG = H3Config(**{**H3Config.tiny().to_diffusers(), "text_dim": 5120, "in_channels": 24,
                               "audio_in_channels": 32})
INTERFACE_VAE_CONFIG = {**VAE_CONFIG, "latent_channels": INTERFACE_CONFIG.in_channels}
INTERFACE_AUDIO_VAE_CONFIG = {
    **AUDIO_VAE_CONFIG, "latent_dim": 32, "latent_channels": INTERFACE_CONFIG.audio_in_channels
}
# 1 head of width 8 and a 16-wide MLP keep 51 layers at 5120 to ~0.4 M parameters each.
INTERFACE_TEXT_CONFIG = dict(hidden_size=INTERFACE_CONFIG.text_dim, intermediate_size=16, num_attention_heads=1,
                             num_key_value_heads=1, head_dim=8)
# preset -> (transformer config, video VAE kwargs, audio VAE kwargs, Qwen3-VL text kwargs)
PRESETS = {
    "tiny": (H3Config.tiny(), VAE_CONFIG, AUDIO_VAE_CONFIG, TEXT_CONFIG),
    "interface": (INTERFACE_CONFIG, INTERFACE_VAE_CONFIG, INTERFACE_AUDIO_VAE_CONFIG, INTERFACE_TEXT_CONFIG),
}
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)
# A fixed merge list (no training, so no tie-breaking to depend on); each merge uses tokens that already exist.
_MERGES = (
    ("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"), ("e", "r"), ("o", "n"), ("Ġ", "s"), ("a", "n"),
    ("r", "e"), ("n", "d"), ("Ġa", "nd"), ("Ġ", "o"), ("Ġo", "f"), ("n", "g"), ("i", "ng"), ("Ġ", "c"), ("Ġ", "w"),
    ("o", "u"), ("a", "t"),
)
# Qwen2's pre-tokenizer split pattern.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# -------------------------------------------------------------------------------------------------- weights
def _normal(shape, seed: int, component: str, name: str):
    import torch

    digest = hashlib.sha256(f"h3lab/{TINY_VERSION}/{seed}/{component}/{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32)


# Output-layer gains applied on top of the rule, so outputs land in their natural range instead of saturating:
# the BigVGAN decoder's pre-clamp waveform has std ~2.7 under the plain rule (78 % of samples clamped at +-1),
# ~0.27 with this gain; the video decoder's ImageNet-normalised pixels get std ~0.5 instead of ~1.
OUTPUT_GAINS = {
    "audio_vae": {"decoder.conv_post.weight_v": 0.1},
    "vae": {"decoder.proj_out.weight": 0.5},
}


def randomize_(module, seed: int, component: str):
    """Redraw every parameter of `module` in place (rule in the module docstring); float32 module expected."""
    import torch

    gains = OUTPUT_GAINS.get(component, {})
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            if name.endswith(".weight_g") and name[:-1] + "v" in params:
                continue
            noise = _normal(p.shape, seed, component, name)
            flat = p.detach().reshape(-1)
            if p.numel() == 1 or bool((flat == flat[0]).all()):
                value = flat[0].float() + 0.1 * noise  # constant-initialised: norms, LayerScale, snake, registers
            elif p.ndim >= 2:
                value = noise / math.sqrt(p[0].numel())  # (out, fan_in...) kernels and embeddings
            else:
                value = 0.1 * noise  # randomly initialised vectors (biases)
            p.copy_(value * gains.get(name, 1.0))
        for name, p in params.items():
            if name.endswith(".weight_g") and name[:-1] + "v" in params:
                v = params[name[:-1] + "v"]  # weight = g * v / |v| over all dims but 0  ->  g = |v| gives weight = v
                p.copy_(torch.norm_except_dim(v, 2, 0).view_as(p))
    return module


def _latent_stats(seed: int, name: str, n: int) -> tuple[list[float], list[float]]:
    """Per-channel latents_mean / latents_std, non-trivial and exactly representable in JSON (4 decimals)."""
    z = _normal((2, n), seed, name, "latent_stats")
    mean = [round(float(v), 4) for v in 0.2 * z[0]]
    std = [round(float(v), 4) for v in 0.5 + 0.25 * z[1].abs()]
    return mean, std


# --------------------------------------------------------------------------------------------- components
def _save_transformer(folder: Path, seed: int, component: str, config: H3Config) -> None:
    import torch
    from diffusers import MiniMaxH3Transformer3DModel

    from .loader import released_dtype

    model = randomize_(MiniMaxH3Transformer3DModel(**config.to_diffusers()), seed, component)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data = p.data.to(released_dtype(name))
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=TRANSFORMER_SHARD_BYTES)


def _save_vae(folder: Path, seed: int, config: dict) -> None:
    from diffusers import AutoencoderKLMiniMaxH3

    mean, std = _latent_stats(seed, "vae", config["latent_channels"])
    vae = AutoencoderKLMiniMaxH3(**config, latents_mean=mean, latents_std=std)
    randomize_(vae, seed, "vae").save_pretrained(folder, safe_serialization=True)


def _save_audio_vae(folder: Path, seed: int, config: dict) -> None:
    from diffusers import AutoencoderKLMiniMaxH3Audio

    mean, std = _latent_stats(seed, "audio_vae", config["latent_channels"])
    vae = AutoencoderKLMiniMaxH3Audio(**config, latents_mean=mean, latents_std=std)
    randomize_(vae, seed, "audio_vae").save_pretrained(folder, safe_serialization=True)


def build_tokenizer():
    """A byte-level BPE `Qwen2Tokenizer` (256 bytes + fixed merges + the Qwen special tokens), built in memory."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    # GPT-2 byte -> printable unicode table (the byte-level alphabet), in byte order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    byte_char = {b: chr(b if b in printable else next(extra)) for b in range(256)}
    vocab = {byte_char[b]: b for b in range(256)}
    for a, b in _MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(_MERGES), byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL_TOKENS])
    return Qwen2TokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
        errors="replace", add_prefix_space=False, model_max_length=131072,
    )


def _save_text_encoder(folder: Path, seed: int, tokenizer, text: dict) -> None:
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), **text, num_hidden_layers=TEXT_LAYERS, max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters=dict(
                rope_type="default", rope_theta=5_000_000.0, mrope_section=[2, 1, 1], mrope_interleaved=True
            ),
        ),
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=text["hidden_size"], deepstack_visual_indexes=[0],
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = randomize_(Qwen3VLForConditionalGeneration(config), seed, "text_encoder").to(torch.bfloat16)
    model.save_pretrained(folder)


def _save_processor(folder: Path, tokenizer) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from .processor import assemble

    # Qwen3-VL's released preprocessing numbers: 16 px patches, 2x2 merge, 2-frame temporal patch, mean/std 0.5.
    image = Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": 65536, "longest_edge": 16777216},
    )
    video = Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2, fps=2)
    assemble(image, tokenizer, video).save_pretrained(folder)


def _save_schedulers(root: Path) -> None:
    from diffusers import MiniMaxH3Scheduler

    MiniMaxH3Scheduler(shift=12.0).save_pretrained(root / "scheduler")
    MiniMaxH3Scheduler(shift=3.0).save_pretrained(root / "audio_scheduler")


def _model_index() -> dict:
    import diffusers

    return {
        "_class_name": "MiniMaxH3ModularPipeline",
        "_diffusers_version": diffusers.__version__,
        "audio_scheduler": ["diffusers", "MiniMaxH3Scheduler"],
        "audio_vae": ["diffusers", "AutoencoderKLMiniMaxH3Audio"],
        "processor": ["transformers", "Qwen3VLProcessor"],
        "scheduler": ["diffusers", "MiniMaxH3Scheduler"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2TokenizerFast"],
        "transformer": ["diffusers", "MiniMaxH3Transformer3DModel"],
        "transformer_ref": ["diffusers", "MiniMaxH3Transformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLMiniMaxH3"],
        # The pipeline's ConfigSpecs, scaled to the tiny canvas (released: 768, 768x1344, 2048) so reference media
        # stay a few latent rows on a CPU.
        "canvas_short_edge": 64,
        "canvas_max_pixels": 7168,
        "reference_image_short_edge": 64,
    }


# -------------------------------------------------------------------------------------------------- manifest
def maker_id() -> str:
    """What the bytes of a tiny snapshot depend on: this maker's code, the tiny config and the library versions that
    serialise the files. A cached snapshot made by another maker is rebuilt rather than trusted. Reads package
    metadata only (no diffusers/transformers import)."""
    from importlib import metadata

    h = hashlib.sha256(TINY_VERSION.encode())
    for source in ("tiny.py", "processor.py"):
        h.update((Path(__file__).parent / source).read_bytes())
    h.update(json.dumps(H3Config.tiny().to_diffusers(), sort_keys=True).encode())
    for dist in ("torch", "diffusers", "transformers", "tokenizers", "safetensors"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "absent"
        h.update(f"{dist}={version};".encode())
    return h.hexdigest()


def _file_hashes(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel != MANIFEST:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def verify_snapshot(root: str | os.PathLike) -> bool:
    """True when `root` holds a tiny snapshot made by this maker (`maker_id`) whose files match its manifest
    exactly (no missing, extra or altered file)."""
    root = Path(root)
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
        return (
            manifest.get("version") == TINY_VERSION
            and manifest.get("maker") == maker_id()
            and manifest.get("files") == _file_hashes(root)
        )
    except (OSError, ValueError, AttributeError):
        return False


# ---------------------------------------------------------------------------------------------------- build
def make_tiny_snapshot(root: str | os.PathLike, seed: int = 0, preset: str = "tiny") -> Path:
    """Write the tiny snapshot for `seed` at `root` (which must not exist or be an empty folder); `preset` "tiny"
    (default) or "interface" (released interface widths, see the module docstring)."""
    import torch

    if preset not in PRESETS:
        raise CheckpointError(f"preset={preset!r}: must be one of {', '.join(PRESETS)}")
    transformer, vae, audio_vae, text = PRESETS[preset]
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise CheckpointError(f"seed={seed!r}: must be a non-negative integer")
    root = Path(root).expanduser()
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise CheckpointError(f"{root}: exists and is not an empty folder; the tiny snapshot needs a fresh path")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.build-", dir=root.parent))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # construction-time init is overwritten, but keep the caller's RNG untouched
            _save_transformer(tmp / "transformer", seed, "transformer", transformer)
            _save_transformer(tmp / "transformer_ref", seed, "transformer_ref", transformer)
            _save_vae(tmp / "vae", seed, vae)
            _save_audio_vae(tmp / "audio_vae", seed, audio_vae)
            tokenizer = build_tokenizer()
            tokenizer.save_pretrained(tmp / "tokenizer")
            _save_processor(tmp / "processor", tokenizer)
            _save_text_encoder(tmp / "text_encoder", seed, tokenizer, text)
            _save_schedulers(tmp)
        (tmp / "model_index.json").write_text(json.dumps(_model_index(), indent=2, sort_keys=True) + "\n")
        manifest = {"version": TINY_VERSION, "seed": seed, "maker": maker_id(), "files": _file_hashes(tmp)}
        if preset != "tiny":  # the default manifest keeps its original keys
            manifest["preset"] = preset
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o755)  # mkdtemp made it 0700; the snapshot is an ordinary readable folder
        if root.exists():
            root.rmdir()
        os.rename(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def cache_dir() -> Path:
    return Path(os.environ.get("H3LAB_CACHE") or Path.home() / ".cache" / "h3lab").expanduser()


def default_snapshot() -> Path:
    """The embedded default: the shipped trained snapshot (`shipped.shapes_snapshot`)."""
    from .shipped import shapes_snapshot

    return shapes_snapshot()


def random_snapshot() -> Path:
    """The random tiny snapshot (seed 0) in the user cache, built once and verified on every call."""
    cache = cache_dir()
    final = cache / f"{TINY_VERSION}-seed0"
    if verify_snapshot(final):
        return final
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=cache))
    trash = cache / f".trash-{final.name}-{os.getpid()}-{time.time_ns()}"
    try:
        built = make_tiny_snapshot(work / final.name, seed=0)
        if final.exists() or final.is_symlink():
            try:
                os.rename(final, trash)  # a corrupt or stale build: move it aside, never delete in place
            except FileNotFoundError:
                pass  # another process moved it first
        try:
            os.rename(built, final)
        except OSError:
            if not verify_snapshot(final):  # lost a race to a concurrent build: theirs must verify
                raise CheckpointError(
                    f"{final}: could not install the tiny snapshot (a concurrent build left it invalid)"
                ) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(trash, ignore_errors=True)
    return final
