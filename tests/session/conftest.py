"""Fixtures of the session tests: the tiny snapshot with tiny reference geometry, one shared `Session`, and the
replay assets.

Reference geometry: the released pipeline puts image references on a 2048 short edge and video references on the
768p canvas (`canvas_short_edge`, `canvas_max_pixels`, `reference_image_short_edge`, ConfigSpecs read from the
snapshot's model index). At that size one CPU ref2va request takes minutes, so these tests use the tiny snapshot
with the three keys set to the tiny values below in its `model_index.json` (the Diffusers place for them). When the
tiny snapshot maker writes the same keys, `snapshot` is the fixture snapshot itself.
"""

import json
import shutil
from pathlib import Path

import pytest
from session_helpers import ASSETS, GEN, TINY_GEOMETRY


@pytest.fixture(scope="session")
def snapshot(tiny_snapshot, tmp_path_factory) -> Path:
    index = json.loads((tiny_snapshot / "model_index.json").read_text())
    if all(index.get(k) == v for k, v in TINY_GEOMETRY.items()):
        return tiny_snapshot
    copy = tmp_path_factory.mktemp("snapshot-geometry") / "h3-tiny"
    shutil.copytree(tiny_snapshot, copy)
    index.update(TINY_GEOMETRY)
    (copy / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return copy


@pytest.fixture(scope="session")
def session(snapshot):
    from h3lab.frontends.cli import quiet_libraries
    from h3lab.app.session import Session

    quiet_libraries()
    return Session(snapshot, device="cpu")


@pytest.fixture(scope="session")
def assets() -> Path:
    return ASSETS


@pytest.fixture
def state(session, tmp_path):
    """A fresh front-end state over the shared session, inputs resolved against the replay assets."""
    from h3lab.frontends import commands

    session.keep = ()  # the session's default (a test may have set it: the session is shared)
    st = commands.SessionState(session=session, base_dir=ASSETS, out_dir=None)
    for line in GEN:
        commands.run_line(st, line)
    yield st
    session.keep = ()
