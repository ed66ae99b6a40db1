"""Capacity planning: per-device bucket sizes that match the data's modality ratios.

Given a lengths index and a target number of LLM tokens per device and microbatch, suggest the
LLM row shape and each encoder phase's capacity so that every phase fills at the same rate
(capacity_p / capacity_llm = total_p / total_llm over the data), each at least what one device
must hold whole (the largest item where the planner routes items, else the largest sample's
units), all on a small ladder of shapes (8 values per octave: {8..15} x 2^k, so a rounded
capacity is within 6% of the ideal and a handful of configs share compiled shapes). Since every
capacity is rounded, `match_llm=True` lets the LLM bucket move one ladder step from the target
when that brings the phases' demands closer together (the phase whose demand runs ahead binds
first; the others can fill only up to their demand relative to it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from jaxmllm.config.phases import BY_NAME, LLM, NAMES, PHASES
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.plan.contract import (
    Capacities,
    Planner,
    pair_rows,
    step_documents,
)
from jaxmllm.plan.summary import IndexSummary, summary_of


def ladder_values(lo: int = 32, hi: int = 1 << 22, per_octave: int = 8) -> np.ndarray:
    """The shape ladder: m * 2**k for m in [per_octave, 2*per_octave), between lo and hi."""
    out = []
    k = 0
    while per_octave << k <= hi:
        out += [m << k for m in range(per_octave, 2 * per_octave)]
        k += 1
    v = np.array(sorted(set(out)), np.int64)
    return v[(v >= lo) & (v <= hi)]


def ladder_up(x: float, per_octave: int = 8, multiple: int = 32) -> int:
    """Smallest ladder value >= x (and a multiple of `multiple`)."""
    v = _ladder(per_octave, multiple, x)
    return int(v[np.searchsorted(v, x)])


def ladder_nearest(x: float, per_octave: int = 8, multiple: int = 32) -> int:
    """Ladder value nearest to x in ratio."""
    v = _ladder(per_octave, multiple, x)
    i = int(np.clip(np.searchsorted(v, x), 1, len(v) - 1))
    lo, hi = v[i - 1], v[i]
    return int(lo if x > 0 and math.log(x / lo) < math.log(hi / x) else hi)


def _ladder(per_octave: int, multiple: int, x: float = 0) -> np.ndarray:
    """The ladder's multiples of `multiple`, up to 2^22 or on past x (a row of 8M tokens, the
    patches of a sample with a thousand images: the shape is large, not a crash)."""
    top = 22 if x <= 1 << 22 else math.ceil(math.log2(x)) + 1
    v = ladder_values(hi=1 << top, per_octave=per_octave)
    return v[v % multiple == 0]


@dataclass(frozen=True)
class CapacitySuggestion:
    """Per device and microbatch bucket sizes (the batch.* keys of the same names)."""

    llm_rows: int
    llm_row_len: int
    units: dict[str, int]  # per encoder phase, its bucket (0 when the data has none of it)
    demand: dict  # per phase: total work / capacity, relative to the LLM's (1.0 = matched)

    def batch_overrides(self) -> dict:
        """The batch config keys to set (e.g. for `capacity: auto`)."""
        out = {"llm_rows": self.llm_rows, "llm_row_len": self.llm_row_len}
        out.update({BY_NAME[p].capacity: n for p, n in self.units.items()})
        return out


def suggest_capacities(
    index: LengthsIndex,
    llm_tokens_per_device: int,
    per_token: Mapping[str, int],
    *,
    per_row: Mapping[str, int] | None = None,
    max_row_len: int | None = None,
    per_octave: int = 8,
    match_llm: bool = False,
    block: int = 1,
    routed: bool = False,
) -> CapacitySuggestion:
    """Suggests capacities for `llm_tokens_per_device` LLM tokens per device and microbatch.

    Args:
      index: the data's lengths index.
      llm_tokens_per_device: target LLM tokens per device per microbatch.
      per_token: per encoder phase, its units per LLM token (vision: merge**2).
      per_row: per encoder phase, its units per encoder row (audio: the stem's stride; 1 where
        missing), so that a bucket holds whole blocks of rows.
      max_row_len: longest LLM row allowed (attention memory); None = one row per device.
      per_octave: ladder resolution.
      match_llm: let the LLM bucket move one ladder step (rows or row length) from the target
        when that brings the phases' demands closer together; otherwise it stays the nearest
        ladder shape to the target (`batch.capacity: auto` keeps the user's LLM bucket).
      block: block-sparse attention's block: every row (LLM, patches, audio encoder rows) a
        whole number of blocks.
      routed: the planner places items, not whole samples (`batch.planner: orchestrated`,
        `plan.assign.RoutedAssignment`): an encoder bucket need hold only the largest item,
        not the most units of one sample (`_encoder_caps`).

    Proportions come from the index's summary (`summary.summary_of`: a uniform sample, the
    whole index when small), extremes from its tail (the longest samples).
    """
    summary = summary_of(index, per_token)
    llm = summary.body.llm_tokens(per_token)
    longest = summary.most_units[LLM] if summary.samples else 1  # (a row holds a sample whole)
    target = max(llm_tokens_per_device, longest)
    mult = math.lcm(32, block)
    if max_row_len is None or target <= max_row_len:
        near = max(ladder_nearest(target, per_octave, mult), ladder_up(longest, per_octave, mult))
        shapes = [(1, near)]
        if match_llm:  # with rounded capacities, the phase whose demand runs ahead binds first
            ladder = _ladder(per_octave, mult)
            i = int(np.searchsorted(ladder, near))
            shapes += [(1, int(v)) for v in ladder[max(i - 1, 0) : i + 2] if v >= longest]
    else:
        row_len = ladder_up(max(longest, max_row_len // 2), per_octave, mult)
        rows = max(1, round(target / row_len))
        shapes = [(rows, row_len)]
        if match_llm:
            shapes += [(r, row_len) for r in (rows - 1, rows + 1) if r >= 1]
    best = None
    for rows, row_len in shapes:
        sug = _encoder_caps(
            summary, llm, rows, row_len, per_token, per_row, per_octave, block, routed
        )
        mismatch = math.log(max(sug.demand.values()) / min(sug.demand.values()))
        score = (round(mismatch, 3), abs(math.log(rows * row_len / target)))
        if best is None or score < best[0]:
            best = (score, sug)
    return best[1]


def encoder_capacities(
    index: LengthsIndex,
    llm_tokens_per_device: int,
    per_token: Mapping[str, int],
    *,
    per_row: Mapping[str, int] | None = None,
    per_octave: int = 8,
    block: int = 1,
    routed: bool = False,
) -> CapacitySuggestion:
    """Encoder buckets matched to exactly `llm_tokens_per_device` LLM tokens a device (as one
    row): where the LLM rows are not a device's (a context group's rows are longer than any
    device's tokens, and its longest document no measure of a device's share). `routed`: as
    `suggest_capacities`'."""
    summary = summary_of(index, per_token)
    llm = summary.body.llm_tokens(per_token)
    return _encoder_caps(
        summary, llm, 1, llm_tokens_per_device, per_token, per_row, per_octave, block, routed
    )


def _encoder_caps(
    summary: IndexSummary,
    llm: np.ndarray,
    rows: int,
    row_len: int,
    per_token: Mapping[str, int],
    per_row: Mapping[str, int] | None,
    per_octave: int,
    block: int = 1,
    routed: bool = False,
) -> CapacitySuggestion:
    """Each encoder phase's bucket for LLM buckets of `rows` x `row_len`: the ladder shape
    nearest the data's ratio to the LLM's, at least what one device must hold whole: the
    largest item where the planner routes items (`routed`), else the most units of one sample
    (a sample's items then share its text's device). A floor of a sample's units where items
    route would size the bucket by the rarest long sample (chats seed 100: a 64-frame clip of
    25,600 patches against a demand of ~20,700 a device, vision filled to 0.78)."""
    llm_cap = rows * row_len
    total_llm = max(int(llm.sum()), 1)
    caps, demand = {}, {LLM: 1.0}
    for name, per_sample in summary.body.units().items():  # (the body's: `llm`'s samples)
        if not summary.most_units[name]:
            caps[name] = 0
            continue
        # (a bucket: whole LLM tokens, a multiple of 4, whole blocks of encoder rows)
        rows_of = (per_row or {}).get(name, 1)
        mult = math.lcm(4 * per_token[name], block * rows_of, 32)
        ideal = llm_cap * per_sample.sum() / total_llm
        whole = summary.most[name] if routed else summary.most_units[name]
        caps[name] = max(
            ladder_nearest(ideal, per_octave, mult), ladder_up(whole, per_octave, mult)
        )
        demand[name] = float(ideal / caps[name])
    return CapacitySuggestion(llm_rows=rows, llm_row_len=row_len, units=caps, demand=demand)


def dry_run_documents(
    planner: Planner, index: LengthsIndex, caps: Capacities, steps: int
) -> dict[str, int]:
    """The most documents one row of `planner`'s plans holds per phase over `steps` plans
    (`planner` is used up: its state advances)."""
    most = dict.fromkeys(PHASES, 0)
    for _ in range(steps):
        for phase, n in step_documents(planner.plan(), index, caps).items():
            most[phase] = max(most[phase], n)
    return most


def most_documents(index: LengthsIndex, caps: Capacities) -> dict[str, int]:
    """Per phase, the most documents one packed row can hold with this data: the row over the
    smallest document (documents never share a position), at most the row, at least 1."""
    least = summary_of(index, caps.per_token).least
    out = {}
    for phase in PHASES:
        per = 1 if phase == LLM else caps.row_units(phase)
        row = caps.group_row_len if phase == LLM else caps.units[phase] // per
        out[phase] = (
            max(1, min(row, row // max(least[phase] // per, 1))) if least[phase] and row else 1
        )
    return out


# ----------------------------------------------------------------------------- routes

ROUTE_DRY_RUN_STEPS = 50  # plans of the dry run that sizes the per-pair route capacity
ROUTE_HEADROOM = 0.1  # over the dry run's most when the run is longer than the dry run


def whole_output_rows(caps: Capacities) -> int:
    """A device's whole encoder output in rows (the largest of its phases): a route capacity
    this large never binds (`route.Routes.free`)."""
    return max([*(caps.units[p] // caps.per_token[p] for p in NAMES), 1])


def largest_item_rows(index: LengthsIndex, caps: Capacities) -> int:
    """The encoder output rows of the data's largest item: the least a route capacity can be
    (every item must be able to leave its device)."""
    most = summary_of(index, caps.per_token).most
    rows = [most[p] // caps.per_token[p] if caps.units[p] else 0 for p in NAMES]
    return max([*rows, 1])


def dry_run_route_rows(planner: Planner, index: LengthsIndex, caps: Capacities, steps: int) -> int:
    """The most encoder rows one (src, dst) device pair carries in one microbatch and phase of
    `planner`'s first `steps` plans (`planner` is used up: its state advances)."""
    most = 0
    for _ in range(steps):
        plan = planner.plan()
        for phase in NAMES:
            most = max(most, int(pair_rows(plan, index, caps, phase).max(initial=0)))
    return most


def route_capacity(
    planner: Planner, index: LengthsIndex, caps: Capacities, steps: int, run_steps: int
) -> int:
    """The per-pair route capacity from the planner's own traffic: the most rows a pair carried
    in a dry run of `steps` plans (`planner` built on `caps` with a route capacity that never
    binds; used up), `ROUTE_HEADROOM` more when the run (`run_steps`) is longer, never below
    the largest item's rows nor above a device's whole encoder output. The planner then holds
    it: a sample whose items would take a pair past it waits (`route.Routes`)."""
    most = dry_run_route_rows(planner, index, caps, steps)
    if steps < run_steps:
        most = math.ceil(most * (1 + ROUTE_HEADROOM))
    return min(max(most, largest_item_rows(index, caps)), whole_output_rows(caps))


# ----------------------------------------------------------------------------- fill


def bins_lower_bound(sizes: np.ndarray, cap: int) -> int:
    """Martello and Toth's L2 lower bound on the bins of `cap` units that items of `sizes` need
    (no packing of them uses fewer): for every threshold a <= cap/2, the items above cap - a
    each need a bin of their own, those in (cap/2, cap - a] too, and the items in [a, cap/2]
    fill what those leave free before opening more. O(n log n)."""
    s = np.sort(np.asarray(sizes, np.int64))
    s = s[s > 0]
    if not len(s):
        return 0
    cs = np.concatenate([[0], np.cumsum(s)])
    big = int(np.searchsorted(2 * s, cap, "right"))  # items from here are above cap / 2
    alphas = np.unique(np.concatenate([[0], s[:big]]))
    hi = np.searchsorted(s, cap - alphas, "right")  # items from here are above cap - a
    n_own = len(s) - big  # above cap - a, and in (cap/2, cap - a]: one bin each
    free = (hi - big) * cap - (cs[hi] - cs[big])  # what those in (cap/2, cap - a] leave free
    small = cs[big] - cs[np.searchsorted(s, alphas, "left")]  # items in [a, cap/2]
    extra = np.ceil(np.maximum(small - free, 0) / cap)
    return int((n_own + extra).max())


def fill_bound(index: LengthsIndex, caps: Capacities) -> dict[str, float]:
    """Per phase, the highest fill any packing of the data's items into the phase's bins (LLM
    rows, a device's patches, a device's frames) can reach over an epoch: total units over
    (`bins_lower_bound` x bin). Coarse items (clips of most of a bucket) hold it below 1."""
    phases = [(LLM, index.llm_tokens(caps.per_token), caps.llm_row_len)]
    phases += [(p, index.items[p].sizes, caps.units[p]) for p in NAMES]
    out = {}
    for p, sizes, cap in phases:
        bins = bins_lower_bound(sizes, cap) if cap > 0 else 0
        out[p] = round(float(sizes.sum()) / (bins * cap), 4) if bins else 1.0
    return out
