"""The checks of a request that need no model: output paths, the speed presets against the DiT's depth (read from
the snapshot's config or the injected model), and the ablation factors a generation can switch on.

Contract
- `check_outputs(output=None, wav=None, frames_dir=None)`: the output paths of one generation, checked before any
  work (`io_utils`: suffix, an existing file of the right kind, a folder that accepts new files, three distinct
  paths); returns them expanded (None when unset).
- `check_preset(store, s)`: the speed-preset rules that need the DiT's depth (`h3lab.presets.check_depth`), from
  the store's injected model of the request's variant or its snapshot config (`num_layers`, default 50); nothing loads.
- `ablation_factors()`: name -> "factor: description" of the ablation rows that are transforms of a run spec;
  `check_ablations(names)` refuses any other name in one line, before any work.
Every refusal is a one-line `ValidationError` (or the presets' `PresetError`) and changes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..errors import ValidationError
from ..io_utils import check_distinct, check_output_dir, check_output_file


def check_outputs(output: Any = None, wav: Any = None, frames_dir: Any = None) -> dict[str, Path | None]:
    """The output paths of one generation, checked before any work (`io_utils`: suffix, an existing file of the
    right kind, a folder that accepts new files, three distinct paths). Returns them expanded (None when unset)."""
    paths = {
        "output": check_output_file(output, (".mp4",), "output") if output else None,
        "wav": check_output_file(wav, (".wav",), "wav output") if wav else None,
        "frames_dir": check_output_dir(frames_dir, "frames folder") if frames_dir else None,
    }
    check_distinct([("output", paths["output"]), ("wav output", paths["wav"]), ("frames folder", paths["frames_dir"])])
    return paths


def check_preset(store: Any, s: Any) -> None:
    """The preset rules that need the DiT's depth, read from the injected model or the snapshot's config, and the
    session's mesh (token reduction refuses a CP / SP row cut)."""
    from .pipeline import variant_for
    from ..presets import check_depth
    from ..presets.token_reduction import refuse_row_cut

    if s.layers is None and not s.token_reduction:
        return
    if s.token_reduction:
        refuse_row_cut(store.plan.placement_value())  # a CP / SP mesh: before any model loads
    check_depth(s, model_depth(store, variant_for(s.task)))


def model_depth(store: Any, variant: str = "transformer") -> int:
    """The DiT's number of blocks: the injected model's, else the snapshot's config (50, the default, when it does
    not say) -- no model loads."""
    model = store.injected.get(variant)
    config = {} if model is not None else store.component_config(variant)
    return int(len(model.transformer_blocks) if model is not None else config.get("num_layers", 50))


def ablation_factors() -> dict[str, str]:
    """The ablation factors a generation can switch on, name -> "factor: description": the rows of
    `h3lab.research.ablation.ROWS` that are transforms of a run spec (`ablation.FACTORS`; expected signature DRIFT, trajectory
    scope). The other rows compare executions rather than change one (controls, invariance, batch and permutation
    probes, distributed rows) or need what only the ablation bench keeps (H15 re-noises the anchor rows from their
    clean latents; a generation's sealed inputs hold the augmented rows only); they run with `h3lab.research.ablation`."""
    from ..research import ablation

    return {name: f"{ablation.ROWS[name].factor}: {ablation.ROWS[name].description}" for name in ablation.FACTORS}


def check_ablations(names: Sequence[str]) -> None:
    """Every name a generation's ablation factor (fails before any work)."""
    if names:
        unknown = [n for n in names if n not in ablation_factors()]
        if unknown:
            raise ValidationError(f"ablation factor(s) {unknown}: must be among {', '.join(ablation_factors())}")


def check_lora_scale(store: Any, s: Any, adapters: Any) -> None:
    """`--lora-scale` needs a loaded adapter and names blocks the DiT has (its depth from the injected model or the
    snapshot's config): one line naming the flag, before any model loads."""
    from .pipeline import variant_for
    from ..schema.lora_scale import FLAG, deepest_block, parse

    text = getattr(s, "lora_scale", None)
    if text is None or not parse(text):
        return
    if not adapters:
        raise ValidationError(f"{FLAG} {text!r}: scales a LoRA adapter, and none is loaded (--lora PATH, !lora PATH)")
    variant = variant_for(s.task)
    model = store.injected.get(variant)
    depth = len(model.transformer_blocks) if model is not None else store.component_config(variant).get(
        "num_layers", 50)
    if deepest_block(parse(text)) >= int(depth):
        raise ValidationError(f"{FLAG} {text!r}: block {deepest_block(parse(text))} does not exist (the "
                              f"{variant} has blocks 0..{int(depth) - 1})")
