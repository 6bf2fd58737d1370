"""The attention probe's arithmetic (`h3lab.research.views.attention`): rows equal an independent float64 softmax within the
bound derived in the module docstring, region sums add to 1 per query row, the map does not depend on the chunk
size, and keys visited in canonical order give the same map for a consistently permuted layout."""

from __future__ import annotations

import math

import pytest
import torch

from h3lab.run.layout import build_layout
from h3lab.research.views.attention import (U64, attention_map, attention_rows, gamma, probability_bound, region_attention)
from h3lab.research.views.regions import layout_regions, select


def _qk(S: int, H: int, D: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(S, H, D, generator=g) * 2).to(dtype)
    k = (torch.randn(S, H, D, generator=g) * 2).to(dtype)
    return q, k


def _reference(q, k, rows, heads):
    """An independent float64 softmax: per head, the full score row through torch.softmax (packed key order)."""
    D = q.shape[-1]
    out = []
    for h in heads:
        s = q[rows, h].double() @ k[:, h].double().T / math.sqrt(D)
        out.append(torch.softmax(s, dim=-1))
    return torch.stack(out, dim=1)  # (R, H', S)


@pytest.mark.parametrize("S,H,D", [(37, 3, 16), (129, 2, 32)])
def test_rows_equal_a_float64_softmax_within_the_derived_bound(S, H, D):
    seed = torch.randint(0, 2**31 - 1, ()).item()
    q, k = _qk(S, H, D, seed)
    rows = torch.randperm(S)[:7]
    heads = [H - 1, 0]
    got = attention_rows(q, k, rows, heads)
    ref = _reference(q, k, rows, heads)
    # Both sides are within `bound` of the exact softmax (the reference's scores are summed in another order, same
    # float64 error bound), so they differ by at most 2 * bound relative to the exact value (<= ref * (1 + bound)).
    bound = probability_bound(q, k, rows, heads)
    err = (got - ref).abs()
    limit = 2 * bound * ref * (1 + bound) + 4 * U64 * ref
    assert bool((err <= limit).all()), f"seed {seed}: max excess {float((err - limit).max()):.3e}"
    assert torch.allclose(got.sum(-1), torch.ones((), dtype=torch.float64), atol=(S + 4) * U64 * 4, rtol=0)


def _layout():
    # t2va: 5 text rows, 3 latent frames of a 4x4 grid (4 rows each), 3 audio latents per channel.
    return build_layout("t2va", torch.ones(5, dtype=torch.long), 3, 4, 4, 3)


def test_region_sums_add_to_one_per_query_row_and_match_the_rows():
    layout = _layout()
    S = layout.sequence_length
    seed = torch.randint(0, 2**31 - 1, ()).item()
    q, k = _qk(S, 2, 16, seed)
    regions = layout_regions(layout, audio_bin=2)
    assert regions.num_regions == 5 + 2 + 3 and regions.labels[5:] == ("audio0", "audio1", "frame0", "frame1", "frame2")
    assert regions.counts[5:].tolist() == [4, 2, 4, 4, 4]  # audio bins of 2 latents x 2 channels, 3 latents
    each_row = torch.arange(S)  # every row its own query region: the per-row region sums themselves
    sums, counts = region_attention(q, k, each_row, regions.index, chunk=4)
    assert counts.tolist() == [1] * S
    G = regions.num_regions
    row_sums = sums.sum(-1)  # (S, H)
    assert bool(((row_sums - 1).abs() <= (2 * G + S + 8) * U64).all())
    probs = attention_rows(q, k, torch.arange(S))  # (S, H, S)
    direct = torch.zeros(S, 2, G, dtype=torch.float64).index_add_(2, regions.index, probs)
    assert bool(((sums - direct).abs() <= 2 * (S + 2) * U64).all())


def test_map_does_not_depend_on_the_chunk_size_and_keeps_its_rows():
    layout = _layout()
    q, k = _qk(layout.sequence_length, 2, 16, 5)
    regions = layout_regions(layout)
    query = select(regions, ["text", "frame1"])
    maps = [attention_map(q, k, regions, block=0, step=0, query=query, chunk=c) for c in (1, 3, 1000)]
    # The chunk regroups the float64 adds of a region's rows: at most 2 R_g u apart (R_g <= 4 rows here).
    assert all(torch.allclose(m.weights, maps[0].weights, rtol=0, atol=2 * 4 * U64) for m in maps[1:])
    m = maps[0]
    assert m.query_labels == regions.labels[:5] + ("frame1",) and m.rows.tolist() == [1] * 5 + [4]
    again = attention_map(q, k, regions, block=0, step=0, query=query, chunk=3)
    assert torch.equal(again.weights, maps[1].weights)  # the same chunking repeats its bytes
    assert bool(((m.weights.sum(-1) - 1).abs() <= (2 * regions.num_regions + 64) * U64).all())


def test_a_consistent_permutation_gives_the_same_map():
    layout = _layout()
    S = layout.sequence_length
    q, k = _qk(S, 2, 16, 9)
    perm = torch.randperm(S)
    permuted = layout.permute(perm)
    a = attention_map(q, k, layout_regions(layout), block=0, step=0)
    b = attention_map(q[perm], k[perm], layout_regions(permuted), block=0, step=0, key_order=permuted.key_order())
    # Keys visited in canonical order and grouped by region: the float64 arithmetic is the same sequence; query rows
    # enter their region's sum in another order, which moves only the last bits.
    assert torch.allclose(a.weights, b.weights, rtol=0, atol=(S + 8) * U64)
    assert a.key_labels == b.key_labels and a.query_labels == b.query_labels


def test_bad_requests_are_one_line():
    layout = _layout()
    q, k = _qk(layout.sequence_length, 2, 16, 1)
    regions = layout_regions(layout)
    from h3lab.research.views.attention import AttentionViewError
    from h3lab.research.views.regions import RegionError

    with pytest.raises(AttentionViewError, match="heads"):
        attention_rows(q, k, [0], heads=[2])
    with pytest.raises(RegionError, match="'frame9'"):
        select(regions, "frame9")
    with pytest.raises(AttentionViewError, match="token reduction"):
        attention_map(q[:-1], k[:-1], regions, block=0, step=0)
    assert gamma(1) > 0


def test_word_regions_sum_the_rows_of_a_split_word():
    layout = _layout()  # 5 text rows: words 0, 1 1 1, 2 (a word the tokenizer split into three rows)
    S = layout.sequence_length
    q, k = _qk(S, 2, 16, torch.randint(0, 2**31 - 1, ()).item())
    labels = ["a", "yellowish", "yellowish", "yellowish", "square"]
    by_token = layout_regions(layout, labels)
    by_word = layout_regions(layout, labels, text_words=[0, 1, 1, 1, 2])
    assert by_word.labels[:3] == ("t0:a", "t1:yellowish", "t2:square") and by_word.counts[:3].tolist() == [1, 3, 1]
    assert by_word.labels[3:] == by_token.labels[5:] and by_word.num_regions == by_token.num_regions - 2
    word = attention_map(q, k, by_word, block=0, step=0, query=select(by_word, "video"))
    token = attention_map(q, k, by_token, block=0, step=0, query=select(by_token, "video"))
    # The word's column is the sum of its rows' columns (float64 adds regrouped: a few ulps).
    summed = token.weights[..., 1:4].sum(-1)
    assert torch.allclose(word.weights[..., 1], summed, rtol=0, atol=16 * U64)
    assert torch.allclose(word.weights[..., 3:], token.weights[..., 5:], rtol=0, atol=16 * U64)
    from h3lab.research.views.regions import RegionError

    for bad, why in (([0, 1, 1], "3 text word indices for 5"), ([0, 2, 1, 1, 3], "non-decreasing"),
                     ([0, 1, 1, 1, 2.0], "integers")):
        with pytest.raises(RegionError, match=why):
            layout_regions(layout, labels, text_words=bad)


def test_words_of_a_prompt_group_the_tokens_a_tokenizer_split():
    from h3lab.components.text_encoder import prompt_words, token_strings, word_groups
    from h3lab.checkpoint.tiny import default_snapshot as embedded_snapshot

    assert word_groups("a big, red-ish cat", [(0, 1), (1, 5), (5, 6), (6, 10), (10, 11), (11, 14), (14, 18)]) == [
        0, 1, 2, 3, 4, 5, 6]  # punctuation is a word of its own; "ish" after "-" opens one
    assert word_groups("yellowish", [(0, 3), (3, 6), (6, 9)]) == [0, 0, 0]
    snapshot = embedded_snapshot()
    prompt = "a yellowish triangle moves down"
    labels, words = prompt_words(snapshot, prompt)
    assert len(labels) == len(words) == len(token_strings(snapshot, prompt)) > 5  # the tiny vocabulary splits it
    assert sorted(set(labels)) == sorted(prompt.split()) and words == sorted(words)
    assert [labels[words.index(w)] for w in sorted(set(words))] == prompt.split()
