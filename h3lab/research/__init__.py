"""Research tools over sealed runs: first-drift localisation, the RFC's arms and ablation matrix, the research views,
the figures, and the `--info` forward.

- `drift.py`        `compare`: the first drift between two run specs
- `arms.py`         the RFC's minimum experiment arms (P/P, R/P, P/R, R/R)
- `diagnostics.py`  what `h3lab --info` reports beyond the headers: one forward of the snapshot's own geometry
- `ablation/`       the RFC matrix (bench, factors, probes, matrix, distributed rows, faults, ratio)
- `views/`          research views read through hook points (regions, attention, probe, A/B compare, knockout)
- `plots/`          matplotlib figures of drift, attention, benchmarks, adapters, tables

May import: the foundations, `execution`, `run`, `model`, `checkpoint`, `adapters`, `schema` (settings included),
`presets`, `stochastic`, `distributed`, `shapes`, `training`, `components`. Never `app` or `frontends`.
"""
