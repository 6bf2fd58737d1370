"""h3lab.shapes.words: the shapes vocabulary as whole-word tokens and a context-light text encoder (contract in the
module docstring), on a fresh copy of the tiny snapshot."""

import shutil

import pytest
import torch

from h3lab.errors import ValidationError
from h3lab.shapes import ClipSpec, partial_prompt, prompt
from h3lab.shapes.words import VOCABULARY, tune_text_encoder


@pytest.fixture
def snapshot(tiny_snapshot, tmp_path):
    return shutil.copytree(tiny_snapshot, tmp_path / "snap")


def _rows(snapshot, text):
    from h3lab.components.text_encoder import TextEncoder

    return TextEncoder.from_pretrained(snapshot, device="cpu").encode(text).embeds.float()[0]


def test_each_word_is_one_token_in_tokenizer_and_processor(snapshot):
    from transformers import AutoTokenizer

    record = tune_text_encoder(snapshot, words=True, branch_scale=0.01, seed=3)
    assert sorted(record["words"]) == sorted(VOCABULARY) and record["scaled_tensors"] == 2 * 51
    for sub in ("tokenizer", "processor"):
        tok = AutoTokenizer.from_pretrained(str(snapshot / sub), local_files_only=True)
        spec = ClipSpec("yellow", "triangle", "down")
        assert [t.strip() for t in tok.tokenize(prompt(spec))] == ["a", "yellow", "triangle", "moves", "down", ",",
                                                                   "Ġa", "low", "tone"]
        assert len(tok.tokenize(partial_prompt(spec, ("colour",)))) == 4  # a yellow shape moves
        assert len(tok.tokenize("yellowish")) > 1  # whole words only
        assert tok.convert_tokens_to_ids("<|image_pad|>") < min(record["words"].values())  # specials keep their ids
    assert (snapshot / "processor" / "processor_config.json").is_file()
    assert _rows(snapshot, prompt(spec)).shape == (9, 16)


def test_small_branch_scale_keeps_a_word_row_its_own(snapshot, tmp_path):
    """The ' down' row of two prompts with other prefixes: close at scale 0.01, far apart at 0.1 (context summed over
    50 layers); a row of another word stays far."""
    other = shutil.copytree(snapshot, tmp_path / "other")
    tune_text_encoder(snapshot, words=True, branch_scale=0.01)
    tune_text_encoder(other, words=True, branch_scale=0.1)

    def gaps(snap):
        a, b = _rows(snap, "a red circle moves down"), _rows(snap, "a blue square moves down")
        c = _rows(snap, "a red circle moves up")
        return float((a[4] - b[4]).norm() / b[4].norm()), float((a[4] - c[4]).norm() / c[4].norm())

    same_small, other_small = gaps(snapshot)
    same_large, _ = gaps(other)
    assert same_small < 0.25 < same_large and other_small > 0.8, (same_small, other_small, same_large)


def test_refusals_leave_the_snapshot_as_it_was(snapshot):
    before = (snapshot / "text_encoder" / "model.safetensors").read_bytes()
    for scale in (0, -0.5, 1.5, True, "0.1"):
        with pytest.raises(ValidationError, match="branch_scale"):
            tune_text_encoder(snapshot, words=True, branch_scale=scale)
    tune_text_encoder(snapshot, words=True, branch_scale=0.5)
    after = (snapshot / "text_encoder" / "model.safetensors").read_bytes()
    with pytest.raises(ValidationError, match="already has the word tokens"):
        tune_text_encoder(snapshot, words=True, branch_scale=0.5)
    assert (snapshot / "text_encoder" / "model.safetensors").read_bytes() == after != before
    shutil.rmtree(snapshot / "processor")
    with pytest.raises(ValidationError, match="processor/"):
        tune_text_encoder(snapshot, words=False, branch_scale=0.5)


def test_weights_scaled_exactly(snapshot):
    from safetensors.torch import load_file

    before = load_file(snapshot / "text_encoder" / "model.safetensors")
    tune_text_encoder(snapshot, words=False, branch_scale=0.25)
    after = load_file(snapshot / "text_encoder" / "model.safetensors")
    for k, v in before.items():
        branch = ".layers." in k and k.endswith(("o_proj.weight", "down_proj.weight")) and "language_model" in k
        want = (v.float() * 0.25).to(v.dtype) if branch else v
        assert torch.equal(after[k], want), k
