"""The panel's LoRA-strength sliders (`h3lab.frontends.panel.lora_sliders`) over the `lora_scale` text: sliders write the
normal form, a typed text moves the sliders, an invalid text leaves them, reset clears, blocks beyond the sliders
are kept; the panel places them where the DiT's depth is known."""

import random
import types

import ipywidgets as W
import pytest

from h3lab.frontends.panel.layout import PanelLayout
from h3lab.frontends.panel.lora_sliders import LoraScaleSliders
from h3lab.schema.lora_scale import parse
from h3lab.schema.generation_settings import GenerationSettings


def test_sliders_write_the_normal_form_and_follow_the_text():
    text = W.Text(value="blocks 1-2:0.5, audio:0")
    sliders = LoraScaleSliders(text, 6)
    blocks, groups = sliders.values()
    assert blocks == [1.0, 0.5, 0.5, 1.0, 1.0, 1.0] and groups == {"refiner": 1.0, "video": 1.0, "audio": 0.0,
                                                                      "text": 1.0}
    rng = random.Random()
    k, v = rng.randrange(6), rng.choice([0.0, 0.25, 1.5])
    sliders.blocks[k].value = v
    expect = {b: s for b, s in enumerate([1.0, 0.5, 0.5, 1.0, 1.0, 1.0])}
    expect[k] = v
    assert parse(text.value) == parse(", ".join(f"block {b}:{s}" for b, s in expect.items()) + ", audio:0")
    sliders.groups["video"].value = 0.3
    assert parse(text.value)["video"] == 0.3 and parse(text.value)["audio"] == 0.0
    text.value = "blocks 0-5:0, text:2"
    assert sliders.values() == ([0.0] * 6, {"refiner": 1.0, "video": 1.0, "audio": 1.0, "text": 2.0})
    text.value = "blocks 3-1:0"  # invalid: the sliders stay, the settings report it on Generate
    assert sliders.values()[0] == [0.0] * 6
    sliders.reset.click()
    assert text.value == "" and sliders.values() == ([1.0] * 6, {g: 1.0 for g in ("refiner", "video", "audio",
                                                                                  "text")})


def test_blocks_beyond_the_sliders_stay_in_the_text():
    text = W.Text(value="blocks 8-9:0")
    sliders = LoraScaleSliders(text, 4)
    sliders.blocks[0].value = 0.5
    assert parse(text.value) == {"blocks": [[0, 0, 0.5], [8, 9, 0.0]]}
    with pytest.raises(ValueError, match="num_blocks=-1"):
        LoraScaleSliders(W.Text(), -1)


def test_the_panel_places_the_sliders_where_the_depth_is_known():
    s = GenerationSettings()
    with_depth = PanelLayout(s, "fake", {}, "none", num_blocks=5)
    assert len(with_depth.lora_sliders.blocks) == 5 and with_depth.lora_sliders.text is with_depth.controls["lora_scale"]
    boxes = [c for c in with_depth.panel.children if c is with_depth.lora_sliders.box]
    assert len(boxes) == 1
    assert PanelLayout(s, "fake", {}, "none").lora_sliders is None


def test_the_workbench_gives_its_sliders_the_embedded_default_depth(tmp_path):
    from h3lab.app.session import Session
    from h3lab.frontends.widgets import Workbench

    wb = Workbench(Session(device="cpu"), out_dir=tmp_path)
    assert len(wb.view.lora_sliders.blocks) == 6
    wb.view.lora_sliders.groups["audio"].value = 0.0
    assert wb.controls["lora_scale"].value == "audio:0"
    fake = types.SimpleNamespace(keep=(), device="cpu", model_name="fake")
    assert Workbench(fake, out_dir=tmp_path / "b").view.lora_sliders is None
