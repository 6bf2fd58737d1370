"""`TextEncoder`: the Qwen3-VL conditioner of MiniMax-H3, presenting a request exactly as the released pipeline does.

Contract
- Loads `text_encoder/` (`Qwen3VLForConditionalGeneration`, safetensors only, offline), `tokenizer/` and `processor/`
  from a snapshot. The tokenizer tokenises (as the pipeline's `tokenizer` component does); the processor supplies the
  vision preprocessing and the Qwen-internal `mm_token_type_ids` (0 text, 1 image, 2 video).
- `encode(prompt, anchors=(), references=()) -> PromptEncoding(embeds (1, L, text_dim), tags (L,), token_ids)`:
  one call of `text_encoder.model(input_ids, attention_mask=ones, mm_token_type_ids, use_cache=False,
  output_hidden_states=True, <vision tensors>)`, returning `hidden_states[50]` — the output of decoder layer 50,
  **before** the final norm (the encoder must have more than 50 layers) — in the encoder's dtype. No chat template,
  `add_special_tokens=False`. `tags` are MiniMax-H3's row tags: 1 for text rows, 0 (video) for every row of a vision
  block (`<|vision_start|>`, pads, `<|vision_end|>`).
- Presentation (token order = row order):
  - t2va: the prompt.
  - fl2va (`anchors`: `Keyframe`s already on the canvas, in packed order first, last): per keyframe i (1-based)
    `"<Picture i>: "` + `<|vision_start|>` + N x `<|image_pad|>` + `<|vision_end|>`, then the prompt;
    N = prod(image_grid_thw) / merge_size^2.
  - ref2va (`references`: normalised `ImageRef`/`VideoRef`/`AudioRef` in request order), labels numbered per modality:
    an audio-bearing reference first emits `"<Audio j>: "` (audio never reaches Qwen); an image emits
    `"<Picture i>: "` + an image vision block; a video emits `"<Video k>: "` then, per merged pair of frames sampled at
    2 fps, `"<t.t seconds>"` (`.1f`, Python's round-half-even) + a `<|video_pad|>` vision block; then the prompt.
  This is Diffusers' `MiniMaxH3{,FL2VA,Ref2VA}TextEncoderStep` bit for bit (tests/components/test_text_encoder.py).
- Video references without torchvision: transformers' `Qwen3VLVideoProcessor` (and so `Qwen3VLProcessor`) cannot be
  built without torchvision. `load_processor` then assembles the processor from the PIL-backend image processor
  (`Qwen2VLImageProcessorPil`) and `PilVideoProcessor` below, which applies the video processor's own geometry
  (`smart_resize` with the temporal factor and the video `size` budget), rescale/normalise with the video config's
  mean/std, and the (t, h, w) merge-ordered patch layout — through the image processor's PIL resize (bicubic on
  uint8) instead of torchvision's antialiased tensor resize. Token counts, grids, labels and patch layout are those
  of transformers; the pixel values of a *resized* video frame differ slightly from a torchvision install (frames
  already at the resolved size are unaffected up to float rounding of the fused rescale). With torchvision present,
  `backend="auto"` loads transformers' own processor and none of this is used. What does not run on the CPU image:
  transformers' `Qwen3VLVideoProcessor` itself, and the torchvision image processor backend. Measured on the GPU
  image (torchvision 0.26, transformers 5.24, tiny snapshot): the Diffusers Ref2VA step with transformers' own
  processor equals `encode(..., backend="auto")` bit for bit, video references included; `backend="pil"` gives the
  same token ids for 64x64, 100x140 and 1280x720 videos, video pixel values within one uint8 level (max 1/127.5,
  mean 3e-5) where frames are resized and within 6e-8 where they are not.
- `cache_key(prompt, anchors, references, salt="")`: SHA-256 hex over the prompt and every conditioning input's kind,
  role, shape, dtype, rate and raw bytes (length-prefixed, so no two different requests share a byte stream). Use it
  on normalised media: it then also captures canvas size and truncation. `salt` carries e.g. a checkpoint fingerprint.
- Device/dtype: the encoder lives on `device` in the snapshot dtype unless `dtype` is given; outputs stay on `device`.
- Length bound: a presentation longer than the encoder's context, `text_config.max_position_embeddings` (262,144 for
  the released Qwen3-VL-32B conditioner, 4,096 for the tiny snapshot), is refused with a one-line `ValidationError`.
  The released pipeline tokenizes with no `max_length` and no truncation (Diffusers 0.42.1
  `modular_pipelines/minimax_h3/encoders.py`) and hands every token to Qwen3-VL, so the only limit it has is the
  encoder's position range; h3lab enforces that limit as an error rather than truncating, because a truncated
  prompt would condition on text the user did not see and on embeddings the released pipeline never produces.
  `PromptBound.from_pretrained(snapshot)` checks a prompt with the tokenizer alone (no weights load, milliseconds
  for 100,000 characters), so the session refuses a long prompt before any model is loaded; `present` checks the
  whole presentation (labels and vision blocks included) again before the encoder runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..config import TEXT, VIDEO
from ..errors import CheckpointError, ValidationError
from .references import FPS, TEMPORAL_PATCH, TEXT_SAMPLE_FPS, AudioRef, ImageRef, Keyframe, Reference, VideoRef

TEXT_ENCODER_LAYER = 50


# ------------------------------------------------------------------------------------------------ length bound
def token_limit(snapshot: str | Path) -> int:
    """The text encoder's context, `text_config.max_position_embeddings` of `text_encoder/config.json`."""
    path = Path(snapshot) / "text_encoder" / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        limit = data.get("text_config", data)["max_position_embeddings"]
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err.strerror or err})") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{path}: does not state text_config.max_position_embeddings") from None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise CheckpointError(f"{path}: max_position_embeddings={limit!r} must be a positive integer")
    return limit


def check_token_count(count: int, limit: int, prompt: str, extra: int = 0) -> None:
    """One-line `ValidationError` when `count` presented tokens (`extra` of them from labels and vision blocks)
    exceed the encoder's context `limit` (see the module docstring: no truncation)."""
    if count <= limit:
        return
    parts = f"{count:,} tokens" + (f" ({extra:,} of them for the anchors/references)" if extra else "")
    raise ValidationError(
        f"prompt of {len(prompt):,} characters: {parts}, above the text encoder's {limit:,}-token context "
        "(text_encoder/config.json max_position_embeddings); the released pipeline does not truncate, so "
        "shorten the prompt"
    )


class PromptBound:
    """The length rule with the tokenizer alone (no weights): `check(prompt) -> token count`. `count(prompt)` is
    the number of ids the pipeline's tokenizer gives with `add_special_tokens=False`; from `tokenizer/tokenizer.json`
    it is counted by the `tokenizers` library directly (the fast tokenizer's own engine: same ids, without the
    second of importing transformers), else by transformers' `AutoTokenizer`."""

    def __init__(self, count: Callable[[str], int], limit: int):
        self.count, self.limit = count, limit

    @classmethod
    def from_pretrained(cls, snapshot: str | Path) -> "PromptBound":
        root = Path(snapshot)
        folder = root / "tokenizer"
        if not folder.is_dir():
            raise CheckpointError(f"snapshot {str(root)!r} has no tokenizer/ folder")
        limit = token_limit(root)
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            try:
                fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
            except Exception as err:  # noqa: BLE001 - the Rust loader raises a bare Exception on a bad file
                raise CheckpointError(f"{folder / 'tokenizer.json'}: not a tokenizer file ({err})") from None
            return cls(lambda text: len(fast.encode(text, add_special_tokens=False).ids), limit)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        return cls(lambda text: len(tok(text, add_special_tokens=False)["input_ids"]), limit)

    def check(self, prompt: str) -> int:
        count = self.count(prompt)
        check_token_count(count, self.limit, prompt)
        return count


def _split_tokens(snapshot: str | Path, text: str) -> tuple[list[str], list[tuple[int, int]] | None]:
    """The tokens of `text` as the pipeline's tokenizer splits it (`add_special_tokens=False`) from `tokenizer/` alone
    (no weights): each token decoded on its own and stripped, and their character offsets (None where a slow
    tokenizer cannot give them)."""
    folder = Path(snapshot) / "tokenizer"
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as err:  # noqa: BLE001 - the Rust loader raises a bare Exception on a bad file
            raise CheckpointError(f"{folder / 'tokenizer.json'}: not a tokenizer file ({err})") from None
        encoded = fast.encode(text, add_special_tokens=False)
        ids, offsets, decode = encoded.ids, list(encoded.offsets), fast.decode
    else:
        if not folder.is_dir():
            raise CheckpointError(f"snapshot {str(Path(snapshot))!r} has no tokenizer/ folder")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        is_fast = bool(getattr(tok, "is_fast", False))
        encoded = tok(text, add_special_tokens=False, return_offsets_mapping=is_fast)
        ids, decode = encoded["input_ids"], tok.decode
        offsets = [tuple(o) for o in encoded["offset_mapping"]] if is_fast else None
    return [decode([i]).strip() or repr(decode([i])) for i in ids], offsets


def token_strings(snapshot: str | Path, text: str) -> list[str]:
    """The tokens of `text` as the pipeline's tokenizer splits it (`add_special_tokens=False`), each decoded on its own
    and stripped ("blue", ","), from `tokenizer/` alone (no weights): labels for the text rows of a view."""
    return _split_tokens(snapshot, text)[0]


def word_groups(text: str, offsets: Sequence[tuple[int, int]]) -> list[int]:
    """The word each token of `text` belongs to, from the tokens' character `offsets` (start, end): a token opens a
    word when it is the first, when its characters begin with whitespace, or when it or the token before it is
    punctuation only (no letter or digit); otherwise it continues the word before ("Ġ", "y", "ellow" -> one word)."""
    groups: list[int] = []
    word, prev_punct = -1, True
    for start, end in offsets:
        piece = text[start:end]
        core = piece.strip()
        punct = bool(core) and not any(c.isalnum() for c in core)
        if word < 0 or piece[:1].isspace() or punct or prev_punct:
            word += 1
        groups.append(word)
        prev_punct = punct
    return groups


def prompt_words(snapshot: str | Path, text: str) -> tuple[list[str], list[int]]:
    """The words of `text` as the pipeline's tokenizer splits it: one label per token (the whole word its token
    belongs to, stripped) and the word index of each token (`word_groups`); a slow tokenizer that gives no character
    offsets makes each token its own word."""
    tokens, offsets = _split_tokens(snapshot, text)
    if offsets is None:
        return tokens, list(range(len(tokens)))
    groups = word_groups(text, offsets)
    spans: dict[int, tuple[int, int]] = {}
    for g, (start, end) in zip(groups, offsets):
        spans[g] = (spans[g][0], end) if g in spans else (start, end)
    words = {g: text[s:e].strip() or repr(text[s:e]) for g, (s, e) in spans.items()}
    return [words[g] for g in groups], groups


# ------------------------------------------------------------------------------------------------ video frames
def sample_video_frames(num_frames: int, fps: float = FPS, sample_fps: float = TEXT_SAMPLE_FPS,
                        temporal_patch: int = TEMPORAL_PATCH) -> tuple[list[int], list[float]]:
    """Indices of the frames the text encoder reads from a normalised reference video and the timestamp of every
    merged block. Frame k*fps/sample_fps (Python-rounded, deduplicated) is read; sampled frame k is at k/sample_fps
    seconds; the list is padded with its last timestamp to a multiple of `temporal_patch`; a block's timestamp is the
    mean of its first and last frame's."""
    stride = fps / sample_fps
    indices: list[int] = []
    k = 0
    while round(k * stride) < num_frames:
        index = round(k * stride)
        if not indices or index > indices[-1]:
            indices.append(index)
        k += 1
    if len(indices) < temporal_patch:
        need = round((temporal_patch - 1) * stride) + 1
        raise ValidationError(
            f"reference video of {num_frames} frames at {fps:g} fps: the text encoder needs at least {need} frames"
        )
    times = [i / sample_fps for i in range(len(indices))]
    times += [times[-1]] * (-len(times) % temporal_patch)
    blocks = [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]
    return indices, blocks


def video_smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's video geometry rule (transformers `video_processing_qwen3_vl.smart_resize`): (height, width)
    multiples of `factor` with t*h*w inside [min_pixels, max_pixels] and the aspect ratio kept."""
    if num_frames < temporal_factor:
        raise ValidationError(f"video of {num_frames} frames: Qwen3-VL needs at least {temporal_factor}")
    if height < factor or width < factor:
        grow = max(factor / height, factor / width)
        height, width = int(height * grow), int(width * grow)
    if max(height, width) / min(height, width) > 200:
        raise ValidationError(f"video frames {width}x{height}: aspect ratio must be below 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class PilVideoProcessor:
    """Qwen3-VL video preprocessing without torchvision (see the module docstring for what differs).

    Called like transformers' video processor with pre-sampled frames:
    `(videos=[uint8 (T, H, W, 3)], do_sample_frames=False, return_tensors="pt") -> {"pixel_values_videos":
    (sum_v T'*gh*gw, 3*tp*p*p) float32, "video_grid_thw": (V, 3) int64}` with T' = ceil(T / tp)."""

    # transformers' Qwen3VLVideoProcessor class defaults, used for keys a config does not set
    DEFAULTS = {
        "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 1 / 255,
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "cap_pixels_per_frame": None,
        "max_video_tokens": 768,
        "resample": 3,  # PIL bicubic
    }

    def __init__(self, image_processor: Any, **config: Any):
        self.image_processor = image_processor  # the PIL-backend image processor whose primitives are reused
        cfg = {**self.DEFAULTS, **{k: v for k, v in config.items() if k in self.DEFAULTS}}
        for key, value in cfg.items():
            setattr(self, key, value)

    @classmethod
    def from_pretrained(cls, folder: str | Path, image_processor: Any) -> "PilVideoProcessor":
        """Read the video config the way transformers does: nested `processor_config.json["video_processor"]`, then
        `video_preprocessor_config.json`, then `preprocessor_config.json`."""
        folder = Path(folder)
        nested = folder / "processor_config.json"
        if nested.is_file():
            data = json.loads(nested.read_text(encoding="utf-8"))
            if isinstance(data.get("video_processor"), dict):
                return cls(image_processor, **data["video_processor"])
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if (folder / name).is_file():
                return cls(image_processor, **json.loads((folder / name).read_text(encoding="utf-8")))
        raise CheckpointError(f"processor folder {str(folder)!r} has no video or image processor config")

    def _resize(self, frames: np.ndarray) -> np.ndarray:
        """(T, H, W, 3) uint8 -> (T, 3, h, w) uint8 at the video processor's resolved size (PIL bicubic)."""
        from transformers.image_processing_backends import PilBackend
        from transformers.image_utils import SizeDict

        t, h, w, _ = frames.shape
        chw = np.ascontiguousarray(frames.transpose(0, 3, 1, 2))
        if not self.do_resize:
            return chw
        factor = self.patch_size * self.merge_size
        max_pixels = self.size["longest_edge"]
        if self.cap_pixels_per_frame:
            per_frame = max(min(self.max_video_tokens * factor * factor, max_pixels // t),
                            int(self.size["shortest_edge"] * 1.05))
            max_pixels = per_frame * t
        rh, rw = video_smart_resize(t, h, w, self.temporal_patch_size, factor, self.size["shortest_edge"], max_pixels)
        if (rh, rw) == (h, w):
            return chw
        size = SizeDict(height=rh, width=rw)
        return np.stack([PilBackend.resize(self.image_processor, f, size, resample=self.resample) for f in chw])

    def _patchify(self, video: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """(T, C, H, W) float -> (T'*gh*gw, C*tp*p*p), rows ordered (t, h/m, w/m, m, m), columns (c, tp, p, p)."""
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if video.shape[0] % tp:
            video = np.concatenate([video, np.repeat(video[-1:], tp - video.shape[0] % tp, axis=0)])
        t, c, h, w = video.shape
        gt, gh, gw = t // tp, h // p, w // p
        x = video.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, gh/m, gw/m, m, m, c, tp, p, p)
        return x.reshape(gt * gh * gw, c * tp * p * p), (gt, gh, gw)

    def __call__(self, videos: Sequence[np.ndarray], do_sample_frames: bool = False,
                 return_tensors: str = "pt", **_: Any) -> dict[str, torch.Tensor]:
        if do_sample_frames:
            raise ValidationError("PilVideoProcessor takes pre-sampled frames only (do_sample_frames=False)")
        patches, grids = [], []
        for video in videos:
            x = self._resize(np.asarray(video, dtype=np.uint8))
            frames = []
            for frame in x:  # the image processor's own PIL-backend arithmetic, frame by frame
                if self.do_rescale:
                    frame = self.image_processor.rescale(frame, self.rescale_factor)
                if self.do_normalize:
                    frame = self.image_processor.normalize(frame, self.image_mean, self.image_std)
                frames.append(np.asarray(frame, dtype=np.float32))
            flat, grid = self._patchify(np.stack(frames))
            patches.append(flat)
            grids.append(grid)
        return {
            "pixel_values_videos": torch.from_numpy(np.concatenate(patches)),
            "video_grid_thw": torch.tensor(grids, dtype=torch.int64),
        }


# ------------------------------------------------------------------------------------------------ processor
def _torchvision_available() -> bool:
    from transformers.utils import is_torchvision_available

    return bool(is_torchvision_available())


def _pil_processor_class() -> type:
    from transformers import Qwen3VLProcessor

    class PilQwen3VLProcessor(Qwen3VLProcessor):
        """`Qwen3VLProcessor` holding a `PilVideoProcessor` (its class check would look the torchvision class up)."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if isinstance(argument, PilVideoProcessor):
                return PilVideoProcessor
            return super().check_argument_for_proper_class(argument_name, argument)

    return PilQwen3VLProcessor


def load_processor(folder: str | Path, tokenizer: Any = None, backend: str = "auto") -> Any:
    """The Qwen3-VL processor of `folder`. backend "auto": transformers' own when torchvision is installed, else the
    PIL assembly; "pil": always the PIL assembly (identical preprocessing on every machine)."""
    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = Path(folder)
    if backend not in ("auto", "pil"):
        raise ValidationError(f"processor backend {backend!r}: must be 'auto' or 'pil'")
    if not folder.is_dir():
        raise CheckpointError(f"processor folder {str(folder)!r} does not exist")
    if backend == "auto" and _torchvision_available():
        return Qwen3VLProcessor.from_pretrained(str(folder), local_files_only=True)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(folder), local_files_only=True)
    video_processor = PilVideoProcessor.from_pretrained(folder, image_processor)
    return _pil_processor_class()(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)


# ------------------------------------------------------------------------------------------------ encoder
@dataclass(frozen=True, eq=False)
class PromptEncoding:
    embeds: torch.Tensor  # (1, L, text_dim), the encoder's dtype, on its device
    tags: torch.Tensor  # (L,) int64 row tags: 1 text, 0 vision-block rows
    token_ids: tuple[int, ...]  # the presented token ids, length L


class TextEncoder:
    """Qwen3-VL conditioner + tokenizer + processor (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, processor: Any, layer: int = TEXT_ENCODER_LAYER):
        num_layers = int(model.config.text_config.num_hidden_layers)
        if num_layers <= layer:
            raise CheckpointError(
                f"text encoder has {num_layers} decoder layers: MiniMax-H3 reads hidden_states[{layer}] (the output of "
                f"decoder layer {layer} before the final norm), so it needs more than {layer}"
            )
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.processor = processor
        self.layer = layer
        self.max_tokens = int(model.config.text_config.max_position_embeddings)
        self._special = {
            name: tokenizer.convert_tokens_to_ids(name)
            for name in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
        }
        missing = [name for name, i in self._special.items() if i is None or i == tokenizer.unk_token_id]
        if missing:
            raise CheckpointError(f"tokenizer lacks the Qwen3-VL special tokens {missing}")

    @classmethod
    def from_pretrained(cls, snapshot: str | Path, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None, processor_backend: str = "auto",
                        layer: int = TEXT_ENCODER_LAYER) -> "TextEncoder":
        """Load `text_encoder/`, `tokenizer/` and `processor/` of a snapshot (safetensors only, offline)."""
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        root = Path(snapshot)
        for sub in ("text_encoder", "tokenizer", "processor"):
            if not (root / sub).is_dir():
                raise CheckpointError(f"snapshot {str(root)!r} has no {sub}/ folder")
        kwargs: dict[str, Any] = {"use_safetensors": True, "local_files_only": True}
        if dtype is not None:
            kwargs["dtype"] = dtype
        if device is not None:
            # Load straight onto the device: the released 32B encoder never makes a second full copy in host RAM.
            kwargs["device_map"] = {"": str(torch.device(device))}
        model = Qwen3VLForConditionalGeneration.from_pretrained(str(root / "text_encoder"), **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
        processor = load_processor(root / "processor", backend=processor_backend)
        return cls(model, tokenizer, processor, layer)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    # -------------------------------------------------------------------------------------- presentation
    def _text(self, text: str) -> tuple[list[int], list[int]]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, [TEXT] * len(ids)

    def _vision(self, pad: str, count: int) -> tuple[list[int], list[int]]:
        ids = [self._special["<|vision_start|>"]] + [self._special[pad]] * count + [self._special["<|vision_end|>"]]
        return ids, [VIDEO] * len(ids)

    def present(self, prompt: str, anchors: Sequence[Keyframe] = (), references: Sequence[Reference] = ()
                ) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
        """Token ids, row tags and vision tensors of the released presentation (no model call)."""
        from PIL import Image

        if not isinstance(prompt, str):
            raise ValidationError(f"prompt of type {type(prompt).__name__}: must be a single string")
        if anchors and references:
            raise ValidationError(
                "anchors and references together: FL2VA anchors and Ref2VA references cannot be mixed"
            )
        merge = self.processor.image_processor.merge_size ** 2
        ids: list[int] = []
        tags: list[int] = []
        vision: dict[str, torch.Tensor] = {}

        def emit(segment: tuple[list[int], list[int]]) -> None:
            ids.extend(segment[0])
            tags.extend(segment[1])

        # Vision tensors are batched per modality; Qwen fills the n-th pad run of a modality with the n-th item.
        images = [k.image for k in anchors] or [r.image for r in references if isinstance(r, ImageRef)]
        image_tokens: list[int] = []
        if images:
            out = self.processor.image_processor(images=[Image.fromarray(i) for i in images], return_tensors="pt")
            vision["pixel_values"], vision["image_grid_thw"] = out["pixel_values"], out["image_grid_thw"]
            image_tokens = [int(g.prod()) // merge for g in out["image_grid_thw"]]
        videos = [r for r in references if isinstance(r, VideoRef)]
        video_tokens: list[int] = []
        video_times: list[list[float]] = []
        if videos:
            vp = self.processor.video_processor
            sampled = []
            for ref in videos:
                indices, times = sample_video_frames(
                    ref.frames.shape[0], ref.fps, TEXT_SAMPLE_FPS, vp.temporal_patch_size
                )
                sampled.append(np.stack([ref.frames[i] for i in indices]))
                video_times.append(times)
            out = vp(videos=sampled, do_sample_frames=False, return_tensors="pt")
            vision["pixel_values_videos"], vision["video_grid_thw"] = out["pixel_values_videos"], out["video_grid_thw"]
            for times, grid in zip(video_times, out["video_grid_thw"]):
                if int(grid[0]) != len(times):
                    raise ValidationError(f"video processor made {int(grid[0])} blocks for {len(times)} timestamps")
                video_tokens.append(int(grid[1]) * int(grid[2]) // merge)

        if anchors:
            for i in range(len(anchors)):
                emit(self._text(f"<Picture {i + 1}>: "))
                emit(self._vision("<|image_pad|>", image_tokens[i]))
        counts = {"image": 0, "video": 0, "audio": 0}
        for ref in references:
            if ref.has_audio:
                counts["audio"] += 1
                emit(self._text(f"<Audio {counts['audio']}>: "))
            if isinstance(ref, ImageRef):
                counts["image"] += 1
                emit(self._text(f"<Picture {counts['image']}>: "))
                emit(self._vision("<|image_pad|>", image_tokens[counts["image"] - 1]))
            elif isinstance(ref, VideoRef):
                counts["video"] += 1
                emit(self._text(f"<Video {counts['video']}>: "))
                for t in video_times[counts["video"] - 1]:
                    emit(self._text(f"<{t:.1f} seconds>"))  # format() rounds half to even: 0.25 -> "0.2"
                    emit(self._vision("<|video_pad|>", video_tokens[counts["video"] - 1]))
            elif not isinstance(ref, AudioRef):
                raise ValidationError(f"reference of type {type(ref).__name__}: must be ImageRef, VideoRef or AudioRef")
        prompt_segment = self._text(prompt)
        emit(prompt_segment)
        if not ids:
            raise ValidationError("empty prompt and no conditioning: nothing to encode")
        check_token_count(len(ids), self.max_tokens, prompt, extra=len(ids) - len(prompt_segment[0]))
        return ids, tags, vision

    # -------------------------------------------------------------------------------------- encode
    @torch.no_grad()
    def encode(self, prompt: str, anchors: Sequence[Keyframe] = (), references: Sequence[Reference] = ()
               ) -> PromptEncoding:
        """(1, L, text_dim) hidden state after decoder layer `layer` (pre-norm) + row tags; see module docstring."""
        ids, tags, vision = self.present(prompt, anchors, references)
        device = self.device
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        mm_types = torch.tensor(self.processor.create_mm_token_type_ids([ids]), dtype=torch.long, device=device)
        kwargs = {
            name: value.to(device, self.model.dtype) if name.startswith("pixel_") else value.to(device)
            for name, value in vision.items()
        }
        out = self.model.model(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=mm_types,
            use_cache=False,
            output_hidden_states=True,
            **kwargs,
        )
        embeds = out.hidden_states[self.layer].to(device=device, dtype=self.model.dtype)
        return PromptEncoding(embeds, torch.tensor(tags, dtype=torch.long), tuple(ids))


# ------------------------------------------------------------------------------------------------ cache key
def _feed(h: "hashlib._Hash", tag: str, payload: bytes) -> None:
    tag_bytes = tag.encode("utf-8")
    h.update(struct.pack("<Q", len(tag_bytes)) + tag_bytes + struct.pack("<Q", len(payload)))
    h.update(payload)


def _feed_array(h: "hashlib._Hash", tag: str, arr: np.ndarray) -> None:
    arr = np.ascontiguousarray(arr)
    _feed(h, f"{tag}:{arr.dtype.str}:{arr.shape}", arr.tobytes())


def cache_key(prompt: str, anchors: Sequence[Keyframe] = (), references: Sequence[Reference] = (),
              salt: str = "") -> str:
    """SHA-256 hex of the prompt and the conditioning media (see module docstring)."""
    h = hashlib.sha256()
    _feed(h, "h3lab-conditioning-v1", salt.encode("utf-8"))
    _feed(h, "prompt", prompt.encode("utf-8"))
    for k in anchors:
        _feed_array(h, f"anchor:{k.anchor}", k.image)
    for ref in references:
        if isinstance(ref, ImageRef):
            _feed_array(h, "ref:image", ref.image)
        elif isinstance(ref, VideoRef):
            _feed_array(h, f"ref:video:{float(ref.fps)!r}", ref.frames)
        elif isinstance(ref, AudioRef):
            _feed(h, "ref:audio", b"")
        else:
            raise ValidationError(f"reference of type {type(ref).__name__}: must be ImageRef, VideoRef or AudioRef")
        if ref.has_audio:
            _feed_array(h, f"audio:{int(ref.sample_rate)}", ref.audio)
    return h.hexdigest()
