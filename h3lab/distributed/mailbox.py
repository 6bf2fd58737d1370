"""Shared-memory transport of shared-device ranks: the strict collectives' bytes move through buffers every rank of a
group maps, not through the host (`Mesh.shared_memory`, on by default for `init_mesh(share_device=True)` on CUDA).

Shared-device ranks (a bytes-only verification mode) sit on one device, so a peer's send buffer can be read
directly: `Mailbox(mesh, dim)` serves one mesh dimension's group. Each rank owns two send slots (used by call parity)
that the group's other ranks map once, and again whenever a slot grows: on CUDA by CUDA IPC memory handles
(`torch.multiprocessing.reductions.reduce_tensor`: one allocation, opened by the other processes on the same
device), on CPU by a file in /dev/shm that every rank maps (`torch.from_file(shared=True)`; the CPU tests run this).
One call:
  1. the send bytes are copied into this rank's slot of the call's parity and the device stream is synchronised;
  2. one gloo all_gather of a small host tensor (slot grew?, bytes, the per-destination row counts) is the barrier
     saying every slot is written, and tells each receiver where its block starts in each sender's slot;
  3. only when a slot grew: the new handles are all-gathered and opened, a barrier, then a CPU file is unlinked;
  4. each rank copies its blocks out of the peers' slots into its own tensors (a byte copy: bytes are moved, never
     changed) -- the gloo process group moves only the few integers of step 2.
A slot of parity p is written again at call k+2, which no rank starts before every rank has passed call k+1's
barrier, and a rank enters that barrier only after synchronising its stream, so after its reads of call k finished:
two slots and one barrier per call are enough. `all_gather(t)` / `all_to_all(send, send_sizes, recv_sizes)` have the
semantics of `collectives._all_gather` / `_all_to_all`, which call them when the mesh's shared memory is on.

`export(t, peers)` / `open_exported(handle)` / `release(handle)`: the same sharing for a read-only tensor (the
weights the CP ranks of one TP shard would each replicate, `replicas.py`): CUDA IPC on the tensor itself (no copy),
on CPU a /dev/shm copy that `release` unlinks once every peer has mapped it. CUDA IPC counts one reference per
handle sent and releases one per opening, so every handle is sent once per peer that opens it (`_handles`).
"""

from __future__ import annotations

import math
import os
import tempfile
import uuid

import torch
import torch.distributed as dist

from .errors import DistributedError

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
MIN_SLOT = 1 << 16  # bytes; a slot grows to 1.25x what a call needs, in 64 KiB steps


# ------------------------------------------------------------------------------------------- shared buffers
def _alloc(nbytes: int, device: torch.device) -> tuple[torch.Tensor, str]:
    """A uint8 buffer of `nbytes` that other processes can map, and its /dev/shm path ("" on CUDA)."""
    if device.type == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=device), ""
    path = os.path.join(SHM_DIR, f"h3lab-shm-{os.getpid()}-{uuid.uuid4().hex}")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), path


def _handles(buf: torch.Tensor, path: str, peers: int) -> list[tuple]:
    """One picklable handle of `buf` per peer that will open it. CUDA IPC counts references per send: every opening
    releases one, so a handle opened by k processes must be sent k times (else the producer's block is never
    returned -- seen on the H200 as a CP4 owner's 62 GiB kept after the model was dropped)."""
    if buf.device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        return [("cuda", reduce_tensor(buf)) for _ in range(peers)]
    return [("file", path, buf.numel())] * peers


def _open(handle: tuple) -> torch.Tensor:
    """The buffer behind a handle from another process's `_alloc` / `export`."""
    try:
        if handle[0] == "cuda":
            rebuild, args = handle[1]
            return rebuild(*args)
        return torch.from_file(handle[1], shared=True, size=handle[2], dtype=torch.uint8)
    except (RuntimeError, OSError) as exc:
        raise DistributedError(f"shared-device transport: cannot map a peer's buffer ({handle[0]}): "
                               f"{str(exc).splitlines()[0]}") from None


def release(handle: tuple) -> None:
    """Unlink a CPU buffer's file once every peer has mapped it (the mappings stay); CUDA buffers need nothing."""
    if handle[0] == "file":
        with _suppress_missing():
            os.unlink(handle[1])


class _suppress_missing:
    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        return kind is FileNotFoundError


def export(t: torch.Tensor, peers: int = 1) -> list[tuple]:
    """`peers` handles (one for each process that will map it) through which processes on `t`'s device map `t`'s
    bytes read-only (CUDA: `t` itself; CPU: a copy in /dev/shm). `open_exported` rebuilds one; the exporter keeps `t`
    alive and `release`s a handle after the peers mapped."""
    t = t.detach()
    if not t.is_contiguous():
        raise DistributedError(f"export: tensor of shape {tuple(t.shape)} must be contiguous")
    meta = (str(t.dtype).replace("torch.", ""), tuple(t.shape))
    if t.device.type == "cuda":
        return [(*h, meta) for h in _handles(t, "", peers)]
    buf, path = _alloc(max(1, t.numel() * t.element_size()), t.device)
    if t.numel():
        buf.copy_(t.reshape(-1).view(torch.uint8))
    return [(*h, meta) for h in _handles(buf, path, peers)]


def open_exported(handle: tuple) -> torch.Tensor:
    """The tensor behind an `export` handle (same dtype, shape and bytes)."""
    dtype, shape = getattr(torch, handle[-1][0]), handle[-1][1]
    if handle[0] == "cuda":
        return _open(handle[:2])
    buf = _open(handle[:3])
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return buf[:n].view(dtype).view(shape)


# ---------------------------------------------------------------------------------------------------- mailbox
class Mailbox:
    """The shared-memory transport of one mesh dimension's group (module docstring)."""

    def __init__(self, mesh, dim: str):
        self.group = mesh.group(dim)
        self.n = mesh.size(dim)
        self.me = mesh.local_rank(dim)
        self.device = mesh.device
        self.slots: list[torch.Tensor | None] = [None, None]
        self.paths = ["", ""]
        self.peers: list[list[torch.Tensor | None]] = [[None] * self.n, [None] * self.n]
        self.calls = 0

    # the four steps of one call; returns (parity, metas of every rank)
    def _post(self, send: torch.Tensor, sizes: list[int]) -> tuple[int, list[list[int]]]:
        parity = self.calls % 2
        self.calls += 1
        data = send.contiguous().reshape(-1).view(torch.uint8)
        need = data.numel()
        slot = self.slots[parity]
        grew = slot is None or slot.numel() < need
        if grew:
            cap = max(MIN_SLOT, -(-int(need * 1.25) // MIN_SLOT) * MIN_SLOT)
            self.slots[parity] = None  # the peers drop their mapping of the old slot below
            slot, self.paths[parity] = _alloc(cap, self.device)
            self.slots[parity] = slot
        if need:
            slot[:need].copy_(data)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        meta = torch.tensor([int(grew), need, *sizes], dtype=torch.int64)
        metas = [torch.empty_like(meta) for _ in range(self.n)]
        dist.all_gather(metas, meta, group=self.group)  # the barrier: every slot of this parity is written
        rows = [m.tolist() for m in metas]
        if any(r[0] for r in rows):
            mine = None
            if grew:  # one handle per peer, in group-rank order (none for this rank)
                mine = _handles(slot, self.paths[parity], self.n - 1)
                mine.insert(self.me, None)
            offered = [None] * self.n
            dist.all_gather_object(offered, mine, group=self.group)
            for i, handles in enumerate(offered):
                if handles is not None and i != self.me:
                    self.peers[parity][i] = _open(handles[self.me])
            dist.barrier(group=self.group)  # every peer mapped the new slots
            if grew and self.paths[parity]:
                release(("file", self.paths[parity]))
        return parity, rows

    def _peer(self, parity: int, i: int) -> torch.Tensor:
        return self.slots[parity] if i == self.me else self.peers[parity][i]

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (equal shapes and dtypes), in group-rank order."""
        t = t.contiguous()
        parity, rows = self._post(t, [])
        nbytes = rows[self.me][1]
        if any(r[1] != nbytes for r in rows):
            raise DistributedError(f"all_gather: ranks send {[r[1] for r in rows]} bytes; equal shapes are required")
        out = []
        for i in range(self.n):
            if i == self.me:
                out.append(t)
                continue
            out.append(self._peer(parity, i)[:nbytes].view(t.dtype).view(t.shape).clone())
        return out

    def all_to_all(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
        """all_to_all_single along axis 0 (block i of `send`, send_sizes[i] rows, goes to group rank i)."""
        send = send.contiguous()
        if len(send_sizes) != self.n or len(recv_sizes) != self.n or sum(send_sizes) != send.shape[0]:
            raise DistributedError(f"all_to_all: split sizes {send_sizes} / {recv_sizes} for {send.shape[0]} rows "
                                   f"over a group of {self.n}")
        row_bytes = math.prod(send.shape[1:]) * send.element_size()
        parity, rows = self._post(send, list(send_sizes))
        pieces = []
        for i in range(self.n):
            sizes = rows[i][2:]
            if sizes[self.me] != recv_sizes[i]:
                raise DistributedError(f"all_to_all: rank {i} sends {sizes[self.me]} rows to rank {self.me}, which "
                                       f"expects {recv_sizes[i]}")
            if i == self.me:
                start = sum(send_sizes[:i])
                pieces.append(send[start:start + recv_sizes[i]])
                continue
            lo = sum(sizes[:self.me]) * row_bytes
            block = self._peer(parity, i)[lo:lo + recv_sizes[i] * row_bytes]
            pieces.append(block.view(send.dtype).view(recv_sizes[i], *send.shape[1:]))
        return torch.cat(pieces) if pieces else send.new_empty((0, *send.shape[1:]))


def mailbox(mesh, dim: str) -> Mailbox:
    """The mesh's mailbox along `dim` (made on the first call: every rank of the group calls together)."""
    boxes = mesh.__dict__.setdefault("_mailboxes", {})
    if dim not in boxes:
        boxes[dim] = Mailbox(mesh, dim)
    return boxes[dim]
