"""The sample stream: the epoch-shuffled order every planner reads samples from; for a mixture
of data sets, rounds of samples drawn from each by weight.

An epoch's order is either a stored permutation (`shuffle="permutation"`: the indexes held in
memory, the synthetic source's and the benchmarks', whose plans stay as they were) or a
bijective index shuffle computed at the positions read (`"index"`: a mapped index of any
size, `jaxmllm.plan.shuffle`), which stores nothing: a host's memory does not grow with the
data set. Either way an epoch is a permutation of the samples, a function of (seed, epoch).
"""

from __future__ import annotations

import numpy as np

from jaxmllm.data.lengths import LengthsIndex, Mixture
from jaxmllm.plan.shuffle import IndexShuffle

SHUFFLES = ("permutation", "index")


def stream_of(index: LengthsIndex, seed: int) -> SampleStream:
    """The stream of an index (its `shuffle`): a `MixtureStream` for a mixture, else the
    epoch-shuffled one."""
    if index.mixture is not None:
        return MixtureStream(index.mixture, seed, index.shuffle)
    return SampleStream(len(index), seed, index.shuffle)


class SampleStream:
    """The epoch-shuffled order of samples; position p is sample order(p // N)[p % N]."""

    KEEP_ITEMS = 1 << 22  # epoch orders kept: of at most this many samples in all, or 2 epochs
    # (take() drops those before its start; a large dataset's window spans one or two epochs)

    def __init__(self, num_samples: int, seed: int | list[int], shuffle: str = "permutation"):
        if shuffle not in SHUFFLES:
            raise ValueError(f"shuffle must be one of {SHUFFLES}, got {shuffle!r}")
        self.n, self.seed, self.shuffle = num_samples, seed, shuffle
        self._orders: dict[int, np.ndarray] = {}
        self._shuffles: dict[int, IndexShuffle] = {}

    def take(self, start: int, count: int) -> np.ndarray:
        """Sample indices at stream positions start .. start+count-1."""
        if self.shuffle == "index":
            return self.at(np.arange(start, start + count, dtype=np.int64))
        out = np.empty(count, np.int64)
        done = 0
        for epoch in [e for e in self._orders if e < start // max(self.n, 1)]:
            del self._orders[epoch]  # (streams are read forward: those come back rarely)
        while done < count:  # one contiguous slice of an epoch's order at a time
            epoch, first = divmod(start + done, self.n)
            k = min(count - done, self.n - first)
            out[done : done + k] = self.order(epoch)[first : first + k]
            done += k
        return out

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of epoch `epoch`, drawn once and then kept: a planner reads a step's
        window past where it cuts it, and the next step starts there, so the same epochs come
        back within a few steps."""
        order = self._orders.get(epoch)
        if order is None:
            order = self._orders[epoch] = self.draw(epoch)
            while len(self._orders) > max(2, self.KEEP_ITEMS // max(self.n, 1)):
                del self._orders[min(self._orders)]
        return order

    def at(self, positions: np.ndarray) -> np.ndarray:
        """Sample indices at stream positions `positions` (any, in any order)."""
        positions = np.asarray(positions, np.int64)
        epochs, within = np.divmod(positions, max(self.n, 1))
        out = np.empty(len(positions), np.int64)
        for epoch in np.unique(epochs).tolist():
            sel = epochs == epoch
            out[sel] = self.in_epoch(epoch, within[sel])
        return out

    def in_epoch(self, epoch: int, within: np.ndarray) -> np.ndarray:
        """The samples at places `within` of epoch `epoch`'s order."""
        if self.shuffle == "permutation":
            return self.order(epoch)[within]
        shuffle = self._shuffles.get(epoch)
        if shuffle is None:  # (a few kept: a window spans one or two epochs)
            shuffle = self._shuffles[epoch] = IndexShuffle(self.n, self.key(epoch))
            while len(self._shuffles) > 4:
                del self._shuffles[min(self._shuffles)]
        return shuffle(within)

    def key(self, epoch: int) -> list[int]:
        return [*self.seed, epoch] if isinstance(self.seed, list) else [self.seed, epoch]

    def draw(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s order: a permutation of the samples, from (seed, epoch)."""
        return np.random.default_rng(self.key(epoch)).permutation(self.n)


class MixtureStream(SampleStream):
    """Samples of several sources (`LengthsIndex.mixture`) drawn by weight, in rounds.

    Round e (stream positions e*N .. (e+1)*N - 1, N the index's length, its "epoch") holds
    `draws[s]` samples of each source s: its next ones in its own epoch-shuffled order (a source
    drawn more than its share repeats its epochs sooner, one drawn less goes through its epochs
    over several rounds), in an order shuffled from (seed, e). Position p is a function of (seed,
    p) alone, so the cursor is the mixture's whole state.
    """

    def __init__(self, mixture: Mixture, seed: int, shuffle: str = "permutation"):
        super().__init__(mixture.starts[-1], seed, shuffle)
        self.mixture = mixture
        sizes = np.diff(mixture.starts)
        self.sources = [SampleStream(int(n), [seed, 1 + s], shuffle) for s, n in enumerate(sizes)]
        self.first_draw = np.cumsum([0, *mixture.draws])  # where each source's draws start

    def in_epoch(self, epoch: int, within: np.ndarray) -> np.ndarray:
        if self.shuffle == "permutation":
            return super().in_epoch(epoch, within)
        # Place q of the round is its draw `mixed[F(q)]` (`draw`'s, unstored): source s's
        # draw d is its own stream's position epoch x draws[s] + d.
        drawn = IndexShuffle(self.n, [self.seed, 0, epoch])(within)
        s = np.searchsorted(self.first_draw, drawn, "right") - 1
        out = np.empty(len(within), np.int64)
        for source in np.unique(s).tolist():
            sel = s == source
            mine = epoch * self.mixture.draws[source] + drawn[sel] - self.first_draw[source]
            out[sel] = self.mixture.starts[source] + self.sources[source].at(mine)
        return out

    def draw(self, epoch: int) -> np.ndarray:
        parts = []
        for s, (start, n) in enumerate(zip(self.mixture.starts, self.mixture.draws, strict=False)):
            parts.append(start + self.sources[s].take(epoch * n, n))
        mixed = np.concatenate(parts)
        return mixed[np.random.default_rng([self.seed, 0, epoch]).permutation(len(mixed))]
