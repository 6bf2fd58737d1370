"""`h3lab.plots`: every figure is checked for its content (axes, image arrays and their shapes, labels, titles,
colours), on fresh random inputs and on real tiny-session objects, not only for raising no error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgba
from matplotlib.image import AxesImage

from h3lab import plots
from h3lab.plots import PlotError

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
def test_latent_strip_grid_shapes_labels_and_shared_basis():
    rng = _rng(3)
    steps, c, t, h, w, a, ca = 3, 24, 5, 4, 6, 7, 8
    video = rng.standard_normal((steps, c, t, h, w))
    video[0] = video[-1] + 2.0 * rng.standard_normal((c, 1, 1, 1))  # a constant shift of every latent vector
    audio = rng.standard_normal((steps, 2 * a, ca))
    labels = ["noise", "pass 0", "pass 1"]
    fig = plots.latent_strip(video, audio, step_labels=labels)

    assert len(fig.axes) == steps * (t + 1)
    grid = np.array(fig.axes).reshape(steps, t + 1)
    basis = plots.pca_rgb_basis(video[-1])
    for s in range(steps):
        expected = plots.pca_rgb(video[s], basis)  # every row through the last row's basis
        assert grid[s, 0].get_ylabel() == labels[s]
        for f in range(t):
            img = _image(grid[s, f])
            assert img.shape == (h, w, 3)
            np.testing.assert_allclose(img, expected[f], atol=1e-12)
        aud = _image(grid[s, t])
        assert aud.shape == (2 * ca, a)
        np.testing.assert_allclose(aud, np.concatenate([audio[s][:a].T, audio[s][a:].T]), atol=1e-12)
    assert [ax.get_title() for ax in grid[0, :t]] == [f"frame {f}" for f in range(t)]
    assert "audio" in grid[0, t].get_title()
    assert "PCA basis from pass 1" in fig._suptitle.get_text()
    # One audio colour scale for the whole strip.
    assert len({_images(grid[s, t])[0].get_clim() for s in range(steps)}) == 1
    # The shifted first row is coloured through the shared basis: a basis of its own would centre the shift away.
    own = plots.pca_rgb(video[0], plots.pca_rgb_basis(video[0]))
    assert not np.allclose(_image(grid[0, 0]), own[0])


def test_latent_strip_subsamples_frames_and_checks_inputs():
    rng = _rng(4)
    video = rng.standard_normal((2, 4, 20, 3, 3))
    fig = plots.latent_strip(video, None, max_frames=5)
    assert len(fig.axes) == 2 * 5
    titles = [ax.get_title() for ax in fig.axes[:5]]
    assert titles[0] == "frame 0" and titles[-1] == "frame 19" and len(set(titles)) == 5
    with pytest.raises(PlotError, match="3 step labels for 2 steps"):
        plots.latent_strip(video, step_labels=["a", "b", "c"])
    with pytest.raises(PlotError, match="audio latents have 3 steps"):
        plots.latent_strip(video, rng.standard_normal((3, 4, 2)))
    with pytest.raises(PlotError, match="expected 5 axes"):
        plots.latent_strip(rng.standard_normal((4, 20, 3, 3)))


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
    with pytest.raises(PlotError, match="'latent/<modality>'"):
        plots.norm_curves({"video": np.ones(3)})


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
    fig = plots.drift_heatmaps(sl, lr, step_labels=steps, layer_labels=layers, row_labels=rows, row_step=1,
                               metric="max |a-b|", title="a vs b")
    ax_sl, ax_lr, ax_band, ax_cb = fig.axes
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
    assert [t.get_text() for t in ax_sl.get_yticklabels()] == ["pass 0", "pass 1"]
    assert [t.get_text() for t in ax_sl.get_xticklabels()] == layers
    assert [t.get_text() for t in ax_lr.get_yticklabels()] == layers
    # Modality bands: one code per packed row, one label per contiguous run, a line at each boundary.
    codes = _image(ax_band)[0]
    assert codes.tolist() == [0, 0, 2, 2, 2, 1, 1]  # text, video, audio in MODALITY_COLORS order
    assert [t.get_text() for t in ax_band.texts] == ["text", "audio", "video"]
    assert sorted(ln.get_xdata()[0] for ln in ax_lr.get_lines()) == [1.5, 4.5]
    assert "pass 1" in ax_band.get_title()
    assert ax_cb.get_ylabel() == "max |a-b|"
    assert fig._suptitle.get_text() == "a vs b"


def test_drift_heatmaps_reject_label_mismatch():
    with pytest.raises(PlotError, match=r"labels say \(2, 3\)"):
        plots.drift_heatmaps(np.ones((2, 2)), np.ones((3, 4)), step_labels=[0, 1], layer_labels=["a", "b", "c"],
                             row_labels=["0:text"] * 4)


def test_drift_plot_of_a_real_report(tiny_session, two_results):
    report = tiny_session.drift(*two_results)
    assert not report.equal  # different seeds: the inputs differ
    fig = plots.PLOTS["drift"](report)
    ax_sl, ax_lr, ax_band, _ = fig.axes
    sl = np.ma.filled(_images(ax_sl)[0].get_array().astype(float), np.nan)
    expected = np.where(report.step_layer_max_abs == 0, np.nan, report.step_layer_max_abs)  # zeros drawn "under"
    np.testing.assert_allclose(np.where(sl < _images(ax_sl)[0].norm.vmin, np.nan, sl), expected)
    assert _images(ax_lr)[0].get_array().shape == (len(report.layer_labels), len(report.row_labels))
    assert sorted(t.get_text() for t in ax_band.texts) == sorted(
        m for m in ("text", "video", "audio") if any(label.endswith(":" + m) for label in report.row_labels)
    )
    assert report.summary()[:40] in fig._suptitle.get_text().replace("\n", " ")
    # The list form re-runs the pair through the session and draws the same matrices.
    fig2 = plots.PLOTS["drift"](list(two_results), tiny_session)
    np.testing.assert_array_equal(np.ma.filled(_images(fig2.axes[0])[0].get_array().astype(float), -1),
                                  np.ma.filled(_images(ax_sl)[0].get_array().astype(float), -1))
    with pytest.raises(PlotError, match="needs two generations"):
        plots.PLOTS["drift"]([two_results[0]], tiny_session)


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
    assert cells[1, 4].get_text().get_text() == "pass 0 rope_cos row 15\n(video)"
    assert cells[2, 4].get_text().get_text() == "-"
    assert "1 passed, 1 failed, 1 not run" in fig._suptitle.get_text()
    with pytest.raises(PlotError, match="lacks 'passed'"):
        plots.ablation_table([{"name": "X", "expected": "", "observed": ""}])


def test_ablation_table_of_real_rows(tiny_snapshot):
    from h3lab import ablation

    bench = ablation.tiny_bench(str(tiny_snapshot))
    rows = ablation.run_matrix(bench, names=["A1", "H9", "A4"])  # off-mode probes and a distributed row (2 ranks)
    fig = plots.PLOTS["ablation"](rows)
    cells = fig.axes[0].tables[0].get_celld()
    for i, row in enumerate(rows, start=1):
        want = {True: plots.PASS_COLOR, False: plots.FAIL_COLOR, None: plots.NOT_RUN_COLOR}[row["passed"]]
        assert cells[i, 0].get_facecolor() == pytest.approx(to_rgba(want))
        assert cells[i, 0].get_text().get_text() == row["name"]
    assert rows[2]["passed"] is True and rows[2]["status"] == "REJECTED"  # A4 ran: refused as non-comparable


# ================================================================================================== sigmas
def test_sigma_grids_plot_both_schedules():
    from h3lab.sampler import DualSchedule

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
    assert len(fig.axes) == (s.steps + 1) * (s.num_latent_frames + 1)
    assert _image(fig.axes[0]).shape == (s.latent_height, s.latent_width, 3)

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
def test_load_benchmarks_keeps_valid_documents_and_lists_the_rest(tmp_path):
    sample = write_benchmark_sample(tmp_path / "results")
    docs, problems = plots.load_benchmarks(tmp_path / "results")
    assert [d["name"] for d in docs] == ["forward_sample"]
    assert len(docs[0]["results"]) == 4
    assert [p.split(":")[0] for p in problems] == sample["skipped"]
    assert "lacks gpu" in problems[1]
    assert plots.load_benchmarks(tmp_path / "missing")[0] == []
    (tmp_path / "empty").mkdir()
    docs_empty, problems_empty = plots.load_benchmarks(tmp_path / "empty")
    assert docs_empty == [] and "no *.json" in problems_empty[0]


def test_benchmark_summary_bars_and_failures(tmp_path):
    write_benchmark_sample(tmp_path)
    docs, _ = plots.load_benchmarks(tmp_path)
    fig = plots.benchmark_summary(docs)
    (ax,) = fig.axes
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights == pytest.approx(sorted([0.25, 0.31, 2.5]))
    assert ax.get_yscale() == "log"
    fails = [ln for ln in ax.get_lines() if ln.get_label() == "h3lab-strict failed"]
    assert len(fails) == 1 and len(fails[0].get_xdata()) == 1
    assert [t.get_text() for t in ax.get_xticklabels()] == ["512x512x22f", "768x768x121f"]
    assert "forward_sample" in ax.get_title() and "NVIDIA H200" in ax.get_title()
    rows = plots.benchmark_rows(docs)
    strict = [r for r in rows if r["impl"] == "h3lab-strict"]
    assert strict[0]["vs_diffusers"] == pytest.approx(0.31 / 0.25) and strict[1]["error"]
    empty = plots.benchmark_summary([])
    assert len(empty.axes) == 1 and empty.axes[0].texts[0].get_text() == "no benchmark results yet"
