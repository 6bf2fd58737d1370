"""The Workbench's parts (`h3lab.frontends.panel`) as the Workbench exposes them, without a model: every widget of the layout is
`wb.<name>`, an unknown name is an AttributeError naming it, and a declared setting whose control would take the name
of a layout widget, a Workbench attribute or a method is refused when the panel is built."""

import types

import pytest

from h3lab.frontends.panel.layout import PanelLayout
from h3lab.schema import SETTINGS, Control, Setting, declare


def _bench(tmp_path):
    from h3lab.frontends.widgets import Workbench

    session = types.SimpleNamespace(keep=(), device="cpu", model_name="fake")
    return Workbench(session, out_dir=tmp_path, prompt="a fox", steps=3)


def test_the_layout_widgets_are_the_workbench_attributes(tmp_path):
    wb = _bench(tmp_path)
    assert isinstance(wb.view, PanelLayout) and wb.session.keep == ("latents",)
    for name in ("prompt", "progress", "status", "video", "strip", "drift_image", "refs_box", "seed", "steps"):
        assert getattr(wb, name) is getattr(wb.view, name)
    assert wb.steps is wb.controls["steps"] and wb.progress.max == 3 and wb.steps.value == 3
    assert wb._thread is None and wb.timings == {} and not wb.running and wb.wait(1)
    assert wb.whatran_text == "no generation yet" and wb.status_text == "ready" and wb.error_text == ""
    with pytest.raises(AttributeError, match="'Workbench' object has no attribute 'no_such_widget'"):
        wb.no_such_widget
    wb.prompt.value = " "
    assert wb.generate() is False and wb._thread is None  # refused in the panel, nothing started
    assert wb.error_text == "prompt='': empty prompt, describe the clip to generate"


@pytest.mark.parametrize("name", ["status", "timings", "runner", "say"])
def test_a_control_may_not_take_a_name_the_panel_uses(name, tmp_path):
    declare(Setting(name, float, 0.5, "a clashing setting", order=140, control=Control(name)))
    try:
        with pytest.raises(ValueError, match=f"setting '{name}': its panel control's name is taken by the Workbench"):
            _bench(tmp_path)
    finally:
        SETTINGS.withdraw(name)
    assert _bench(tmp_path).status_text == "ready"  # withdrawn: the panel builds again
