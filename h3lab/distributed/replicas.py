"""One copy of each TP shard on a shared device: the CP ranks that hold the same TP shard map one rank's weights.

On a real mesh every CP rank of a TP shard holds its own copy of that shard (CP replicates the weights). On
shared-device ranks (one GPU, bytes only) those copies would be the same bytes several times over -- CP4 of the 62 GiB
model is 4 x 62 GiB on a 139 GiB card -- so `replica_shared_transformer(config, mesh, seed, device)` lets the CP
group's rank 0 build the rank's counter-random TP shard (`shard_load.random_sharded_transformer`, the weights every
one of them would have built: each element is a function of (seed, key, flat index) only) and the group's other ranks
map its parameter tensors (`mailbox.export` / `open_exported`: CUDA IPC on the tensors themselves, a /dev/shm copy
on CPU ranks) instead of building their own. Every rank's model then holds the same bytes a resident build gives it
(the tests compare them), read-only (the forwards never write weights). Off a shared-device mesh, or with cp 1, it
is `random_sharded_transformer` itself.

`model.h3lab_weights_owner` is the global rank whose allocation holds the weights (the rank itself when it built
them), so a benchmark can say which rank's memory counts them. `weight_nbytes(model)`: the parameter bytes a model
holds (on a real mesh, every rank's own).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .mailbox import export, open_exported, release
from .shard_load import _assemble, random_sharded_transformer


def replica_shared_transformer(config, mesh, seed: int = 0, device=None, dtype_policy: str = "released"):
    """This rank's counter-random TP shard, built once per CP group on a shared-device mesh (module docstring)."""
    device = mesh.device if device is None else torch.device(device)
    if not mesh.share_device or mesh.size("cp") == 1:
        model = random_sharded_transformer(config, mesh, seed, device, dtype_policy)
        model.h3lab_weights_owner = mesh.rank
        return model
    owner = mesh.group_ranks("cp")[0]
    group = mesh.group("cp")
    peers = mesh.size("cp") - 1
    handles = None
    model = None
    if mesh.rank == owner:  # one handle per mapping rank (CUDA IPC releases one reference per opening)
        model = random_sharded_transformer(config, mesh, seed, device, dtype_policy)
        handles = {k: export(p, peers) for k, p in model.named_parameters()}
    box = [(handles, model.fingerprint, model.h3lab_shard) if model is not None else None]
    dist.broadcast_object_list(box, src=owner, group=group)
    handles, fingerprint, shard = box[0]
    me = mesh.local_rank("cp")
    if mesh.rank != owner:
        tensors = {k: open_exported(h[me - 1]) for k, h in handles.items()}
        model = _assemble(config, tensors, dtype_policy, device, fingerprint, shard)
    dist.barrier(group=group)  # every rank mapped the owner's tensors
    if mesh.rank == owner:
        for per_peer in handles.values():
            release(per_peer[0])
    model.h3lab_weights_owner = owner
    return model


def weight_nbytes(model) -> int:
    """Parameter bytes `model` holds."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
