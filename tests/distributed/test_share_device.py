"""Shared-device ranks (`init_mesh(share_device=True)`, `--share-device`): the verdict every rank reaches (several
ranks on one CUDA device accepted only with the flag, and only over gloo; ranks must agree on it), the mesh's
transport and "bytes only" label in the trace, and a TP2 forward through the host-staged transport path.

The CPU cannot hold CUDA tensors, so the staging copies here are host-to-host: the test runs the staged code path
(send buffer to the host, the gloo call, the copy back, the agreement flag on the host) on 2 gloo ranks and checks
the bytes and the trace; the GPU run (benchmarks/benchmark_distributed.py --share-device) is where CUDA tensors
are staged."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from dist_helpers import CONFIG, build_model, fl2va_forward
from harness import run_ranks

from h3lab.distributed import init_mesh, parallelize
from h3lab.distributed.frontend import mesh_request
from h3lab.distributed.mesh import Mesh, _decide, check_degrees


def _reports(share: bool, devices=("cuda:0", "cuda:0"), shares=None) -> list[dict]:
    shares = shares or [share] * len(devices)
    return [{"asked": {"tp": 2, "cp": 1, "sp": False, "row_parallel": "auto", "share_device": s}, "device": d,
             "problem": "", "device_problem": ""} for d, s in zip(devices, shares)]


def test_the_verdict_on_shared_devices():
    topology = check_degrees(2, 1, False)
    assert "two ranks share one CUDA device (cuda:0, cuda:0): one device per rank, or share_device=True" in _decide(
        _reports(False), topology, 2, "nccl")
    assert _decide(_reports(True), topology, 2, "gloo") == ""
    assert _decide(_reports(False, ("cuda:0", "cuda:1")), topology, 2, "nccl") == ""
    assert "shared-device ranks need gloo" in _decide(_reports(True), topology, 2, "nccl")
    assert "cuda needs nccl" in _decide(_reports(False, ("cuda:0", "cuda:1")), topology, 2, "gloo")
    assert _decide(_reports(True, shares=[True, False]), topology, 2, "gloo").startswith("ranks disagree on the topology")


def test_a_one_process_mesh_request_takes_the_flag():
    args = SimpleNamespace(tp=None, cp=None, sp=False, row_parallel=None, share_device=True, device="cpu", mode=None)
    mesh = mesh_request(args)
    assert mesh.share_device and mesh.transport == "none" and mesh.timing_label == "timing"  # one rank: nothing shared


class _Staged(Mesh):
    """A mesh whose collectives take the host-staged path (on CPU tensors the copies are host to host)."""

    @property
    def staged(self) -> bool:
        return True

    @property
    def transport(self) -> str:
        return "gloo (host-staged cuda)"


def _staged_forward(rank: int, world: int) -> dict:
    mesh = init_mesh(tp=2, device="cpu", config=CONFIG, share_device=True)
    plain = mesh.to_dict()
    mesh.__class__ = _Staged
    model = build_model(1)
    parallelize(model, mesh)
    video, audio, trace = fl2va_forward(model)
    transports = sorted({r.transport for r in trace.collectives.records})
    return {"video": video, "audio": audio, "plain": json.dumps(plain), "transports": json.dumps(transports),
            "placement": json.dumps(trace.placement)}


def test_host_staged_collectives_keep_the_bytes_and_the_trace_names_the_transport():
    results = run_ranks(_staged_forward, 2, timeout=240)
    video, audio, _ = fl2va_forward(build_model(1))
    for res in results:
        assert torch.equal(res["video"], video) and torch.equal(res["audio"], audio)
        plain = json.loads(res["plain"])
        assert plain["share_device"] is True and plain["transport"] == "gloo"
        assert plain["timings"].startswith("bytes only:")
        assert json.loads(res["transports"]) == ["gloo (host-staged cuda)"]
        placement = json.loads(res["placement"])
        assert placement["transport"] == "gloo (host-staged cuda)" and placement["timings"].startswith("bytes only")
