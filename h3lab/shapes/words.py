"""The shapes vocabulary as whole-word tokens, and a text encoder whose features are mostly each word's own.

Why: the tiny snapshot's tokenizer is byte-level (a shapes prompt is ~31 byte tokens) and its 51-layer Qwen3-VL text
encoder is random and causal, so the layer-50 row of every byte after the first word that differs between two prompts
is a fresh hash of the whole prefix. A held-out mix of words ("a green square moves down") then has text rows the
transformer never saw, and a transformer trained on the other mixes reads it as some training mix (measured:
`benchmarks/results/shapes_partial_prompts.json`). The released Qwen3-VL tokenizer has these English words as single
tokens, and a trained encoder keeps a word's identity in its rows; this module gives the tiny snapshot both.

Contract
- `VOCABULARY`: every word a shapes prompt (`prompt`, `partial_prompt`) uses besides "a": the colours, shapes,
  directions, tone names, "moves", "tone" and "shape".
- `add_word_tokens(tokenizer)`: each word becomes one added token (whole-word match that absorbs the space on its
  left), appended after the existing ids, so the Qwen special tokens keep theirs. Returns {word: id}.
- `tune_text_encoder(snapshot, *, words, branch_scale, seed)`: rewrites the snapshot's `tokenizer/`, `processor/`
  (its tokenizer files) and `text_encoder/` in place, atomically per folder. With `words`, the tokenizer gains the
  word tokens and the encoder's input embedding and lm_head one row per new token, drawn by tiny's seeded rule
  (`_normal(...) / sqrt(hidden)`, component "text_encoder_words"). Every decoder layer's residual branches
  (`self_attn.o_proj`, `mlp.down_proj`) are multiplied by `branch_scale` (0 < s <= 1): the layer-50 row of a token is
  its embedding plus a context term about `branch_scale` times as large as the random encoder's, so a held-out mix of
  words is a sequence of rows each close to one seen in training. The classes, config keys (except `vocab_size`),
  layer count and dtype stay the released ones. Returns the record for the training seal (words and their ids,
  branch scale, SHA-256 of the rewritten weights).
- Refused (ValidationError, nothing written): `branch_scale` outside (0, 1]; a snapshot without the three folders; a
  tokenizer that already has a word token.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import tempfile
from pathlib import Path

from ..errors import ValidationError
from .clips import COLOURS, DIRECTIONS, SHAPES, TONES

VOCABULARY = (*COLOURS, *SHAPES, *DIRECTIONS, *(name for name, _ in TONES.values()), "moves", "tone", "shape")
BRANCHES = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def add_word_tokens(tokenizer) -> dict[str, int]:
    """Add `VOCABULARY` to `tokenizer` as whole-word tokens (module docstring); {word: id}."""
    from tokenizers import AddedToken

    have = [w for w in VOCABULARY if w in tokenizer.get_vocab()]
    if have:
        raise ValidationError(f"tokenizer already has the word tokens {have}: tune a fresh tiny snapshot")
    tokenizer.add_tokens([AddedToken(w, single_word=True, lstrip=True, normalized=False) for w in VOCABULARY])
    return {w: tokenizer.convert_tokens_to_ids(w) for w in VOCABULARY}


def _replace_folder(folder: Path, write) -> None:
    """Write `folder` anew through `write(tmp)` in a sibling temp folder, then swap it in (old copy removed last)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        write(tmp)
        old = folder.with_name(f".{folder.name}.old")
        folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def tune_text_encoder(snapshot: str | Path, *, words: bool, branch_scale: float, seed: int = 0) -> dict:
    """Give `snapshot` word tokens and a context-light text encoder in place (module docstring); the seal record."""
    import torch
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    from ..checkpoint.tiny import _normal

    root = Path(snapshot)
    if isinstance(branch_scale, bool) or not isinstance(branch_scale, (int, float)) or not 0 < branch_scale <= 1:
        raise ValidationError(f"branch_scale={branch_scale!r}: must be a number in (0, 1]")
    missing = [sub for sub in ("tokenizer", "processor", "text_encoder") if not (root / sub).is_dir()]
    if missing:
        raise ValidationError(f"snapshot {str(root)!r} has no {', '.join(m + '/' for m in missing)}")
    tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
    ids = add_word_tokens(tokenizer) if words else {}
    model = Qwen3VLForConditionalGeneration.from_pretrained(
        str(root / "text_encoder"), use_safetensors=True, local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        if words:
            old = model.get_input_embeddings().weight.shape[0]
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
            for module, name in ((model.get_input_embeddings(), "embed_tokens"), (model.lm_head, "lm_head")):
                w = module.weight
                fresh = _normal((w.shape[0] - old, w.shape[1]), seed, "text_encoder_words", name)
                w[old:] = fresh / math.sqrt(w.shape[1])
        scaled = 0
        for name, p in model.model.language_model.named_parameters():
            if name.startswith("layers.") and name.endswith(BRANCHES):
                p.mul_(float(branch_scale))
                scaled += 1
    model = model.to(torch.bfloat16)
    if words:
        for sub in ("tokenizer", "processor"):
            def write(tmp, sub=sub):
                for f in (root / sub).iterdir():  # keep processor_config.json and anything else the folder holds
                    if f.is_file():
                        shutil.copy2(f, tmp / f.name)
                tokenizer.save_pretrained(str(tmp))
            _replace_folder(root / sub, write)
    _replace_folder(root / "text_encoder", lambda tmp: model.save_pretrained(str(tmp), safe_serialization=True))
    weights = (root / "text_encoder" / "model.safetensors").read_bytes()
    return {"words": ids, "branch_scale": float(branch_scale), "scaled_tensors": scaled,
            "vocab_size": len(tokenizer), "text_encoder_sha256": hashlib.sha256(weights).hexdigest()}
