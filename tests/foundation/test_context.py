"""h3lab/execution/context.py: the one execution context. Every field is in the digest (a field added later is covered: the
test walks the dataclass fields and fails for a field without a changed value here), equal contexts give equal
digests in another process, the setters of the runtime, fast mode, the graph fronts, hooks and LoRA are thin ones
over the one context variable, and no execution state is left in a context variable of its own."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3lab.execution import context, fast, graphs, runtime
from h3lab.distributed import collectives
from h3lab.model import hooks, transformer
from h3lab.training import step_graph

REPO = Path(__file__).resolve().parents[2]


def _other_op(x):
    return x


class _Placement:
    def __init__(self, tp: int):
        self.tp = tp

    def describe(self) -> dict:
        return {"tp": self.tp}


# One value per field, each unlike the default: the digest must change when the field alone changes.
CHANGED = {
    "mode": "strict",
    "overrides": (("silu", _other_op),),
    "placement": _Placement(2),
    "placement_frame": (0, 11),
    "precomputed": _Placement(3),
    "fast_fused": False,
    "fast_emulated": True,
    "fp8_attention": "on",
    "graphs": ("fast", "step"),
    "checkpoint_rng": False,
    "hooks": _other_op,
    "hook_view": _Placement(4),
    "lora_streams": torch.tensor([0, 1, 2]),
    "collective_timing": True,
    "follow_pass": 3,
    "fusions": ("qk_norm_rope",),
    "front": "strict",
    "kernel_tables": (("bfloat16", (64, 64, 32)),),
    "adapter_state": ((True, ("default",), (), None, None),),
    "model": (1, "fp", b"\x01"),
    "inputs": (((2, 3), "torch.float32", (3, 1), "cpu"),),
}


def test_every_field_changes_the_digest():
    fields = [f.name for f in dataclasses.fields(context.ExecutionContext)]
    missing = sorted(set(fields) - set(CHANGED))
    assert not missing, f"fields {missing} have no changed value in CHANGED: add one (the digest must cover them)"
    base = context.ExecutionContext()
    digests = {base.digest()}
    for name in fields:
        changed = base.replace(**{name: CHANGED[name]})
        assert getattr(changed, name) is not getattr(base, name), name
        assert changed.digest() != base.digest(), name
        digests.add(changed.digest())
    assert len(digests) == len(fields) + 1  # no two single-field changes collide either


def test_values_not_identities_make_the_digest():
    a = context.ExecutionContext(mode="strict", overrides=(("silu", _other_op),), placement=_Placement(2))
    b = context.ExecutionContext(mode="strict", overrides=(("silu", _other_op),), placement=_Placement(2))
    assert a.placement is not b.placement and a.digest() == b.digest()
    assert a.replace(placement=_Placement(4)).digest() != a.digest()
    streams = torch.tensor([0, 1, 2])
    assert a.replace(lora_streams=streams).digest() != a.replace(lora_streams=streams.flip(0)).digest()
    assert context.ExecutionContext(model=(1, 2)).digest() != context.ExecutionContext(model=((1, 2),)).digest()


def test_a_bound_context_digests_as_the_same_fields_built_directly():
    base = context.ExecutionContext(mode="strict", fp8_attention="off")
    base.digest()  # its own fields' state is kept and handed to what it binds
    call = dict(front="strict", kernel_tables=((1, 2),), adapter_state=(), model=(1, "fp"), inputs=(("meta",),))
    bound = base.bind(**call)
    assert bound.digest() == context.ExecutionContext(mode="strict", fp8_attention="off", **call).digest()
    assert bound.bind(front="fast").digest() != bound.digest()
    with pytest.raises(TypeError, match=r"bind field\(s\) \['mode'\]"):
        base.bind(mode="off")


_CHILD = """
import torch
from h3lab.execution import context, runtime
with runtime.use_mode("strict"):
    ctx = context.current().replace(fp8_attention="off", lora_streams=torch.tensor([2, 0, 1]), follow_pass=4,
                                    kernel_tables=((1, 2), ("a", 3.5)))
print(context.DEFAULT.digest(), ctx.digest())
"""


def test_equal_contexts_give_equal_digests_across_processes():
    runs = [subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, cwd=REPO, check=True)
            for _ in range(2)]
    with runtime.use_mode("strict"):
        here = context.current().replace(fp8_attention="off", lora_streams=torch.tensor([2, 0, 1]), follow_pass=4,
                                         kernel_tables=((1, 2), ("a", 3.5)))
    expected = f"{context.DEFAULT.digest()} {here.digest()}"
    assert [r.stdout.strip() for r in runs] == [expected, expected]


def test_the_public_setters_are_fields_of_the_one_context():
    base = context.current()
    with runtime.use_mode("strict"), fast.use_fused_producers(False), fast.use_emulation(), \
            fast.use_fp8_attention("off"), graphs.use_graphs("strict", False), step_graph.use_graphs(False), \
            transformer.checkpoint_rng_state(False), hooks.use_view("view"), collectives.use_timing(), \
            runtime.use_overrides({"silu": _other_op}), runtime.use_placement("p"), runtime.use_precomputed("t"):
        ctx = context.current()
        assert (ctx.mode, ctx.fast_fused, ctx.fast_emulated, ctx.fp8_attention, ctx.graphs, ctx.checkpoint_rng) == \
            ("strict", False, True, "off", ("fast",), False)
        assert (ctx.hook_view, ctx.collective_timing, ctx.overrides, ctx.placement, ctx.precomputed) == \
            ("view", True, (("silu", _other_op),), "p", "t")
        assert runtime.current_mode() == "strict" and runtime.active_overrides() == ("silu",)
        assert ctx.digest() != base.digest()
    assert context.current() is base


def test_bad_fields_and_switches_are_refused_in_one_line():
    with pytest.raises(TypeError, match=r"execution context field\(s\) \['colour'\]") as info:
        with context.use(colour="red"):
            pass
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="graph front 'train'"):
        context.use_graphs("train", True, "use_graphs")
    with pytest.raises(TypeError, match=r"use_graphs\(1\): must be True or False"):
        graphs.use_graphs("strict", 1)


def test_no_execution_state_outside_the_one_context():
    """Context variables left in h3lab and h3kernels are records of what ran (module contract of h3lab/execution/context.py)."""
    allowed = {"h3lab/execution/context.py": 1, "h3lab/execution/runtime.py": 2, "h3lab/execution/graphs.py": 1, "h3lab/training/step_graph.py": 1,
               "h3lab/components/streaming.py": 1, "h3lab/distributed/collectives.py": 1, "kernels/_index_cache.py": 1}
    found = {}
    for root in ("h3lab", "kernels"):
        for path in sorted((REPO / root).rglob("*.py")):
            n = len(re.findall(r"ContextVar\(", path.read_text(encoding="utf-8")))
            if n:
                found[str(path.relative_to(REPO))] = n
    assert found == allowed
