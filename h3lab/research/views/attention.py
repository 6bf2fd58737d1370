"""Exact attention probabilities of one block, recomputed from the Q and K the attention kernel consumed, and their
sums over the packed layout's regions -- without ever holding the S x S matrix.

The strict and fast attention kernels never materialise probabilities. This module recomputes rows of
P = softmax(Q K^T / sqrt(D)) from the block's `q_rope` / `k_rope` tensors (after Q/K RMS norm and the partial RoPE:
exactly what `ops.attention` received), outside the model and outside the run's arithmetic.

Arithmetic (declared; the tests bound it against an independent float64 softmax)
------------------------------------------------------------------------------
- Inputs: q, k (S, H, D) of one batch item, any float dtype (bfloat16 in the release), upcast to float64 -- exact.
- Keys are visited in canonical order (`key_order`, `PackedLayout.key_order()`; None: packed order is canonical),
  grouped region by region (a stable sort of the canonical keys by region: canonical order inside a region).
- Scores s = (q . k) * D**-0.5 in float64 (a batched float64 matmul; the BLAS picks the summation order). Each
  product of two bfloat16 values is exact in float64; the rounding error of a score is at most
  gamma(D + 1) * D**-0.5 * sum_i |q_i k_i|, gamma(n) = n u / (1 - n u), u = 2**-53.
- Softmax per (row, head): m = max_j s_j (exact), e_j = exp(s_j - m), Z = sum_j e_j, p_j = e_j / Z, float64. With
  E the largest score error of the row, each p_j is within p_j * (exp(2E) (1 + 2u)^2 (1 + gamma(S)) - 1) of the exact
  softmax of the exact scores (exp and division rounded to within 1 ulp).
- Region sums: the probabilities of the region-grouped keys are cumulated (`cumsum`, sequential, float64) and each
  region's sum is the difference of the cumulative values at its ends: absolute error at most 2 S u per region.
  A row's region sums add to 1 within (2 G + S) u (G key regions).
- Query regions: each chunk's per-row region sums are added into their query region by a float64 one-hot matmul,
  chunk by chunk in ascending row order; the map holds the mean over the region's chosen query rows. The chunk size
  regroups those float64 adds: it moves a region's sum by at most 2 R_g u (R_g its rows), never more.
The probe computes on the device of q and k and returns float64 CPU tensors. It never writes q or k.

Cost (stated; `benchmarks/benchmark_attention_view.py` measures it on the GPU)
-------------------------------------------------------------------------------
R chosen query rows, S keys, H' chosen heads, D head channels, G key regions, Gq query regions, c rows per chunk:
  time     2 R S H' D flops (the QK^T products) + about 6 R S H' elementwise float64 operations (max, exp, sum,
           divide, cumsum, gather) + 2 R H' G Gq flops (query aggregation)
  memory   S H' D * 8 bytes (K in float64, grouped) + at most 3 c S H' * 8 bytes (one chunk's probabilities, computed
           in place, their cumulative sums, and the max / sum temporaries) + Gq H' G * 8 bytes (the map); never
           S x S unless c = S. `chunk_rows(S, H', budget)` picks c so
           the chunk's three buffers fit `budget` bytes (default `CHUNK_BYTES`, 1 GiB).

Contract
--------
- `attention_rows(q, k, rows, heads=None, key_order=None) -> (R, H', S) float64`: the probabilities of the chosen
  query rows (packed positions) for the chosen heads, columns in packed order (key j's probability at column j).
- `region_attention(q, k, query_regions, key_regions, rows=None, heads=None, key_order=None, chunk=None)
  -> (sums (Gq, H', G) float64, counts (Gq,) int64)`: for every query region, the sum over its chosen rows of each
  row's attention mass on each key region; `rows` limits the query rows (None: every row of a query region).
  `query_regions`, `key_regions`: (S,) int64 region of each packed row (`Regions.index`), G and Gq their counts.
- `AttentionMap`: the result of one view (block, pass, heads, regions, mean weights, cost), with `mean_heads()`,
  `lines()` (a text table) and `to_dict()`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ...errors import ValidationError

CHUNK_BYTES = 1 << 30  # the three float64 chunk buffers of one chunk of query rows
ARITHMETIC = ("float64 scores and softmax over keys in canonical order, grouped by region; region sums as "
              "differences of a float64 cumulative sum; query regions as means of their rows")
U64 = 2.0 ** -53


class AttentionViewError(ValidationError):
    """An attention view cannot be computed from what it was given (one line naming the value and the rule)."""


def gamma(n: int) -> float:
    """gamma(n) = n u / (1 - n u) for float64 (Higham): the relative error bound of an n-term float64 sum."""
    return n * U64 / (1 - n * U64)


def chunk_rows(keys: int, heads: int, budget: int = CHUNK_BYTES) -> int:
    """Query rows per chunk so that one chunk's three float64 (rows, heads, keys) buffers fit `budget` bytes."""
    return max(1, int(budget // (3 * 8 * max(1, heads) * max(1, keys))))


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.ndim != 3 or k.ndim != 3 or q.shape != k.shape:
        raise AttentionViewError(f"q {list(q.shape)} and k {list(k.shape)}: must be one batch item each, (S, H, D) "
                                 "of one shape")
    if not q.is_floating_point() or not k.is_floating_point():
        raise AttentionViewError(f"q {q.dtype}, k {k.dtype}: must be floating point")


def _heads(heads: Sequence[int] | None, H: int) -> list[int]:
    if heads is None:
        return list(range(H))
    out = [int(h) for h in heads]
    bad = [h for h in out if not 0 <= h < H]
    if bad or not out or len(set(out)) != len(out):
        raise AttentionViewError(f"heads {list(heads)}: must be distinct head indices in 0..{H - 1}")
    return out


def _canonical(key_order: torch.Tensor | None, S: int, device: torch.device) -> torch.Tensor:
    if key_order is None:
        return torch.arange(S, device=device)
    if key_order.shape != (S,):
        raise AttentionViewError(f"key_order of shape {list(key_order.shape)}: must be ({S},)")
    return key_order.to(device=device, dtype=torch.long)


def _probabilities(q64: torch.Tensor, k64: torch.Tensor, D: int) -> torch.Tensor:
    """(H', c, D) x (H', S, D) -> (H', c, S) float64 softmax over the keys (module docstring), in place after the
    matmul: one (H', c, S) buffer."""
    p = torch.matmul(q64, k64.transpose(1, 2))
    p.mul_(D ** -0.5)
    p.sub_(p.amax(dim=-1, keepdim=True)).exp_()
    return p.div_(p.sum(dim=-1, keepdim=True))


def attention_rows(q: torch.Tensor, k: torch.Tensor, rows: Sequence[int] | torch.Tensor,
                   heads: Sequence[int] | None = None, key_order: torch.Tensor | None = None) -> torch.Tensor:
    """(R, H', S) float64 probabilities of query rows `rows` (packed positions) for `heads`, columns in packed order
    (module docstring: keys visited in canonical order)."""
    _check_qk(q, k)
    S, H, D = q.shape
    hs = _heads(heads, H)
    rows = torch.as_tensor(rows, dtype=torch.long, device=q.device).flatten()
    if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < S):
        raise AttentionViewError(f"query rows must lie in 0..{S - 1}")
    canon = _canonical(key_order, S, q.device)
    idx = torch.tensor(hs, device=q.device)
    q64 = q[rows][:, idx].to(torch.float64).transpose(0, 1)  # (H', R, D)
    k64 = k[canon][:, idx].to(torch.float64).transpose(0, 1)  # (H', S, D) canonical order
    p_canon = _probabilities(q64, k64, D)  # (H', R, S)
    out = torch.empty_like(p_canon)
    out[..., canon] = p_canon  # back to packed columns
    return out.transpose(0, 1).cpu()


def region_attention(q: torch.Tensor, k: torch.Tensor, query_regions: torch.Tensor, key_regions: torch.Tensor,
                     rows: Sequence[int] | torch.Tensor | None = None, heads: Sequence[int] | None = None,
                     key_order: torch.Tensor | None = None, chunk: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums (Gq, H', G), counts (Gq,)): per query region the summed region mass of its chosen rows (module
    docstring); never more than `chunk` query rows at a time."""
    _check_qk(q, k)
    S, H, D = q.shape
    hs = _heads(heads, H)
    for name, t in (("query_regions", query_regions), ("key_regions", key_regions)):
        if t.shape != (S,) or t.dtype != torch.long:
            raise AttentionViewError(f"{name} {list(t.shape)} {t.dtype}: must be ({S},) int64 (Regions.index)")
    dev = q.device
    Gq, G = int(query_regions.max()) + 1, int(key_regions.max()) + 1
    rows = torch.arange(S) if rows is None else torch.as_tensor(rows, dtype=torch.long).flatten().cpu()
    chunk = chunk or chunk_rows(S, len(hs))
    # Keys: canonical order, grouped by region (stable: canonical order within a region).
    canon = _canonical(key_order, S, torch.device("cpu"))
    grouped = canon[torch.sort(key_regions.cpu()[canon], stable=True).indices]
    ends = torch.bincount(key_regions.cpu(), minlength=G).cumsum(0)  # (G,) exclusive end of each region's keys
    starts = ends - torch.bincount(key_regions.cpu(), minlength=G)
    idx = torch.tensor(hs, device=dev)
    k64 = k[grouped.to(dev)][:, idx].to(torch.float64).transpose(0, 1)  # (H', S, D)
    ends_d, starts_d = (ends - 1).clamp(min=0).to(dev), (starts - 1).clamp(min=0).to(dev)
    empty_start, empty = (starts == 0).to(dev), (ends == starts).to(dev)  # no key before it / no key in it
    sums = torch.zeros(Gq, len(hs) * G, dtype=torch.float64, device=dev)
    qr_all = query_regions.cpu()
    for lo in range(0, rows.numel(), chunk):
        part = rows[lo:lo + chunk]
        q64 = q[part.to(dev)][:, idx].to(torch.float64).transpose(0, 1)  # (H', c, D)
        c = _probabilities(q64, k64, D).cumsum(dim=-1)  # (H', c, S) cumulative over grouped keys
        zero = torch.zeros((), dtype=c.dtype, device=dev)
        hi_c = c.index_select(-1, ends_d)
        lo_c = torch.where(empty_start, zero, c.index_select(-1, starts_d))
        del c
        hi_c = torch.where(empty, lo_c, hi_c)
        per_row = (hi_c - lo_c).transpose(0, 1).reshape(part.numel(), -1)  # (c, H' * G)
        onehot = torch.nn.functional.one_hot(qr_all[part], Gq).to(device=dev, dtype=torch.float64)  # (c, Gq)
        sums += onehot.T @ per_row
    counts = torch.bincount(qr_all[rows], minlength=Gq)
    return sums.reshape(Gq, len(hs), G).cpu(), counts


@dataclass
class AttentionMap:
    """One attention view: the mean attention of each chosen query region's rows on every key region, per head.

    weights (Gq, H', G) float64: row g, head h: the mean over region g's chosen query rows of the probability mass on
    each key region (each (g, h) row sums to 1); `query`/`key`: (labels, kinds, times) of the regions; `rows`: the
    query rows behind each query region; `block`, `step` (pass), `heads`, `batch_item`; `cost`: seconds, rows, keys,
    flops; `arithmetic`: `ARITHMETIC`."""

    block: int
    step: int
    heads: tuple[int, ...]
    query_labels: tuple[str, ...]
    query_kinds: tuple[str, ...]
    query_times: torch.Tensor
    key_labels: tuple[str, ...]
    key_kinds: tuple[str, ...]
    key_times: torch.Tensor
    weights: torch.Tensor
    rows: torch.Tensor
    batch_item: int = 0
    cost: dict[str, Any] = field(default_factory=dict)
    arithmetic: str = ARITHMETIC

    def mean_heads(self) -> torch.Tensor:
        """(Gq, G) the weights averaged over the chosen heads."""
        return self.weights.mean(dim=1)

    def keys(self, words: str | Sequence[str] | None) -> list[int]:
        """Key region indices named by selector words (`views.regions.select`: "video", "frame3", "text", ...)."""
        from .regions import select_labels

        return select_labels(self.key_labels, self.key_kinds, words)

    def key_columns(self, keys: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights on the key regions `keys` (Gq, H', K), the mass left on every other region (Gq, H'))."""
        keep = torch.as_tensor(list(keys), dtype=torch.long)
        w = self.weights.index_select(2, keep)
        return w, self.weights.sum(dim=2) - w.sum(dim=2)

    def lines(self, top: int = 3, keys: Sequence[int] | None = None) -> list[str]:
        """A text table: per query region its `top` key regions (mean over heads), among `keys` when given."""
        w = self.mean_heads()
        cols = list(range(w.shape[1])) if keys is None else list(keys)
        heads = "all heads" if len(self.heads) > 8 else "heads " + ",".join(map(str, self.heads))
        out = [f"attention block {self.block} pass {self.step + 1}, {heads}: {len(self.query_labels)} query regions "
               f"x {len(self.key_labels)} key regions ({int(self.rows.sum())} query rows, "
               f"{self.cost.get('seconds', 0.0):.3f} s)"]
        for g, label in enumerate(self.query_labels):
            vals = w[g, cols]
            order = torch.argsort(vals, descending=True, stable=True)[:top].tolist()
            best = ", ".join(f"{self.key_labels[cols[j]]} {float(vals[j]):.3f}" for j in order)
            out.append(f"  {label:>14} -> {best}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "block": self.block, "pass": self.step, "heads": list(self.heads), "batch_item": self.batch_item,
            "query": {"labels": list(self.query_labels), "kinds": list(self.query_kinds),
                      "times": self.query_times.tolist(), "rows": self.rows.tolist()},
            "key": {"labels": list(self.key_labels), "kinds": list(self.key_kinds), "times": self.key_times.tolist()},
            "weights": self.weights.tolist(), "cost": dict(self.cost), "arithmetic": self.arithmetic,
        }


def attention_map(q: torch.Tensor, k: torch.Tensor, regions: Any, *, block: int, step: int,
                  query: Sequence[int] | None = None, heads: Sequence[int] | None = None,
                  key_order: torch.Tensor | None = None, chunk: int | None = None, batch_item: int = 0
                  ) -> AttentionMap:
    """The `AttentionMap` of q, k (S, H, D) over `regions` (a `views.regions.Regions`): query rows are the rows of
    the query regions `query` (None: every region), keys every row (module docstring)."""
    _check_qk(q, k)
    S, H, D = q.shape
    if regions.num_rows != S:
        raise AttentionViewError(f"the block saw {S} rows and the layout has {regions.num_rows}: a transform changed "
                                 "the rows (token reduction); attention views need the full layout")
    hs = _heads(heads, H)
    qsel = list(range(regions.num_regions)) if query is None else sorted(set(query))
    rows = regions.rows_of(qsel)
    # Query regions renumbered 0..len(qsel)-1; rows of other regions are never read.
    renumber = torch.full((regions.num_regions,), 0, dtype=torch.long)
    renumber[qsel] = torch.arange(len(qsel))
    started = time.perf_counter()
    sums, counts = region_attention(q, k, renumber[regions.index], regions.index, rows=rows, heads=hs,
                                    key_order=key_order, chunk=chunk)
    if q.is_cuda:
        torch.cuda.synchronize(q.device)
    seconds = time.perf_counter() - started
    counts = counts[: len(qsel)]
    weights = sums[: len(qsel)] / counts.clamp(min=1).to(torch.float64)[:, None, None]
    R = rows.numel()
    cost = {"seconds": seconds, "query_rows": R, "keys": S, "heads": len(hs), "head_dim": D,
            "flops": 2 * R * S * len(hs) * D, "chunk_rows": chunk or chunk_rows(S, len(hs))}
    pick = lambda seq: tuple(seq[g] for g in qsel)  # noqa: E731
    return AttentionMap(block=block, step=step, heads=tuple(hs), query_labels=pick(regions.labels),
                        query_kinds=pick(regions.kinds), query_times=regions.times[qsel],
                        key_labels=regions.labels, key_kinds=regions.kinds, key_times=regions.times,
                        weights=weights, rows=counts, batch_item=batch_item, cost=cost)


def score_error_bound(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, heads: Sequence[int]) -> float:
    """The largest float64 score error E over the chosen rows and heads (module docstring): gamma(D + 1) * D**-0.5 *
    max_j sum_i |q_i k_ji|."""
    S, H, D = q.shape
    idx = torch.tensor(list(heads))
    qa = q[rows][:, idx].abs().to(torch.float64).transpose(0, 1)
    ka = k[:, idx].abs().to(torch.float64).transpose(0, 1)
    return gamma(D + 1) * (D ** -0.5) * float(torch.matmul(qa, ka.transpose(1, 2)).max())


def probability_bound(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, heads: Sequence[int]) -> float:
    """The relative bound of each probability against the exact softmax of the exact scores (module docstring)."""
    S = q.shape[0]
    E = score_error_bound(q, k, rows, heads)
    return math.exp(2 * E) * (1 + 2 * U64) ** 2 * (1 + gamma(S)) - 1
