"""The grain pipeline: plan a step, load only its samples, bucketize, prefetch in a thread.

    source (grain.MapDataset, random access) ─┐
    lengths index -> planner (carried state) ─┴─> StepIterator -> ThreadPrefetch -> trainer

Everything per step runs on the prefetch thread, ahead of the trainer: planning, loading,
bucketizing, the step's counts for metrics (real tokens, analytic FLOPs); given `to_device`,
a second thread puts each batch on the devices while the first works on the next step, so the
trainer's thread only dispatches steps.

The iterator is a `grain.DatasetIterator`, so its state (the planner's) is checkpointed with
grain's own orbax handler and a restored pipeline replays the exact same steps.

On several hosts every process plans the same global step from the same index and seed, then
loads and bucketizes only the samples with text or an encoder item on its own data-parallel
positions (`positions`); grain saves each process's iterator state in its own file.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grain
import numpy as np

from jaxmllm.batch.bucketize import bucketize, fill_stats
from jaxmllm.batch.counts import StepCounter
from jaxmllm.batch.info import StepInfo
from jaxmllm.config import Config
from jaxmllm.config.phases import NAMES
from jaxmllm.config.spec import BatchSpec
from jaxmllm.data.loader import Loader
from jaxmllm.data.source import make_source
from jaxmllm.data.text.specials import RESERVED
from jaxmllm.feed.times import HostTimes, Stopwatch
from jaxmllm.plan.registry import make_planner
from jaxmllm.plan.sizing import capacities
from jaxmllm.plan.stages.choose import Variants
from jaxmllm.plan.state import PlanStateError, check_state

log = logging.getLogger("jaxmllm")


class StepIterator(grain.DatasetIterator):
    """Yields one batch per step: {"batch": arrays, "info": its `StepInfo`}.

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
        self.spec = BatchSpec.of(cfg)  # (the batch resolved: `plan.sizing.resolve_batch`)
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
        if self.loader is None:  # made on first use: worker processes start here
            # (its rejects go to the log when the trainer takes their step: `RunReport`)
            self.loader = Loader(self.cfg, self.source, self.reject_log, write=False)
            self.loader.log.counts.update(self._restored_rejects)
        clock = Stopwatch()  # each stage's time, for the metrics (host/*) and bench.host
        plan = self.planner.plan()
        times = HostTimes(plan_s=clock.lap())
        parts = local_parts(plan, self.positions, self.caps.devices, self.caps.context)
        # A sample that fails to load is None under data.on_error=skip: its slots stay padding.
        # On several hosts each decodes only the images and clips its own devices encode.
        media = None if self.positions is None else local_media(parts)
        samples = self.loader.load(parts["read"], plan.step, media)
        times.load_s, times.samples = clock.lap(), len(samples)
        batch = bucketize(
            plan, samples, self.cfg, self.caps, self.positions, self.index, self.specials
        )
        variant = "whole"
        if self.variants is not None:  # a compiled program per variant used
            batch, variant = self.variants.pick(plan, self.index, batch)
        if plan.variant:  # (a long step's tile lists: `jaxmllm.plan.ladder`, its own program)
            variant += f"+long{plan.variant}"
        mix = self.index.mixture  # (data.sources: the step's samples per source)
        fill = fill_stats(batch)  # this host's buckets
        times.bucketize_s = clock.lap()
        counts = self.count(batch)  # this host's real tokens and FLOPs, for the metrics
        times.count_s = clock.lap()
        times.bytes_to_device = sum(a.nbytes for a in batch.values())
        new_rejects, first_reject = self.loader.log.take_new()
        info = StepInfo(
            step=plan.step,
            samples=plan.samples.copy(),  # the whole step's, on every host
            parts=parts,  # what this host read, trains (text) and encodes
            deferred=plan.deferred,
            fill=fill,
            rejects=self.loader.counts(),
            new_rejects=new_rejects,
            first_reject=first_reject,
            reject_entries=self.loader.log.take_entries(),
            variant=variant,
            sources={} if mix is None else mix.counts(plan.samples),
            host=times,  # this step's time in each stage of the feed
            **counts,
        )
        if self.to_device is not None:  # the transfer overlaps the step the device is running
            batch = self.to_device(batch)
            times.transfer_s = clock.lap()
        return {"batch": batch, "info": info}

    def close(self) -> None:
        """Stops and joins the loader's worker processes (grain's close only marks the iterator
        closed): a run that ends, by an exception too, leaves no workers behind. Idempotent
        (grain calls it again from __del__)."""
        if self._closed:
            return
        if self.loader is not None:
            self.loader.close()
        super().close()

    def get_state(self) -> dict:
        counts = self.loader.log.counts if self.loader is not None else self._restored_rejects
        rejects = {k: int(v) for k, v in counts.items() if k.startswith("load_")}
        return {"planner": self.planner.get_state(), "load_rejects": rejects}

    def set_state(self, state: dict) -> None:
        """Restores a checkpoint's state; refuses (PlanStateError) one that does not fit the
        index, rather than resume on other batches without a word."""
        if not isinstance(state, dict):
            raise PlanStateError(f"the checkpoint's data state is not an object: {state!r:.80}")
        check_state(state.get("planner"), len(self.index))
        try:
            self.planner.set_state(state["planner"])
        except (KeyError, TypeError, ValueError) as e:  # (a field this planner lacks)
            raise PlanStateError(
                f"the checkpoint's planner state is not one batch.planner="
                f"{self.cfg.batch.planner} wrote ({type(e).__name__}: {e})"
            ) from None
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
    per encoder phase (by name): [k, 2] (sample, item) pairs encoded there; read: the samples
    to load (text here, or an item encoded here).
    """
    mine = np.ones(devices, bool)
    if positions is not None:
        mine[:] = False
        mine[positions] = True
    text = plan.samples[mine.reshape(-1, context).all(1)[plan.device]]
    out = {"text": text}
    read = [text]
    for phase, items in plan.items.items():
        here = mine[items.device]
        owners = plan.samples[items.owner[here]]
        out[phase] = np.stack([owners, items.item[here]], axis=1).astype(np.int64)
        read.append(owners)
    out["read"] = np.unique(np.concatenate(read))
    return out


def local_media(parts: dict[str, np.ndarray]) -> dict[int, dict[str, tuple[int, ...]]]:
    """sample -> {phase: its items encoded on this host}, from `local_parts`."""
    out: dict[int, dict[str, list]] = {int(i): {p: [] for p in NAMES} for i in parts["read"]}
    for phase in NAMES:
        for i, j in parts[phase].tolist():
            out[i][phase].append(j)
    return {i: {p: tuple(js) for p, js in by.items()} for i, by in out.items()}


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

    `cfg` must be resolved against the data (`jaxmllm.plan.sizing.resolve_batch`: the trainer
    does it once, at start-up); pass `source`/`index` to reuse
    a source the caller already opened, `positions` (this host's data-parallel positions) to
    load and bucketize only those devices' rows, `to_device` (host arrays -> device arrays, e.g.
    `sharding.make_global_batch`) to put each batch on the devices ahead of the trainer too: in
    a second thread after the feed's (one batch ahead), so the copy overlaps the next step's
    work.
    """
    ds = StepDataset(
        cfg,
        devices,
        source=source,
        index=index,
        positions=positions,
        reject_log=reject_log,
        to_device=None if prefetch > 0 else to_device,  # (prefetched: its own thread, below)
    )
    if prefetch > 0:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
        if to_device is not None:  # the copy on a thread of its own: overlaps the next step's
            ds = ds.map(Transfer(to_device))  # planning, loading and bucketize
            ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=1)
    return iter(ds)


class Transfer:
    """Puts a step's batch on the devices (`to_device`), timing it into the step's host times.

    With prefetching it runs on its own thread after the feed's, so the copy (which releases
    the GIL) overlaps the next step's work; the state checkpointed is still the one after the
    last step the trainer took (each prefetch stage keeps its parent's state per element)."""

    def __init__(self, to_device: Callable[[dict[str, np.ndarray]], dict[str, Any]]):
        self.to_device = to_device

    def __call__(self, element: dict[str, Any]) -> dict[str, Any]:
        clock = Stopwatch()
        batch = self.to_device(element["batch"])
        element["info"].host.transfer_s = clock.lap()
        return {**element, "batch": batch}
