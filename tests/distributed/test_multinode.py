"""Multi-node the standard way, on one machine: two `torchrun --nnodes 2 --nproc-per-node 1` agents (two "nodes" of
one gloo rank each, loopback only) meet through the c10d rendezvous and run `h3lab --tp 2 --device cpu --replay`
(rank 0 leads, rank 1 on the other "node" follows; `--share-device` passes through to the mesh); and a rank that dies mid-run (a signal, not an exception) ends
every rank of a local launch with one line naming it, with nothing written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from h3lab.distributed.launch import RankFailed
from ports import free_port

REPLAY = """\
!mesh
!size 32x32
!steps 1
!mode strict
a red ball
"""  # a replay holds at least one generation (strict: the mode a mesh runs); unchecked, so --allow-unchecked



def test_two_nodes_meet_through_c10d_rendezvous(tmp_path, tiny_snapshot):
    replay = tmp_path / "mesh.h3"
    replay.write_text(REPLAY)
    port = free_port()
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    agents = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "h3lab-test", "--local-addr", "127.0.0.1", "-m", "h3lab", "--tp", "2", "--device",
               "cpu", "--share-device", "-d", str(tiny_snapshot), "--replay", str(replay), "--allow-unchecked"]
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       cwd=tmp_path))
    outs = [agent.communicate(timeout=240) for agent in agents]
    for agent, (out, err) in zip(agents, outs):
        assert agent.returncode == 0, out[-2000:] + err[-3000:]
    lead, follower = outs[0][0], outs[1][0]
    assert "mesh tp2xcp1: 2 rank(s), row-parallel k_chunks" in lead + follower
    assert "rank 0 on cpu (gloo)" in lead + follower
    assert "shared device: timings are bytes only" in lead + follower  # --share-device reached the mesh
    assert (lead + follower).count("mesh tp2xcp1") == 1  # only rank 0 prints


def _dies(rank: int, world: int, how: str) -> dict:
    dist.barrier()  # both ranks are up and joined
    if rank == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    dist.barrier()  # rank 0 waits for a peer that is gone
    return {"never": torch.ones(1)}


@pytest.mark.parametrize("how, said", [("kill", "killed by SIGKILL"), ("exit", "exit code 3")])
def test_a_rank_that_dies_mid_run_is_named_on_one_line(how, said):
    with pytest.raises(RankFailed) as info:
        run_ranks(_dies, 2, how, timeout=120)
    message = str(info.value)
    assert message == f"rank 1 died mid-run ({said}); every other rank was stopped"
    assert "\n" not in message
