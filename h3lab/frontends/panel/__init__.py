"""The parts of the notebook panel (`h3lab.frontends.widgets.Workbench`), one job each: `controls.py` the settings' controls
generated from the schema, `layout.py` every widget and where it sits (`PanelLayout`), `run.py` the generation worker
and its progress (`RunWorker`), `media.py` the result's text, latent strip, MP4 player, drift heatmaps and timing line
(`MediaView`). `h3lab.frontends.widgets` wires them together; nothing here touches the model (only `Session`'s public methods).

May import: the session layer (`h3lab.app`) and the front ends' command registry.
"""
