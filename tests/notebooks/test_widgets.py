"""`h3lab.widgets.Workbench` without a browser: construct the panel over a real tiny session, set the controls, call
the handlers the buttons call, wait for the worker thread, and check what the panel shows."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
from PIL import Image

from h3lab.widgets import Workbench
from nb_helpers import TINY_REQUEST

WAIT_S = 300


def _png(seed: int, size: int = 64) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _upload(widget, name: str, data: bytes) -> None:
    """What the browser sends when a file is picked: a comm state update with one file entry (deserialised by the
    widget exactly as a message from the front end)."""
    widget.set_state({"value": [{"name": name, "type": "application/octet-stream", "size": len(data),
                                 "content": memoryview(data), "last_modified": 0}]})


@pytest.fixture()
def bench(tiny_session, tmp_path):
    return Workbench(tiny_session, out_dir=tmp_path / "out", prompt="A red fox walks through fresh snow.",
                     seed=3, **TINY_REQUEST)


def _generate(wb: Workbench) -> None:
    assert wb.generate(), wb.error_text
    assert wb.wait(WAIT_S), "the generation did not finish in time"


def test_controls_start_from_the_given_settings(bench):
    assert bench.prompt.value == "A red fox walks through fresh snow."
    assert (bench.seed.value, bench.width.value, bench.height.value) == (3, 64, 64)
    assert (bench.steps.value, bench.mode.value, bench.length_unit.value, bench.length.value) == (2, "off", "frames", 22)
    assert bench.length_note.value == "= 22 frames (0.917 s)"
    assert bench.generate_button.disabled is False and bench.cancel_button.disabled is True
    # no video / strip element before a result exists
    assert bench.video_box.children == () and bench.results_box.children == () and bench.preview_box.children == ()
    bench.length_unit.value = "seconds"
    bench.length.value = 1.5
    assert bench.length_note.value == "= 39 frames (1.625 s)"  # 36 frames snapped up to 17n+5
    bench.random_seed.click()
    assert 0 <= bench.seed.value < 2**31


def test_generate_shows_video_strip_progress_and_preview(bench):
    seen: list[int] = []
    bench.progress.observe(lambda ch: seen.append(ch["new"]), names="value")
    caller = threading.current_thread()
    _generate(bench)
    assert bench.error_text == ""
    assert bench._thread is not caller and bench._thread.name == "h3lab-workbench"
    assert bench.progress.value == bench.progress.max == 2 and 1 in seen and bench.progress.bar_style == "success"
    result = bench.state.last
    assert result.settings.seed == 3 and result.settings.steps == 2 and len(bench.state.results) == 1
    assert bench.video in bench.video_box.children and bench.results_box.children == (bench.strip,)
    mp4 = bytes(bench.video.value)
    assert mp4[4:8] == b"ftyp" and mp4 == result.outputs[0].read_bytes()
    assert result.outputs[0].parent == bench.state.out_dir and result.outputs[0].name == "001.mp4"
    with Image.open(io.BytesIO(bytes(bench.strip.value))) as strip:
        assert strip.format == "PNG" and strip.size[0] > 200
    with Image.open(io.BytesIO(bytes(bench.preview.value))) as preview:  # the newest pass's decoded frame
        assert preview.size == (64, 64)
    assert bench.preview in bench.preview_box.children
    assert result.trajectory_hash in bench.summary.value
    assert bench.generate_button.disabled is False and bench.cancel_button.disabled is True


def test_second_run_adds_the_drift_heatmap(bench):
    _generate(bench)
    assert bench.drift_image not in bench.results_box.children
    bench.seed.value = 4
    _generate(bench)
    assert bench.error_text == ""
    assert len(bench.state.results) == 2 and bench.state.results[-1].settings.seed == 4
    assert bench.drift_image in bench.results_box.children
    with Image.open(io.BytesIO(bytes(bench.drift_image.value))) as img:
        assert img.format == "PNG"
    assert "first drift" in bench.status.value  # different seeds drift at the inputs


def test_invalid_setting_is_one_line_and_starts_nothing(bench):
    bench.width.value = 48
    assert bench.generate() is False
    assert bench._thread is None
    assert bench.error_text == "width=48: must be a multiple of 32"
    bench.width.value = 64
    bench.seed.value = -1
    assert bench.generate() is False and bench.error_text == "seed=-1: must be between 0 and 2**63-1"
    bench.seed.value = 3
    bench.steps.value = 1
    bench.mode.value = "off"
    _generate(bench)  # the panel is still usable
    assert bench.error_text == "" and len(bench.state.results) == 1


def test_error_in_the_worker_shows_in_the_panel_and_the_session_stays_usable(bench):
    bench.prompt.value = "   "
    assert bench.generate() is True  # the empty prompt is refused by the session, on the worker thread
    assert bench.wait(WAIT_S)
    assert bench.error_text.startswith("prompt='': empty prompt")
    assert bench.progress.bar_style == "danger" and bench.generate_button.disabled is False
    assert bench.state.results == []
    bench.prompt.value = "A heron lands on a pond."
    _generate(bench)
    assert bench.error_text == "" and len(bench.state.results) == 1


def test_cancel_stops_between_passes(bench):
    bench.steps.value = 3
    assert bench.generate()
    bench.cancel()
    assert bench.wait(WAIT_S)
    assert "cancelled before pass" in bench.status.value
    assert bench.error_text == "" and bench.state.results == []
    assert bench.progress.value < 3 and bench.progress.bar_style == "warning"
    assert bench.generate_button.disabled is False and bench.cancel_button.disabled is True
    bench.steps.value = 2
    _generate(bench)  # a cancelled run leaves the session usable
    assert len(bench.state.results) == 1


def test_anchor_uploads_go_through_the_command_grammar(bench):
    _upload(bench.first_upload, "first frame.png", _png(1))
    assert bench.error_text == ""
    first = bench.state.settings.first
    assert first is not None and first.endswith("first_frame.png") and bench.first_label.value.endswith("first_frame.png")
    assert bench.state.settings.task == "fl2va"
    _upload(bench.last_upload, "notes.png", b"this is not an image")
    assert bench.error_text != "" and bench.state.settings.last is None  # rejected, state unchanged
    bench.first_clear.click()
    assert bench.state.settings.first is None and bench.first_label.value == "(none)"


def test_reference_list_add_reorder_remove(bench):
    for i in range(3):
        _upload(bench.ref_upload, f"ref{i}.png", _png(10 + i))
    assert bench.error_text == ""
    names = lambda: [r.path.rsplit("-", 1)[-1] for r in bench.state.settings.references]  # noqa: E731
    assert names() == ["ref0.png", "ref1.png", "ref2.png"] and len(bench.refs_box.children) == 3
    bench.move_reference(2, -1)
    assert names() == ["ref0.png", "ref2.png", "ref1.png"]
    up, down, remove = bench.refs_box.children[0].children[1:]
    assert up.disabled and not down.disabled
    down.click()
    assert names() == ["ref2.png", "ref0.png", "ref1.png"]
    bench.refs_box.children[1].children[3].click()  # remove the second
    assert names() == ["ref2.png", "ref1.png"] and bench.state.settings.task == "ref2va"
    # An anchor cannot join references: the grammar refuses it in one line, the list is unchanged.
    _upload(bench.first_upload, "a.png", _png(20))
    assert "cannot be mixed" in bench.error_text and names() == ["ref2.png", "ref1.png"]


def test_command_lines_share_the_grammar_and_move_the_controls(bench):
    assert bench.command("!seed 9") == ["seed 9"] and bench.seed.value == 9
    bench.command("!size 96x64")
    assert (bench.width.value, bench.height.value) == (96, 64)
    bench.command("!seconds 1.5")
    assert bench.length_unit.value == "seconds" and bench.length.value == 1.5
    assert bench.length_note.value == "= 39 frames (1.625 s)"
    assert bench.command("!bogus") == [] and bench.error_text.startswith("unknown command !bogus")
    assert bench.command("!steps 0") == [] and bench.error_text == "steps=0: must be between 1 and 1000 denoising passes"
    assert bench.steps.value == 2 and bench.state.settings.steps == 2  # the rejected line changed nothing
    bench.command("!frames 22")
    assert bench.command("A crow on a fence.") == ["generating"]  # a prompt line generates, on the worker
    assert bench.prompt.value == "A crow on a fence." and bench.wait(WAIT_S)
    assert bench.error_text == "" and bench.state.last.settings.prompt == "A crow on a fence."
    assert bench.state.last.settings.seed == 9 and bench.state.last.settings.width == 96


def test_speed_preset_controls(bench):
    """The presets' controls (h3lab.presets): commands move them, Generate reads them, bad values are one line."""
    assert (bench.layers.value, bench.core_reuse.value, bench.token_reduction.value) == (0, 1, False)
    bench.command("!core-reuse 2")
    assert bench.core_reuse.value == 2 and bench.current_settings().core_reuse == 2
    bench.core_reuse.value = 7
    assert bench.generate() is False and bench.error_text.startswith("core_reuse=7: must be an integer between 1 and 6")
    bench.core_reuse.value = 1
    bench.layers.value = 1  # the tiny snapshot's DiT has 2 blocks
    assert bench.generate() is False and "between 2 and 2 for this 2-block transformer" in bench.error_text
    bench.layers.value = 0
    bench.reference_rope.value = True
    assert bench.current_settings().reference_rope and bench.current_settings().layers is None
    bench.command("!reference-rope off")
    assert bench.reference_rope.value is False and bench._thread is None
