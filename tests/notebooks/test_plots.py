"""`h3lab.research.plots`: every figure is checked for its content (axes, image arrays and their shapes, labels, titles,
colours), on fresh random inputs and on real tiny-session objects, not only for raising no error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgba
from matplotlib.image import AxesImage

from h3lab.research import plots
from h3lab.research.plots import PlotError

from figure_checks import assert_readable, small_fonts, tick_label_overlaps
from nb_helpers import write_benchmark_sample


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _images(ax) -> list[AxesImage]:
    return [c for c in ax.get_children() if isinstance(c, AxesImage)]


def _image(ax) -> np.ndarray:
    (im,) = _images(ax)
    return np.asarray(im.get_array())


# ============================================================================================== PCA to RGB
def test_pca_basis_recovers_dominant_channels_with_fixed_signs():
    # Channel variances 9, 1, 4, 0.01: principal directions e0, e2, e1 in that order, each with a positive sign.
    rng = _rng(0)
    scales = np.array([3.0, 1.0, 2.0, 0.1])
    x = rng.standard_normal((4, 5, 6, 7)) * scales[:, None, None, None] + rng.standard_normal((4, 1, 1, 1))
    basis = plots.pca_rgb_basis(x)
    assert np.argmax(np.abs(basis.components), axis=1).tolist() == [0, 2, 1]
    assert all(c[np.argmax(np.abs(c))] > 0 for c in basis.components)
    np.testing.assert_allclose(basis.mean, x.reshape(4, -1).mean(axis=1), rtol=1e-12)
    rgb = plots.pca_rgb(x, basis)
    assert rgb.shape == (5, 6, 7, 3) and rgb.min() >= 0.0 and rgb.max() <= 1.0
    # 1st..99th percentile of the projections spans the display range: some pixels saturate at both ends.
    assert (rgb == 0).any() and (rgb == 1).any()
    # Negated latents: the refitted directions keep their fixed signs, so every colour channel inverts exactly.
    flipped = plots.pca_rgb_basis(-x)
    np.testing.assert_allclose(flipped.components, basis.components, atol=1e-12)
    np.testing.assert_allclose(plots.pca_rgb(-x, flipped), 1.0 - rgb, atol=1e-12)


def test_pca_rgb_rejects_channel_mismatch():
    basis = plots.pca_rgb_basis(_rng(1).standard_normal((4, 2, 3, 3)))
    with pytest.raises(PlotError, match="24 channels"):
        plots.pca_rgb(_rng(2).standard_normal((24, 2, 3, 3)), basis)


# ============================================================================================ latent strip
def _tile(ax, r: int, c: int) -> np.ndarray:
    y, x, h, w = ax.h3lab_tiles[r][c]
    return _image(ax)[y:y + h, x:x + w]


def test_latent_strip_tiles_labels_and_shared_basis():
    rng = _rng(3)
    steps, c, t, h, w, a, ca = 3, 24, 5, 4, 6, 7, 8
    video = rng.standard_normal((steps, c, t, h, w))
    video[0] = video[-1] + 2.0 * rng.standard_normal((c, 1, 1, 1))  # a constant shift of every latent vector
    audio = rng.standard_normal((steps, 2 * a, ca))
    labels = ["noise", "pass 0", "pass 1"]
    fig = plots.latent_strip(video, audio, step_labels=labels)

    ax_v, ax_a, ax_cb = fig.axes
    assert fig.h3lab_rows == [0, 1, 2]
    basis = plots.pca_rgb_basis(video[-1])
    for s in range(steps):
        expected = plots.pca_rgb(video[s], basis)  # every row through the last row's basis
        for f in range(t):
            tile = _tile(ax_v, s, f)
            assert tile.shape == (h, w, 4) and (tile[..., 3] == 1).all()
            np.testing.assert_allclose(tile[..., :3], expected[f], atol=1e-12)
        aud = _tile(ax_a, s, 0)
        np.testing.assert_allclose(aud, np.concatenate([audio[s][:a].T, audio[s][a:].T]), atol=1e-12)
    # Between tiles: transparent gaps (video), masked gaps (audio).
    y, x, th, tw = ax_v.h3lab_tiles[0][0]
    assert (_image(ax_v)[:, x + tw, 3] == 0).all()
    assert np.asarray(_images(ax_a)[0].get_array().mask)[ax_a.h3lab_tiles[0][0][2], 0]
    assert [tl.get_text() for tl in ax_v.get_yticklabels()] == labels
    assert [tl.get_text() for tl in ax_v.get_xticklabels()] == [str(f) for f in range(t)]
    assert ax_v.get_xlabel() == "latent frame (all 5)"
    assert "PCA basis from pass 1" in fig._suptitle.get_text() and "all 3 rows" in fig._suptitle.get_text()
    # The audio panel has a scale: its colorbar, one symmetric range for every row.
    (im_a,) = _images(ax_a)
    assert im_a.colorbar is not None and im_a.colorbar.ax is ax_cb and ax_cb.get_ylabel() == "audio latent value"
    lo, hi = im_a.get_clim()
    assert lo == -hi > -np.inf
    # The shifted first row is coloured through the shared basis: a basis of its own would centre the shift away.
    own = plots.pca_rgb(video[0], plots.pca_rgb_basis(video[0]))
    assert not np.allclose(_tile(ax_v, 0, 0)[..., :3], own[0])
    assert_readable(fig)


def test_latent_strip_subsamples_rows_and_frames_with_the_rule_printed():
    rng = _rng(4)
    steps = 21  # 20 passes + the noise: 2,390 px tall as one axes per row before
    video = rng.standard_normal((steps, 4, 20, 8, 8))
    audio = rng.standard_normal((steps, 2 * 37, 8))
    labels = ["noise"] + [f"pass {i} (sigma {1 - i / 20:.3f})" for i in range(20)]
    fig = plots.latent_strip(video, audio, step_labels=labels, max_frames=5, max_rows=6)
    rows = fig.h3lab_rows
    assert len(rows) == 6 and rows[0] == 0 and rows[-1] == 20 and rows == sorted(set(rows))
    assert "6 of 21 rows, evenly spaced (first and last kept)" in fig._suptitle.get_text()
    ax_v = fig.axes[0]
    assert [tl.get_text() for tl in ax_v.get_yticklabels()] == [labels[r] for r in rows]
    assert [tl.get_text() for tl in ax_v.get_xticklabels()] == ["0", "5", "10", "14", "19"]
    assert ax_v.get_xlabel() == "latent frame (5 of 20, evenly spaced)"
    basis = plots.pca_rgb_basis(video[-1])  # fitted on the last step of all 21, not of the drawn ones
    np.testing.assert_allclose(_tile(ax_v, 2, 1)[..., :3], plots.pca_rgb(video[rows[2]], basis)[5], atol=1e-12)
    assert_readable(fig)
    # A page instead of a sample: rows 7..12, the page named.
    page = plots.latent_strip(video, audio, step_labels=labels, max_rows=6, page=1)
    assert page.h3lab_rows == list(range(6, 12)) and "rows 7-12 of 21 (page 2 of 4)" in page._suptitle.get_text()
    assert_readable(page)
    with pytest.raises(PlotError, match="page=4: the 21 rows make 4 page"):
        plots.latent_strip(video, step_labels=labels, max_rows=6, page=4)
    with pytest.raises(PlotError, match="3 step labels for 21 steps"):
        plots.latent_strip(video, step_labels=["a", "b", "c"])
    with pytest.raises(PlotError, match="audio latents have 3 steps"):
        plots.latent_strip(video, rng.standard_normal((3, 4, 2)))
    with pytest.raises(PlotError, match="expected 5 axes"):
        plots.latent_strip(rng.standard_normal((4, 20, 3, 3)))


def test_one_axes_per_row_would_fail_the_readability_checks():
    """The checks can fail: a strip drawn with one axes per row (21 rows, 23.9 in tall, row labels at 6 pt
    that do not fit their rows) is over the size limit, its labels overlap and its font is too small."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13.0, 23.9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    rng = _rng(5)
    for r in range(21):
        ax = fig.add_subplot(21, 1, r + 1)
        ax.imshow(rng.random((4, 400, 3)))  # equal aspect: a 0.1 in tall row for 4 labels
        ax.set_yticks([0, 1, 2, 3], [f"pass {r} (sigma 0.{r:03d})"] * 4, fontsize=6)
    with pytest.raises(AssertionError):
        assert_readable(fig)
    assert tick_label_overlaps(fig) and small_fonts(fig)


# =================================================================================================== norms
def test_norm_curves_lines_match_inputs_and_align_velocities():
    rng = _rng(5)
    norms = {"latent/video": rng.random(4), "latent/audio": rng.random(4),
             "velocity/video": rng.random(3), "velocity/audio": rng.random(3)}
    labels = ["noise", "pass 0", "pass 1", "pass 2"]
    fig = plots.norm_curves(norms, step_labels=labels)
    assert len(fig.axes) == 2
    for ax, kind in zip(fig.axes, ("latent", "velocity")):
        assert ax.get_title() == f"{kind} RMS"
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert set(lines) == {"video", "audio"}
        for modality, ln in lines.items():
            np.testing.assert_array_equal(ln.get_ydata(), norms[f"{kind}/{modality}"])
            # velocities start at the first pass (x = 1), latents at the noise (x = 0)
            assert ln.get_xdata()[0] == (1 if kind == "velocity" else 0)
        assert [t.get_text() for t in ax.get_xticklabels()] == labels
        assert ln.get_color() == plots.MODALITY_COLORS[modality]
    assert_readable(fig)
    with pytest.raises(PlotError, match="'latent/<modality>'"):
        plots.norm_curves({"video": np.ones(3)})


def test_norm_curves_of_many_passes_thin_their_labels_and_say_so():
    rng = _rng(15)
    n = 41
    norms = {"latent/video": rng.random(n), "velocity/video": rng.random(n - 1)}
    labels = ["noise"] + [f"pass {i}" for i in range(n - 1)]
    fig = plots.norm_curves(norms, step_labels=labels)
    ax = fig.axes[0]
    shown = [t.get_text() for t in ax.get_xticklabels()]
    k = int(ax.get_xlabel().split("1 label in ")[1].split()[0])
    assert k >= 2 and shown == labels[::k]
    assert_readable(fig)


# =================================================================================================== drift
def test_drift_heatmaps_colours_bands_and_arrays():
    rng = _rng(6)
    steps, layers = [0, 1], ["pack", "blocks.0", "blocks.1", "final_modulate"]
    rows = ["0:text", "1:text", "2:audio", "3:audio", "4:audio", "5:video", "6:video"]
    sl = rng.random((2, 4)) + 1e-3
    sl[0, 0] = 0.0  # byte-equal cell
    sl[1, 3] = np.nan  # not captured
    lr = rng.random((4, 7)) * 1e-2 + 1e-6
    lr[:, :2] = 0.0  # text rows byte-equal
    first = {"step": 1, "point": "blocks.0.q_norm", "packed_row": 5}
    fig = plots.drift_heatmaps(sl, lr, step_labels=steps, layer_labels=layers, row_labels=rows, row_step=1,
                               first=first, metric="max |a-b|", title="a vs b")
    ax_sl, ax_lr, ax_band, ax_cb_sl, ax_cb_lr = fig.axes
    (im_sl,) = _images(ax_sl)
    (im_lr,) = _images(ax_lr)
    assert im_sl.get_array().shape == (2, 4) and im_lr.get_array().shape == (4, 7)
    # NaN stays masked (grey), zeros render white, positives keep their values on one shared log scale.
    assert im_sl.get_array().mask[1, 3] and not im_sl.get_array().mask[0, 1]
    np.testing.assert_allclose(im_sl.get_array()[0, 1], sl[0, 1])
    rgba = im_sl.to_rgba(im_sl.get_array())
    assert tuple(rgba[0, 0]) == pytest.approx(to_rgba(plots.EQUAL_COLOR))
    assert tuple(rgba[1, 3]) == pytest.approx(to_rgba(plots.MISSING_COLOR))
    assert tuple(im_lr.to_rgba(im_lr.get_array())[2, 0]) == pytest.approx(to_rgba(plots.EQUAL_COLOR))
    assert im_sl.norm is im_lr.norm or (im_sl.norm.vmin, im_sl.norm.vmax) == (im_lr.norm.vmin, im_lr.norm.vmax)
    assert im_sl.norm.vmin == pytest.approx(min(sl[sl > 0].min(), lr[lr > 0].min()))
    assert [t.get_text() for t in ax_sl.get_yticklabels()] == ["pass 1", "pass 2"]  # passes shown from 1
    assert [t.get_text() for t in ax_sl.get_xticklabels()] == layers
    assert [t.get_text() for t in ax_lr.get_yticklabels()] == layers
    # Modality bands: one code per packed row, one label per contiguous run, a line at each boundary.
    codes = _image(ax_band)[0]
    assert codes.tolist() == [0, 0, 2, 2, 2, 1, 1]  # text, video, audio in MODALITY_COLORS order
    assert [t.get_text() for t in ax_band.texts] == ["text", "audio", "video"]
    assert sorted(ln.get_xdata()[0] for ln in ax_lr.get_lines() if ln.get_marker() in ("None", "")) == [1.5, 4.5]
    assert "pass 2" in ax_band.get_title()  # row_step=1: the second pass
    # A colorbar per heatmap, on the shared scale.
    assert im_sl.colorbar.ax is ax_cb_sl and im_lr.colorbar.ax is ax_cb_lr
    assert ax_cb_sl.get_ylabel() == ax_cb_lr.get_ylabel() == "max |a-b|"
    assert fig._suptitle.get_text() == "a vs b"
    # The first drift (blocks.0.q_norm at pass 1, packed row 5) is marked in the plotted column that holds it.
    (mark,) = [ln for ln in ax_sl.get_lines() if ln.get_marker() == "s"]
    assert (list(mark.get_xdata()), list(mark.get_ydata())) == ([1], [1])  # blocks.0, pass 1
    (row_mark,) = [ln for ln in ax_lr.get_lines() if ln.get_marker() == "s"]
    assert (list(row_mark.get_xdata()), list(row_mark.get_ydata())) == ([5], [1])
    assert "blocks.0.q_norm, in layer column blocks.0" in fig._supxlabel.get_text().replace("\n", " ")
    assert_readable(fig)


def test_drift_titles_tell_byte_equal_from_nothing_comparable():
    kw = dict(step_labels=[0], layer_labels=["pack", "blocks.0"], row_labels=["0:text", "1:video"])
    equal = plots.drift_heatmaps(np.zeros((1, 2)), np.zeros((2, 2)), title="a vs b", **kw)
    assert equal._suptitle.get_text() == "a vs b -- byte-equal at every plotted point"
    differ = plots.drift_heatmaps(np.full((1, 2), np.nan), np.full((2, 2), np.nan), title="a vs b", **kw)
    text = differ._suptitle.get_text().replace("\n", " ")
    assert "nothing comparable" in text and "different prompts or shapes" in text and "byte-equal" not in text
    part = plots.drift_heatmaps(np.array([[0.0, np.nan]]), np.zeros((2, 2)), title="t", **kw)
    assert "byte-equal where both runs were captured" in part._suptitle.get_text()
    assert plots.first_drift_layer("refiner.0.attention", ["pack", "blocks.0", "final_modulate"]) == 0
    assert plots.first_drift_layer("blocks.0.attention", ["pack", "blocks.0", "final_modulate"]) == 1
    assert plots.first_drift_layer("scheduler.video", ["pack", "blocks.0", "final_modulate"]) == 2
    assert plots.first_drift_layer("blocks.10.q", ["pack", "blocks.1", "blocks.10"]) == 2  # not blocks.1


def test_drift_of_many_packed_rows_is_binned_to_a_sane_png():
    """512x512x22f packs 2,066 rows; `!plot drift` drew them one column each (an 11,770 px wide PNG)."""
    rng = _rng(16)
    rows = [f"{i}:text" for i in range(40)] + [f"{i}:audio" for i in range(40, 77)] + \
        [f"{i}:video" for i in range(77, 2066)]
    layers = ["pack"] + [f"blocks.{i}" for i in range(48)] + ["final_modulate"]
    lr = rng.random((len(layers), len(rows))) + 1e-6
    lr[:, 100] = np.nan
    lr[3, 500] = 50.0  # one large value inside a bin
    sl = rng.random((20, len(layers)))
    fig = plots.drift_heatmaps(sl, lr, step_labels=list(range(20)), layer_labels=layers, row_labels=rows)
    ax_lr = fig.axes[1]
    shown = np.ma.filled(_images(ax_lr)[0].get_array().astype(float), np.nan)
    mats, mods, spans, k = plots.bin_rows(lr, plots.row_modalities(rows), 160)
    assert k == 13 and shown.shape == (len(layers), len(spans)) and shown.shape[1] <= 160 + 3
    assert all(mods[i] == plots.row_modalities(rows)[s0] for i, (s0, _s1) in enumerate(spans))  # bins stay in a band
    b = next(i for i, (s0, s1) in enumerate(spans) if s0 <= 500 < s1)
    assert shown[3, b] == 50.0  # max per bin
    assert "bins of 13 rows" in ax_lr.get_xlabel()
    assert_readable(fig)


def test_drift_heatmaps_reject_label_mismatch():
    with pytest.raises(PlotError, match=r"labels say \(2, 3\)"):
        plots.drift_heatmaps(np.ones((2, 2)), np.ones((3, 4)), step_labels=[0, 1], layer_labels=["a", "b", "c"],
                             row_labels=["0:text"] * 4)


def test_drift_plot_of_a_real_report(tiny_session, two_results):
    report = tiny_session.drift(*two_results)
    assert not report.equal  # different seeds: the inputs differ
    fig = plots.PLOTS["drift"](report)
    assert_readable(fig)
    ax_sl, ax_lr, ax_band = fig.axes[:3]
    sl = np.ma.filled(_images(ax_sl)[0].get_array().astype(float), np.nan)
    expected = np.where(report.step_layer_max_abs == 0, np.nan, report.step_layer_max_abs)  # zeros drawn "under"
    np.testing.assert_allclose(np.where(sl < _images(ax_sl)[0].norm.vmin, np.nan, sl), expected)
    assert _images(ax_lr)[0].get_array().shape == (len(report.layer_labels), len(report.row_labels))
    assert sorted(t.get_text() for t in ax_band.texts) == sorted(
        m for m in ("text", "video", "audio") if any(label.endswith(":" + m) for label in report.row_labels)
    )
    assert report.summary()[:40] in fig._suptitle.get_text().replace("\n", " ")
    # The report's dict form (as ablation rows carry it) draws the same matrices.
    fig_d = plots.PLOTS["drift"](report.to_dict())
    np.testing.assert_array_equal(np.ma.filled(_images(fig_d.axes[0])[0].get_array().astype(float), -1),
                                  np.ma.filled(_images(ax_sl)[0].get_array().astype(float), -1))
    # The renderer does no model work: a list of results is refused (the `!plot` handler passes session.drift's report).
    with pytest.raises(PlotError, match="compute it with session.drift"):
        plots.PLOTS["drift"](list(two_results), tiny_session)
    with pytest.raises(PlotError, match="compute it with session.drift"):
        plots.plot("drift", list(two_results), tiny_session)


def test_drift_between_different_prompts_is_not_called_byte_equal(tiny_session, two_results):
    from nb_helpers import TINY_REQUEST

    other = tiny_session.generate("A cat.", seed=11, **TINY_REQUEST)
    report = tiny_session.drift(two_results[0], other)
    fig = plots.PLOTS["drift"](report)
    title = fig._suptitle.get_text().replace("\n", " ")
    assert "nothing comparable" in title and "byte-equal" not in title
    assert_readable(fig)


# ================================================================================================ ablation
def test_ablation_table_cells_and_pass_fail_colours():
    rows = [
        {"name": "A1", "mode": "off", "expected": "EXPECTED DRIFT at rope_cos (pass 0)", "observed": "DRIFT at ...",
         "first_drift": {"step": 0, "point": "rope_cos", "packed_row": 15, "modality": "video"}, "passed": True},
        {"name": "H9", "mode": "off", "expected": "EXPECTED DRIFT at scheduler.video (pass 0)",
         "observed": "PASS byte-equal", "first_drift": None, "passed": False},
        {"name": "A4", "mode": "strict", "expected": "REJECTED (needs distributed)", "observed": "not run",
         "first_drift": None, "passed": None},
    ]
    fig = plots.ablation_table(rows)
    (ax,) = fig.axes
    (table,) = ax.tables
    cells = table.get_celld()
    assert [cells[0, c].get_text().get_text() for c in range(6)] == list(plots.ABLATION_COLUMNS)
    colours = {True: plots.PASS_COLOR, False: plots.FAIL_COLOR, None: plots.NOT_RUN_COLOR}
    for i, row in enumerate(rows, start=1):
        assert cells[i, 0].get_text().get_text() == row["name"]
        assert cells[i, 5].get_text().get_text() == {True: "PASS", False: "FAIL", None: "not run"}[row["passed"]]
        for c in range(6):
            assert cells[i, c].get_facecolor() == pytest.approx(to_rgba(colours[row["passed"]]))
    assert cells[1, 4].get_text().get_text() == "pass 1 rope_cos row 15\n(video)"
    assert cells[2, 4].get_text().get_text() == "-"
    assert "1 passed, 1 failed, 1 not run" in fig._suptitle.get_text()
    assert table.get_celld()[1, 3].get_text().get_fontsize() == plots.FONT_PT
    assert_readable(fig)
    with pytest.raises(PlotError, match="lacks 'passed'"):
        plots.ablation_table([{"name": "X", "expected": "", "observed": ""}])


def test_ablation_table_of_real_rows(tiny_snapshot):
    from h3lab.research import ablation

    bench = ablation.tiny_bench(str(tiny_snapshot))
    rows = ablation.run_matrix(bench, names=["A1", "H9", "A4"])  # off-mode probes and a distributed row (2 ranks)
    fig = plots.PLOTS["ablation"](rows)
    cells = fig.axes[0].tables[0].get_celld()
    for i, row in enumerate(rows, start=1):
        want = {True: plots.PASS_COLOR, False: plots.FAIL_COLOR, None: plots.NOT_RUN_COLOR}[row["passed"]]
        assert cells[i, 0].get_facecolor() == pytest.approx(to_rgba(want))
        assert cells[i, 0].get_text().get_text() == row["name"]
    assert rows[2]["passed"] is True and rows[2]["status"] == "REJECTED"  # A4 ran: refused as non-comparable
    assert_readable(fig)
    with pytest.raises(PlotError, match="run the matrix and pass its rows"):
        plots.PLOTS["ablation"](None)


# ================================================================================================== sigmas
def test_sigma_grids_plot_both_schedules():
    from h3lab.run.sampler import DualSchedule

    sched = DualSchedule.from_passes(5)
    fig = plots.PLOTS["sigmas"](sched)
    ax, ax2 = fig.axes
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert set(lines) == {"video (shift 12)", "audio (shift 3)"}
    np.testing.assert_array_equal(lines["video (shift 12)"].get_ydata(), sched.video.sigmas.double().numpy())
    np.testing.assert_array_equal(lines["audio (shift 3)"].get_ydata(), sched.audio.sigmas.double().numpy())
    heights = [p.get_height() for p in ax2.patches]
    dv = (sched.video.sigmas[:-1] - sched.video.sigmas[1:]).double().numpy()
    da = (sched.audio.sigmas[:-1] - sched.audio.sigmas[1:]).double().numpy()
    np.testing.assert_allclose(heights, np.concatenate([dv, da]), rtol=1e-6)
    assert "6 grid points, 5 passes" in ax.get_title()
    # An int builds the N-pass grids; the two shifts give different grids.
    fig3 = plots.PLOTS["sigmas"](3)
    assert len(fig3.axes[0].get_lines()[0].get_ydata()) == 4
    assert not np.array_equal(lines["video (shift 12)"].get_ydata(), lines["audio (shift 3)"].get_ydata())
    assert_readable(fig)
    assert_readable(plots.PLOTS["sigmas"](200))  # 201 grid points: labels thinned, not piled up


# ======================================================================================== adapters / PLOTS
def test_plots_from_a_real_result(two_results):
    result = two_results[1]
    steps = plots.latent_steps(result)
    s = result.settings
    c = result.latents.shape[0]
    assert steps.video.shape == (s.steps + 1, c, s.num_latent_frames, s.latent_height, s.latent_width)
    assert steps.audio.shape == (s.steps + 1, 2 * s.num_audio_latents, result.audio_latents.shape[1])
    # The last row is the result's final latents, the first the sealed initial noise.
    np.testing.assert_array_equal(steps.video[-1], result.latents.numpy())
    np.testing.assert_array_equal(steps.audio[-1], result.audio_latents.numpy())
    assert steps.step_labels[0] == "noise" and steps.step_labels[-1].startswith(f"pass {s.steps - 1}")

    fig = plots.PLOTS["latents"](list(two_results))  # a list: the newest result is drawn
    assert fig.h3lab_rows == list(range(s.steps + 1))
    np.testing.assert_allclose(_tile(fig.axes[0], s.steps, 0)[..., :3],
                               plots.pca_rgb(steps.video[-1], plots.pca_rgb_basis(steps.video[-1]))[0], atol=1e-12)
    assert_readable(fig)

    norms, labels = plots.step_norms(result)
    nv = result.trajectory.inputs.num_condition_video_rows
    final = result.trajectory.kept[f"video.{s.steps - 1:04d}"][0, nv:].double()
    assert norms["latent/video"][-1] == pytest.approx(float(final.pow(2).mean().sqrt()), rel=1e-12)
    assert len(norms["velocity/audio"]) == s.steps and labels[0] == "noise"
    fig = plots.PLOTS["norms"](result)
    assert [ln.get_label() for ln in fig.axes[0].get_lines()] == ["video", "audio"]

    fig = plots.PLOTS["sigmas"]([result])
    np.testing.assert_array_equal(fig.axes[0].get_lines()[0].get_ydata(),
                                  result.trajectory.schedule.video.sigmas.double().numpy())


def test_latents_without_kept_tensors_say_how_to_keep_them(two_results):
    import dataclasses

    traj = two_results[0].trajectory
    bare = dataclasses.replace(traj, kept={})
    with pytest.raises(PlotError, match=r"Session.keep"):
        plots.PLOTS["latents"](bare)
    with pytest.raises(PlotError, match="no generation yet"):
        plots.PLOTS["latents"]([])


def test_plots_mapping_and_unknown_kind():
    assert set(plots.PLOTS) == {"latents", "norms", "drift", "ablation", "sigmas"}
    with pytest.raises(PlotError, match="plot kind 'heat'"):
        plots.plot("heat", None)


# ===================================================================================================== save
def test_save_is_atomic_png_and_no_pyplot_state(tmp_path):
    import matplotlib.pyplot as plt
    from PIL import Image

    fig = plots.sigma_grids(torch.tensor([1.0, 0.5, 0.0]), torch.tensor([1.0, 0.7, 0.0]))
    out = plots.save(fig, tmp_path / "sub" / "sigmas.png")
    with Image.open(out) as img:
        assert img.format == "PNG" and img.size == (1000, 360)  # 10 x 3.6 in at 100 dpi
    assert sorted(p.name for p in out.parent.iterdir()) == ["sigmas.png"]  # no temp file left behind
    with pytest.raises(PlotError, match="must end in .png"):
        plots.save(fig, tmp_path / "sigmas.jpg")
    assert plt.get_fignums() == []  # nothing went through pyplot


# =============================================================================================== benchmarks
def test_load_benchmarks_keeps_valid_documents_and_lists_the_rest_once_per_file(tmp_path):
    sample = write_benchmark_sample(tmp_path / "results")
    docs, problems = plots.load_benchmarks(tmp_path / "results")
    assert [d["name"] for d in docs] == ["forward_sample"]  # the sweep's entries all lack keys: no empty plot
    assert len(docs[0]["results"]) == 4
    assert [p.split(":")[0] for p in problems] == sample["skipped"]  # one line per file, not per entry
    assert "lacks gpu" in problems[1]
    assert problems[2] == "gemm_sweep.json: 30 results lack shape, rows, impl, runs, peak_mem_gib"
    line = plots.skipped_line(problems)
    assert "\n" not in line and line.startswith("skipped (not in the DESIGN schema): broken.json: not readable JSON")
    assert all(n in line for n in sample["skipped"])
    assert plots.skipped_line([]) == ""
    assert plots.load_benchmarks(tmp_path / "missing")[0] == []
    (tmp_path / "empty").mkdir()
    docs_empty, problems_empty = plots.load_benchmarks(tmp_path / "empty")
    assert docs_empty == [] and "no *.json" in problems_empty[0]


def _bars(ax) -> list:
    return [p for p in ax.patches if p.get_width() > 0]


def test_benchmark_figure_ratios_on_a_zero_based_linear_axis(tmp_path):
    write_benchmark_sample(tmp_path)
    docs, _ = plots.load_benchmarks(tmp_path)
    fig = plots.benchmark_figure(docs[0])
    (ax,) = fig.axes
    assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0
    # diffusers is the baseline (the line at 1); h3lab-strict 0.31 s / 0.25 s of the same case, same run.
    (bar,) = _bars(ax)
    assert bar.get_width() == pytest.approx(0.31 / 0.25)
    assert any(t.get_text().strip() == "1.24x (310 ms)" for t in ax.texts)
    assert [ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_label() == "diffusers = 1"] == [1.0]
    fails = [ln for ln in ax.get_lines() if ln.get_label() == "h3lab-strict failed"]
    assert len(fails) == 1 and list(fails[0].get_xdata()) == [0.0]  # the 768 case failed: marked, no bar
    assert [t.get_text() for t in ax.get_yticklabels()] == ["512x512x22f 2066 rows", "768x768x121f 21000 rows"]
    assert "ratio" not in ax.get_xlabel() and "diffusers time of the same case, same run" in ax.get_xlabel()
    assert_readable(fig)


def _doc(name, results):
    return {"name": name, "date": "d", "gpu": "g", "torch": "t", "triton": "tr", "git_rev": "r", "command": "c",
            "file": f"{name}.json", "results": [{"rows": 1, "runs": 3, "peak_mem_gib": 1.0, **e} for e in results]}


def test_benchmark_colours_cases_and_rows_without_nan():
    rng = _rng(20)
    kernels = _doc("kernels", [{"shape": "s", "op": op, "impl": impl, "median_s": float(rng.random()) + 0.1}
                               for op in ("rope", "silu") for impl in ("h3lab-off", "h3lab-strict")])
    loops = _doc("loops", [  # one shape, cases told apart by `what`; one implementation: absolute seconds
        {"shape": "512x512x22f", "what": "loop, no recorder", "impl": "h3lab-strict", "median_s": 3.8},
        {"shape": "512x512x22f", "what": "loop, recorder", "impl": "h3lab-strict", "median_s": 4.46,
         "peak_mem_gib": float("nan")},
    ])
    figs = plots.benchmark_figures([kernels, loops])
    colors = plots.impl_colors([kernels, loops])
    assert len(figs) == 2
    seen = {}
    for fig in figs:  # every bar of an implementation has that implementation's colour, in every figure
        for container in fig.axes[0].containers:
            for bar in container.patches:
                seen.setdefault(container.get_label(), set()).add(to_rgba(bar.get_facecolor()))
        assert_readable(fig)
    assert seen == {"h3lab-strict": {to_rgba(colors["h3lab-strict"])}}  # the baseline is the line, not a bar
    ax = figs[1].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["512x512x22f loop, no recorder", "512x512x22f loop, recorder"]
    assert sorted(b.get_width() for b in _bars(ax)) == [3.8, 4.46]  # seconds from 0: 3.8 vs 4.46 is no chasm
    assert ax.get_xlim()[0] == 0 and ax.get_xscale() == "linear"
    rows = plots.benchmark_rows([kernels, loops])
    assert all(not (isinstance(v, float) and np.isnan(v)) for r in rows for v in r.values())
    assert rows[-1]["peak_mem_gib"] is None and rows[-1]["ratio"] is None and rows[-1]["baseline"] is None
    assert rows[1]["ratio"] == pytest.approx(kernels["results"][1]["median_s"] / kernels["results"][0]["median_s"])
    summary = plots.benchmark_summary([kernels, loops])
    (sax,) = summary.axes
    (bar,) = _bars(sax)
    assert bar.get_width() == pytest.approx(np.median([r["ratio"] for r in rows if r["ratio"] is not None
                                                       and r["impl"] == "h3lab-strict"]))
    assert "loops.json" in summary._supxlabel.get_text()  # no baseline: named, not drawn as a ratio
    assert_readable(summary)
    empty = plots.benchmark_summary([])
    assert len(empty.axes) == 1 and empty.axes[0].texts[0].get_text() == "no benchmark results yet"


def test_benchmark_figures_of_the_committed_results_are_readable():
    from nb_helpers import REPO

    docs, problems = plots.load_benchmarks(REPO / "benchmarks" / "results")
    if not docs:
        pytest.skip("no committed benchmark results")
    assert all(d["results"] for d in docs)
    for fig in plots.benchmark_figures(docs) + [plots.benchmark_summary(docs)]:
        assert_readable(fig)
