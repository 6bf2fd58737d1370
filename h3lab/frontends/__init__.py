"""The front ends: they parse, render and ask; the work is in `h3lab.app` and below.

- `cli.py`        the `h3lab` command (`python -m h3lab`), its flags and actions
- `repl.py`       the interactive REPL; `commands.py` the one command registry (`@command`) it, the replays and
                  the panel run lines through; `replay.py` scripted `.h3` replays
- `widgets.py`    the notebook workbench; `panel/` its layout, controls and tabs
- `preview.py`    terminal image preview for `!show` / `--show`
- `train.py`      `h3lab train` (SFT, `grpo`, `nft`); `encode.py` `h3lab encode`; `verify.py` `h3lab verify`

May import: every layer (this is the top).
"""
