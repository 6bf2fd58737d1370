"""The shared-device transport (`mailbox.py`) and one weight copy per CP group (`replicas.py`), on CPU gloo ranks
whose slots are /dev/shm files (the CUDA path maps the same slots by CUDA IPC; the GPU run of
benchmarks/benchmark_distributed.py --share-device is where that is exercised).

- the mailbox's all_gather and uneven all_to_all give gloo's bytes, over calls that grow the slots and alternate
  their parity, on fresh random data of two dtypes; `export` gives one handle per mapping peer;
- a CP2 shared-device model: rank 1 maps rank 0's weights (the same bytes a resident build gives), the forward
  through the mailbox equals the one-process strict forward, and the trace names the transport."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from dist_helpers import config, fl2va_forward
from harness import run_ranks

from h3lab.distributed import init_mesh, parallelize
from h3lab.distributed.mailbox import export, mailbox, open_exported, release
from h3lab.distributed.replicas import replica_shared_transformer
from h3lab.distributed.shard_load import random_sharded_transformer

SEED = 11


def _transport(rank: int, world: int) -> dict:
    mesh = init_mesh(tp=world, device="cpu", share_device=True)
    mesh.shared_memory = True
    box = mailbox(mesh, "tp")
    g = torch.Generator().manual_seed(100 + rank)
    ok = []
    for call, (rows, dtype) in enumerate([(3, torch.bfloat16), (40, torch.float32), (5, torch.bfloat16),
                                          (900, torch.float32), (2, torch.float32)]):
        t = torch.randn(rows, 7, generator=g).to(dtype)
        want = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(want, t)
        got = box.all_gather(t)
        ok.append(all(torch.equal(a, b) for a, b in zip(got, want)))
        # uneven all_to_all: rank r sends r + i + call rows to rank i
        send_sizes = [rank + i + call for i in range(world)]
        recv_sizes = [j + rank + call for j in range(world)]
        send = torch.randn(sum(send_sizes), 3, 2, generator=g).to(dtype)
        want_recv = send.new_empty((sum(recv_sizes), 3, 2))
        dist.all_to_all_single(want_recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes)
        ok.append(torch.equal(box.all_to_all(send, send_sizes, recv_sizes), want_recv))
    return {"ok": json.dumps(ok), "calls": str(box.calls), "transport": mesh.transport}


def test_mailbox_moves_gloos_bytes():
    for res in run_ranks(_transport, 3, timeout=120):
        assert json.loads(res["ok"]) == [True] * 10 and res["calls"] == "10"
        assert res["transport"] == "shared memory (host)"


def test_export_gives_one_handle_per_mapping_peer():
    """CUDA IPC releases one reference per opening, so `export` hands out one handle per peer; every one maps the
    tensor's bytes (here a /dev/shm copy), and `release` unlinks the file once the peers mapped it."""
    t = torch.randn(5, 3, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    handles = export(t, 3)
    assert len(handles) == 3
    mapped = [open_exported(h) for h in handles]
    release(handles[0])
    assert not os.path.exists(handles[0][1])
    assert all(m.dtype == t.dtype and torch.equal(m, t) for m in mapped)


def _replicas(rank: int, world: int) -> dict:
    c = config(1)
    mesh = init_mesh(cp=2, device="cpu", config=c, share_device=True)
    mesh.shared_memory = True
    model = replica_shared_transformer(c, mesh, SEED)
    resident = random_sharded_transformer(c, mesh, SEED)
    held = resident.state_dict()
    same = all(torch.equal(p, held[k]) for k, p in model.state_dict().items())
    parallelize(model, mesh)
    video, audio, trace = fl2va_forward(model)
    return {"video": video, "audio": audio, "same": str(same), "owner": str(model.h3lab_weights_owner),
            "transports": json.dumps(sorted({r.transport for r in trace.collectives.records}))}


def test_cp_ranks_map_one_weight_copy_and_keep_the_bytes():
    results = run_ranks(_replicas, 2, timeout=240)
    video, audio, _ = fl2va_forward(random_sharded_transformer(config(1), None, SEED))
    for res in results:
        assert res["same"] == "True" and res["owner"] == "0"
        assert torch.equal(res["video"], video) and torch.equal(res["audio"], audio)
        assert json.loads(res["transports"]) == ["shared memory (host)"]
