"""A fixed-size summary of a lengths index, what start-up reads instead of the whole index.

Sizing the buckets (`capacity`, `sizing`) and setting up a planner (`work.Phases`) need the
data's proportions (units per phase, attention tiles per unit) and its extremes (the longest
document, the largest item, the smallest document), never every sample. At 10^8 samples a
pass of Python-level work per sample, or an array of every sample's work per phase, is minutes
and gigabytes a host; the summary is bounded:

- `body`: a uniform sample of `SAMPLE` samples (the whole index when it holds no more: every
  figure is then exactly the index's, so plans on small indexes are what they were), for the
  proportions;
- `tail`: the `TAIL` samples with the longest LLM sequences (and, where samples hold two
  documents, a preference pair's, those with the longest LLM document) and, per encoder phase,
  those with the most units and the largest items, for the extremes a capacity must hold (a
  sample of the body alone would miss them: one document in 10^6 is what sets a tile capacity);
- the exact maxima and minima per phase.

The tail and the extremes come from one vectorised pass over the index in chunks of `CHUNK`
samples (a sample's sums are differences of a running sum at its items' pointers; the highest
scores are kept chunk by chunk, looking only at those above the lowest kept), so memory stays
bounded and the pass is numpy's speed over the index's arrays (memory-mapped ones included).
The summary is computed once per (index, units per LLM token) and kept while the index lives.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from jaxmllm.config.phases import LLM, NAMES
from jaxmllm.data.columnar import window
from jaxmllm.data.lengths import Items, LengthsIndex, document_table, split_documents

SAMPLE = 1 << 16  # samples of the body (a uniform sample); the whole index below it
TAIL = 256  # samples of the tail per measure (longest LLM sequence, most units, largest item)
CHUNK = 1 << 20  # samples a chunk of the pass over the index (its working set: ~100 MB)
SEED = 20240906  # the body's draw (a summary is a function of the index alone)


@dataclass(frozen=True)
class IndexSummary:
    """A bounded view of a lengths index (module docstring). Per phase (the LLM's tokens, each
    encoder phase's item units): `most` the largest document, `least` the smallest non-zero
    one (0 for a phase without data; the LLM's documents are a preference pair's two, each
    sample's one else: `LengthsIndex.llm_documents`); `most_units` per phase the most units
    of one sample (the LLM's: the longest sample's tokens, a pair's both documents, what one
    row must hold)."""

    samples: int  # samples of the index
    body: LengthsIndex  # a uniform sample (the index itself when small)
    body_ids: np.ndarray  # its samples' ids in the index (ascending)
    tail: LengthsIndex  # the tail samples
    tail_ids: np.ndarray  # their ids in the index (ascending)
    most: Mapping[str, int]
    least: Mapping[str, int]
    most_units: Mapping[str, int]

    @property
    def whole(self) -> bool:
        """Whether the body is the whole index (every figure exact)."""
        return len(self.body) == self.samples

    @property
    def scale(self) -> float:
        """Samples of the index per sample of the body (totals of the body times this)."""
        return self.samples / max(len(self.body), 1)


_CACHE: dict[tuple[int, tuple], IndexSummary] = {}


def summary_of(index: LengthsIndex, per_token: Mapping[str, int]) -> IndexSummary:
    """The summary of `index` with `per_token` encoder units per LLM token, computed once and
    kept while the index lives."""
    key = (id(index), tuple(sorted(per_token.items())))
    got = _CACHE.get(key)
    if got is None:
        got = _CACHE[key] = summarize(index, per_token)
        weakref.finalize(index, _CACHE.pop, key, None)
    return got


def summarize(index: LengthsIndex, per_token: Mapping[str, int]) -> IndexSummary:
    """The summary of `index` (module docstring), computed afresh."""
    n = len(index)
    most = dict.fromkeys([LLM, *NAMES], 0)
    least = dict.fromkeys([LLM, *NAMES], 0)
    most_units = dict.fromkeys([LLM, *NAMES], 0)
    # (LLM; per phase units, largest item; the LLM's longest document where samples split)
    tops = [_Top() for _ in range(2 + 2 * len(NAMES))]
    paired = index.split is not None
    phases = [(k, p) for k, p in enumerate(NAMES) if len(index.items[p].sizes)]
    if n <= SAMPLE:  # (the whole index when small, else a sample)
        body_ids = np.arange(n, dtype=np.int64)
    else:
        body_ids = np.sort(np.random.default_rng(SEED).choice(n, SAMPLE, replace=False))
    bodies = []
    for start in range(0, n, CHUNK):
        lo, hi = start, min(n, start + CHUNK)
        # (each window read from its column's file, not through the mapping: the pages of a
        # mapped column a pass touched would stay in the process's resident memory)
        text = window(index.text, lo, hi)
        llm, chunk = text.astype(np.int64), {}
        for k, p in phases:  # (a phase without items adds nothing: its pointers unread)
            ptr = window(index.items[p].ptr, lo, hi + 1)
            sizes = window(index.items[p].sizes, int(ptr[0]), int(ptr[-1]))
            sizes = sizes.astype(np.int64, copy=False)
            chunk[p] = Items(ptr - ptr[0], sizes)
            units = _run_sums(sizes, ptr)
            llm += _rows(sizes, ptr, units, per_token[p])
            tops[1 + 2 * k].add(lo, units)
            # (an item's sample: the run its position falls in)
            big = tops[2 + 2 * k].add(0, sizes, keep=False)
            tops[2 + 2 * k].ids_of(lo + np.searchsorted(ptr, ptr[0] + big, "right") - 1, sizes[big])
            _extremes(most, least, p, sizes)
            most_units[p] = max(most_units[p], int(units.max(initial=0)))
        tops[0].add(lo, llm)
        most_units[LLM] = max(most_units[LLM], int(llm.max(initial=0)))
        split = window(index.split, lo, hi).astype(np.int64) if paired else None
        if split is None:
            _extremes(most, least, LLM, llm)
        else:  # (a pair's or a group's documents: its longest one in the tail)
            _extremes(most, least, LLM, split_documents(llm, split))
            tops[-1].add(lo, document_table(llm, split)[0].max(1))
        if len(body_ids) < n:  # (the sample's members in this window, gathered from it)
            mine = body_ids[np.searchsorted(body_ids, lo) : np.searchsorted(body_ids, hi)]
            part = LengthsIndex(text=text, items=chunk, split=split)
            bodies.append(subset(part, mine - lo))
    tail_ids = np.unique(np.concatenate([t.ids for t in tops]))
    body = index if len(body_ids) == n else LengthsIndex.concat(bodies)
    tail = subset(index, tail_ids)
    return IndexSummary(n, body, body_ids, tail, tail_ids, most, least, most_units)


def _rows(sizes: np.ndarray, ptr: np.ndarray, units: np.ndarray, per: int) -> np.ndarray:
    """Each run's LLM rows, the sum of its items' `sizes // per` (`units`: the runs' sums of
    `sizes`): the units' quotient when every size is a multiple of `per` (an image's patches
    come in whole merge blocks), which saves a second running sum."""
    if per == 1:
        return units
    odd = sizes & (per - 1) if per & (per - 1) == 0 else sizes % per
    return units // per if not odd.any() else _run_sums(sizes // per, ptr)


def _run_sums(values: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """The sum of each run of `values` (run i: ptr[i] - ptr[0] .. ptr[i + 1] - ptr[0])."""
    cum = np.zeros(len(values) + 1, np.int64)
    np.cumsum(values, dtype=np.int64, out=cum[1:])
    ends = np.take(cum, ptr - ptr[0])
    return np.diff(ends)


class _Top:
    """The ids of the TAIL highest scores seen, chunk by chunk: only those above the lowest
    kept one are looked at after the first chunk (few, on a long tail)."""

    def __init__(self):
        self.ids = np.zeros(0, np.int64)
        self.scores = np.zeros(0, np.int64)

    def add(self, first: int, score: np.ndarray, keep: bool = True) -> np.ndarray:
        """Folds in `score` (of ids first, first + 1, ...); with `keep` False only returns
        the positions that would enter (for `ids_of`)."""
        floor = self.scores.min() if len(self.scores) >= TAIL else 0
        cand = np.flatnonzero(score > floor)
        if len(cand) > TAIL:
            cand = cand[np.argpartition(score[cand], len(cand) - TAIL)[len(cand) - TAIL :]]
        if keep:
            self.ids_of(first + cand, score[cand])
        return cand

    def ids_of(self, ids: np.ndarray, scores: np.ndarray) -> None:
        """Folds in these (id, score) pairs, keeping the TAIL highest."""
        ids = np.concatenate([self.ids, ids])
        scores = np.concatenate([self.scores, scores])
        if len(scores) > TAIL:
            top = np.argpartition(scores, len(scores) - TAIL)[len(scores) - TAIL :]
            ids, scores = ids[top], scores[top]
        self.ids, self.scores = ids, scores


def _extremes(most: dict, least: dict, phase: str, values: np.ndarray) -> None:
    """Folds `values` (a chunk's documents of `phase`) into `most` and `least` (non-zero)."""
    if not len(values):
        return
    top = int(values.max())
    if top <= 0:
        return
    most[phase] = max(most[phase], top)
    low = int(values.min())  # (items have units: the smallest is the smallest non-zero)
    if low <= 0:
        low = int(np.where(values > 0, values, top).min())
    least[phase] = low if not least[phase] else min(least[phase], low)


def subset(index: LengthsIndex, ids: np.ndarray) -> LengthsIndex:
    """The samples `ids` of `index` (ascending) as an index of their own."""
    items = {}
    for p in NAMES:
        ptr = index.items[p].ptr
        first = ptr[ids]
        count = ptr[ids + 1] - first
        flat = np.repeat(first - np.concatenate([[0], np.cumsum(count)[:-1]]), count)
        flat += np.arange(int(count.sum()), dtype=np.int64)
        new_ptr = np.concatenate([[0], np.cumsum(count)]).astype(np.int64)
        items[p] = Items(new_ptr, index.items[p].sizes[flat].astype(np.int64, copy=False))
    text = index.text[ids].astype(np.int64, copy=False)
    return LengthsIndex(text=text, items=items, split=index.split_rows(ids))
