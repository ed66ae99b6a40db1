"""The balancer: per-step selection, per-phase device assignment, packing and deferral.

Each step the planner takes the deferred samples (oldest first) plus enough upcoming samples of
the epoch-shuffled stream to overfill the step by `lookahead`, then, one microbatch at a time
(hierarchical, in the spirit of Entrain: every microbatch gets a full, equal share first, then
its devices are balanced):

1. selects, in priority order (oldest first), the samples that fit the microbatch's total
   capacity in every phase (vectorised greedy rounds: take the longest prefix that fits, then
   the next items that still fit, ...);
2. assigns them to buckets, largest first, each round of `bins` items going to the least loaded
   bins (LPT), then best-fit for the few that missed: `orchestrated` assigns every phase on its
   own (LLM samples to rows, images and clips to devices, anywhere: the routing tables bring
   encoder output rows to their text), `balanced` assigns whole samples to devices (no routing);
3. fills what slack is left from the rest of the window (same packer, starting from the loads);
4. `orchestrated` then permutes encoder items of equal size among their devices so as many as
   possible sit on their text's device (this leaves every device's load unchanged, so locality
   costs no balance), and enforces the per-(src, dst) route capacity.

A sample is planned only when all its parts are; what is not planned waits for a later step,
oldest first, and a sample that has waited `max_age - 1` steps goes first into the emptiest
buckets, so no sample waits more than `max_age` steps. Nothing is dropped: a sample that can
never fit fails `check_fits` at start-up (the data issue's oversize policy).

All of it is numpy over arrays (the only Python loops run over rounds, microbatches and the few
best-fit leftovers), deterministic, and a function of (seed, step, index, carried state).
"""

from __future__ import annotations

import numpy as np

from jaxmllm.data.cost import CostModel
from jaxmllm.data.planner import (
    Capacities,
    ItemPlan,
    OversizeError,
    SampleStream,
    StepPlan,
    check_fits,
)
from jaxmllm.data.samples import LengthsIndex

ENC = ("vision", "audio")


def gather_items(ptr: np.ndarray, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Items of `samples` in a ragged array: (owner position, item number, flat index)."""
    cnt = ptr[samples + 1] - ptr[samples]
    owner = np.repeat(np.arange(len(samples)), cnt)
    start = np.cumsum(cnt) - cnt
    j = np.arange(int(cnt.sum())) - start[owner]
    return owner, j, ptr[samples][owner] + j


def offsets_in_bins(bins: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """First unit of each item when the items of a bin are laid out in their given order."""
    order = np.argsort(bins, kind="stable")
    s = sizes[order]
    cum = np.cumsum(s) - s
    b = bins[order]
    first = np.searchsorted(b, b, "left")
    out = np.empty(len(bins), np.int64)
    out[order] = cum - cum[first]
    return out


def lpt_assign(
    sizes: np.ndarray,
    load: np.ndarray,
    cap: int,
    urgent: np.ndarray | None = None,
    quad: np.ndarray | None = None,
    best_fit_max: int | None = None,
) -> np.ndarray:
    """Assigns items to bins of capacity `cap`; returns the bin per item (-1: did not fit).

    Urgent items first, then largest first, a round of len(load) items at a time. Without
    `quad` this is LPT: the biggest item of a round to the emptiest bin. With `quad` (per bin,
    sum of size**2: the attention cost) every bin will end up nearly full, so what matters is
    the size of the items still to come: a bin that may still take `headroom` = (mean final
    quadratic load - its own) over its `free` units is best filled with items of size about
    headroom / free, and the round gives its biggest item to the bin where that is largest.
    Items that missed get a few rounds into the bins with the most room, then (at most
    `best_fit_max` of them) a best fit. `load` and `quad` are updated in place.
    """
    n, nb = len(sizes), len(load)
    out = np.full(n, -1, np.int64)
    if n == 0:
        return out
    key = [-sizes] if urgent is None else [-sizes, ~urgent]
    order = np.lexsort(key)
    sq = sizes.astype(np.float64) ** 2
    if quad is not None:
        placeable = min(1.0, float((cap - load).sum()) / max(float(sizes.sum()), 1.0))
        target = (quad.sum() + placeable * sq.sum()) / nb

    def lightest() -> np.ndarray:
        if quad is None:
            return load.astype(np.float64)
        return -(target - quad) / np.maximum(cap - load, 1)

    pending = order
    for _ in range(4 * (n // nb) + 16):
        idx = pending[:nb]
        bins = np.argsort(lightest(), kind="stable")[: len(idx)]
        ok = load[bins] + sizes[idx] <= cap
        if quad is not None:  # a big item waits for a bin whose attention budget it fits
            ok &= (quad[bins] + sq[idx] <= 1.02 * target) | (sq[idx] <= 0.01 * target)
        if not ok.any():
            break
        out[idx[ok]] = bins[ok]
        load[bins[ok]] += sizes[idx[ok]]
        if quad is not None:
            quad[bins[ok]] += sq[idx[ok]]
        pending = np.concatenate([idx[~ok], pending[nb:]])
        if not len(pending):
            break
    missed = order[out[order] < 0]
    for _ in range(4):  # the misses, largest first, to the bins with the most room
        missed = missed[sizes[missed] <= cap - load.min()]
        if not len(missed):
            break
        idx = missed[:nb]
        bins = np.argsort(load, kind="stable")[: len(idx)]
        ok = load[bins] + sizes[idx] <= cap
        out[idx[ok]] = bins[ok]
        load[bins[ok]] += sizes[idx[ok]]
        if quad is not None:
            quad[bins[ok]] += sq[idx[ok]]
        missed = np.concatenate([idx[~ok], missed[nb:]])
    limit = 32 if best_fit_max is None else best_fit_max
    for i in missed[:limit]:  # and a few best fits
        fits = load + sizes[i] <= cap
        if not fits.any():
            continue
        b = int(np.argmin(np.where(fits, cap - load, cap + 1)))
        out[i] = b
        load[b] += sizes[i]
        if quad is not None:
            quad[b] += sq[i]
    return out


class _Micro:
    """Bucket loads and placements of one microbatch while it is being filled."""

    def __init__(self, caps: Capacities):
        self.rows = np.zeros(caps.devices * caps.llm_rows, np.int64)
        self.enc = {p: np.zeros(caps.devices, np.int64) for p in ENC}
        self.rows_q = np.zeros(caps.devices * caps.llm_rows)  # sum of squared sizes
        self.enc_q = {p: np.zeros(caps.devices) for p in ENC}
        z = np.zeros(0, np.int64)
        self.entries: list[np.ndarray] = [z]  # pool positions placed, in order
        self.row_bin: list[np.ndarray] = [z]  # their LLM row bin (device * rows + row)
        # per phase: (owner entry, item number, size, device) of placed items
        self.items: dict[str, list[tuple[np.ndarray, ...]]] = {p: [] for p in ENC}
        self.remote: dict[str, tuple[np.ndarray, np.ndarray]] = {
            p: (np.zeros(0, np.int64), np.zeros(0, np.int64)) for p in ENC
        }


class BalancedPlanner:
    """Ours, joint per device: a sample's text and media share a device (no routing)."""

    routed = False

    def __init__(
        self,
        index: LengthsIndex,
        caps: Capacities,
        seed: int,
        cost: CostModel | None = None,
        *,
        max_age: int = 4,
        lookahead: float = 0.25,
    ):
        self._check(index, caps)
        self.index, self.caps, self.seed = index, caps, seed
        self.cost = cost
        self.max_age, self.lookahead = max_age, lookahead
        self.stream = SampleStream(len(index), seed)
        self.llm = index.llm_tokens(caps.merge_area, caps.subsample)
        self.sizes = {"vision": index.images, "audio": index.audio}
        self.ptr = {"vision": index.images_ptr, "audio": index.audio_ptr}
        self.per_row = {"vision": caps.merge_area, "audio": caps.subsample}
        self.cap = {"vision": caps.vision_patches, "audio": caps.audio_frames}
        self.work = np.stack(
            [
                self.llm,
                index.per_sample_sum(index.images, index.images_ptr),
                index.per_sample_sum(index.audio, index.audio_ptr),
            ],
            1,
        )
        self.cap_vec = np.array(
            [caps.llm_rows * caps.llm_row_len, caps.vision_patches, caps.audio_frames], np.int64
        )
        self.mean_work = self.work.mean(0) if len(index) else np.ones(3)
        # Long-run share of its capacity each phase fills when the most demanding one is full.
        demand = np.where(self.cap_vec > 0, self.mean_work / np.maximum(self.cap_vec, 1), 0)
        self.share = demand / max(demand.max(), 1e-30)
        self.cursor, self.step = 0, 0
        self.deferred = np.zeros((0, 2), np.int64)  # (sample, stream step it was pulled at)
        self.last_ages = np.zeros(0, np.int64)

    def _check(self, index: LengthsIndex, caps: Capacities) -> None:
        check_fits(index, caps)

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
        pool = self._pull()
        samples, since = pool[:, 0], pool[:, 1]
        urgent = step - since >= self.max_age - 1
        taken = np.zeros(len(pool), bool)
        micros = []
        for m in range(caps.microbatches):
            mb = _Micro(caps)
            # Across microbatches first: each gets at most an equal share of what is left.
            share = self.work[samples[~taken]].sum(0) / (caps.microbatches - m)
            sel = self._select(samples, taken, share)
            self._add(mb, sel, samples, urgent)
            taken[np.concatenate(mb.entries)] = True
            self._add(mb, np.flatnonzero(~taken), samples, urgent)
            taken[np.concatenate(mb.entries)] = True
            micros.append(mb)
        self.deferred = pool[~taken]
        self.step += 1
        return self._emit(step, micros, samples, since)

    def _pull(self) -> np.ndarray:
        """Deferred samples then fresh ones, until every phase holds its long-run share of the
        step's capacity plus `lookahead`, or one phase its whole capacity plus `lookahead` (a
        rare modality must not make the window, and so the waits, grow)."""
        m = self.caps.microbatches * self.caps.devices
        budget = np.where(self.share > 0, m * self.cap_vec * self.share, np.inf)
        goal = (1 + self.lookahead) * budget
        have = self.work[self.deferred[:, 0]].sum(0)
        per = np.where(self.cap_vec > 0, self.mean_work, 0)
        need = np.where(per > 0, np.where(np.isfinite(goal), goal, 0) - have, 0)
        n = int((need / np.maximum(per, 1e-9)).max()) + 16
        n = max(n * 5 // 4, 16)
        while True:
            fresh = self.stream.take(self.cursor, n)
            ratio = (have + np.cumsum(self.work[fresh], 0)) / budget
            full = (have + np.cumsum(self.work[fresh], 0)) / (m * np.maximum(self.cap_vec, 1))
            hit = np.flatnonzero(
                ((ratio >= 1 + self.lookahead) | (self.share <= 0)).all(1)
                | (full >= 1 + self.lookahead).any(1)
            )
            if len(hit) or n > m * self.cap_vec[0]:  # (only empty samples get here)
                k = int(hit[0]) + 1 if len(hit) else n
                break
            n *= 2
        fresh = np.stack([fresh[:k], np.full(k, self.step)], 1)
        self.cursor += k
        return np.concatenate([self.deferred, fresh])

    def _select(
        self, samples: np.ndarray, taken: np.ndarray, share: np.ndarray, rounds: int = 8
    ) -> np.ndarray:
        """Pool positions (priority order) that together fit one microbatch in every phase and
        take at most about `share` of each phase's work."""
        full = self.caps.devices * self.cap_vec.astype(np.float64)
        left = np.minimum(full, np.where(share > 0, share * 1.02, full))
        chosen = np.zeros(len(samples), bool)
        for _ in range(rounds):
            cand = np.flatnonzero(~taken & ~chosen)
            w = self.work[samples[cand]]
            cand, w = cand[(w <= left).all(1)], w[(w <= left).all(1)]
            if not len(cand):
                break
            ok = (np.cumsum(w, 0) <= left).all(1)
            k = int(np.argmin(ok)) if not ok.all() else len(ok)
            chosen[cand[:k]] = True
            left = left - w[:k].sum(0)
            if k == len(cand):
                break
        return np.flatnonzero(chosen)

    # ------------------------------------------------------------------ placement

    def _add(
        self, mb: _Micro, entries: np.ndarray, samples: np.ndarray, urgent: np.ndarray
    ) -> None:
        """Places what it can of `entries` into the microbatch (all parts of a sample or none)."""
        if not len(entries):
            return
        s = samples[entries]
        rows = self._assign(mb, s, urgent[entries])
        items = {}
        ok = rows >= 0
        for p in ENC:
            owner, j, flat = gather_items(self.ptr[p], s)
            items[p] = (owner, j, self.sizes[p][flat])
        ok, devs = self._assign_items(mb, rows, items, urgent[entries], ok)
        # Roll back the samples that did not get all their parts.
        bad = np.flatnonzero(~ok & (rows >= 0))
        np.subtract.at(mb.rows, rows[bad], self.llm[s[bad]])
        np.subtract.at(mb.rows_q, rows[bad], self.llm[s[bad]].astype(np.float64) ** 2)
        for p in ENC:
            owner, j, size = items[p]
            dev = devs[p]
            drop = ~ok[owner] & (dev >= 0)
            np.subtract.at(mb.enc[p], dev[drop], size[drop])
            np.subtract.at(mb.enc_q[p], dev[drop], size[drop].astype(np.float64) ** 2)
            keep = ok[owner]
            mb.items[p].append((entries[owner[keep]], j[keep], size[keep], dev[keep]))
        mb.entries.append(entries[ok])
        mb.row_bin.append(rows[ok])

    def _assign(self, mb: _Micro, s: np.ndarray, urgent: np.ndarray) -> np.ndarray:
        """Joint: whole samples to devices (vector bin packing), then a row on that device."""
        caps = self.caps
        d_n, r_n, row_len = caps.devices, caps.llm_rows, caps.llm_row_len
        w = self.work[s]
        cap = self.cap_vec
        norm = np.where(cap > 0, w / np.maximum(cap, 1), 0).max(1)
        order = np.lexsort((-norm, ~urgent))
        out = np.full(len(s), -1, np.int64)
        rows2 = mb.rows.reshape(d_n, r_n)
        enc = np.stack([mb.enc["vision"], mb.enc["audio"]], 1)  # [D, 2] (copy, written back)
        for start in range(0, len(s), d_n):
            idx = order[start : start + d_n]
            dev_load = np.concatenate([rows2.sum(1, keepdims=True), enc], 1)
            score = (dev_load / np.maximum(cap, 1)).max(1)
            devs = np.argsort(score, kind="stable")[: len(idx)]
            r = np.argmin(rows2[devs], 1)
            ok = (rows2[devs, r] + w[idx, 0] <= row_len) & (enc[devs] + w[idx, 1:] <= cap[1:]).all(
                1
            )
            devs, r, idx = devs[ok], r[ok], idx[ok]
            rows2[devs, r] += w[idx, 0]
            enc[devs] += w[idx, 1:]
            out[idx] = devs * r_n + r
        missed = order[out[order] < 0]
        for i in missed[:64]:
            fits_enc = (enc + w[i, 1:] <= cap[1:]).all(1)
            r = np.argmin(rows2, 1)
            fits = fits_enc & (rows2[np.arange(d_n), r] + w[i, 0] <= row_len)
            if not fits.any():
                continue
            slack = (cap[1:] - enc).sum(1) + (row_len - rows2[np.arange(d_n), r])
            d = int(np.argmin(np.where(fits, slack, np.iinfo(np.int64).max)))
            rows2[d, r[d]] += w[i, 0]
            enc[d] += w[i, 1:]
            out[i] = d * r_n + r[d]
        mb.enc["vision"][:], mb.enc["audio"][:] = enc[:, 0], enc[:, 1]
        return out

    def _assign_items(self, mb, rows, items, urgent, ok):
        """Joint: media sit on their text's device (already counted in the loads)."""
        devs = {}
        for p in ENC:
            owner = items[p][0]
            devs[p] = np.where(rows[owner] >= 0, rows[owner] // self.caps.llm_rows, -1)
        return ok, devs

    # ------------------------------------------------------------------ output

    def _emit(
        self, step: int, micros: list[_Micro], samples: np.ndarray, since: np.ndarray
    ) -> StepPlan:
        r_n = self.caps.llm_rows
        parts, item_parts = [], {p: [] for p in ENC}
        base = 0
        for m, mb in enumerate(micros):
            e = np.concatenate(mb.entries)
            rb = np.concatenate(mb.row_bin)
            pos_of = np.full(len(samples), -1, np.int64)
            pos_of[e] = base + np.arange(len(e))
            off = offsets_in_bins(rb, self.llm[samples[e]])
            parts.append((e, np.full(len(e), m), rb // r_n, rb % r_n, off))
            for p in ENC:
                if not mb.items[p]:
                    continue
                ent, j, size, dev = (np.concatenate(x) for x in zip(*mb.items[p], strict=True))
                owner = pos_of[ent]
                order = np.lexsort((j, owner))  # a sample's items in placeholder order
                owner, j, size, dev = owner[order], j[order], size[order], dev[order]
                item_parts[p].append((owner, j, dev, offsets_in_bins(dev, size)))
            base += len(e)
        e, micro, dev, row, off = (
            np.concatenate(x).astype(np.int64) for x in zip(*parts, strict=True)
        )
        self.last_ages = step - since[e]
        plans = {}
        for p in ENC:
            if item_parts[p]:
                a = [np.concatenate(x).astype(np.int64) for x in zip(*item_parts[p], strict=True)]
                plans[p] = ItemPlan(owner=a[0], item=a[1], device=a[2], offset=a[3])
            else:
                plans[p] = ItemPlan.empty()
        return StepPlan(
            step=step,
            samples=samples[e],
            micro=micro,
            device=dev,
            row=row,
            offset=off,
            vision=plans["vision"],
            audio=plans["audio"],
            deferred=len(self.deferred),
        )


class OrchestratedPlanner(BalancedPlanner):
    """Ours, per phase with routing: images and clips may be encoded away from their text."""

    routed = True

    def _check(self, index: LengthsIndex, caps: Capacities) -> None:
        if caps.route_pair_capacity <= 0:
            raise OversizeError(
                "batch.planner=orchestrated routes encoder outputs between "
                "devices: set batch.route_pair_capacity > 0 (e.g. the largest "
                "item's encoder rows, or vision_patches / merge^2)"
            )
        llm = index.llm_tokens(caps.merge_area, caps.subsample)
        checks = [("batch.llm_row_len", llm, caps.llm_row_len)]
        for key, values, cap, per in (
            ("batch.vision_patches", index.images, caps.vision_patches, caps.merge_area),
            ("batch.audio_frames", index.audio, caps.audio_frames, caps.subsample),
        ):
            if len(values) and not cap:
                raise OversizeError(f"the data has items for {key} but that phase is disabled")
            checks.append((key, values, cap))
            if len(values) and values.max() // per > caps.route_pair_capacity:
                raise OversizeError(
                    f"an item needs {int(values.max() // per)} encoder rows, more than "
                    f"batch.route_pair_capacity={caps.route_pair_capacity}; raise it"
                )
        for key, need, cap in checks:
            bad = np.flatnonzero(need > cap)
            if len(bad):
                raise OversizeError(
                    f"{len(bad)} item(s) need more than {key}={cap} (the "
                    f"largest needs {int(need.max())}); raise {key}"
                )

    def _assign(self, mb: _Micro, s: np.ndarray, urgent: np.ndarray) -> np.ndarray:
        """LLM phase on its own: samples to rows, largest first, least-loaded rows first."""
        return lpt_assign(self.llm[s], mb.rows, self.caps.llm_row_len, urgent, mb.rows_q)

    def _assign_items(self, mb, rows, items, urgent, ok):
        """Each encoder phase on its own, then equal-size swaps towards the text's device."""
        devs = {}
        home_all = np.where(rows >= 0, rows // self.caps.llm_rows, -1)
        for p in ENC:
            owner, _, size = items[p]
            dev = np.full(len(owner), -1, np.int64)
            sel = np.flatnonzero(ok[owner])
            dev[sel] = lpt_assign(
                size[sel], mb.enc[p], self.cap[p], urgent[owner[sel]], mb.enc_q[p]
            )
            ok[owner[sel[dev[sel] < 0]]] = False
            devs[p] = dev
        for p in ENC:  # locality, then the route capacity, on the items that stay
            owner, _, size = items[p]
            dev = devs[p]
            keep = np.flatnonzero(ok[owner])
            home = home_all[owner[keep]]
            dev[keep] = localize(size[keep], dev[keep], home, self.caps.devices)
            over = self._route_overflow(mb, p, size[keep], dev[keep], home)
            ok[owner[keep[over]]] = False
        for p in ENC:  # record the routed rows of what is finally kept
            owner, _, size = items[p]
            keep = np.flatnonzero(ok[owner])
            home = home_all[owner[keep]]
            remote = devs[p][keep] != home
            keys = devs[p][keep][remote] * self.caps.devices + home[remote]
            old_k, old_r = mb.remote[p]
            mb.remote[p] = (
                np.concatenate([old_k, keys]),
                np.concatenate([old_r, size[keep][remote] // self.per_row[p]]),
            )
        return ok, devs

    def _route_overflow(
        self, mb: _Micro, p: str, size: np.ndarray, dev: np.ndarray, home: np.ndarray
    ) -> np.ndarray:
        """Mask of items whose (src, dst) pair would exceed batch.route_pair_capacity."""
        d_n = self.caps.devices
        remote = dev != home
        keys = np.concatenate([mb.remote[p][0], dev[remote] * d_n + home[remote]])
        rows = np.concatenate([mb.remote[p][1], size[remote] // self.per_row[p]])
        order = np.argsort(keys, kind="stable")
        k, r = keys[order], rows[order]
        cum = np.cumsum(r)
        first = np.searchsorted(k, k, "left")
        within = cum - (cum[first] - r[first])
        over_sorted = within > self.caps.route_pair_capacity
        over_all = np.empty(len(keys), bool)
        over_all[order] = over_sorted
        out = np.zeros(len(size), bool)
        out[np.flatnonzero(remote)] = over_all[len(mb.remote[p][0]) :]
        return out


def localize(size: np.ndarray, dev: np.ndarray, home: np.ndarray, devices: int) -> np.ndarray:
    """Reassigns devices among items of equal size so that most sit on their `home` device.

    Every device keeps the same multiset of item sizes (so the same load and quadratic cost);
    among items of one size, as many as the device has slots of that size stay home.
    """
    n = len(size)
    if n == 0:
        return dev
    slot_key = size * devices + dev
    item_key = size * devices + home
    order = np.argsort(item_key, kind="stable")
    ik = item_key[order]
    rank = np.arange(n) - np.searchsorted(ik, ik, "left")
    sk = np.sort(slot_key)
    avail = np.searchsorted(sk, ik, "right") - np.searchsorted(sk, ik, "left")
    local = rank < avail
    out = np.empty(n, np.int64)
    out[order[local]] = home[order[local]]
    uk, cnt = np.unique(slot_key, return_counts=True)
    lk = ik[local]
    used = np.searchsorted(lk, uk, "right") - np.searchsorted(lk, uk, "left")
    free_slots = np.repeat(uk, cnt - used)  # sorted by size, then device
    out[order[~local]] = free_slots % devices  # items sorted by size too: classes line up
    return out


def check_plan(plan: StepPlan, index: LengthsIndex, caps: Capacities) -> None:
    """Raises ValueError unless the plan honours the contract (capacities, no overlap, every
    item of every planned sample placed once, items local or within the route capacity)."""
    d_n, r_n, row_len = caps.devices, caps.llm_rows, caps.llm_row_len
    llm = index.llm_tokens(caps.merge_area, caps.subsample)[plan.samples]
    if (
        len(plan.samples)
        and (
            (plan.micro < 0)
            | (plan.micro >= caps.microbatches)
            | (plan.device < 0)
            | (plan.device >= d_n)
            | (plan.row < 0)
            | (plan.row >= r_n)
        ).any()
    ):
        raise ValueError(f"step {plan.step}: a sample outside the [M, D, R] buckets")
    key = (plan.micro * d_n + plan.device) * r_n + plan.row
    _check_segments(plan.step, "llm", key, plan.offset, llm, row_len)
    for p, values, ptr, cap, per in (
        ("vision", index.images, index.images_ptr, caps.vision_patches, caps.merge_area),
        ("audio", index.audio, index.audio_ptr, caps.audio_frames, caps.subsample),
    ):
        it: ItemPlan = getattr(plan, p)
        want = ptr[plan.samples + 1] - ptr[plan.samples]
        got = np.bincount(it.owner, minlength=len(plan.samples)) if len(it.owner) else want * 0
        uniq = len(np.unique(it.owner * (int(want.max(initial=0)) + 1) + it.item))
        if (got != want).any() or uniq != len(it.owner) or (it.item >= want[it.owner]).any():
            raise ValueError(f"step {plan.step}: {p} items of planned samples not placed once")
        if not len(it.owner):
            continue
        size = values[ptr[plan.samples[it.owner]] + it.item]
        micro = plan.micro[it.owner]
        _check_segments(plan.step, p, micro * d_n + it.device, it.offset, size, cap)
        if (it.offset % per).any():
            raise ValueError(f"step {plan.step}: {p} item offsets must be multiples of {per}")
        home = plan.device[it.owner]
        remote = it.device != home
        if caps.route_pair_capacity == 0:
            if remote.any():
                raise ValueError(f"step {plan.step}: {p} item away from its text, no routing")
            continue
        pair = (micro * d_n + it.device) * d_n + home
        _, inv = np.unique(pair[remote], return_inverse=True)
        if remote.any() and np.bincount(inv, size[remote] // per).max() > caps.route_pair_capacity:
            raise ValueError(
                f"step {plan.step}: {p} rows between two devices exceed "
                f"route_pair_capacity={caps.route_pair_capacity}"
            )


def _check_segments(
    step: int, what: str, key: np.ndarray, start: np.ndarray, size: np.ndarray, cap: int
) -> None:
    end = start + size
    if len(key) and ((start < 0) | (end > cap)).any():
        raise ValueError(f"step {step}: {what} capacity {cap} exceeded")
    o = np.lexsort((start, key))
    same = key[o][1:] == key[o][:-1]
    if (start[o][1:][same] < end[o][:-1][same]).any():
        raise ValueError(f"step {step}: {what} segments overlap")
