"""A bijective index shuffle: the position of each of [0, n) in a random permutation, computed
for any positions at once without storing the permutation.

An epoch's order over 10^8 samples as a stored permutation is 800 MB a host and seconds to draw;
this is a keyed pseudo-random permutation (a Feistel network, as grain's `index_shuffle` and
format-preserving encryption use): the n positions are numbers of 2h bits (the fewest with
2^(2h) >= n), split into two h-bit halves, mixed by `ROUNDS` rounds of `left ^= F(right, key)`
with the halves swapped between rounds, which is a bijection of [0, 2^(2h)) whatever F is.
"Cycle walking" makes it one of [0, n): a value >= n is shuffled again until it falls below n
(it does: following the permutation's cycle from a position below n comes back to it), fewer
than four times on average as 2^(2h) < 4n. F is splitmix64's finaliser of the half and a round
key (the key's SeedSequence words), so the order is a function of the key alone.

grain's own `index_shuffle` computes one position a call (about 7 us each in Python); a step's
window of tens of thousands of samples wants them as one numpy operation (about 0.1 us each).
"""

from __future__ import annotations

import numpy as np

ROUNDS = 4  # Feistel rounds: 4 make a pseudo-random permutation of a pseudo-random F (Luby-Rackoff)
M1, M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's


class IndexShuffle:
    """A permutation of [0, n) from `key` (ints): `shuffle(positions)` -> the samples there."""

    def __init__(self, n: int, key: list[int]):
        self.n = int(n)
        bits = max(1, (max(self.n, 2) - 1).bit_length())  # 2^bits >= n
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = np.random.SeedSequence([int(k) for k in key]).generate_state(ROUNDS, np.uint64)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The samples at `positions` (each in [0, n)) of this permutation, as int64."""
        x = np.asarray(positions, np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"positions must be in [0, {self.n})")
        y = self._feistel(x.astype(np.uint64))
        out = y >= self.n
        while out.any():  # cycle walking (see the module docstring)
            y[out] = self._feistel(y[out])
            out[out] = y[out] >= self.n
        return y.astype(np.int64)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        f = np.empty_like(x)
        for key in self.keys:
            np.bitwise_xor(right, key, out=f)
            _mix(f)
            f &= self.mask
            f ^= left
            left, right, f = right, f, left
        left <<= self.half
        left |= right
        return left


def _mix(z: np.ndarray) -> None:
    """splitmix64's finaliser, in place: every output bit depends on every input bit."""
    z ^= z >> np.uint64(30)
    z *= M1
    z ^= z >> np.uint64(27)
    z *= M2
    z ^= z >> np.uint64(31)
