"""The sample stream: the epoch-shuffled order every planner reads samples from."""

from __future__ import annotations

import numpy as np


class SampleStream:
    """The epoch-shuffled order of samples; position p is sample order(p // N)[p % N]."""

    KEEP_ITEMS = 1 << 22  # epoch orders kept: of at most this many samples in all, or 2 epochs
    # (take() drops those before its start; a large dataset's window spans one or two epochs)

    def __init__(self, num_samples: int, seed: int):
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
            order = np.random.default_rng([self.seed, epoch]).permutation(self.n)
            self._orders[epoch] = order
            while len(self._orders) > max(2, self.KEEP_ITEMS // max(self.n, 1)):
                del self._orders[min(self._orders)]
        return order
