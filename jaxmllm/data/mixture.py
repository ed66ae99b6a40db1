"""A mixture of data sets (`data.sources`) as one source and one lengths index.

Each source is a data set with its own index (`jaxmllm.data.source.open_data_set`); the mixture
puts their samples one after another (sample i of the mixture is sample i - start of its
source) into one `LengthsIndex`, whose `Mixture` says where each source starts and how many of
its samples every round of the stream draws (`jaxmllm.plan.stream.MixtureStream`): the planner
sees one index, so it balances across sources, and the stream's position, its cursor, is the
mixture's, saved with every checkpoint.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from jaxmllm.config import ConfigError
from jaxmllm.data.lengths import LengthsIndex, Mixture
from jaxmllm.data.samples import Sample


class MixtureSource:
    """grain random-access source over several data sets' sources: `source[i]` -> Sample.

    `parts` are the sources (`ManifestSource`s), `sets` their `DataSet`s (name, weight).
    """

    def __init__(self, parts: Sequence, sets: Sequence):
        """One source over the data sets' sources (`parts`, one per set of `sets`), their rows one
        set after another; refuses two sets of one name."""
        names = [ds.name for ds in sets]
        twice = [n for n, c in Counter(names).items() if c > 1]
        if twice:
            raise ConfigError(
                f"data.sources: several sources are named {twice[0]!r} (a name is the file's "
                "stem unless given): give each a distinct `name`"
            )
        sizes = [len(p) for p in parts]
        try:
            mixture = Mixture.of(names, sizes, [ds.weight for ds in sets])
        except ValueError as e:
            raise ConfigError(
                f"data.sources: {e}; give it data, or a larger weight (weights: "
                f"{[ds.weight for ds in sets]}, all 0 = in proportion to the records)"
            ) from None
        self.parts, self.mixture = list(parts), mixture
        self.starts = np.asarray(mixture.starts, np.int64)
        self._index: LengthsIndex | None = None
        self.specials = parts[0].specials  # (one tokenizer for all)
        self.pairs = parts[0].pairs  # (every source's, by the objective: `check_objective`)
        self.media_ids = list(self.specials.media.values())
        self.startup_rejects = [
            {**e, "source": name}
            for p, name in zip(parts, names, strict=True)
            for e in p.startup_rejects
        ]
        counts: Counter[str] = Counter()
        for p in parts:
            counts.update(p.index_rejects)
        self.index_rejects = dict(counts)

    def __len__(self) -> int:
        """Rows of every data set together."""
        return int(self.starts[-1])

    @property
    def index(self) -> LengthsIndex:
        """The sources' lengths one after another (made on first use: a worker process,
        which loads samples through the parts, never needs this copy of every count)."""
        if self._index is None:
            self._index = LengthsIndex.concat([p.index for p in self.parts], self.mixture)
        return self._index

    def __getstate__(self):
        """Sent to a loader worker without its combined lengths index (built again there on use)."""
        return {**self.__dict__, "_index": None}

    def _at(self, i: int) -> tuple[int, int]:
        """(data set, its row) of mixture row i."""
        s = int(np.searchsorted(self.starts, int(i), "right")) - 1
        return s, int(i) - int(self.starts[s])

    def __getitem__(self, i: int) -> Sample:
        """Mixture row i as a Sample, every item decoded."""
        return self.load(i)

    def load(self, i: int, keep: dict[str, tuple[int, ...]] | None = None) -> Sample:
        """Sample i (its source's sample, numbered as the mixture's)."""
        s, j = self._at(i)
        sample = self.parts[s].load(j, keep)
        sample.id = int(i)
        return sample

    def record_id(self, i: int) -> str:
        """The record id of mixture row i, as its data set names it."""
        s, j = self._at(i)
        return self.parts[s].record_id(j)
