"""Sizing: a config's `auto` and -1 batch sizes resolved against the data, and the planner's
capacities from the resolved config.

Every dry run that sizes a bucket is here (route capacity, tile and document capacities: each a
run of the planner's own plans over the data), beside `capacities` (a resolved config -> the
planner contract) and `planner_from_config`. The trainer resolves once, at start-up, before
anything is shaped; checkpoints keep the resolved values, so a resumed run plans as before.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import numpy as np

import sharding
from jaxmllm.config import Config, ConfigError, phases
from jaxmllm.config.phases import ENCODERS, LLM
from jaxmllm.config.spec import BatchSpec, documents_bounded
from jaxmllm.cost.model import CostModel
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.data.preprocess import MEDIA
from jaxmllm.plan.contract import Capacities, Planner, device_tile_caps
from jaxmllm.plan.registry import HOLDS_TILES, make_planner
from jaxmllm.plan.tiles import band_above, bin_tiles, tiles_alone
from jaxmllm.resolve.attention import resolve_attention
from jaxmllm.resolve.capacity import (
    ROUTE_DRY_RUN_STEPS,
    dry_run_documents,
    encoder_capacities,
    most_documents,
    route_capacity,
    suggest_capacities,
)
from jaxmllm.resolve.tilesize import (
    HELD_DRY_RUN_STEPS,
    dry_run_tiles,
    largest_doc_tiles,
    size_tiles,
    span_upper,
)

log = logging.getLogger("jaxmllm")


def resolve_batch(cfg: Config, index: LengthsIndex, devices: int | None = None) -> Config:
    """Resolves `batch.capacity: auto`, `batch.route_pair_capacity: -1` (`resolve_route`),
    `batch.devices_per_host: -1` and `batch.*_tiles: -1` against the data.

    auto keeps the LLM bucket (the token budget per device is the user's choice) and sizes the
    encoder buckets to the data's modality ratios, on the capacity ladder, each at least the
    largest item (a planner of whole samples': the most units of one sample; and whole blocks
    of block-sparse attention). Tile capacities: see
    `resolve_tiles`. The resolved values are what the model, the planner and checkpoints see.
    `devices`: the data-parallel buckets (default: from the config's mesh).
    """
    cfg = resolve_attention(cfg)  # (the trainer resolved it already; entry points that did not)
    b, m = cfg.batch, cfg.model
    if len(index) == 0:
        raise ConfigError(
            "the data has no usable samples (every record was rejected or the source is empty); "
            "see the index's rejects.jsonl, or raise data.synthetic.num_samples"
        )
    changes = {}
    per_token = {p.name: p.per_token(m) for p in ENCODERS}
    if b.capacity == "auto":
        block = b.attention_block if m.attention == "block_sparse" else 1
        per_row = {p.name: p.per_row(m) for p in ENCODERS}
        tokens = b.llm_rows * b.llm_row_len
        # (orchestrated places items, not samples: a bucket holds the largest item whole)
        kw = dict(per_row=per_row, block=block, routed=b.planner == "orchestrated")
        if cfg.mesh.context > 1:  # (a device's tokens: its share of its group's longer rows)
            got = encoder_capacities(index, tokens, per_token, **kw)
        else:
            got = suggest_capacities(index, tokens, per_token, max_row_len=b.llm_row_len, **kw)
        for p in ENCODERS:
            if got.units[p.name]:  # 0: the data has none of it (below)
                changes[p.capacity] = got.units[p.name]
    for p in phases.enabled(m):  # the data has none of its items: the step leaves it out
        if not len(index.items[p.name]) and p.bucket(b):
            changes[p.capacity] = 0
            log.info(
                "the data has no %s items: batch.%s = 0, the %s encoder and its projector are "
                "left out of the step (and not trained)",
                p.item,
                p.capacity,
                p.name,
            )
    auto_route = False
    if b.route_pair_capacity != 0 and b.planner != "orchestrated":
        # Only orchestrated moves items between devices; an exchange would only move zeros.
        changes["route_pair_capacity"] = 0
    elif b.route_pair_capacity == -1:
        # A device's whole encoder output (never binds) for the dry run, then what it carried.
        rows = [
            changes.get(p.capacity, p.bucket(b)) // per_token[p.name] for p in phases.enabled(m)
        ]
        changes["route_pair_capacity"] = max([*rows, 1])
        auto_route = True
    if b.devices_per_host == -1:
        changes["devices_per_host"] = resolve_devices_per_host(cfg, devices)
    if changes:
        cfg = dataclasses.replace(cfg, batch=dataclasses.replace(b, **changes))
    if auto_route:
        changes["route_pair_capacity"] = resolve_route(cfg, index, devices)
        cfg = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, **changes))
    tiles = {**resolve_tiles(cfg, index, devices), **resolve_documents(cfg, index, devices)}
    if tiles:
        cfg = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, **tiles))
    if changes or tiles:
        log.info("batch resolved from the data: %s", {**changes, **tiles})
    return cfg


def resolve_devices_per_host(cfg: Config, devices: int | None) -> int:
    """`batch.devices_per_host: -1` (auto): the data-parallel positions one process holds (every
    position when there is one process)."""
    if jax.process_count() == 1:
        return devices or sharding.data_parallel_size(sharding.make_mesh(cfg.mesh))
    return len(sharding.local_dp_indices(sharding.make_mesh(cfg.mesh)))


def resolve_route(cfg: Config, index: LengthsIndex, devices: int | None) -> int:
    """`batch.route_pair_capacity: -1` (auto) of orchestrated, resolved (the rest resolved, the
    route capacity a device's whole encoder output): the most encoder rows one (src, dst) pair
    carried in a microbatch of a dry run of its own plans (`ROUTE_DRY_RUN_STEPS` at most, then
    `ROUTE_HEADROOM` more when the run is longer), at least the largest item's rows
    (`capacity.route_capacity`). The dense exchange's buffer is [devices, this] rows per
    device, so it no longer grows with the device count as a whole output per pair did; the
    planner holds the bound (a sample that would take a pair past it waits)."""
    if devices is None:
        devices = sharding.data_parallel_size(sharding.make_mesh(cfg.mesh))
    caps = capacities(cfg, devices)
    planner = make_planner(cfg.batch.planner, index, caps, cfg.data.seed)
    steps = min(cfg.train.steps, ROUTE_DRY_RUN_STEPS)
    return route_capacity(planner, index, caps, steps, cfg.train.steps)


# Long variants of the step (`jaxmllm.plan.ladder`) only for runs of this many steps: each is
# one more program to compile (minutes for a large model), which a shorter run would spend
# more on than its padding tiles cost it
LADDER_MIN_STEPS = 1000
DRY_RUN_STEPS = 2000  # at most this many steps planned to size a planner's tile capacities
DRY_RUN_HEADROOM = 0.1  # added when the run is longer than the dry run


def resolve_tiles(cfg: Config, index: LengthsIndex, devices: int | None) -> dict:
    """The `batch.*_tiles: -1` and `batch.*_long_tiles: [-1]` (auto) of block-sparse
    attention, resolved (the rest resolved).

    A planner that holds a tile capacity near the mean (`HOLDS_TILES`: orchestrated) gets the
    data's mean need per device plus the headroom (of a few) whose plans do the most useful
    work per FLOP the buckets compute under the model's cost (`capacity.size_tiles`), or less
    where a dry run of `HELD_DRY_RUN_STEPS` of its plans without a bound never needed as much
    (uniform data, where its tiles are even without holding them); where the longest documents
    need more than that, long variants of the step for them (`jaxmllm.plan.ladder`: with its
    tiles auto, in a run of LADDER_MIN_STEPS or more, without context groups, whose split
    shares a long document among the group; with a context degree per step, whose long
    variants are its groups, in any run).
    Any other planner gets the most its own buckets need in a dry run of its plans
    (`DRY_RUN_STEPS` at most, then `DRY_RUN_HEADROOM` more when the run is longer), so that its
    buckets always fit and the comparison shows what its packing costs, and no long variant.
    Every document fits the top variant, wherever in a block it starts.
    """
    b = cfg.batch
    keys = {p: key for p, key in tile_keys().items() if getattr(b, key) == -1}
    longs = {p: key for p, key in long_tile_keys().items() if getattr(b, key) == (-1,)}
    if cfg.model.attention != "block_sparse" or not (keys or longs):
        return {}
    out = {key: () for key in longs.values()}  # (no long variant unless sized below)
    # (long tiles set by hand: not the one a degree per step has while none is, `BatchSpec.of`)
    configured = any(getattr(b, k) not in ((), (-1,)) for k in long_tile_keys().values())
    if not keys:
        return out
    caps = capacities(cfg, devices or 1)  # (the -1s: no bound)
    if devices is None:
        devices = sharding.data_parallel_size(sharding.make_mesh(cfg.mesh))
        caps = dataclasses.replace(caps, devices=devices)
    planner = make_planner(b.planner, index, caps, cfg.data.seed)
    long = ()
    if b.planner in HOLDS_TILES:
        # (the headroom that does the most useful work per computed FLOP of the cost model;
        # a decoder's windowed layers on their own list, `window_tile_cap`, but in groups)
        cost = CostModel.from_model(cfg.model)
        weights = cost.tile_weights(caps.attention_block, caps.per_row, caps.context)
        # (a degree per step: its long variants are its groups, whatever the run's length, and
        # sized for the phases whose long tiles are auto)
        ladder = bool(longs) and (
            bool(caps.long_context)
            or (
                len(longs) == len(long_tile_keys())
                and cfg.mesh.context == 1
                and cfg.train.steps >= LADDER_MIN_STEPS
            )
        )
        sizes = size_tiles(
            planner,
            index,
            caps,
            min(cfg.train.steps, HELD_DRY_RUN_STEPS),
            make=lambda c: make_planner(b.planner, index, c, cfg.data.seed),
            weights=weights,
            ladder=ladder or configured,
        )
        need, long = sizes.tiles, sizes.long if ladder else ()
    else:
        steps = min(cfg.train.steps, DRY_RUN_STEPS)
        need = dry_run_tiles(planner, index, caps, steps)
        if steps < cfg.train.steps:
            need = {p: math.ceil(n * (1 + DRY_RUN_HEADROOM)) for p, n in need.items()}
    if not long and not configured:
        # Documents the dry run did not meet fit too, wherever in a block they start.
        least = device_tile_caps(caps, largest_doc_tiles(index, caps))
        need = {p: max(n, least[p]) for p, n in need.items()}
    out.update({key: max(need[p], 1) for p, key in keys.items()})
    if long and longs:
        out.update({key: tuple(rung[p] for rung in long) for p, key in longs.items()})
    return out


DOCUMENTS_HEADROOM = 0.25  # cuDNN's documents per row: over the dry run's most, when longer


def resolve_documents(cfg: Config, index: LengthsIndex, devices: int | None) -> dict[str, int]:
    """The `batch.*_documents: -1` (auto) of cuDNN attention (and of a vision tower's class
    tokens, `documents_phases`): the most documents one row of the
    planner's own plans holds in a dry run (`DRY_RUN_STEPS` at most, then `DOCUMENTS_HEADROOM`
    more when the run is longer), never above what the data allows (the row over its smallest
    document). cuDNN's backward workspace grows with this bound, and the data's worst case
    (rows of the shortest samples only) is often many times what plans ever hold: at 16384
    tokens a row, 0.4B parameters, it asked for 234 GiB on an H100. A later row past the
    bound stops the run naming the key (`bucketize`); resume with it raised."""
    b = cfg.batch
    keys = {
        p: key
        for p, key in document_keys().items()
        if getattr(b, key) == -1 and p in documents_bounded(cfg.model)
    }
    if not keys:
        return {}
    if devices is None:
        devices = sharding.data_parallel_size(sharding.make_mesh(cfg.mesh))
    caps = capacities(cfg, devices)
    bound = most_documents(index, caps)
    steps = min(cfg.train.steps, DRY_RUN_STEPS)
    most = dry_run_documents(
        make_planner(b.planner, index, caps, cfg.data.seed), index, caps, steps
    )
    if steps < cfg.train.steps:
        most = {p: math.ceil(n * (1 + DOCUMENTS_HEADROOM)) for p, n in most.items()}
    return {key: max(1, min(bound[p], most[p])) for p, key in keys.items()}


def tile_keys() -> dict[str, str]:
    """Per phase, the batch key of its tile capacity (block-sparse attention)."""
    return {LLM: "llm_tiles", **{p.name: p.tiles for p in ENCODERS}}


def long_tile_keys() -> dict[str, str]:
    """Per phase, the batch key of its long variants' tiles (block-sparse attention)."""
    return {LLM: "llm_long_tiles", **{p.name: p.long_tiles for p in ENCODERS}}


def document_keys() -> dict[str, str]:
    """Per phase, the batch key of its most documents a row (cuDNN attention)."""
    return {LLM: "llm_documents", **{p.name: p.documents for p in ENCODERS}}


def resolve_bounds(cfg: Config, devices: int) -> Config:
    """Every `-1` batch size at its bound without data, for compile-only measurements (the
    memory bench, the recipes' compile test): what any data the config admits may need.

    A route capacity of a device's whole encoder output; per phase, the tiles of a bucket full
    of the longest documents the config admits laid end to end (for a given fill, fewer,
    longer documents need more tiles): a row of text per LLM row, each encoder's largest item
    (`preprocess.MEDIA[phase].largest`: an image at `data.image_max_pixels`, a chunk of
    `data.audio_max_frames`) in the encoders'; cuDNN's
    documents per row at one a unit (its workspace then is the worst there is: set
    `batch.*_documents` to measure a bound of your own). `mesh.context_steps: auto` is measured
    as all (a group step, the largest program, is either choice's). `batch.capacity: auto` is
    refused: it sizes the encoder buckets from the data."""
    if cfg.batch.capacity == "auto":
        raise ConfigError(
            "batch.capacity=auto sizes the encoder buckets from the data, which a compile-only "
            "measurement does not read: set batch.capacity: fixed (--set batch.capacity=fixed)"
        )
    if cfg.mesh.context_steps == "auto":  # (chosen from the data; the group steps' programs,
        # the largest, are either choice's: measured as all)
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, context_steps="all"))
    b, m = cfg.batch, cfg.model
    on = phases.enabled(m)
    changes = {}
    if b.route_pair_capacity != 0 and b.planner != "orchestrated":
        changes["route_pair_capacity"] = 0  # (as resolve_batch: only orchestrated routes)
    elif b.route_pair_capacity == -1:  # a device's whole output
        changes["route_pair_capacity"] = max([p.bucket(b) // p.per_token(m) for p in on] + [1])
    if b.devices_per_host == -1:
        changes["devices_per_host"] = devices
    cfg = dataclasses.replace(cfg, batch=dataclasses.replace(b, **changes))
    caps = capacities(cfg, devices)
    # Per phase: (rows of its longest document, rows of a bucket's row, bucket rows, causal)
    longest = {LLM: (caps.group_row_len, caps.group_row_len, b.llm_rows, True)}
    for p in on:
        per_row = p.per_row(m)
        longest[p.name] = (MEDIA[p.name].largest(cfg) // per_row, p.bucket(b) // per_row, 1, False)
    tiles, docs = {}, {}
    for phase, (size, row, rows, causal) in longest.items():
        size = max(min(size, row), 1)
        offsets = np.arange(0, row, size)
        sizes = np.minimum(size, row - offsets)
        bucket = bin_tiles(np.zeros_like(offsets), offsets, sizes, 1, b.attention_block, causal)
        # ... and never below what resolve_tiles holds for the longest document (starting
        # anywhere in a block: one block more than its size in blocks)
        least = tiles_alone(size, b.attention_block, causal)
        tiles[phase] = max(rows * int(bucket[0]), int(least))
        if causal and caps.bidirectional:  # (spans: tiles above the diagonal, as far ahead
            # as the largest item a bucket holds reaches)
            tiles[phase] += rows * band_above(row // b.attention_block, span_upper(caps))
        docs[phase] = max(row, 1)  # (cuDNN: a document a unit)
    tiles = device_tile_caps(caps, tiles)
    bounds = {
        key: max(tiles[p], 1)
        for p, key in tile_keys().items()
        if p in tiles and getattr(b, key) == -1
    }
    bounds |= {
        key: docs[p] for p, key in document_keys().items() if p in docs and getattr(b, key) == -1
    }
    # (the bounds are the worst any data needs: no long variant holds more)
    bounds |= {key: () for key in long_tile_keys().values() if getattr(b, key) == (-1,)}
    return dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, **bounds))


def capacities(cfg: Config, devices: int) -> Capacities:
    """The planner's bucket capacities of a config's bucket spec (`BatchSpec`), over `devices`
    data-parallel buckets; sizes still -1 (auto) are no bound, the route capacity excepted."""
    return Capacities.of(BatchSpec.of(cfg, resolved=False), devices)


def planner_from_config(cfg: Config, index: LengthsIndex, devices: int) -> Planner:
    """The planner named by batch.planner over `index`, with `devices` data-parallel buckets."""
    return make_planner(cfg.batch.planner, index, capacities(cfg, devices), cfg.data.seed)
