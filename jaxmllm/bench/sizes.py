"""The balance bench's capacities, as the trainer sizes them: buckets matched to the data's
modality ratios (`make_caps`), the per-pair route capacity and a tile-holding policy's tile
capacities from dry runs of its plans (`sized_caps`), and the steps of a run (`steps_for`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmllm.config.phases import NAMES
from jaxmllm.cost.model import CostModel
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.plan.contract import Capacities
from jaxmllm.plan.registry import HOLDS_TILES, make_planner
from jaxmllm.plan.summary import summary_of
from jaxmllm.resolve.capacity import ROUTE_DRY_RUN_STEPS, route_capacity, suggest_capacities
from jaxmllm.resolve.tilesize import HELD_DRY_RUN_STEPS, size_tiles


def make_caps(
    index: LengthsIndex,
    devices: int,
    tokens: int,
    micro: int,
    policy: str,
    merge_area: int = 4,
    subsample: int = 4,
    block: int = 0,
    devices_per_host: int = 0,
    context: int = 1,
    long_context: int = 0,
) -> Capacities:
    """Capacities matched to the data; route capacity = a device's whole encoder output (it
    never binds: `route_caps` sizes it as the trainer does); `devices_per_host` (0: one host)
    for host-aware routing; with `block`, rows in whole blocks (tile capacities: `held_caps`);
    `context`, `long_context`: context groups (`Capacities`: every step's, or with a degree
    per step the long variants')."""
    per_token = {"vision": merge_area, "audio": subsample}
    per_row = {"vision": 1, "audio": subsample}  # (the pairs stem: a row per LLM token)
    sug = suggest_capacities(
        index,
        tokens,
        per_token,
        per_row=per_row,
        match_llm=True,
        block=block or 1,
        routed=policy == "orchestrated",  # (items, not samples, to a device: `RoutedAssignment`)
    )
    route = max(sug.units[p] // per_token[p] for p in per_token)
    caps = Capacities(
        microbatches=micro,
        devices=devices,
        llm_rows=sug.llm_rows,
        llm_row_len=sug.llm_row_len,
        units=sug.units,
        per_token=per_token,
        per_row=per_row,
        route_pair_capacity=route if policy == "orchestrated" else 0,
        attention_block=block,
        devices_per_host=devices_per_host,
        context=context,
        long_context=long_context,
    )
    return caps


def route_caps(index: LengthsIndex, caps: Capacities, policy: str, steps: int, seed: int):
    """A routing policy's per-pair route capacity as the trainer sizes it (`resolve_route`:
    the most rows a pair carried in a dry run of its plans, at least the largest item's), from
    the plans of the next seed, with the headroom of a run longer than its dry run: the
    bench's run is then past its dry run, as a long run mostly is."""
    if not caps.route_pair_capacity:
        return caps
    planner = make_planner(policy, index, caps, seed + 1)
    pair = route_capacity(planner, index, caps, min(steps, ROUTE_DRY_RUN_STEPS), steps + 1)
    return dataclasses.replace(caps, route_pair_capacity=pair)


def held_caps(
    index: LengthsIndex,
    caps: Capacities,
    policy: str,
    steps: int,
    seed: int,
    cost: CostModel | None = None,
    ladder: bool = True,
):
    """A tile-holding policy's capacities as the trainer sizes them (`resolve_tiles`): the mean
    need plus headroom (with `cost`, the headroom that does the most useful work per computed
    FLOP), or what a dry run of its plans without a bound needed if that is less; with
    `ladder`, a long variant for the documents a base bucket cannot hold (`plan.ladder`)."""
    sizes = size_tiles(
        make_planner(policy, index, caps, seed),
        index,
        caps,
        steps,
        make=lambda c: make_planner(policy, index, c, seed),
        weights=cost.tile_weights(caps.attention_block, caps.per_row, caps.context)
        if cost
        else None,
        ladder=ladder,
    )
    return dataclasses.replace(caps, tiles=sizes.tiles, long_tiles=sizes.long)


def sized_caps(
    index: LengthsIndex,
    caps: Capacities,
    policy: str,
    steps: int,
    cost: CostModel | None,
    seed: int = 0,
    pair: str = "auto",
) -> Capacities:
    """`make_caps`' capacities as a policy runs the bench for `steps` plans: the route
    capacity as the trainer sizes it (`route_caps`; `pair` "whole" keeps a device's whole
    encoder output) and, with tiles, a tile-holding policy's tile capacities (`held_caps`)."""
    if pair == "auto":
        caps = route_caps(index, caps, policy, steps, seed)
    if caps.attention_block and policy in HOLDS_TILES:
        # (no long variants beside every step's context groups: the trainer sizes none)
        ladder = caps.context == 1
        steps = min(steps, HELD_DRY_RUN_STEPS)
        caps = held_caps(index, caps, policy, steps, seed, cost, ladder=ladder)
    return caps


def steps_for(index: LengthsIndex, devices: int, tokens: int, micro: int, lo: int, hi: int) -> int:
    """Enough steps for about one epoch, within [lo, hi] (the mean sample from the index's
    summary: the whole index's when small)."""
    per_token = dict.fromkeys(NAMES, 4)
    mean = summary_of(index, per_token).body.llm_tokens(per_token).mean()
    per_step = devices * micro * tokens / max(mean, 1)
    return int(np.clip(np.ceil(len(index) / per_step), lo, hi))
