"""Tiny, seeded component folders for the component tests (facts section 8 configs), used when the shared tiny
snapshot maker (`h3lab.checkpoint.tiny`) is not available. Writes `text_encoder/` (Qwen3-VL, 51 layers, text hidden
16), `tokenizer/` (261-token byte-level Qwen2 tokenizer), `processor/` (tokenizer + image/video processor configs, as
a Qwen3-VL repository holds them), `vae/` (4 latent channels) and `audio_vae/` (8 latent channels), safetensors only.
Zero-initialised parameters (LayerScale, biases) are re-drawn so every weight reaches the output."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

IMAGE_PROCESSOR = {
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 64},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
VIDEO_PROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 64},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "fps": 2,
    "do_sample_frames": True,
}


def _redraw_zeros(module: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and not p.any():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return Qwen2TokenizerFast(
        tokenizer_object=tok,
        unk_token=None,
        bos_token=None,
        eos_token=SPECIALS[0],
        pad_token=SPECIALS[0],
        additional_special_tokens=SPECIALS[1:],
    )


def write_text_parts(root: Path, seed: int = 0) -> None:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    tokenizer.save_pretrained(root / "processor")
    Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR).save_pretrained(root / "processor")
    (root / "processor" / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR, indent=2))
    ids = [tokenizer.convert_tokens_to_ids(s) for s in SPECIALS]
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=51,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 1, 1], "mrope_interleaved": True
            },
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=16,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
        image_token_id=ids[3],
        video_token_id=ids[4],
        vision_start_token_id=ids[1],
        vision_end_token_id=ids[2],
    )
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    _redraw_zeros(model, torch.Generator().manual_seed(seed + 1))
    model.save_pretrained(root / "text_encoder", safe_serialization=True)


def write_vae_parts(root: Path, seed: int = 0) -> None:
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    g = torch.Generator().manual_seed(seed + 2)
    torch.manual_seed(seed + 3)
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        spatial_downsample_factors=(2, 2, 2, 2),
        temporal_downsample_factors=(1, 2, 2, 1),
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=8,
        decoder_num_register_tokens=1,
        latents_mean=(torch.randn(4, generator=g) * 0.3).tolist(),
        latents_std=(torch.rand(4, generator=g) + 0.5).tolist(),
    )
    _redraw_zeros(vae, g)
    vae.save_pretrained(root / "vae", safe_serialization=True)
    audio = AutoencoderKLMiniMaxH3Audio(
        encoder_dim=2,
        latent_dim=32,
        latent_channels=8,
        num_attention_heads=2,
        decoder_dim=128,
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),),
        latents_mean=(torch.randn(8, generator=g) * 0.3).tolist(),
        latents_std=(torch.rand(8, generator=g) + 0.5).tolist(),
    )
    _redraw_zeros(audio, g)
    audio.save_pretrained(root / "audio_vae", safe_serialization=True)


def make_component_snapshot(root: str | Path, seed: int = 0) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    write_text_parts(root, seed)
    write_vae_parts(root, seed)
    return root
