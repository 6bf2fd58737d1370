"""The session and its request pipeline: one loaded snapshot serving generations, rollouts, re-runs and replays.

- `session.py`         `Session` (orchestration, lock, caches, adapters)
- `generation.py`      one generation: validate, encode, denoise, decode, write; `results.py` what it hands back
- `pipeline.py`        plain functions: read media, encode text and conditions, layout, noise, RunSpec, decode
- `prepared.py`        `PreparedRequest`: one request's schedule, DiT, layout and adapters (draw, spec, final)
- `phases.py`          the phases generation, rollout and clip encoding share (encode, prepare, denoise, decode)
- `request_checks.py`  the checks of a request that need no model; `memory_plan.py` what it will need on the GPU
- `caches.py`          the conditioning caches
- `rollout.py`         stochastic rollouts for RL; `keep.py` a generation's per-pass tensors after the fact
- `reruns.py`          drift between two results, the replay of a sealed trajectory on the session's models
- `clips_in.py`, `clips_manifest.py`   clips and their prompts -> encoded training requests (`h3lab encode`)
- `sealed.py`          what a sealed folder holds and its replay on a model rebuilt from what it sealed

May import: every layer below it (foundations, `schema`, `execution`, `checkpoint`, `run`, `model`, `adapters`,
`stochastic`, `presets`, `distributed`, `shapes`, `training`, `components`, `research`). Never `frontends`:
`import h3lab.app.session` loads no front end.
"""
