"""Regions of a packed layout: the groups of rows an attention view sums over, readable at 20k+ rows.

Contract
--------
`layout_regions(layout, text_labels=None, audio_bin=1, text_words=None) -> Regions` names every packed row's region,
in the layout's current packed order (the order the model's hook points see):

  text      one region per text row (a token), labelled "t<i>" or "t<i>:<label>" with `text_labels` (one string per
            text row, e.g. the decoded tokens), kind "text"; with `text_words` (one word index per text row,
            non-decreasing, e.g. `components.text_encoder.prompt_words`) one region per word instead: the rows of a
            word a sub-word tokenizer split ("tri", "angle") sum into one region "t<w>:<label of its first row>"
  anchors,  one region per conditioning or reference block, labelled with the block's label ("anchor0:first",
  references  "ref1:video", "ref1:soundtrack", "ref0:audio"), kind "cond" or "ref"
  video     one region per latent frame of the target video, "frame<k>", kind "video"
  audio     the target audio by time: latents [b*audio_bin, (b+1)*audio_bin) of both channels form region "audio<b>",
            kind "audio"

Regions are numbered in canonical block order (text, anchors / references, target audio bins, target video frames),
so a region index means the same thing whatever the packed order. `times` is each region's mean rotary time t
(the layout's `position_ids[:, 0]`, float64): video frames and audio bins sit on one clock (40 units per second),
which is what puts "video <-> audio over time" on one axis. `select(regions, words)` turns selector words into
region indices: a kind ("text", "cond", "ref", "video", "audio"), "all", a label ("frame3", "audio10", "ref0:image",
"t2") or its part before the colon ("ref0", "anchor0"), or a text row's label ("blue": every text row labelled so).

Pure functions of the layout's tables (no model, no tensor arithmetic beyond integer indexing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ...errors import ValidationError

KINDS = ("text", "cond", "ref", "video", "audio")


class RegionError(ValidationError):
    """A region selector or a region table request breaks a rule (one line naming the value and the rule)."""


@dataclass(frozen=True, eq=False)
class Regions:
    """The region table of a layout (module docstring): `index` (S,) int64 region of each packed row; `labels`,
    `kinds` one per region; `times` (G,) float64 mean rotary time; `counts` (G,) int64 rows per region."""

    index: torch.Tensor
    labels: tuple[str, ...]
    kinds: tuple[str, ...]
    times: torch.Tensor
    counts: torch.Tensor

    @property
    def num_regions(self) -> int:
        return len(self.labels)

    @property
    def num_rows(self) -> int:
        return self.index.numel()

    def of_kind(self, *kinds: str) -> list[int]:
        return [g for g, k in enumerate(self.kinds) if k in kinds]

    def rows_of(self, regions: Iterable[int]) -> torch.Tensor:
        """(R,) int64 packed rows in the given regions, ascending."""
        chosen = torch.zeros(self.num_regions, dtype=torch.bool)
        chosen[list(regions)] = True
        return torch.nonzero(chosen[self.index], as_tuple=False).flatten()

    def to_dict(self) -> dict:
        return {"labels": list(self.labels), "kinds": list(self.kinds), "times": self.times.tolist(),
                "counts": self.counts.tolist()}


def _word_starts(text_words: Sequence[int] | None, rows: int) -> list[int]:
    """The text rows that open a region: every row, or the first row of each word of `text_words`."""
    if text_words is None:
        return list(range(rows))
    words = list(text_words)
    if len(words) != rows:
        raise RegionError(f"{len(words)} text word indices for {rows} text rows: give one word index per text row")
    if any(isinstance(w, bool) or not isinstance(w, int) for w in words) or any(
            b < a for a, b in zip(words, words[1:])):
        raise RegionError(f"text_words={words}: must be integers, non-decreasing (a word's rows are consecutive)")
    return [i for i in range(rows) if i == 0 or words[i] != words[i - 1]]


def layout_regions(layout, text_labels: Sequence[str] | None = None, audio_bin: int = 1,
                   text_words: Sequence[int] | None = None) -> Regions:
    """The region table of `layout` (a `PackedLayout`; module docstring)."""
    if isinstance(audio_bin, bool) or not isinstance(audio_bin, int) or audio_bin < 1:
        raise RegionError(f"audio_bin={audio_bin!r}: must be an integer >= 1 (audio latents per region)")
    if not layout.is_consistent:
        raise RegionError(f"layout left {list(layout.left_behind)} behind: regions need a consistent layout")
    L = layout.num_text_tokens
    if text_labels is not None and len(text_labels) != L:
        raise RegionError(f"{len(text_labels)} text labels for {L} text rows: give one label per text row")
    starts = _word_starts(text_words, L)
    row_region = torch.tensor(starts, dtype=torch.long)  # the first row of each text region
    text_region_of_row = torch.searchsorted(row_region, torch.arange(L), right=True) - 1
    labels: list[str] = []
    kinds: list[str] = []
    # Per block: the region id of the block's first row and how a row offset maps to a region.
    block_region: list[tuple[int, str, int]] = []  # (first region id, how, per) per block
    for b in layout.blocks:
        first = len(labels)
        if b.role == "text":
            labels += [f"t{g}" if text_labels is None else f"t{g}:{text_labels[i]}" for g, i in enumerate(starts)]
            kinds += ["text"] * len(starts)
            block_region.append((first, "row", 1))
        elif b.role in ("cond", "ref"):
            labels.append(b.label)
            kinds.append(b.role)
            block_region.append((first, "block", 1))
        elif b.stream == "video":
            labels += [f"frame{k}" for k in range(b.frames)]
            kinds += ["video"] * b.frames
            block_region.append((first, "frame", b.grid_h * b.grid_w))
        else:
            bins = -(-b.audio_latents // audio_bin)
            labels += [f"audio{k}" for k in range(bins)]
            kinds += ["audio"] * bins
            block_region.append((first, "audio", b.audio_latents))
    first = torch.tensor([r[0] for r in block_region], dtype=torch.long)[layout.row_blocks]
    how = [block_region[i][1] for i in range(len(block_region))]
    per = torch.tensor([r[2] for r in block_region], dtype=torch.long)[layout.row_blocks]
    off = layout.row_offsets
    kind_of_row = torch.tensor([("row", "block", "frame", "audio").index(h) for h in how],
                               dtype=torch.long)[layout.row_blocks]
    text_step = text_region_of_row[off.clamp(max=max(L - 1, 0))] if L else torch.zeros_like(off)
    step = torch.where(kind_of_row == 0, text_step, torch.zeros_like(off))
    step = torch.where(kind_of_row == 2, off // per, step)
    step = torch.where(kind_of_row == 3, (off % per) // audio_bin, step)  # channel-major: latent = off % A
    index = first + step
    G = len(labels)
    counts = torch.bincount(index, minlength=G)
    t_sum = torch.zeros(G, dtype=torch.float64).index_add_(0, index, layout.position_ids[:, 0])
    return Regions(index=index, labels=tuple(labels), kinds=tuple(kinds), times=t_sum / counts.to(torch.float64),
                   counts=counts)


def select(regions: Regions, words: str | Sequence[str] | None) -> list[int]:
    """Region indices named by selector words (module docstring); None or "all" is every region."""
    return select_labels(regions.labels, regions.kinds, words)


def select_labels(labels: Sequence[str], kinds: Sequence[str], words: str | Sequence[str] | None) -> list[int]:
    """`select` over region labels and kinds alone (an `AttentionMap`'s key regions)."""
    if words is None:
        return list(range(len(labels)))
    items = [words] if isinstance(words, str) else list(words)
    chosen: list[int] = []
    for word in items:
        for part in str(word).split(","):
            part = part.strip()
            if part == "all":
                hits = list(range(len(labels)))
            elif part in KINDS:
                hits = [g for g, k in enumerate(kinds) if k == part]
            else:
                hits = [g for g, label in enumerate(labels) if part in (label, label.split(":")[0])
                        or kinds[g] == "text" and label.partition(":")[2] == part]
            if not hits:
                raise RegionError(f"region {part!r}: not in this layout (kinds {', '.join(KINDS)}, 'all', or a "
                                  f"label such as {labels[-1]!r})")
            chosen += [g for g in hits if g not in chosen]
    return sorted(chosen)
