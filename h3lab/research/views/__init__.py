"""Research views: what a run attends to, and two runs side by side with numbers -- read from sealed runs through
hook points, never by changing the model or a run's bytes.

- `regions.py`          the region table of a packed layout (text tokens, each anchor / reference, each latent
                        frame of the target video, target audio by time): `Regions`, `layout_regions`, `select`
- `attention.py`        exact attention probabilities recomputed from the hooked Q and K (float64, keys in canonical
                        order) and their region sums in chunks of query rows: `attention_rows`, `region_attention`,
                        `attention_map`, `AttentionMap` (its docstring states the arithmetic and the cost bound)
- `attention_probe.py`  a sealed `RunSpec` re-run with a probe hook at one block's `q_rope` / `k_rope`:
                        `AttentionProbe`, `attention_view`
- `compare.py`          matched-seed A/B numbers of two decoded results: PSNR / SSIM per frame, audio log-spectral
                        distance and RMS ratio, the h3-shapes attribute reads, the first drift: `Comparison`,
                        `compare_results`
- `knockout.py`         a block knocked out from outside (its output replaced by its input through hook points):
                        `knocked_out`

May import: the foundations, `execution`, `run`, `model`, `shapes`, and `drift` beside it. The session re-runs and compares
through these (`Session.attention`, `Session.compare`); front ends reach them only through the session.
"""
