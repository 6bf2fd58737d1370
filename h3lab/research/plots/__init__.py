"""Figures of h3lab: pure matplotlib functions that return `matplotlib.figure.Figure`s. No pyplot: every figure is a
`Figure` with its own Agg canvas, so nothing registers in pyplot's global figure list, any thread may draw, and the
caller decides what happens to it (`save`, `png_bytes`, or display in a notebook after `%matplotlib inline`).

Every figure is sized for a notebook cell and a PNG: at most `MAX_WIDTH_IN` x `MAX_HEIGHT_IN` inches (1000 x 1400 px
at the `DPI` of `save`/`png_bytes`), no text below `MIN_FONT_PT` (9.7 px at that DPI), labelled axes, one colorbar per
heatmap. Category tick labels that would overlap are thinned to every k-th one and the axis label says so; long series
are subsampled or paginated and the figure says by which rule.

Figure functions take documented plain inputs (numpy arrays or tensors + labels, reports, row dicts), never a model:

- `latent_strip(video (S, C, T, h, w), audio (S, 2A, Ca) | None, step_labels)`: one mosaic, rows = denoising steps
  (at most `max_rows`: evenly spaced with the first and last kept, or one `page`), columns = latent frames (at most
  `max_frames`, evenly spaced), each frame a PCA-to-RGB of its C channels (24 released, 4 tiny) through ONE basis
  fitted on `basis_step` (default the last step), so a colour means the same latent direction in every row; beside it
  the audio latents of the same rows as an image over time (channel-0 features above channel-1 features) on one
  symmetric colour scale with its colorbar.
- `norm_curves({"latent/video": (S,), "velocity/audio": (S',), ...}, step_labels)`: RMS per step and modality.
- `drift_heatmaps(step_layer (S, L), layer_row (L, R), step_labels, layer_labels, row_labels, first=...)`: log-scale
  heatmaps of a drift metric, step x layer and layer x packed row (rows binned, max per bin, when there are more than
  `max_row_columns`), each with its colorbar, the packed rows' modality bands above the second, the first drift marked
  in the plotted layer that holds it. Exactly 0 (byte-equal) is white, NaN (not captured by both runs) grey; a title
  tells "byte-equal" apart from "nothing comparable" (different prompts or shapes: every plotted point NaN).
- `ablation_table(rows)`: the ablation matrix as a table, one row per dict with `name`, `expected`, `observed`,
  `first_drift` (a `DriftPoint.to_dict()`, text or None) and `passed` (True / False / None); rows are coloured
  green (passed), red (failed) or grey (not run).
- `sigma_grids(video_sigmas, audio_sigmas)`: both grids over the grid index, and the sigma step of every pass.
- `benchmark_summary(docs)` (one ratio bar per benchmark file: median and range over its cases, time relative to the
  file's baseline implementation measured in the same run) and `benchmark_figure(doc)` (one file: per case and
  implementation the time relative to the baseline, or absolute seconds where the file has none, on a linear axis
  from 0, the seconds written on each bar); one colour per implementation in every figure (`impl_colors`).
  `load_benchmarks(folder)` reads a results folder (the DESIGN "Evidence" schema) and reports one problem per skipped
  file; `skipped_line(problems)` says it in one line.

- `attention_heatmap(view)`, `text_to_video(view)`, `video_audio(view)`, `attention_figure(view)`,
  `attention_blocks(views)` (`attention.py`): an attention view (`Session.attention`): query regions x key regions,
  text tokens -> video frames, video <-> audio over time in seconds, several blocks side by side.
- `block_map_figure(rows, attributes)` (`block_map.py`): configurations x attributes, match fractions.
- `compare_figure(comparison)` (`compare.py`): a matched-seed A/B (`Session.compare`): frames and |A - B|,
  spectrograms, PSNR / SSIM per frame, the table.

Adapters turn h3lab objects into those inputs: `latent_steps(result | trajectory)`, `step_norms(...)` (they need the
per-step tensors kept: `Session.keep = ("latents", "velocities")` before generating), `drift_inputs(report)`.

`PLOTS` maps a kind to a renderer of the kind's data (no model work):

    latents   a GenerationResult or Trajectory (the newest of a list)
    norms     a GenerationResult or Trajectory (the newest of a list)
    drift     a DriftReport (or its `to_dict()`)
    ablation  the row dicts of `ablation.run_matrix()`
    sigmas    a DualSchedule, a GenerationResult / Trajectory (its schedule), or a list of results (the newest);
              an int N builds the N-pass grids with the session's shifts (the released ones without a session)

`plot(kind, source, session)` is what `!plot KIND PATH` calls; for drift and ablation the command handler computes the
data first (`session.drift(...)`, the ablation rows) and passes the report / rows: the renderers do no model work.

Every bad input raises `PlotError` (an `H3Error`) with one line naming the value and the rule.

Modules, one per figure family: `figure.py` (sizes, fonts, colours, `PlotError`, `save`, `png_bytes`, tick
thinning), `latents.py` (PCA-to-RGB, `latent_strip`, `norm_curves`), `drift.py` (`drift_heatmaps`, `drift_inputs`),
`tables.py` (`ablation_table`, `sigma_grids`), `benchmarks.py` (`load_benchmarks`, the benchmark figures),
`adapters.py` (`latent_steps`, `step_norms`), `kinds.py` (`PLOTS`, `plot`), `attention.py` (attention views),
`compare.py` (A/B), `block_map.py` (the block map). Every name is importable from
`h3lab.research.plots` as before.

May import: the foundations, `run`, `schema` (settings), `components`; matplotlib on first use.
"""


from .figure import (
    BASELINE_IMPLS,
    BENCHMARK_KEYS,
    BENCHMARK_RESULT_KEYS,
    COLOR_NAMES,
    DPI,
    EQUAL_COLOR,
    FAIL_COLOR,
    FIRST_DRIFT_COLOR,
    FONT_PT,
    IMPL_COLORS,
    MAX_HEIGHT_IN,
    MAX_WIDTH_IN,
    MIN_FONT_PT,
    MISSING_COLOR,
    MODALITY_COLORS,
    NOT_RUN_COLOR,
    PASS_COLOR,
    PlotError,
    _overlap,
    finish,
    log_ticks,
    new_figure,
    overlapping_labels,
    png_bytes,
    save,
)
from .latents import (
    PCABasis,
    audio_image,
    latent_strip,
    norm_curves,
    pca_rgb,
    pca_rgb_basis,
    strip_rows,
)
from .drift import (
    bin_rows,
    drift_heatmaps,
    drift_inputs,
    drift_state,
    first_drift_layer,
    row_modalities,
)
from .tables import (
    ABLATION_COLUMNS,
    ABLATION_WRAP,
    ablation_table,
    sigma_grids,
)
from .benchmarks import (
    baseline_impl,
    benchmark_figure,
    benchmark_figures,
    benchmark_rows,
    benchmark_summary,
    case_labels,
    impl_colors,
    load_benchmarks,
    skipped_line,
)
from .adapters import (
    LatentSteps,
    latent_steps,
    step_norms,
)
from .kinds import (
    PLOTS,
    plot,
)
from .attention import (
    attention_blocks,
    attention_figure,
    attention_heatmap,
    text_to_video,
    video_audio,
)
from .compare import (
    compare_figure,
)
from .block_map import (
    block_map_figure,
)

__all__ = [
    "ABLATION_COLUMNS", "ABLATION_WRAP", "BASELINE_IMPLS", "BENCHMARK_KEYS", "BENCHMARK_RESULT_KEYS", "COLOR_NAMES",
    "DPI", "EQUAL_COLOR", "attention_blocks", "attention_figure", "attention_heatmap", "block_map_figure",
    "compare_figure",
    "text_to_video", "video_audio", "FAIL_COLOR", "FIRST_DRIFT_COLOR", "FONT_PT", "IMPL_COLORS", "LatentSteps",
    "MAX_HEIGHT_IN", "MAX_WIDTH_IN", "MIN_FONT_PT", "MISSING_COLOR", "MODALITY_COLORS", "NOT_RUN_COLOR",
    "PASS_COLOR", "PCABasis", "PLOTS", "PlotError", "ablation_table", "audio_image", "baseline_impl",
    "benchmark_figure", "benchmark_figures", "benchmark_rows", "benchmark_summary", "bin_rows", "case_labels",
    "drift_heatmaps", "drift_inputs", "drift_state", "finish", "first_drift_layer", "impl_colors", "latent_steps",
    "latent_strip", "load_benchmarks", "log_ticks", "new_figure", "norm_curves", "overlapping_labels", "pca_rgb",
    "pca_rgb_basis", "plot", "png_bytes", "row_modalities", "save", "sigma_grids", "skipped_line", "step_norms",
    "strip_rows",
]
