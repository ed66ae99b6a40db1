"""The lengths index: per-sample counts in model units (text tokens, and per encoder phase the
units of each item: patches per image, frames per clip), what the planner plans from without
touching the media."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxmllm.config.phases import ENCODERS, LLM


@dataclass(frozen=True)
class Items:
    """One encoder phase's items of every sample, as a ragged array: sample i's items are
    `sizes[ptr[i]:ptr[i + 1]]`, each in the phase's units."""

    ptr: np.ndarray  # int64 [samples + 1]
    sizes: np.ndarray  # int64 [items]

    @classmethod
    def from_lists(cls, lists: list[list[int]]) -> Items:
        return cls(
            ptr=np.cumsum([0] + [len(x) for x in lists]).astype(np.int64),
            sizes=np.array([v for x in lists for v in x], np.int64),
        )

    @classmethod
    def none(cls, samples: int) -> Items:
        """No items for any of `samples` samples (a read-only view of one zero: no memory)."""
        return cls(ptr=np.broadcast_to(np.int64(0), (samples + 1,)), sizes=np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.sizes)

    def of(self, i: int) -> np.ndarray:
        """Sample i's item sizes."""
        return self.sizes[self.ptr[i] : self.ptr[i + 1]]

    def count(self) -> np.ndarray:
        """Items per sample."""
        return np.diff(self.ptr)

    def size(self, samples: np.ndarray, item: np.ndarray) -> np.ndarray:
        """The size of item `item` of each sample in `samples`."""
        return self.sizes[self.ptr[samples] + item]

    def per_sample(self, values: np.ndarray | None = None) -> np.ndarray:
        """Sum within each sample of `values` (one per item; default: the sizes)."""
        values = self.sizes if values is None else values
        if not len(values):
            return np.zeros(len(self.ptr) - 1, np.int64)
        # (the differences of the cumulative sum at each sample's first item: one pass and one
        # gather, exact in integers)
        total = np.empty(len(values) + 1, np.int64)
        total[0] = 0
        np.cumsum(values, out=total[1:])
        return np.diff(total[self.ptr])


@dataclass(frozen=True)
class Mixture:
    """Several data sets in one index, one after another (source s holds samples `starts[s]`
    .. `starts[s + 1] - 1`), each drawn `draws[s]` times in every round of `len(index)` samples
    (`jaxmllm.plan.stream.MixtureStream`): its weight's share, to the nearest sample."""

    names: tuple[str, ...]
    starts: tuple[int, ...]  # [sources + 1]
    draws: tuple[int, ...]  # [sources], summing to the index's length

    @classmethod
    def of(cls, names: list[str], sizes: list[int], weights: list[float]) -> Mixture:
        """Sources of `sizes` samples drawn by `weights` (all 0: in proportion to their sizes),
        apportioned to whole samples a round by largest remainder.

        Raises:
          ValueError: a source with no samples, or one whose weight draws none in a round.
        """
        total = sum(sizes)
        w = np.asarray(sizes if not any(weights) else weights, np.float64)
        quota = w / w.sum() * total
        draws = np.floor(quota).astype(np.int64)
        order = np.argsort(-(quota - draws), kind="stable")
        draws[order[: total - int(draws.sum())]] += 1
        for name, size, n in zip(names, sizes, draws.tolist(), strict=True):
            if not size or not n:
                why = "has no usable samples" if not size else "is drawn 0 times a round"
                raise ValueError(f"source {name!r} {why} (of {total} samples a round)")
        starts = np.cumsum([0, *sizes]).tolist()
        return cls(tuple(names), tuple(int(x) for x in starts), tuple(draws.tolist()))

    def source_of(self, samples: np.ndarray) -> np.ndarray:
        """Which source each sample is from."""
        return np.searchsorted(np.asarray(self.starts), samples, "right") - 1

    def counts(self, samples: np.ndarray) -> dict[str, int]:
        """Samples per source."""
        n = np.bincount(self.source_of(np.asarray(samples, np.int64)), minlength=len(self.names))
        return dict(zip(self.names, n.tolist(), strict=True))

    def to_json(self) -> dict:
        return {"names": list(self.names), "starts": list(self.starts), "draws": list(self.draws)}


@dataclass
class LengthsIndex:
    """Per-sample counts in model units, as ragged numpy arrays (vectorised planning needs them).

    text[i] = text tokens of sample i (placeholders excluded); items[phase] = the units of each
    item of every sample in that encoder phase (patches per image, log-mel frames per clip),
    for every phase of the table (empty where the data has none).
    """

    text: np.ndarray
    items: dict[str, Items]
    mixture: Mixture | None = None  # several data sets drawn by weight (data.sources)
    # The epoch order (`jaxmllm.plan.stream`): "permutation", a stored permutation (indexes
    # held in memory: synthetic, benchmark mixes), or "index", a bijective index shuffle that
    # stores nothing (a mapped index, `jaxmllm.data.columnar`, of any size)
    shuffle: str = "permutation"

    def __post_init__(self):
        empty = Items.none(len(self.text))
        self.items = {p.name: self.items.get(p.name, empty) for p in ENCODERS}

    def __len__(self) -> int:
        return len(self.text)

    @classmethod
    def from_records(cls, records: list[dict]) -> LengthsIndex:
        """Builds the index from dicts like {"text": 312, "images": [1024], "audio": [850]}."""
        return cls(
            text=np.array([r.get("text", 0) for r in records], np.int64),
            items={
                p.name: Items.from_lists([list(r.get(p.items, [])) for r in records])
                for p in ENCODERS
            },
        )

    @classmethod
    def concat(cls, parts: list[LengthsIndex], mixture: Mixture | None = None) -> LengthsIndex:
        """The samples of `parts`, one after another."""
        items = {}
        for p in ENCODERS:
            sizes = [part.items[p.name].sizes for part in parts]
            counts = [part.items[p.name].count() for part in parts]
            items[p.name] = Items(
                ptr=np.cumsum([0, *np.concatenate(counts)]).astype(np.int64),
                sizes=np.concatenate(sizes).astype(np.int64),
            )
        text = np.concatenate([part.text for part in parts]).astype(np.int64)
        mapped = any(part.shuffle == "index" for part in parts)
        return cls(text, items, mixture, "index" if mapped else "permutation")

    def record(self, i: int) -> dict:
        """Sample i in the lengths-file format."""
        out = {"text": int(self.text[i])}
        out.update({p.items: self.items[p.name].of(i).tolist() for p in ENCODERS})
        return out

    def write_jsonl(self, path: str | Path) -> None:
        """Writes the lengths file (one JSON object a line)."""
        with open(path, "w") as f:
            for i in range(len(self)):
                f.write(json.dumps(self.record(i)) + "\n")

    def units(self) -> dict[str, np.ndarray]:
        """Each encoder phase's units per sample."""
        return {name: items.per_sample() for name, items in self.items.items()}

    def work(self, per_token: Mapping[str, int]) -> np.ndarray:
        """Each sample's work per phase [sample, (LLM tokens, then each encoder phase's units,
        in the table's order)]."""
        return np.stack([self.llm_tokens(per_token), *self.units().values()], 1)

    def llm_tokens(self, per_token: Mapping[str, int]) -> np.ndarray:
        """LLM sequence length of each sample: text + one token per encoder output row
        (`per_token[phase]` units each)."""
        out = self.text.copy()
        for name, items in self.items.items():
            out = out + items.per_sample(items.sizes // per_token[name])
        return out

    def phases_of(self) -> tuple[str, ...]:
        """The phases the data has: the LLM's, and each encoder phase with any item."""
        return (LLM, *(name for name, items in self.items.items() if len(items)))
