"""Shared builders of the preset tests (imported by name: pytest puts this folder on sys.path): a deeper tiny
transformer (the released structure at tiny widths, `num_layers` blocks, seeded random weights), a layout and its
seeded inputs, and run specs over them."""

import torch

from h3lab.research.ablation import make_inputs
from h3lab.config import H3Config
from h3lab.run.layout import build_layout
from h3lab.model import H3Transformer
from h3lab.model.random_init import random_state_dict
from h3lab.run import RunSpec
from h3lab.run.sampler import DualSchedule


def deep_config(num_layers: int, refiner: int = 1) -> H3Config:
    return H3Config(**{**H3Config.tiny().to_diffusers(), "num_layers": num_layers, "num_refiner_layers": refiner})


def deep_model(num_layers: int, seed: int = 3, refiner: int = 1) -> H3Transformer:
    cfg = deep_config(num_layers, refiner)
    model = H3Transformer(cfg)
    model.load_state_dict(random_state_dict(cfg, seed))
    return model.eval().requires_grad_(False)


def fl2va_layout(frames: int = 2, height: int = 4, width: int = 6, text: int = 5):
    """fl2va with a first anchor: text, anchor rows, audio and an odd 2 x 3 target grid (one singleton column)."""
    return build_layout("fl2va", torch.ones(text, dtype=torch.long), frames, height, width, 3, anchors=("first",))


def spec_for(model, layout, passes: int = 4, seed: int = 2, **changes) -> RunSpec:
    schedule = DualSchedule.from_passes(passes)
    return RunSpec(make_inputs(model.config, layout, schedule, seed=seed), schedule, layout=layout, **changes)


class Calls:
    """Counts calls of modules per pass: `calls.at(pass)[name]` (torch forward hooks; the model's own hook points
    are not touched, so the fused paths stay as they are)."""

    def __init__(self, model, modules: dict):
        self.model, self.counts, self.handles = model, {}, []
        for name, module in modules.items():
            self.handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name):
        def hook(_m, _a, _o):
            step = self.model.hook_context.get("step", -1)
            self.counts.setdefault(step, {}).setdefault(name, 0)
            self.counts[step][name] += 1

        return hook

    def at(self, step: int) -> dict:
        return self.counts.get(step, {})

    def remove(self):
        for h in self.handles:
            h.remove()
