"""The grain pipeline: plan a step, load only its samples, bucketize, prefetch in a thread.

    source (grain.MapDataset, random access) ─┐
    lengths index -> planner (carried state) ─┴─> StepIterator -> ThreadPrefetch -> trainer

Everything per step runs on the prefetch thread, ahead of the trainer: planning, loading,
bucketizing, the step's counts for metrics (real tokens, analytic FLOPs) and, given `to_device`,
putting the batch on the devices, so the trainer's thread only dispatches steps.

The iterator is a `grain.DatasetIterator`, so its state (the planner's) is checkpointed with
grain's own orbax handler and a restored pipeline replays the exact same steps.

On several hosts every process plans the same global step from the same index and seed, then
loads and bucketizes only the samples with text or an encoder item on its own data-parallel
positions (`positions`); grain saves each process's iterator state in its own file.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import grain
import jax
import numpy as np

import sharding
from jaxmllm.config import Config, ConfigError
from jaxmllm.data.bucketize import bucketize, fill_stats
from jaxmllm.data.cost import CostModel
from jaxmllm.data.loader import Loader
from jaxmllm.data.samples import LengthsIndex
from jaxmllm.data.specials import RESERVED
from jaxmllm.data.synthetic import SyntheticSource
from jaxmllm.metrics import StepCounter
from jaxmllm.pipeline.choose import Variants
from jaxmllm.plan.capacity import (
    HELD_DRY_RUN_STEPS,
    ROUTE_DRY_RUN_STEPS,
    dry_run_documents,
    dry_run_tiles,
    encoder_capacities,
    held_tiles,
    largest_doc_tiles,
    most_documents,
    route_capacity,
    suggest_capacities,
)
from jaxmllm.plan.contract import Capacities, Planner, device_tile_caps
from jaxmllm.plan.registry import HOLDS_TILES, make_planner

log = logging.getLogger("jaxmllm")


def make_source(cfg: Config) -> tuple[grain.MapDataset, LengthsIndex]:
    """The record source named by data.source and its lengths index.

    A manifest or ArrayRecord source reads its index (`python -m jaxmllm.data.index`), checks it
    against the config and applies data.on_oversize; row i of the index is `source[i]`.
    """
    if cfg.data.source == "synthetic":
        source = SyntheticSource(cfg)
        return grain.MapDataset.source(source), source.lengths()
    from jaxmllm.data.source import open_source

    manifest = open_source(cfg)
    return grain.MapDataset.source(manifest), manifest.index


def resolve_batch(cfg: Config, index: LengthsIndex, devices: int | None = None) -> Config:
    """Resolves `batch.capacity: auto`, `batch.route_pair_capacity: -1` (`resolve_route`),
    `batch.devices_per_host: -1` and `batch.*_tiles: -1` against the data.

    auto keeps the LLM bucket (the token budget per device is the user's choice) and sizes the
    encoder buckets to the data's modality ratios, on the capacity ladder, each at least the
    largest item (and whole blocks of block-sparse attention). Tile capacities: see
    `resolve_tiles`. The resolved values are what the model, the planner and checkpoints see.
    `devices`: the data-parallel buckets (default: from the config's mesh).
    """
    b, m = cfg.batch, cfg.model
    if len(index) == 0:
        raise ConfigError(
            "the data has no usable samples (every record was rejected or the source is empty); "
            "see the index's rejects.jsonl, or raise data.synthetic.num_samples"
        )
    changes = {}
    if b.capacity == "auto":
        block = b.attention_block if m.attention == "block_sparse" else 1
        area, sub = m.vision.merge**2, m.audio.subsample
        if cfg.mesh.context > 1:  # (a device's tokens: its share of its group's longer rows)
            got = encoder_capacities(index, b.llm_rows * b.llm_row_len, area, sub, block=block)
        else:
            got = suggest_capacities(index, b.llm_rows * b.llm_row_len, area, sub,
                                     max_row_len=b.llm_row_len, block=block)  # fmt: skip
        for key in ("vision_patches", "audio_frames"):
            value = getattr(got, key)
            if value:  # 0: the data has none of it; keep the configured bucket
                changes[key] = value
    auto_route = False
    if b.route_pair_capacity != 0 and b.planner != "orchestrated":
        # Only orchestrated moves items between devices; an exchange would only move zeros.
        changes["route_pair_capacity"] = 0
    elif b.route_pair_capacity == -1:
        # A device's whole encoder output (never binds) for the dry run, then what it carried.
        vision = changes.get("vision_patches", b.vision_patches) // m.vision.merge**2
        audio = changes.get("audio_frames", b.audio_frames) // m.audio.subsample
        changes["route_pair_capacity"] = max(
            vision if m.vision.enabled else 0, audio if m.audio.enabled else 0, 1
        )
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


DRY_RUN_STEPS = 2000  # at most this many steps planned to size a planner's tile capacities
DRY_RUN_HEADROOM = 0.1  # added when the run is longer than the dry run


def resolve_tiles(cfg: Config, index: LengthsIndex, devices: int | None) -> dict[str, int]:
    """The `batch.*_tiles: -1` (auto) of block-sparse attention, resolved (the rest resolved).

    A planner that holds a tile capacity near the mean (`HOLDS_TILES`: orchestrated) gets the
    data's mean need per device plus the headroom (of a few) whose plans do the most useful
    work per FLOP the buckets compute under the model's cost (`held_tiles`), or less where a dry
    run of `HELD_DRY_RUN_STEPS` of its plans without a bound never needed as much (uniform
    data, where its tiles are even without holding them); any other gets the
    most its own buckets need in a dry run of its plans (`DRY_RUN_STEPS` at most, then
    `DRY_RUN_HEADROOM` more when the run is longer), so that its buckets always fit and the
    comparison shows what its packing costs. Never below what the largest document needs.
    """
    b = cfg.batch
    keys = [f"{p}_tiles" for p in ("llm", "vision", "audio") if getattr(b, f"{p}_tiles") == -1]
    if cfg.model.attention != "block_sparse" or not keys:
        return {}
    caps = capacities(cfg, devices or 1)  # (the -1s: no bound)
    if devices is None:
        devices = sharding.data_parallel_size(sharding.make_mesh(cfg.mesh))
        caps = dataclasses.replace(caps, devices=devices)
    planner = make_planner(b.planner, index, caps, cfg.data.seed)
    if b.planner in HOLDS_TILES:
        # (the headroom that does the most useful work per computed FLOP of the cost model)
        weights = CostModel.from_model(cfg.model).tile_weights(caps.block, caps.audio_per_row)
        need = held_tiles(
            planner,
            index,
            caps,
            min(cfg.train.steps, HELD_DRY_RUN_STEPS),
            make=lambda c: make_planner(b.planner, index, c, cfg.data.seed),
            weights=weights,
        )
    else:
        steps = min(cfg.train.steps, DRY_RUN_STEPS)
        need = dry_run_tiles(planner, index, caps, steps)
        if steps < cfg.train.steps:
            need = {p: math.ceil(n * (1 + DRY_RUN_HEADROOM)) for p, n in need.items()}
    # Documents the dry run did not meet fit too, wherever in a block they start.
    least = device_tile_caps(caps, largest_doc_tiles(index, caps))
    need = {p: max(n, least[p]) for p, n in need.items()}
    return {key: max(need[key.removesuffix("_tiles")], 1) for key in keys}


DOCUMENTS_HEADROOM = 0.25  # cuDNN's documents per row: over the dry run's most, when longer


def resolve_documents(cfg: Config, index: LengthsIndex, devices: int | None) -> dict[str, int]:
    """The `batch.*_documents: -1` (auto) of cuDNN attention: the most documents one row of the
    planner's own plans holds in a dry run (`DRY_RUN_STEPS` at most, then `DOCUMENTS_HEADROOM`
    more when the run is longer), never above what the data allows (the row over its smallest
    document). cuDNN's backward workspace grows with this bound, and the data's worst case
    (rows of the shortest samples only) is often many times what plans ever hold: at 16384
    tokens a row, 0.4B parameters, it asked for 234 GiB on an H100. A later row past the
    bound stops the run naming the key (`bucketize`); resume with it raised."""
    b = cfg.batch
    keys = [p for p in ("llm", "vision", "audio") if getattr(b, f"{p}_documents") == -1]
    if cfg.model.attention != "cudnn" or not keys:
        return {}
    if devices is None:
        devices = sharding.data_parallel_size(sharding.make_mesh(cfg.mesh))
    caps = capacities(cfg, devices)
    bound = most_documents(index, caps)
    steps = min(cfg.train.steps, DRY_RUN_STEPS)
    most = dry_run_documents(make_planner(b.planner, index, caps, cfg.data.seed), index, caps,
                             steps)  # fmt: skip
    if steps < cfg.train.steps:
        most = {p: math.ceil(n * (1 + DOCUMENTS_HEADROOM)) for p, n in most.items()}
    return {f"{p}_documents": max(1, min(bound[p], most[p])) for p in keys}


def capacities(cfg: Config, devices: int) -> Capacities:
    """The planner's bucket capacities from a resolved config (see `resolve_batch`), over
    `devices` data-parallel buckets. A tile capacity still -1 (auto) is no bound."""
    b, m = cfg.batch, cfg.model
    sparse = m.attention == "block_sparse"
    if b.route_pair_capacity < 0:
        raise ValueError(
            "batch.route_pair_capacity=-1 (auto) must be resolved against the "
            "data first: jaxmllm.data.pipeline.resolve_batch"
        )
    return Capacities(
        microbatches=b.microbatches,
        devices=devices,
        llm_rows=b.llm_rows,
        llm_row_len=b.llm_row_len,
        vision_patches=b.vision_patches if m.vision.enabled else 0,
        audio_frames=b.audio_frames if m.audio.enabled else 0,
        merge_area=m.vision.merge**2,
        subsample=m.audio.subsample,
        audio_stride=0 if m.audio.stride == m.audio.subsample else m.audio.stride,
        route_pair_capacity=b.route_pair_capacity,
        devices_per_host=max(b.devices_per_host, 0),
        context=cfg.mesh.context,
        block=b.attention_block if sparse else 0,
        llm_tiles=max(b.llm_tiles, 0) if sparse else 0,
        vision_tiles=max(b.vision_tiles, 0) if sparse and m.vision.enabled else 0,
        audio_tiles=max(b.audio_tiles, 0) if sparse and m.audio.enabled else 0,
    )


def planner_from_config(cfg: Config, index: LengthsIndex, devices: int) -> Planner:
    """The planner named by batch.planner over `index`, with `devices` data-parallel buckets."""
    return make_planner(cfg.batch.planner, index, capacities(cfg, devices), cfg.data.seed)


class StepIterator(grain.DatasetIterator):
    """Yields one batch per step: {"batch": arrays, "info": plan summary and counts}.

    The batch is this host's numpy arrays, or what `to_device` makes of them (global device
    arrays). Putting it on the devices changes no iterator state: the state saved with a
    checkpoint is still the one after the last step the trainer took.
    """

    def __init__(
        self,
        cfg: Config,
        devices: int,
        source=None,
        index=None,
        positions=None,
        reject_log=None,
        to_device: Callable[[dict[str, np.ndarray]], dict[str, Any]] | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.source, self.index = (source, index) if source is not None else make_source(cfg)
        # The tokenizer's pad and media ids (a source under grain's MapDataset is its _source).
        self.specials = getattr(getattr(self.source, "_source", self.source), "specials", RESERVED)
        self.cfg = cfg = resolve_batch(cfg, self.index)  # idempotent: the trainer resolved it
        self.caps = capacities(cfg, devices)
        self.planner = make_planner(cfg.batch.planner, self.index, self.caps, cfg.data.seed)
        self.positions = None if positions is None else np.asarray(positions, np.int64)
        self.reject_log = reject_log  # this process's rejects file; default <output_dir>/...
        self.loader: Loader | None = None
        self._restored_rejects: dict[str, int] = {}  # load-time reject counts of earlier runs
        self.count = StepCounter(cfg)  # real tokens and analytic FLOPs of each step
        self.variants = Variants.of(cfg)  # pipeline.encoder_fractions: each step's buckets
        self.to_device = to_device

    def __next__(self) -> dict[str, Any]:
        plan = self.planner.plan()
        if self.loader is None:  # made on first use: worker processes start here
            self.loader = Loader(self.cfg, self.source, self.reject_log)
            self.loader.log.counts.update(self._restored_rejects)
        parts = local_parts(plan, self.positions, self.caps.devices, self.caps.context)
        # A sample that fails to load is None under data.on_error=skip: its slots stay padding.
        # On several hosts each decodes only the images and clips its own devices encode.
        media = None if self.positions is None else local_media(parts)
        samples = self.loader.load(parts["read"], plan.step, media)
        batch = bucketize(
            plan, samples, self.cfg, self.caps, self.positions, self.index, self.specials
        )
        variant = "whole"
        if self.variants is not None:  # a compiled program per variant used
            batch, variant = self.variants.pick(plan, self.index, batch)
        info = {
            "step": plan.step,
            "variant": variant,
            "samples": plan.samples.copy(),  # the whole step's, on every host
            "parts": parts,  # what this host read, trains (text) and encodes
            "deferred": plan.deferred,
            "fill": fill_stats(batch),  # this host's buckets
            "rejects": self.loader.counts(),
            **self.count(batch),  # this host's real tokens and FLOPs, for the metrics
        }
        if self.to_device is not None:  # the transfer overlaps the step the device is running
            batch = self.to_device(batch)
        return {"batch": batch, "info": info}

    def get_state(self) -> dict:
        counts = self.loader.log.counts if self.loader is not None else self._restored_rejects
        rejects = {k: int(v) for k, v in counts.items() if k.startswith("load_")}
        return {"planner": self.planner.get_state(), "load_rejects": rejects}

    def set_state(self, state: dict) -> None:
        self.planner.set_state(state["planner"])
        # Cumulative load-time reject counts carry across restarts, like the planner's cursor.
        self._restored_rejects = dict(state.get("load_rejects", {}))
        if self.loader is not None:
            self.loader.log.counts.clear()
            self.loader.log.counts.update(self._restored_rejects)


def local_parts(
    plan, positions: np.ndarray | None, devices: int, context: int = 1
) -> dict[str, np.ndarray]:
    """What a host holding `positions` needs of a plan (all of it when positions is None).

    text: samples whose text is on those positions (on their context groups, `context` > 1);
    vision / audio: [k, 2] (sample, item) pairs encoded there; read: the samples to load (text
    here, or an item encoded here).
    """
    mine = np.ones(devices, bool)
    if positions is not None:
        mine[:] = False
        mine[positions] = True
    text = plan.samples[mine.reshape(-1, context).all(1)[plan.device]]
    out = {"text": text}
    read = [text]
    for phase, items in (("vision", plan.vision), ("audio", plan.audio)):
        here = mine[items.device]
        owners = plan.samples[items.owner[here]]
        out[phase] = np.stack([owners, items.item[here]], axis=1).astype(np.int64)
        read.append(owners)
    out["read"] = np.unique(np.concatenate(read))
    return out


def local_media(parts: dict[str, np.ndarray]) -> dict[int, tuple[tuple, tuple]]:
    """sample -> (its images, its clips) encoded on this host, from `local_parts`."""
    out: dict[int, tuple[list, list]] = {int(i): ([], []) for i in parts["read"]}
    for which, phase in ((0, "vision"), (1, "audio")):
        for i, j in parts[phase].tolist():
            out[i][which].append(j)
    return {i: (tuple(a), tuple(b)) for i, (a, b) in out.items()}


class StepDataset(grain.IterDataset):
    """grain dataset wrapper so the step iterator composes with grain's prefetching."""

    def __init__(self, cfg: Config, devices: int, **kwargs):
        super().__init__()
        self.cfg, self.devices, self.kwargs = cfg, devices, kwargs

    def __iter__(self) -> StepIterator:
        return StepIterator(self.cfg, self.devices, **self.kwargs)


def make_pipeline(
    cfg: Config,
    devices: int,
    prefetch: int = 2,
    *,
    source=None,
    index=None,
    positions=None,
    reject_log=None,
    to_device: Callable[[dict[str, np.ndarray]], dict[str, Any]] | None = None,
) -> grain.DatasetIterator:
    """The trainer's data iterator; planning and loading run ahead in a background thread.

    `auto` sizes are resolved against the data (`resolve_batch`); pass `source`/`index` to reuse
    a source the caller already opened, `positions` (this host's data-parallel positions) to
    load and bucketize only those devices' rows, `to_device` (host arrays -> device arrays, e.g.
    `sharding.make_global_batch`) to put each batch on the devices in that thread as well.
    """
    ds = StepDataset(
        cfg,
        devices,
        source=source,
        index=index,
        positions=positions,
        reject_log=reject_log,
        to_device=to_device,
    )
    if prefetch > 0:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
    return iter(ds)
