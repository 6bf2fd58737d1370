"""Who failed: a rank's failure inside a torchrun job named on every surviving rank in one line (`RankFailed`).

`watch(mesh, what)` (a context manager every rank enters around the same work, e.g. `h3lab train --cp C`) turns
the ways a mesh job ends early into one line on every rank:
- a rank whose own code raises (not a collective) writes "failed: <its one-line message>" under its key in the
  process group's store and re-raises its error (its own line);
- a rank whose collective breaks (the peer's socket closed: gloo / NCCL raise) or whom the launcher stops (torchrun
  sends SIGTERM to the survivors of a dead worker; the handler turns it into `Stopped`, once, and ignores the next
  ones until the process exits, so its line gets printed; whatever the stop interrupted counts as the stop; a stop
  that lands in a finalizer (`__del__`, run by the garbage collector anywhere), where Python would swallow the error
  and print "Exception ignored in ...", is sent again `REDELIVER_S` later instead) writes
  "alive" and waits up to `window` seconds for every other rank's word; then it raises `RankFailed`: "rank R failed:
  <R's line>"
  when a peer reported its error, else "rank R died mid-<what> (no word from it after the process group broke);
  every other rank stopped" naming the ranks that never answered. If every peer answered "alive", the original
  error stands.
The store is the process group's (`torchrun` hosts it in its agent, `TORCHELASTIC_USE_AGENT_STORE`, so it outlives
any worker); each `watch` uses its own key prefix (a counter every rank advances alike). Nothing here writes files:
what a job folder holds is what its writers wrote atomically before the failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable, Iterator

import torch.distributed as dist

from ..errors import user_message
from .errors import DistributedError
from .launch import RankFailed
from .mesh import Mesh

WINDOW_S = 5.0  # how long a survivor waits for its peers' word
REDELIVER_S = 0.05  # a stop that landed in a finalizer is sent again this much later
_count = [0]


class Stopped(DistributedError):
    """The launcher stopped this rank (SIGTERM) while a peer had failed."""


def broken_collective(exc: BaseException) -> bool:
    """A failure of the process group's transport (a peer gone) or the launcher's stop, not of this rank's own code;
    also when wrapped (the Triton interpreter re-raises what interrupts a kernel as its own error)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (Stopped, getattr(dist, "DistError", ()))):
            return True
        text = str(exc).lower()
        if isinstance(exc, RuntimeError) and any(w in text for w in ("gloo", "nccl", "connection", "peer")):
            return True
        if "stopped by the launcher" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def watch(mesh: Mesh, what: str = "run", window: float = WINDOW_S) -> Iterator[None]:
    """Run the body; a failure becomes one line naming the failed rank on every survivor (module docstring)."""
    world = mesh.dp * mesh.topology.world_size
    if world == 1 or not dist.is_initialized():
        yield
        return
    _count[0] += 1
    prefix = f"h3lab/peers/{_count[0]}/"
    store = dist.distributed_c10d._get_default_store()
    failing, stopped = [False], [False]
    previous = None
    main = threading.current_thread() is threading.main_thread()
    stop = _stop_handler(mesh.rank, failing, stopped)
    if main:
        previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then re-raised or named
        failing[0] = True
        if not (stopped[0] or broken_collective(exc)):  # whatever the stop interrupted counts as the stop
            with contextlib.suppress(Exception):
                store.set(prefix + str(mesh.rank), "failed: " + user_message(exc).splitlines()[0])
            raise
        with contextlib.suppress(Exception):
            store.set(prefix + str(mesh.rank), "alive")
        verdict = _verdict(store, prefix, mesh.rank, world, what, window)
        if verdict:
            raise RankFailed(verdict) from exc
        raise
    finally:  # on failure the handler stays (it ignores a second SIGTERM), so the one line is printed before exit
        if main and previous is not None and not failing[0]:
            signal.signal(signal.SIGTERM, previous)


def _stop_handler(rank: int, failing: list[bool], stopped: list[bool],
                  redeliver: Callable[[], None] | None = None) -> Callable:
    """The SIGTERM handler of one `watch`: raises `Stopped` once (setting `failing` and `stopped`), then ignores;
    in a finalizer it raises nothing and calls `redeliver` (default: SIGTERM to this process `REDELIVER_S` later)."""
    def stop(signum, frame):  # noqa: ARG001 - the signal module's signature
        if failing[0]:
            return
        if _in_finalizer(frame):  # what a __del__ raises is swallowed (printed as "Exception ignored in ...")
            (redeliver or _redeliver)()
            return
        failing[0] = stopped[0] = True
        raise Stopped(f"rank {rank} stopped by the launcher (SIGTERM)")

    return stop


def _in_finalizer(frame) -> bool:
    """Whether `frame` runs inside a `__del__` (the garbage collector's finalizers run in whatever code allocated)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _redeliver() -> None:
    timer = threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signal.SIGTERM))
    timer.daemon = True
    timer.start()


def _verdict(store, prefix: str, rank: int, world: int, what: str, window: float) -> str:
    """The one line naming the failed peer(s) ("" when every peer answered alive)."""
    others = [r for r in range(world) if r != rank]
    words: dict[int, str] = {}
    deadline = time.monotonic() + window
    while True:
        for r in others:
            if r not in words:
                try:
                    if store.check([prefix + str(r)]):
                        words[r] = store.get(prefix + str(r)).decode()
                except Exception:  # noqa: BLE001 - a store that is gone answers nothing
                    pass
        failed = [(r, w) for r, w in sorted(words.items()) if w.startswith("failed: ")]
        if failed:
            r, word = failed[0]
            return f"rank {r} failed: {word[len('failed: '):]}"
        if len(words) == len(others) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    silent = [r for r in others if r not in words]
    if not silent:
        return ""
    who = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {silent}"
    return (f"{who} died mid-{what} (no word from it after the process group broke); every other rank stopped")
