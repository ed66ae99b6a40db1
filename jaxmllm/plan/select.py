"""Selection: which samples of the window a microbatch takes.

Each step the planner takes the deferred samples (oldest first) plus enough upcoming samples of
the epoch-shuffled stream to overfill the step by `lookahead` (`Selector.window`); then, one
microbatch at a time, it selects in priority order (oldest first) the samples that fit the
microbatch's total capacity in every phase and take about an equal share of what the window
holds (vectorised greedy rounds: take the longest prefix that fits, then the next items that
still fit, ...), and trades samples for others of the window when a phase is left short
(`Selector.swap`).
"""

from __future__ import annotations

import numpy as np

from jaxmllm.plan.ragged import smallest
from jaxmllm.plan.stream import SampleStream
from jaxmllm.plan.work import Phases

# Tuned constants of the selection (what each was measured to do: plan/README.md).
FILL = 0.997  # a microbatch's first selection takes at most this share of each capacity
OVER_SHARE = 1.02  # ... and at most this times its equal share of what the window holds
ROUNDS = 32  # most greedy rounds (longest prefix that fits, then the next that fit) a selection
SMALL = 0.02  # the slack pass takes samples no bigger than this share of a bucket in any phase
BINDING = 0.98  # phases whose long-run demand is within this of the largest one's bind
HEADROOM = 1 / 3  # a non-binding phase's microbatch takes <= its share + this of the rest
SWAP_SHORT = 0.02  # a phase this far (share of a microbatch) below what it may take swaps


class Selector:
    """Window and selection of the balanced planners, from the phases' long-run demands."""

    def __init__(self, phases: Phases, lookahead: float, variant: int = 0):
        # (the phases' units, and their expected tiles where tiles have a capacity: Phases; in
        # a step of `variant`)
        self.caps, self.phases = phases.caps, phases
        self.cap_vec = phases.sel_caps[variant]
        self.lookahead = lookahead
        self.mean_work = phases.mean_work
        # Long-run share of its capacity each phase fills when the most demanding one is full.
        demand = np.where(self.cap_vec > 0, self.mean_work / np.maximum(self.cap_vec, 1), 0)
        # Tile rows (after the phases' units) only bound what a microbatch takes: no share of
        # the window, never a phase to fill by swaps.
        self.units = np.arange(len(self.cap_vec)) < len(phases.cap_vec)
        demand = np.where(self.units, demand, 0.0)
        self.share = demand / max(demand.max(), 1e-30)
        # A phase that does not bind (its long-run demand under BINDING of the largest) gets
        # at most its share of a microbatch plus HEADROOM of the rest: taking all the window
        # offers would leave the next microbatch (or step) short of it, and its buckets' cost
        # would swing with the window. A binding phase may fill its whole capacity.
        nonbinding = (self.share > 0) & (self.share < BINDING)
        self.micro_cap = np.where(nonbinding, self.share + HEADROOM * (1 - self.share), 1.0)

    def window(
        self,
        stream: SampleStream,
        cursor: int,
        deferred: np.ndarray,
        step: int,
        held: np.ndarray | None = None,
    ) -> tuple[np.ndarray, int]:
        """The step's pool of (sample, step pulled) pairs and the count of fresh samples taken
        from `stream` at `cursor`: the `deferred` ones, then fresh ones until every phase holds
        its long-run share of the step's capacity plus `lookahead`, or one phase its whole
        capacity plus `lookahead` (a rare modality must not make the window, and so the waits,
        grow). `held`: the deferred ones this step cannot take (long samples in a base step,
        `jaxmllm.plan.ladder`), which count for nothing."""
        m = self.caps.microbatches * self.caps.devices
        budget = np.where(self.share > 0, m * self.cap_vec * self.share, np.inf)
        goal = (1 + self.lookahead) * budget
        counted = deferred[:, 0] if held is None else deferred[~held, 0]
        have = self.phases.sel_of(counted).sum(1)
        per = np.where(self.cap_vec > 0, self.mean_work, 0)
        need = np.where(per > 0, np.where(np.isfinite(goal), goal, 0) - have, 0)
        n = int((need / np.maximum(per, 1e-9)).max()) + 16
        n = max(n * 5 // 4, 16)
        # Each phase's running sum never falls (work >= 0): the first sample at which it reaches
        # its bound (the integer above it) is a binary search away, and the window ends at the
        # first sample where every phase with a share is in, or one phase is full.
        all_in = [(p, goal[p] - have[p]) for p in range(len(goal)) if self.share[p] > 0]
        one_full = [
            (p, (1 + self.lookahead) * m * self.cap_vec[p] - have[p])
            for p in range(len(goal))
            if self.cap_vec[p] > 0
        ]
        while True:
            fresh = stream.take(cursor, n)
            cum = np.cumsum(self.phases.sel_of(fresh), 1)
            first = [int(np.searchsorted(cum[p], int(np.ceil(b)), "left")) for p, b in all_in]
            k = max(first, default=0)
            for p, b in one_full:
                k = min(k, int(np.searchsorted(cum[p], int(np.ceil(b)), "left")))
            if k < n or n > m * self.cap_vec[0]:  # (only empty samples get here)
                k = k + 1 if k < n else n
                break
            n *= 2
        fresh = np.stack([fresh[:k], np.full(k, step)], 1)
        return np.concatenate([deferred, fresh]), k

    def select(
        self,
        work: np.ndarray,
        taken: np.ndarray,
        share: np.ndarray,
        rounds: int = ROUNDS,
        small: bool = False,
        urgent: np.ndarray | None = None,
        fill: float = FILL,
    ) -> np.ndarray:
        """Pool positions (priority order) that together fit one microbatch in every phase and
        take at most about `share` of each phase's work (with `small`: exactly `share`, and
        only samples no bigger than SMALL of a bucket in any phase). `work`: [phase, pool
        position]."""
        full = self.caps.devices * self.cap_vec.astype(np.float64) * fill
        left = np.minimum(full, np.where(share > 0, share * OVER_SHARE, full))
        left = np.minimum(left, full * self.micro_cap)  # (non-binding phases: see __init__)
        if small:
            left = np.where(self.cap_vec > 0, share, 0.0)
        chosen = np.zeros(taken.shape, bool)
        cand = np.flatnonzero(~taken)
        bound = SMALL * self.cap_vec if small else None
        # Each round takes the longest prefix of the candidates that fit (each on its own) whose
        # running sum fits, and drops the next one that fits. Sizes are >= 0, so `left` never
        # grows and a candidate that does not fit now never will: the rounds scan the
        # candidates once, in chunks (doubling), instead of filtering and summing all those
        # left each round (the same picks and the same `left`: integer sums).
        pos, n = 0, len(cand)
        for _ in range(rounds):
            picks, total, step = [], np.zeros(len(work), work.dtype), 1024
            while pos < n:
                c = cand[pos : pos + step]
                wc = np.take(work, c, axis=1)
                fit = _fits(wc, left)
                if bound is not None:
                    fit &= _fits(wc, bound)
                i = np.flatnonzero(fit)
                if not len(i):
                    pos, step = pos + len(c), 2 * step
                    continue
                cw = np.cumsum(np.take(wc, i, axis=1), 1)
                cw += total[:, None]
                ok = _fits(cw, left)
                if ok.all():
                    picks.append(c[i])
                    total = cw[:, -1]
                    pos, step = pos + len(c), 2 * step
                    continue
                k = int(np.argmin(ok))
                picks.append(c[i[:k]])
                if k:
                    total = cw[:, k - 1]
                pos += int(i[k]) + 1  # (the one that did not fit, at k, is out)
                break
            if not picks:
                break
            chosen[np.concatenate(picks)] = True
            left = left - total
        if not small:
            # FILL leaves room for packing slack that one sample alone does not need: a
            # document as long as a microbatch's only row (one context group) still goes (its
            # units in; its exact tiles, from the row's start, the tile budget checks): when
            # nothing else fits, or when it is urgent (the rounds skip what FILL cannot hold,
            # so it would wait past the age bound while smaller samples fill the row).
            if not chosen.any():
                alone = cand
            elif urgent is not None:
                alone = cand[~chosen[cand] & urgent[cand]]
                alone = alone[~_fits(np.take(work, alone, axis=1), full)]
            else:
                alone = cand[:0]
            if len(alone):
                whole = np.where(self.units, self.caps.devices * self.cap_vec, np.inf)
                fit = np.flatnonzero(_fits(np.take(work, alone, axis=1), whole))
                if len(fit):
                    return alone[fit[:1]]
            if not chosen.any():
                return np.flatnonzero(chosen)
        if urgent is not None:
            self.swap(work, taken, chosen, left, urgent, fill)
        return np.flatnonzero(chosen)

    def swap(
        self,
        work: np.ndarray,
        taken: np.ndarray,
        chosen: np.ndarray,
        left: np.ndarray,
        urgent: np.ndarray,
        fill: float = FILL,
    ) -> None:
        """Trades chosen samples for others of the window when a phase is left short.

        Taking samples in priority order can fill one phase (say the LLM, with text-only
        chats) while another (audio) has room that no sample in order fits without text; a
        phase that does not bind can likewise end well under its microbatch cap (see
        __init__), and its buckets' cost then swings from step to step. Then the window's
        samples richest in the short phase p (its share of a bucket over the other phases'
        shares) come in, and the chosen non-urgent samples poorest in it (youngest first)
        wait for a later step, as many as make room in the fullest phase q and in every
        other phase the newcomers would overfill: the number of trades that fills the phases
        most in all (the sum of each one's net change over its capacity; p must gain), with
        every phase within what is left of its share (`left`); for a short phase that does
        not bind, no binding phase but the fullest one gives anything up. Updates `chosen` in
        place. Urgent samples never wait.
        """
        full = self.caps.devices * self.cap_vec * fill
        rel = left / np.maximum(full, 1)
        target = (full > 0) & self.units
        p = int(np.argmax(np.where(target, rel, -1.0)))
        q = int(np.argmin(np.where(target, rel, np.inf)))
        if rel[p] < SWAP_SHORT or p == q:
            return
        add = np.flatnonzero(~taken & ~chosen & (work[p] > 0))
        rem = np.flatnonzero(chosen & ~urgent)[::-1]  # (youngest first)
        if not len(add) or not len(rem):
            return
        # Only the few best of each side matter: about 4x what the gap can take.
        others = np.where((np.arange(len(full)) != p) & target, 1.0 / np.maximum(full, 1), 0)
        k = min(len(add), int(4 * left[p] / max(float(work[p, add].mean()), 1.0)) + 16)
        wa = np.take(work, add, axis=1)
        add = add[smallest(-wa[p] / np.maximum(others @ wa, 1e-12), k)]
        wa = np.cumsum(np.take(work, add, axis=1), 1)  # [phase, adds]
        k = min(len(rem), int(4 * wa[q, -1] / max(float(work[q, rem].mean()), 1.0)) + 16)
        wr = np.take(work, rem, axis=1)
        rem = rem[smallest(wr[p] / np.maximum(others @ wr, 1e-12), k)]
        wr = np.zeros((len(work), len(rem) + 1), work.dtype)
        np.cumsum(np.take(work, rem, axis=1), 1, out=wr[:, 1:])  # [phase, removals]
        # per count of adds, the fewest removals that make room in every phase the adds
        # overfill (q first of all; an add may bring another phase's work too)
        need = wa - left[:, None]
        j = np.searchsorted(wr[q], need[q], "left")
        for r in np.flatnonzero((need > 0).any(1) & (np.arange(len(full)) != q)):
            j = np.maximum(j, np.searchsorted(wr[r], need[r], "left"))
        ok = j < wr.shape[1]
        j = np.minimum(j, wr.shape[1] - 1)
        net = wa - wr[:, j]
        ok &= (net <= left[:, None]).all(0) & (net[p] > 0)
        # ... and the trade fills the phases more in all (each as a share of its capacity)
        gain = (net / np.maximum(full, 1)[:, None])[target].sum(0)
        ok &= gain > 0
        if self.share[p] < BINDING:  # (for a phase that does not bind, no binding phase
            # but the fullest one gives anything up: a binding phase's items stay in)
            keep = (self.share >= BINDING) & (np.arange(len(full)) != q) & (full > 0)
            ok &= (net[keep] >= 0).all(0)
        if not ok.any():
            return
        i = int(np.argmax(np.where(ok, gain, -1)))
        chosen[add[: i + 1]] = True
        chosen[rem[: j[i]]] = False


def _fits(w: np.ndarray, left: np.ndarray) -> np.ndarray:
    """Mask of the columns of w [phase, item] that are <= left in every phase."""
    ok = w[0] <= left[0]
    for p in range(1, len(w)):
        ok &= w[p] <= left[p]
    return ok
