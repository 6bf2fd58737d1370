"""`peers._verdict`, the survivor's reading of its peers' word (a dict-backed store: no processes): a peer's own
error is named as that rank's failure, a peer that never answers within the window is named dead, peers that all
answered alive leave the original error standing; which errors count as a broken collective; and the launcher's
stop (SIGTERM) raised once, or sent again when it lands in a finalizer (where Python would swallow it)."""

from __future__ import annotations

import signal
import sys

import pytest

from h3lab.distributed import peers


class Store:
    def __init__(self, words):
        self.words = {k: v.encode() for k, v in words.items()}

    def check(self, keys):
        return all(k in self.words for k in keys)

    def get(self, key):
        return self.words[key]


def test_a_peer_that_raised_is_named_with_its_line():
    store = Store({"p/0": "alive", "p/1": "failed: ValueError: boom", "p/3": "alive"})
    assert peers._verdict(store, "p/", 0, 4, "step", 0.2) == "rank 1 failed: ValueError: boom"


def test_a_silent_peer_is_named_dead_and_alive_peers_name_nobody():
    store = Store({"p/0": "alive", "p/1": "alive"})
    said = peers._verdict(store, "p/", 0, 3, "step", 0.2)
    assert said == "rank 2 died mid-step (no word from it after the process group broke); every other rank stopped"
    assert peers._verdict(Store({"p/1": "alive", "p/2": "alive"}), "p/", 0, 3, "step", 0.2) == ""
    assert peers._verdict(Store({}), "p/", 0, 3, "run", 0.1).startswith("ranks [1, 2] died mid-run")


def test_which_errors_are_a_broken_collective():
    assert peers.broken_collective(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert peers.broken_collective(peers.Stopped("rank 0 stopped by the launcher (SIGTERM)"))
    assert not peers.broken_collective(ValueError("a bad clip"))
    try:  # the interpreter re-raises what interrupted a kernel as its own error
        try:
            raise peers.Stopped("rank 0 stopped by the launcher (SIGTERM)")
        except peers.Stopped as inner:
            raise KeyError(repr(inner)) from inner
    except KeyError as wrapped:
        assert peers.broken_collective(wrapped)
    assert peers.broken_collective(KeyError("InterpreterError(\"Stopped('rank 0 stopped by the launcher')\")"))


class _Finalized:
    def __init__(self, seen):
        self.seen = seen

    def __del__(self):
        self.seen.append(sys._getframe())


def test_the_stop_is_raised_once_and_sent_again_from_a_finalizer():
    frames: list = []
    _Finalized(frames)  # collected at once: its __del__ records the frame it ran in
    in_del, here = frames[0], sys._getframe()
    assert peers._in_finalizer(in_del) and not peers._in_finalizer(here)
    failing, stopped, sent = [False], [False], []
    stop = peers._stop_handler(3, failing, stopped, redeliver=lambda: sent.append(1))
    assert stop(signal.SIGTERM, in_del) is None and sent == [1] and failing == [False]  # nothing raised, resent
    with pytest.raises(peers.Stopped, match=r"^rank 3 stopped by the launcher \(SIGTERM\)$"):
        stop(signal.SIGTERM, here)
    assert failing == [True] and stopped == [True]
    assert stop(signal.SIGTERM, here) is None and sent == [1]  # a second stop is ignored
