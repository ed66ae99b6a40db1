"""numpy's `default_rng(key)` streams for many keys at once, without a Generator each.

The built-in synthetic source draws each sample's parameters from its own
`np.random.default_rng([seed, i, 0])`: deterministic per sample, whatever the order samples are
read in. Making 200k Generators takes seconds of Python; this computes the same numbers for all
samples at once with array arithmetic, following numpy's algorithms step by step:
`SeedSequence` (its hash mixing of the key's 32-bit words), `PCG64` (128-bit LCG state, XSL-RR
output), and the few draws the source makes (`random`, `integers` below 2**32 by Lemire's
method on the bit generator's buffered 32-bit halves, `geometric` by inversion of a ziggurat
exponential). Where numpy would take a rare branch (a rejected draw, the ziggurat's slow path),
the lane is marked and its caller draws it the ordinary way; `check` compares lanes against
real Generators, so a numpy that changed its streams costs time, never different samples.
The ziggurat's tables are read from numpy itself (`_Ziggurat`), by feeding it chosen words.
"""

from __future__ import annotations

import functools
import math

import numpy as np

M32 = np.uint64(0xFFFFFFFF)
# SeedSequence's hash constants and PCG64's multiplier (numpy/random/bit_generator.pyx,
# numpy/random/src/pcg64/pcg64.h).
INIT_A, MULT_A, INIT_B, MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
MIX_L, MIX_R = 0xCA01F9DD, 0x4973F715
PCG_MULT = (2549297995355413924 << 64) | 4865540595714422341
PCG_MULT_INVERSE = pow(PCG_MULT, -1, 1 << 128)  # (a step back)
POOL = 4


def key_words(value: int) -> list[int]:
    """An integer as SeedSequence reads it: 32-bit words, lowest first (0 is one word)."""
    if value < 0:
        raise ValueError("keys must be >= 0")
    words = []
    while True:
        words.append(value & 0xFFFFFFFF)
        value >>= 32
        if not value:
            return words


class Streams:
    """The PCG64 streams of `np.random.default_rng([*head, i, *tail])` for every i in `ids`
    (each of `head`, `tail` an int), advanced together: `next64()` is every lane's next
    64-bit output, `next32()` its next 32-bit one (the low half of a fresh output, then its
    high half, as PCG64 buffers them)."""

    def __init__(self, head: list[int], ids: np.ndarray, tail: list[int]):
        """Seeds a lane per id as `default_rng([*head, id, *tail])` would: the words SeedSequence
        reads, mixed, its 8 state words, then PCG64's seeding step (state and increment)."""
        ids = np.asarray(ids, np.uint64)
        if ids.size and int(ids.max()) > 0xFFFFFFFF:
            raise ValueError("ids must fit 32 bits")
        words = [w for v in head for w in key_words(v)]
        entropy = [np.full(ids.shape, w, np.uint64) for w in words] + [ids]
        entropy += [np.full(ids.shape, w, np.uint64) for v in tail for w in key_words(v)]
        seed = _generate_state(_mix_entropy(entropy))  # 8 x 32-bit words
        v = [seed[2 * k] | (seed[2 * k + 1] << np.uint64(32)) for k in range(4)]
        initstate = _limbs_of(v[0], v[1])  # (high, low) 64-bit halves
        initseq = _limbs_of(v[2], v[3])
        self.inc = _shift_left_or_one(initseq)
        state = _mul_add(_zeros(ids.shape), self.inc)  # state = 0; step
        state = _add(state, initstate)
        self.state = _mul_add(state, self.inc)  # step
        self._half: np.ndarray | None = None  # the buffered high halves

    def take(self, lanes: np.ndarray) -> Streams:
        """The streams of `lanes` (a mask or indices) alone, where they are now."""
        out = object.__new__(Streams)
        out.state = [a[lanes] for a in self.state]
        out.inc = [a[lanes] for a in self.inc]
        out._half = None if self._half is None else self._half[lanes]
        return out

    def next64(self) -> np.ndarray:
        """Every lane's next 64-bit output: the LCG step, then PCG64's XSL-RR output function."""
        self.state = _mul_add(self.state, self.inc)
        a0, a1, a2, a3 = self.state
        hi, lo = (a3 << np.uint64(32)) | a2, (a1 << np.uint64(32)) | a0
        x, rot = hi ^ lo, a3 >> np.uint64(26)
        return (x >> rot) | (x << ((np.uint64(64) - rot) & np.uint64(63)))

    def next32(self) -> np.ndarray:
        """Every lane's next 32-bit output, as PCG64 buffers them: the low half of a fresh 64-bit
        output, then its high half."""
        if self._half is not None:
            out, self._half = self._half, None
            return out
        word = self.next64()
        self._half = word >> np.uint64(32)
        return word & M32

    def random(self) -> np.ndarray:
        """`Generator.random()`: float64 in [0, 1)."""
        return (self.next64() >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)

    def integers(self, low: int, high: int) -> tuple[np.ndarray, np.ndarray]:
        """`Generator.integers(low, high)` (high exclusive, range below 2**32), and where it
        is exact: False where numpy would reject the draw and draw again."""
        span = high - 1 - low
        if span < 0:
            raise ValueError(f"low >= high ({low} >= {high})")  # (as numpy)
        if span == 0:
            return np.full(self.state[0].shape, low, np.int64), np.ones(self.state[0].shape, bool)
        excl = np.uint64(span + 1)
        m = self.next32() * excl
        ok = (m & M32) >= excl  # (below it numpy checks a threshold and may draw again)
        return (m >> np.uint64(32)).astype(np.int64) + low, ok

    def geometric(self, p: float) -> tuple[np.ndarray, np.ndarray]:
        """`Generator.geometric(p)`, and where it is exact: False on the ziggurat's slow path
        (p < 1/3: inversion of a standard exponential)."""
        if p >= 0.333333333333333333333333:  # (numpy's test) a search over the CDF
            return self._geometric_search(p)
        word = self.next64()
        zig = _Ziggurat.get()
        ri = word >> np.uint64(3)
        idx = (ri & np.uint64(0xFF)).astype(np.intp)
        ri >>= np.uint64(8)
        ok = ri < zig.ke[idx]
        x = ri.astype(np.float64) * zig.we[idx]
        z = np.ceil(-x / math.log1p(-p))
        big = z >= 9.223372036854776e18  # (the least double above INT64_MAX)
        out = np.where(big, 0.0, z).astype(np.int64)
        out[big] = np.iinfo(np.int64).max
        return out, ok

    def _geometric_search(self, p: float) -> tuple[np.ndarray, np.ndarray]:
        """The least x with u <= P(X <= x), the CDF summed term by term as numpy sums it."""
        u = self.random()
        top, cdf, term, q = float(u.max(initial=0.0)), [p], p, 1.0 - p
        while cdf[-1] < top and len(cdf) < 10_000:
            term *= q
            cdf.append(cdf[-1] + term)
        x = np.searchsorted(np.asarray(cdf), u, side="left")
        return x.astype(np.int64) + 1, x < len(cdf)  # (past the sum's end: drawn numpy's way)


class _Ziggurat:
    """numpy's exponential ziggurat tables (`we`, `ke`), read off `standard_exponential` by
    choosing the word it draws: ri = 1 returns we[idx] itself, and ke[idx] is the least ri that
    leaves the fast path (found by bisection, watching how many words a draw takes)."""

    def __init__(self):
        """The ziggurat's per-strip tables for the standard exponential, learned from numpy's own
        draws: each strip's fast-path value scale (`we`) and the least 53-bit draw that takes the
        slow path (`ke`, found by bisection); 0 where every draw is slow."""
        gen = np.random.Generator(np.random.PCG64(0))
        self.we = np.zeros(256)
        self.ke = np.zeros(256, np.uint64)
        for idx in range(256):
            fast, value = _exponential_of(gen, 1, idx)
            if not fast:
                continue  # (every draw of this strip takes the slow path: ke 0)
            self.we[idx] = value
            lo, hi = 1, 1 << 53  # fast at lo; the slow path at hi (ri < 2**53)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if _exponential_of(gen, mid, idx)[0] else (lo, mid)
            self.ke[idx] = hi

    @classmethod
    @functools.cache
    def get(cls) -> _Ziggurat:
        """The tables, built once per process (a bisection per strip over numpy's draws)."""
        return cls()


def _exponential_of(gen: np.random.Generator, ri: int, idx: int) -> tuple[bool, float]:
    """(whether it took one word, the value) of a `standard_exponential` whose next word makes
    `ri` and `idx`."""
    word = (ri << 11) | (idx << 3)
    after = word  # a state whose high half is 0 outputs its low half, unrotated
    inc = 1
    before = ((after - inc) * PCG_MULT_INVERSE) % (1 << 128)
    gen.bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {"state": before, "inc": inc},
        "has_uint32": 0,
        "uinteger": 0,
    }
    value = float(gen.standard_exponential())
    return gen.bit_generator.state["state"]["state"] == after, value


def check(streams_of, scalar_of, ids: np.ndarray) -> bool:
    """Whether `streams_of(ids)` equals `scalar_of(i)` for each i (a few, at start-up)."""
    got = streams_of(np.asarray(ids))
    return all(got[k] == scalar_of(int(i)) for k, i in enumerate(ids))


# ----------------------------------------------------------------------------- SeedSequence


def _u32(x: np.ndarray) -> np.ndarray:
    """The low 32 bits of each lane (uint64 arrays hold 32-bit words here)."""
    return x & M32


def _hashmix(value: np.ndarray, const: list[int]) -> np.ndarray:
    """SeedSequence's hashmix of 32-bit words, lane-wise; advances the shared multiplier
    `const[0]` as SeedSequence does between calls."""
    value = value ^ np.uint64(const[0])
    const[0] = (const[0] * MULT_A) & 0xFFFFFFFF
    value = _u32(value * np.uint64(const[0]))
    return value ^ (value >> np.uint64(16))


def _mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """SeedSequence's mix of two 32-bit words, lane-wise."""
    result = _u32(np.uint64(MIX_L) * x - np.uint64(MIX_R) * y)
    return result ^ (result >> np.uint64(16))


def _mix_entropy(entropy: list[np.ndarray]) -> list[np.ndarray]:
    """SeedSequence's entropy pool (4 words) from the entropy words, lane-wise: each word
    hashed in, then every pool word mixed with every other, then the words past the pool's."""
    const = [INIT_A]
    zero = np.zeros_like(entropy[0])
    pool = [_hashmix(entropy[k] if k < len(entropy) else zero, const) for k in range(POOL)]
    for src in range(POOL):
        for dst in range(POOL):
            if src != dst:
                pool[dst] = _mix(pool[dst], _hashmix(pool[src], const))
    for src in range(POOL, len(entropy)):
        for dst in range(POOL):
            pool[dst] = _mix(pool[dst], _hashmix(entropy[src], const))
    return pool


def _generate_state(pool: list[np.ndarray], words: int = 8) -> list[np.ndarray]:
    """SeedSequence.generate_state(words) from a mixed pool, lane-wise: the 32-bit words PCG64
    takes its state and increment from."""
    const, out = INIT_B, []
    for k in range(words):
        value = pool[k % POOL] ^ np.uint64(const)
        const = (const * MULT_B) & 0xFFFFFFFF
        value = _u32(value * np.uint64(const))
        out.append(value ^ (value >> np.uint64(16)))
    return out


# ----------------------------------------------------------------------------- 128-bit lanes
# A 128-bit number is 4 arrays of 32-bit limbs (in uint64), lowest first.

_MULT = [(PCG_MULT >> (32 * k)) & 0xFFFFFFFF for k in range(4)]


def _zeros(shape) -> list[np.ndarray]:
    """A 128-bit zero per lane, as its four 32-bit limbs."""
    return [np.zeros(shape, np.uint64) for _ in range(4)]


def _limbs_of(high: np.ndarray, low: np.ndarray) -> list[np.ndarray]:
    """A 128-bit number per lane from its 64-bit (high, low) halves, as four 32-bit limbs."""
    return [low & M32, low >> np.uint64(32), high & M32, high >> np.uint64(32)]


def _carry(columns: list[np.ndarray]) -> list[np.ndarray]:
    """Limb sums (each under 2^64) normalised to 32-bit limbs, carrying upwards; the carry out
    of the top limb is dropped (arithmetic mod 2^128)."""
    out, carry = [], np.uint64(0)
    for column in columns:
        column = column + carry
        out.append(column & M32)
        carry = column >> np.uint64(32)
    return out


def _add(a: list[np.ndarray], b: list[np.ndarray]) -> list[np.ndarray]:
    """a + b mod 2^128, lane-wise."""
    return _carry([x + y for x, y in zip(a, b, strict=True)])


def _mul_add(a: list[np.ndarray], inc: list[np.ndarray]) -> list[np.ndarray]:
    """a * PCG_MULT + inc (mod 2**128)."""
    columns = list(inc)
    for i in range(4):
        for j in range(4 - i):
            product = a[i] * np.uint64(_MULT[j])  # < 2**64
            columns[i + j] = columns[i + j] + (product & M32)
            if i + j + 1 < 4:
                columns[i + j + 1] = columns[i + j + 1] + (product >> np.uint64(32))
    return _carry(columns)


def _shift_left_or_one(a: list[np.ndarray]) -> list[np.ndarray]:
    """(a << 1) | 1 (mod 2**128)."""
    out, carry = [], np.uint64(1)
    for limb in a:
        out.append(((limb << np.uint64(1)) & M32) | carry)
        carry = limb >> np.uint64(31)
    return out
