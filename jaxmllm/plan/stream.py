"""The sample stream: the epoch-shuffled order every planner reads samples from; for a mixture
of data sets, rounds of samples drawn from each by weight."""

from __future__ import annotations

import numpy as np

from jaxmllm.data.lengths import LengthsIndex, Mixture


def stream_of(index: LengthsIndex, seed: int) -> SampleStream:
    """The stream of an index: a `MixtureStream` for a mixture, else the epoch-shuffled one."""
    if index.mixture is not None:
        return MixtureStream(index.mixture, seed)
    return SampleStream(len(index), seed)


class SampleStream:
    """The epoch-shuffled order of samples; position p is sample order(p // N)[p % N]."""

    KEEP_ITEMS = 1 << 22  # epoch orders kept: of at most this many samples in all, or 2 epochs
    # (take() drops those before its start; a large dataset's window spans one or two epochs)

    def __init__(self, num_samples: int, seed: int | list[int]):
        self.n, self.seed = num_samples, seed
        self._orders: dict[int, np.ndarray] = {}

    def take(self, start: int, count: int) -> np.ndarray:
        """Sample indices at stream positions start .. start+count-1."""
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

    def draw(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s order: a permutation of the samples, from (seed, epoch)."""
        key = [*self.seed, epoch] if isinstance(self.seed, list) else [self.seed, epoch]
        return np.random.default_rng(key).permutation(self.n)


class MixtureStream(SampleStream):
    """Samples of several sources (`LengthsIndex.mixture`) drawn by weight, in rounds.

    Round e (stream positions e*N .. (e+1)*N - 1, N the index's length, its "epoch") holds
    `draws[s]` samples of each source s: its next ones in its own epoch-shuffled order (a source
    drawn more than its share repeats its epochs sooner, one drawn less goes through its epochs
    over several rounds), in an order shuffled from (seed, e). Position p is a function of (seed,
    p) alone, so the cursor is the mixture's whole state.
    """

    def __init__(self, mixture: Mixture, seed: int):
        super().__init__(mixture.starts[-1], seed)
        self.mixture = mixture
        sizes = np.diff(mixture.starts)
        self.sources = [SampleStream(int(n), [seed, 1 + s]) for s, n in enumerate(sizes)]

    def draw(self, epoch: int) -> np.ndarray:
        parts = []
        for s, (start, n) in enumerate(zip(self.mixture.starts, self.mixture.draws, strict=False)):
            parts.append(start + self.sources[s].take(epoch * n, n))
        mixed = np.concatenate(parts)
        return mixed[np.random.default_rng([self.seed, 0, epoch]).permutation(len(mixed))]
