"""Build and load the Qwen3-VL processor of a snapshot on machines without torchvision.

Why this file exists (transformers 5.x, measured with 5.24): `Qwen3VLProcessor(...)` checks its video processor
against `transformers.VideoProcessorMixin`, which is only exported when torchvision is installed; the fallback
lookup then crashes (`VIDEO_PROCESSOR_MAPPING` is a torchvision dummy). And `Qwen3VLProcessor.from_pretrained`
instantiates `Qwen3VLVideoProcessor` through a path that requires torchvision. So without torchvision no
`Qwen3VLProcessor` can be constructed the ordinary way, whatever the files hold.

Contract
- The saved `processor/` folder is exactly what `Qwen3VLProcessor.save_pretrained` writes (`processor_config.json`
  with the `image_processor` and `video_processor` sections, `tokenizer.json`, `tokenizer_config.json`); with
  torchvision present `Qwen3VLProcessor.from_pretrained(path)` loads it as is.
- `load_processor(path)` returns a genuine `Qwen3VLProcessor` offline either way: it tries
  `Qwen3VLProcessor.from_pretrained(path, local_files_only=True)`; if that needs torchvision it loads the tokenizer
  with `AutoTokenizer.from_pretrained(path)`, the image processor with
  `AutoImageProcessor.from_pretrained(path, backend="pil")` (`Qwen2VLImageProcessorPil`: resize with PIL, no
  torchvision), builds `Qwen3VLVideoProcessor(**saved video_processor section)` (config only: *processing* a video
  still needs torchvision), and assembles the processor with the class check relaxed for the video processor
  alone (`assemble`). Text, image and `create_mm_token_type_ids` paths then work; video references do not.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import CheckpointError


def _qwen3vl():
    from transformers import Qwen3VLProcessor
    from transformers.video_processing_utils import VideoProcessorMixin

    class _Relaxed(Qwen3VLProcessor):
        """Construction-only subclass: validates the video processor against the real `VideoProcessorMixin`
        (imported from its module, which needs no torchvision) instead of the torchvision-gated export."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":
                if not isinstance(argument, VideoProcessorMixin):
                    raise TypeError(f"video_processor is a {type(argument).__name__}: must be a video processor")
                return VideoProcessorMixin
            return super().check_argument_for_proper_class(argument_name, argument)

    return Qwen3VLProcessor, _Relaxed


def assemble(image_processor, tokenizer, video_processor):
    """A `Qwen3VLProcessor` from its three parts, without torchvision. The object is re-classed to the plain
    `Qwen3VLProcessor` after `__init__`, so `type(p) is Qwen3VLProcessor` and `save_pretrained` writes
    `"processor_class": "Qwen3VLProcessor"`."""
    qwen3vl, relaxed = _qwen3vl()
    try:
        return qwen3vl(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)
    except (AttributeError, TypeError, ValueError, ImportError):
        proc = relaxed(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)
        proc.__class__ = qwen3vl
        return proc


def load_processor(path: str | os.PathLike):
    """Load a snapshot's `processor/` folder as a `Qwen3VLProcessor`, offline (see the module docstring)."""
    path = Path(path)
    if not (path / "processor_config.json").is_file() and not (path / "preprocessor_config.json").is_file():
        raise CheckpointError(f"{path}: not a processor folder (no processor_config.json or preprocessor_config.json)")
    qwen3vl, _ = _qwen3vl()
    try:
        return qwen3vl.from_pretrained(str(path), local_files_only=True)
    except (ImportError, AttributeError):
        pass  # no torchvision: assemble from the parts below
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    image_processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True, backend="pil")
    video_cfg = _video_section(path)
    video_cfg.pop("video_processor_type", None)
    video_cfg.pop("processor_class", None)
    return assemble(image_processor, tokenizer, Qwen3VLVideoProcessor(**video_cfg))


def _video_section(path: Path) -> dict:
    for name, section in (("processor_config.json", "video_processor"), ("video_preprocessor_config.json", None)):
        file = path / name
        if file.is_file():
            data = json.loads(file.read_text(encoding="utf-8"))
            data = data.get(section, {}) if section else data
            if data:
                return dict(data)
    return {}
