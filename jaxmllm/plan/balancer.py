"""The balancer: per-step selection, per-phase device assignment, packing and deferral.

Each step the planner takes the deferred samples (oldest first) plus enough upcoming samples of
the epoch-shuffled stream to overfill the step by `lookahead`, then, one microbatch at a time
(hierarchical, in the spirit of Entrain: every microbatch gets a full, equal share first, then
its devices are balanced):

1. selects, in priority order (oldest first), the samples that fit the microbatch's total
   capacity in every phase and take about an equal share of what the window holds
   (`jaxmllm.plan.select`);
2. assigns them to buckets with its assignment strategy (`jaxmllm.plan.assign`):
   `orchestrated` packs every phase on its own (`jaxmllm.plan.pack`) and routes encoder
   output rows to their text (`jaxmllm.plan.route`), `balanced` assigns whole samples to
   devices (no routing);
3. fills what slack is left with the next samples of the window that fit (same strategy,
   starting from the loads; up to MANY_BUCKETS buckets: beyond, the slack is a sliver and the
   look-ahead shrinks, see Balancer.__init__).

A sample is planned only when all its parts are; what is not planned waits for a later step,
oldest first, and a sample that has waited `max_age - 1` steps goes first into the emptiest
buckets, so no sample waits more than `max_age` steps (as long as the urgent samples fit
there: in tiny buckets one now and then waits a step more, see tests/test_plan.py
test_age_bound_holds_after_every_plan). Nothing is dropped: a sample that can
never fit fails the strategy's start-up check (the data issue's oversize policy).

All of it is numpy over arrays (the only Python loops run over packing rounds, passes and
microbatches), deterministic (stable sorts only, so every host computes the same plan), and a
function of (seed, step, index, carried state).
"""

from __future__ import annotations

import numpy as np

from jaxmllm.config.phases import LLM
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.plan import ladder
from jaxmllm.plan.assign import Assignment, text_home
from jaxmllm.plan.contract import Capacities, ItemPlan, StepPlan
from jaxmllm.plan.ladder import Ladder
from jaxmllm.plan.ragged import offsets_in_bins
from jaxmllm.plan.select import Selector
from jaxmllm.plan.stream import stream_of
from jaxmllm.plan.work import ENC, Micro, Phases

# Tuned constants of the step (what each was measured to do: plan/README.md).
MANY_BUCKETS = 128  # beyond this many buckets the planner works coarser (see __init__)
MAX_AGE = 4  # default: most steps a sample waits
LOOKAHEAD = 0.5  # default: share of the step's capacity the window holds beyond it
# A microbatch whose placement left a phase short of RETRY_FILL of its capacity although its
# selection brought that much (items too big for the packers at FILL: broad mixes of long
# documents and big images) is selected again at RETRY_FILL, and the fuller of the two kept
# (routing strategies; measured in plan/README.md)
RETRY_FILL = 0.98
TILE_RETRIES = 2  # times a sample a device's tile capacity turned away tries other devices


class Balancer:
    """The balanced planners (`balanced`, `orchestrated`): one step for both; how a
    microbatch's samples are placed on its buckets is the `assignment` strategy
    (`jaxmllm.plan.assign`), which also checks the data at start-up."""

    def __init__(
        self,
        index: LengthsIndex,
        caps: Capacities,
        seed: int,
        *,
        assignment: Assignment,
        max_age: int = MAX_AGE,
        lookahead: float = LOOKAHEAD,
        long_wait: int | None = None,
    ):
        assignment.check(index, caps.top)  # (the longest samples: the top variant's buckets)
        self.index, self.caps, self.seed = index, caps, seed
        self.assignment = assignment
        self.max_age = max_age
        # Beyond MANY_BUCKETS buckets (microbatches x devices) a step's totals are sums over
        # so many samples that their spread is small: the window overfills the step by
        # lookahead * sqrt(MANY_BUCKETS / buckets) of its capacity instead of `lookahead`
        # (what selection needs to even out the phases grows as the square root of the
        # samples in a step, not in proportion), and a routing strategy leaves out the slack
        # pass after each microbatch (it adds a sliver of fill for a lot of planning time;
        # `balanced`, packing whole samples per device, leaves more slack, which it fills).
        buckets = caps.microbatches * caps.devices
        self.lookahead = lookahead * min(1.0, (MANY_BUCKETS / max(buckets, 1)) ** 0.5)
        self.slack_pass = buckets <= MANY_BUCKETS or not assignment.routed
        # (a routing strategy packs each phase on its own: the retry at RETRY_FILL lets it fit
        # big items it left out; `balanced`'s whole samples gained nothing, omni: see README)
        self.retry = assignment.routed
        self.stream = stream_of(index, seed)
        # per step variant (`jaxmllm.plan.ladder`: the long one plans the long samples), its
        # work and selection (with a context degree per step a long variant's buckets are its
        # groups: `Capacities.at`)
        by_degree = {}
        for view in (caps.at(v) for v in range(caps.variants)):
            if view.context not in by_degree:
                by_degree[view.context] = Phases(index, view)
        self.phases_of = [by_degree[caps.at(v).context] for v in range(caps.variants)]
        self.phases = self.phases_of[0]  # (the step's, as it plans)
        self.selectors = [
            Selector(self.phases_of[v], self.lookahead, v) for v in range(caps.variants)
        ]
        self.selector = self.selectors[0]  # (the step's, as it plans)
        wait = ladder.LONG_WAIT if long_wait is None else long_wait
        self.ladder = Ladder(caps, wait) if caps.variants > 1 else None
        self.cursor, self.step = 0, 0
        # A finite set (a GRPO rollout, `jaxmllm.loop.rollouts.drain`): the stream ends after
        # its first epoch, so no sample comes again to take a straggler's room
        self.finite = False
        self.deferred = np.zeros((0, 2), np.int64)  # (sample, stream step it was pulled at)
        self.ages = np.zeros(0, np.int64)

    # ------------------------------------------------------------------ carried state

    def get_state(self) -> dict:
        """Carried state: cursor, step and the deferred queue (sample, step pulled), JSON-able."""
        return {
            "step": int(self.step),
            "cursor": int(self.cursor),
            "deferred": self.deferred.tolist(),
        }

    def set_state(self, state: dict) -> None:
        self.step, self.cursor = int(state["step"]), int(state["cursor"])
        self.deferred = np.array(state.get("deferred", []), np.int64).reshape(-1, 2)

    # ------------------------------------------------------------------ one step

    def plan(self) -> StepPlan:
        """Plans the next step and advances the state."""
        caps, step = self.caps, self.step
        held, variant = None, 0
        if self.ladder is not None:  # (a long step plans the long samples; the rest wait)
            waiting = self._levels(self.deferred[:, 0])
            variant = self.ladder.variant(step, self.deferred[:, 1], waiting)
            held = self.ladder.held(waiting, variant)
        self.selector, self.phases = self.selectors[variant], self.phases_of[variant]
        caps = self.phases.caps  # (the variant's buckets)
        pool, fresh = self.selector.window(self.stream, self.cursor, self.deferred, step, held)
        if self.finite:  # (the fresh samples past the set's end are not read)
            over = max(0, self.cursor + fresh - len(self.index))
            pool, fresh = pool[: len(pool) - over], fresh - over
        # The pool's work: by sample where every sample's is kept, else by pool position
        every = self.phases.every
        if every is not None:
            self.work_of, self.at = every, pool[:, 0]
        else:
            self.work_of, self.at = self.phases.of(pool[:, 0]), np.arange(len(pool))
        self.cursor += fresh
        samples, since = pool[:, 0], pool[:, 1]
        urgent = step - since >= self.max_age - 1
        taken = np.zeros(len(pool), bool)
        held = None
        if self.ladder is not None:
            levels = self._levels(samples)
            held = self.ladder.held(levels, variant)  # (they wait for a step that holds them)
            long = levels.any(1)
            urgent = (urgent & ~long) | (long & ~held)  # (long ones first)
            taken |= held
        work = np.take(self.work_of.sel, self.at, axis=1)  # [phase, pool position]
        left = work.sum(1)  # work of the pool not yet taken
        if held is not None:
            left -= work[:, held].sum(1)
        micros = []
        for m in range(caps.microbatches):
            mb = Micro(caps, self.phases.cost, variant)
            # Across microbatches first: each gets at most an equal share of what is left.
            share = left / (caps.microbatches - m)
            sel = self.selector.select(work, taken, share, urgent=urgent)
            self._add(mb, sel, samples, urgent)
            if self.retry and self._left_short(mb, work, sel, urgent):
                again = Micro(caps, self.phases.cost, variant)
                sel = self.selector.select(work, taken, share, urgent=urgent, fill=RETRY_FILL)
                self._add(again, sel, samples, urgent)
                if self._fuller(again, urgent) > self._fuller(mb, urgent):
                    mb = again
            taken[np.concatenate(mb.entries)] = True
            # Slack left: the next samples of the window that fit it, in the same order.
            if self.slack_pass:
                sel = self.selector.select(work, taken, self._free(mb), small=True)
                self._add(mb, sel, samples, urgent)
            placed = np.concatenate(mb.entries)
            taken[placed] = True
            left = left - np.take(work, placed, axis=1).sum(1)
            micros.append(mb)
        if held is not None:
            taken &= ~held  # (they wait)
        self.deferred = pool[~taken]
        self.step += 1
        return self._emit(step, micros, samples, since, variant)

    def _levels(self, samples: np.ndarray) -> np.ndarray:
        """Per sample and phase, its level of the ladder (`Ladder.sample_levels`)."""
        pool = self.phases.of(samples)
        return self.ladder.sample_levels(
            pool.longest(), {p: it[:2] for p, it in pool.items.items()}
        )

    def _left_short(self, mb: Micro, work: np.ndarray, sel: np.ndarray, urgent) -> bool:
        """Whether the placement of a selection (`sel`) left out an urgent sample, or left
        some phase short of RETRY_FILL of the microbatch's capacity where the selection
        brought at least that much: a selection at RETRY_FILL, leaving the packers room, may
        then place more."""
        placed = np.concatenate(mb.entries)
        if self.slack_pass and urgent[sel].sum() > urgent[placed].sum():
            return True  # (past MANY_BUCKETS buckets one waits a step more instead)
        full = RETRY_FILL * self.caps.devices * self.phases.cap_vec
        chosen = np.take(work, sel, axis=1).sum(1)[: len(full)]
        return bool(((chosen >= full) & (mb.used() < full)).any())

    def _fuller(self, mb: Micro, urgent: np.ndarray) -> tuple[int, float]:
        """What makes one placement of a microbatch better than another: the urgent samples
        it places, then its units over its capacity summed over the phases."""
        placed = np.concatenate(mb.entries)
        fill = float((mb.used() / np.maximum(self.phases.cap_vec, 1)).sum())
        return int(urgent[placed].sum()), fill

    def _free(self, mb: Micro) -> np.ndarray:
        """Units still free in each phase of the microbatch."""
        return self.caps.devices * self.selector.cap_vec - mb.used_selected(self.phases)

    # ------------------------------------------------------------------ placement

    def _add(
        self,
        mb: Micro,
        entries: np.ndarray,
        samples: np.ndarray,
        urgent: np.ndarray,
        retries: int = TILE_RETRIES,
    ) -> None:
        """Places what it can of `entries` into the microbatch (all parts of a sample or none).
        Samples turned away only by a device's tile capacity try again (`retries` times): the
        packers see the loads without them, so they go to devices with room."""
        if not len(entries):
            return
        ph = self.phases
        s, at = samples[entries], self.at[entries]
        pw = self.work_of.take(at, sel=False)
        ends = {LLM: mb.rows.units.copy(), **{p: mb.enc[p].units.copy() for p in ENC}}
        rows = self.assignment.samples(ph, mb, pw, urgent[entries])
        items = {}
        ok = rows >= 0
        for p in ENC:
            items[p] = self.work_of.items_of(p, at)
        ok, devs = self.assignment.items(ph, mb, rows, items, urgent[entries], ok)
        retry, offsets = np.zeros(0, np.int64), {}
        if mb.tiles is not None:  # block-sparse attention: each device within its tiles
            placed = {LLM: (np.arange(len(s)), rows, ends[LLM], pw.llm, pw.split, pw.extra)}
            for p in ENC:
                placed[p] = (items[p][0], devs[p], ends[p], items[p][2])
            fitted = ok.copy()
            ok, offsets = mb.tiles.admit(placed, ok)  # (with the documents' offsets)
            retry = entries[fitted & ~ok]
        # Roll back the samples that did not get all their parts.
        bad = np.flatnonzero(~ok & (rows >= 0))
        np.subtract.at(mb.rows.units, rows[bad], pw.llm[bad])
        np.subtract.at(mb.rows.quad, rows[bad], pw.llm_cost[bad])
        for p in ENC:
            owner, j, size, cost = items[p]
            dev = devs[p]
            drop = ~ok[owner] & (dev >= 0)
            np.subtract.at(mb.enc[p].units, dev[drop], size[drop])
            np.subtract.at(mb.enc[p].quad, dev[drop], cost[drop])
            keep = ok[owner]
            off = _offsets(dev, size, ends[p], keep, offsets.get(p))
            mb.items[p].append((entries[owner[keep]], j[keep], dev[keep], off))
            # (the route capacity counts what is kept: not what a tile capacity turned away)
            mb.routes[p].add(size[keep], dev[keep], text_home(rows, ph.caps)[owner[keep]])
        mb.entries.append(entries[ok])
        mb.row_bin.append(rows[ok])
        mb.row_offset.append(_offsets(rows, pw.llm, ends[LLM], ok, offsets.get(LLM)))
        if len(retry) and retries:
            self._add(mb, retry, samples, urgent, retries - 1)

    def _emit(
        self, step: int, micros: list[Micro], samples: np.ndarray, since: np.ndarray, variant: int
    ) -> StepPlan:
        # Each microbatch's arrays concatenated straight into the step's (int64 already: no
        # astype copies; the offsets were laid out as each placement was kept).
        r_n = self.caps.llm_rows
        counts = [sum(len(x) for x in mb.entries) for mb in micros]
        e, rb, off = (np.empty(sum(counts), np.int64) for _ in range(3))
        a = 0
        for mb, c in zip(micros, counts, strict=True):
            np.concatenate(mb.entries, out=e[a : a + c])
            np.concatenate(mb.row_bin, out=rb[a : a + c])
            np.concatenate(mb.row_offset, out=off[a : a + c])
            a += c
        micro = np.repeat(np.arange(len(micros)), counts)
        pos_of = np.empty(len(samples), np.int64)  # (entries are distinct pool positions)
        pos_of[e] = np.arange(len(e))
        dev, row = np.divmod(rb, r_n)
        self.ages = step - since[e]
        plans = {}
        for p in ENC:
            if not any(mb.items[p] for mb in micros):
                plans[p] = ItemPlan.empty()
                continue
            counts = [sum(len(q[0]) for q in mb.items[p]) for mb in micros]
            it = ItemPlan(*(np.empty(sum(counts), np.int64) for _ in range(4)))
            a = 0
            for mb, c in zip(micros, counts, strict=True):
                if not mb.items[p]:
                    continue
                ent, j, idev, ioff = zip(*mb.items[p], strict=True)
                # (owners already by owner, then item: the order they were added)
                np.take(pos_of, np.concatenate(ent), out=it.owner[a : a + c])
                np.concatenate(j, out=it.item[a : a + c])
                np.concatenate(idev, out=it.device[a : a + c])
                np.concatenate(ioff, out=it.offset[a : a + c])
                a += c
            plans[p] = it
        return StepPlan(
            step=step,
            samples=samples[e],
            micro=micro,
            device=dev,
            row=row,
            offset=off,
            items=plans,
            deferred=len(self.deferred),
            variant=variant,
        )


def _offsets(
    bins: np.ndarray,
    sizes: np.ndarray,
    start: np.ndarray,
    keep: np.ndarray,
    laid_out: np.ndarray | None,
) -> np.ndarray:
    """The offsets in their bins of the documents `keep` of one placement, laid out in order
    after where each bin's earlier documents end (`start`): `laid_out`'s where the tile budget
    laid them out already."""
    if laid_out is not None:
        return laid_out[keep]
    b = bins[keep]
    return offsets_in_bins(b, sizes[keep]) + start[b]
