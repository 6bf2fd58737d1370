"""Strict rules of a parallelized model: every refusal is one line naming the topology and the rule, reached on
every rank alike before any work (no rank left waiting in a collective), and the model still runs afterwards.

One process: a config that does not admit the degree, placement values that break a rule, a spec naming a topology
its model is not parallelized on, a module that is not an H3Transformer, parallelizing twice (the ablation's faults
without CP: tests/research/test_ablation.py).
Two ranks (one run): another mode than strict, inputs that differ between ranks, a spec of another topology, grad,
a hook replacing a tensor on one rank only, a reshaping hook -- then a clean forward. Four ranks: CP larger than the
packed rows.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import CONFIG, build_model, build_spec
from harness import run_ranks

from h3lab.execution import runtime
from h3lab.distributed import DistributedError, TopologyError, init_mesh, parallelize
from h3lab.run import RunSpecError, model_forward
from h3lab.run.trajectory import record


def test_one_process_refusals():
    with pytest.raises(TopologyError, match=r"^tp=5: must divide num_attention_heads=12 \(this config admits tp in "):
        init_mesh(tp=5, config=CONFIG)
    spec = build_spec("t2va", passes=1)
    for value, rule in (({"tp": 2, "pp": 2}, r"placement key\(s\) \['pp'\]"),
                        ({"sp": True}, r"sp=True with tp=1"),
                        ({"tp": 3, "row_parallel": "k_chunks"}, r"row_parallel='k_chunks' at tp=3"),
                        ({"tp": 0}, r"tp=0: must be a positive integer")):
        with pytest.raises((TopologyError, RunSpecError), match=rule):
            spec.replace(placement=value)
    model = build_model()
    with pytest.raises(TopologyError, match=r"placement tp2xcp1 \(k_chunks\): the run's model is not parallelized"):
        record(spec.replace(placement={"tp": 2}), model)
    mesh = init_mesh(config=CONFIG)  # world size 1, no process group
    with pytest.raises(DistributedError, match="not an h3lab H3Transformer"):
        parallelize(torch.nn.Linear(2, 2), mesh)
    parallelize(model, mesh)
    with pytest.raises(DistributedError, match="already parallelized"):
        parallelize(model, mesh)
    # tp1 through the distributed code path: any mode runs (nothing is served by the placement), bytes unchanged
    with runtime.use_mode("off"), torch.no_grad():
        got = model_forward(model, spec.inputs, spec.inputs.video, spec.inputs.audio, 0)
        want = model_forward(build_model(), spec.inputs, spec.inputs.video, spec.inputs.audio, 0)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    with pytest.raises(TopologyError, match=r"placement tp1xcp2 \(k_chunks\): the run's model is parallelized on "
                                            r"tp1xcp1 \(k_chunks\)"):
        record(spec.replace(placement={"cp": 2}), model)


def _refusals(rank: int, world: int) -> dict:
    mesh = init_mesh(tp=2, device="cpu", config=CONFIG)
    model = build_model()
    parallelize(model, mesh)
    spec = build_spec("t2va", passes=1)
    x = spec.inputs
    out = {}

    def attempt(name, fn):
        try:
            fn()
        except (DistributedError, TopologyError) as exc:
            out[name] = str(exc)
        else:
            out[name] = "no error"

    def forward(mode="strict", inputs=x, video=None):
        with runtime.use_mode(mode), torch.no_grad():
            return model_forward(model, inputs, x.video if video is None else video, x.audio, 0)

    attempt("mode", lambda: forward("off"))
    attempt("inputs", lambda: forward(video=x.video + rank))
    attempt("topology", lambda: record(spec.replace(placement={"cp": 2}), model))

    def with_grad():
        model.proj_in.weight.requires_grad_(True)
        try:
            with runtime.use_mode("strict"):
                model_forward(model, x, x.video, x.audio, 0)
        finally:
            model.proj_in.weight.requires_grad_(False)

    attempt("grad", with_grad)
    handle = model.add_hook(lambda p, t: t + 1 if rank == 0 else None, names=["blocks.0.q"])
    attempt("one-rank hook", forward)
    handle.remove()
    handle = model.add_hook(lambda p, t: t[:, :-1], names=["pack"])
    attempt("reshape", forward)
    handle.remove()
    video, audio = forward()  # the model still runs, strict and whole
    out.update(video=video, audio=audio)
    return out


def test_refusals_reach_every_rank_alike():
    results = run_ranks(_refusals, 2)
    assert results[0]["mode"] == ("mode 'off' on topology tp2xcp1: a forward on several ranks runs in mode strict "
                                  "only (the row-parallel layers reduce by the declared 8-chunk tree; there is no "
                                  "production multi-rank path)")
    assert results[0]["inputs"].startswith("input hidden_states differs between rank 0 and rank 1 on tp2xcp1")
    assert "the run's model is parallelized on tp2xcp1" in results[0]["topology"]
    assert "under TP only LoRA factors train" in results[0]["grad"]  # proj_in.weight: a base weight
    assert results[0]["one-rank hook"].startswith("a hook at blocks.0.q replaced the tensor on rank(s) [0] of 2 only")
    assert "no reshaping" in results[0]["reshape"]
    for name in ("mode", "inputs", "topology", "grad", "one-rank hook", "reshape"):
        assert results[1][name] == results[0][name] and "\n" not in results[0][name], name
    spec = build_spec("t2va", passes=1)
    x = spec.inputs
    with runtime.use_mode("strict"), torch.no_grad():
        video, audio = model_forward(build_model(), x, x.video, x.audio, 0)
    for res in results:
        assert torch.equal(res["video"], video) and torch.equal(res["audio"], audio)


def _cp_too_large(rank: int, world: int) -> dict:
    mesh = init_mesh(cp=4, device="cpu", config=CONFIG)
    model = build_model()
    parallelize(model, mesh)
    g = torch.Generator().manual_seed(0)
    index = lambda *v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    try:  # 3 packed rows: text 0, video 1, audio 2
        with runtime.use_mode("strict"), torch.no_grad():
            model(torch.randn(1, 1, CONFIG.video_patch_dim, generator=g),
                  torch.randn(1, 1, CONFIG.audio_in_channels, generator=g),
                  torch.randn(1, 1, CONFIG.text_dim, generator=g), torch.tensor([0.5]), index(0, 0, 0),
                  index(1, 0, 2), torch.zeros(3, 3), index(1), index(2), index(0))
    except DistributedError as exc:
        return {"error": str(exc)}
    return {"error": "no error"}


def test_cp_larger_than_the_rows_is_refused_on_every_rank():
    results = run_ranks(_cp_too_large, 4)
    assert results[0]["error"] == ("topology tp1xcp4: cp=4 is larger than the 3 rows to shard: every cp rank must "
                                   "own at least one row")
    assert all(r["error"] == results[0]["error"] for r in results)


def test_cli_mesh_flags_fail_before_any_work(capsys, tmp_path):
    from h3lab.frontends import cli

    for argv, message in (
        (["--tp", "2", "-p", "a fox", "-o", ""], "--tp 2 --cp 1 needs 2 rank(s), this launch has 1: run torchrun "
                                                 "--nproc-per-node 2 -m h3lab --tp 2 --cp 1 ..."),
        (["--tp", "2", "--info"], "--tp with --info: --info only reports the snapshot"),
        (["--tp", "1", "--sp", "-p", "a fox"], "sp=True with tp=1: sequence parallel shards rows over a TP group"),
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"h3lab: error: {message}") and "\n" not in err, err
    assert not list(tmp_path.iterdir())


def _one_rank_fails(rank: int, world: int) -> dict:
    if rank == 1:
        raise ValueError(f"boom on rank {rank}")
    return {}


def test_a_failing_rank_fails_the_run_in_one_line():
    from h3lab.distributed.launch import RankFailed

    with pytest.raises(RankFailed, match=r"^rank 1 failed: ValueError: boom on rank 1$") as info:
        run_ranks(_one_rank_fails, 2)
    assert "Traceback" in str(info.value.__cause__)  # the rank's whole traceback stays reachable
