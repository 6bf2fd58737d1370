"""The training rooms' derived seeds: one helper (`hashing.key_seed`), and the values every shipped run recorded.

The pinned integers were computed by the three inline `int.from_bytes(sha256(key)[:8], "little") >> 1` copies that
`key_seed` replaced; a change of key text, byte order or shift changes them and fails here."""

import hashlib

from h3lab.hashing import key_seed
from h3lab.training.grpo import selection_seed
from h3lab.training.grpo_job import rollout_seed
from h3lab.training.run import request_seed


def test_derived_seeds_are_unchanged():
    assert [request_seed(0, 0, 0), request_seed(7, 3, 2), request_seed(2**40, 11, 5)] == [
        1208616462177348820, 8398614186297577211, 226581823732836861]
    assert [selection_seed(0, 0, 0), selection_seed(5, 2, 1)] == [4293229708001824379, 4080617101044645151]
    assert [rollout_seed(0, 0), rollout_seed(9, 4)] == [9045724229154386947, 2647975136672948549]


def test_key_seed_is_the_top_63_bits_of_the_first_eight_digest_bytes():
    key = "h3lab-train-seed|3|1|4"
    head = hashlib.sha256(key.encode()).digest()[:8]
    assert key_seed(key) == int.from_bytes(head, "little") >> 1 == request_seed(3, 1, 4)
    assert 0 <= key_seed(key) < 2**63 and key_seed(key) != key_seed(key + " ")
