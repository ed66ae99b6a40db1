"""The feed: a step's data in named stages, on a resolved run (`jaxmllm.resolve.run.Run`).

    plan -> local parts -> load -> bucketize -> count -> transfer

`Feed` holds the stages a step's data goes through on a data set (the run's, or another:
evaluation is the same feed over its held-out set, `jaxmllm.loop.evaluate`): the planner's
plan, what this host needs of it (`local_parts`: the text of its own data-parallel positions,
or context groups, and the items encoded there), loading those samples (in worker processes),
bucketizing them into the fixed-shape batch. The training iterator (`StepIterator`) adds its
own stages: the step's program variant, the counts for the metrics (real tokens, analytic
FLOPs), the `StepInfo`, and the copy to the devices.

    source, lengths index -> planner (carried state) -> StepIterator -> ThreadPrefetch -> trainer

Everything per step runs on the prefetch thread, ahead of the trainer; given `to_device`, a
second thread puts each batch on the devices while the first works on the next step, so the
trainer's thread only dispatches steps.

The iterator is a `grain.DatasetIterator`, so its state (the planner's) is checkpointed with
grain's own orbax handler and a restored pipeline replays the exact same steps.

On several hosts every process plans the same global step from the same index and seed, then
loads and bucketizes only the samples with text or an encoder item on its own data-parallel
positions (`Run.positions`); grain saves each process's iterator state in its own file.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import numpy as np

from jaxmllm.batch.bucketize import bucketize, fill_stats
from jaxmllm.batch.counts import StepCounter
from jaxmllm.config.phases import NAMES
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.data.loader import Loader
from jaxmllm.data.samples import Sample
from jaxmllm.data.text.specials import RESERVED
from jaxmllm.feed.info import StepInfo
from jaxmllm.feed.times import HostTimes, Stopwatch
from jaxmllm.pipeline.choose import Variants
from jaxmllm.plan.contract import StepPlan
from jaxmllm.plan.state import PlanStateError, check_state
from jaxmllm.resolve.run import Run

log = logging.getLogger("jaxmllm")


class Feed:
    """The stages of a step's data over one data set, on a run: `plan`, `local_parts`, `load`,
    `bucketize`. Training's iterator and evaluation each hold one.

    `source` (`source[i]` -> Sample) and `index` default to the run's; `workers` to
    `data.workers` (worker processes start on the first load); load-time rejects are counted
    and logged to `reject_log` (default `<output_dir>/rejects.jsonl`); `write_rejects` False:
    the caller writes them (`RejectLog.take_entries`).
    """

    def __init__(
        self,
        run: Run,
        source=None,
        index: LengthsIndex | None = None,
        *,
        workers: int | None = None,
        reject_log: str | Path | None = None,
        write_rejects: bool = True,
        reference: np.ndarray | None = None,
    ):
        """`run`'s planner over `source` and `index` (default the run's own data set); the
        loader, and with it any worker processes, starts on the first `load`. `reference`: a
        precomputed preference run's reference log-probs for this data set (default the run's for
        its own)."""
        self.cfg, self.caps, self.positions = run.cfg, run.caps, run.positions
        # (preference.reference: precomputed: the pairs' reference log-probs, the run's own
        # for its own data set)
        self.reference = (run.reference_logps or {}).get("train") if source is None else reference
        if workers is not None and workers != self.cfg.data.workers:
            data = dataclasses.replace(self.cfg.data, workers=workers)
            self.cfg = dataclasses.replace(self.cfg, data=data)
        self.source = run.source if source is None else source
        self.index = run.index if index is None else index
        self.planner = run.planner(self.index)
        self.specials = getattr(self.source, "specials", RESERVED)  # the tokenizer's pad, media
        self.reject_log, self.write_rejects = reject_log, write_rejects
        self.loader: Loader | None = None  # (made on the first load: worker processes start)

    def plan(self) -> StepPlan:
        """The next step's plan (the planner's carried state advances)."""
        return self.planner.plan()

    def local_parts(self, plan: StepPlan) -> dict[str, np.ndarray]:
        """What this host needs of `plan` (`local_parts`)."""
        caps = self.caps.at(plan.variant)  # (a context degree per step: the variant's groups)
        return local_parts(plan, self.positions, caps.devices, caps.context)

    def load(self, plan: StepPlan, parts: dict[str, np.ndarray]) -> dict[int, Sample | None]:
        """The samples this host reads, and of them only the items it encodes (on several
        hosts); a sample that fails to load is None under data.on_error=skip."""
        media = None if self.positions is None else local_media(parts)
        return self.open_loader().load(parts["read"], plan.step, media)

    def open_loader(self) -> Loader:
        """The loader, made on first use (its worker processes start here)."""
        if self.loader is None:
            self.loader = Loader(self.cfg, self.source, self.reject_log, self.write_rejects)
        return self.loader

    def bucketize(self, plan: StepPlan, samples: dict) -> dict[str, np.ndarray]:
        """This host's fixed-shape arrays of the step."""
        return bucketize(
            plan,
            samples,
            self.cfg,
            self.caps,
            self.positions,
            self.index,
            self.specials,
            self.reference,
        )

    def close(self) -> None:
        """Stops the loader's worker processes, if any."""
        if self.loader is not None:
            self.loader.close()


class StepIterator(grain.DatasetIterator):
    """Yields one batch per step: {"batch": arrays, "info": its `StepInfo`}.

    The batch is this host's numpy arrays, or what `to_device` makes of them (global device
    arrays). Putting it on the devices changes no iterator state: the state saved with a
    checkpoint is still the one after the last step the trainer took.
    """

    def __init__(
        self,
        run: Run,
        reject_log=None,
        to_device: Callable[[dict[str, np.ndarray]], dict[str, Any]] | None = None,
    ):
        """The feed over `run`'s training data; its rejects are kept for the trainer to log when
        it takes their step (the feed runs ahead), and `to_device`, when given, puts each batch
        on the devices in this thread."""
        super().__init__()
        self.cfg = run.cfg
        # (its rejects go to the log when the trainer takes their step, `RunReport`: the feed
        # loads steps ahead of the one the trainer trains)
        self.feed = Feed(run, reject_log=reject_log, write_rejects=False)
        self.index = self.feed.index
        self._restored_rejects: dict[str, int] = {}  # load-time reject counts of earlier runs
        self.count = StepCounter(run.cfg, run.cost, run.calibrated)  # tokens, FLOPs, work
        self.variants = Variants.of(run.cfg)  # pipeline.encoder_fractions: each step's buckets
        self.to_device = to_device
        # (plan, samples, batch) -> None, on the bucketized batch before it is counted: a pass
        # over a finite set masks what it brought before (`loop.rollouts`)
        self.marks: Callable[[StepPlan, dict, dict], None] | None = None

    @property
    def planner(self):
        """The feed's planner, whose carried state (cursor, deferred samples) is the iterator's
        state."""
        return self.feed.planner

    def __next__(self) -> dict[str, Any]:
        """The next step: planned, this host's samples loaded, bucketized into the fixed-shape
        batch (and the step's pipeline variant), counted; each stage timed into `StepInfo.host`."""
        if self.feed.loader is None:  # (worker processes start here; restored counts carry on)
            self.feed.open_loader().log.counts.update(self._restored_rejects)
        clock = Stopwatch()  # each stage's time, for the metrics (host/*) and bench.host
        plan = self.feed.plan()
        times = HostTimes(plan_s=clock.lap())
        parts = self.feed.local_parts(plan)
        samples = self.feed.load(plan, parts)
        times.load_s, times.samples = clock.lap(), len(samples)
        batch = self.feed.bucketize(plan, samples)
        if self.marks is not None:
            self.marks(plan, samples, batch)
        batch, variant = self.variant(plan, batch)
        fill = fill_stats(batch)  # this host's buckets
        times.bucketize_s = clock.lap()
        # this host's real tokens and FLOPs, for the metrics (a row's groups: its variant's)
        counts = self.count(batch, self.feed.caps.at(plan.variant).context)
        times.count_s = clock.lap()
        times.bytes_to_device = sum(a.nbytes for a in batch.values())
        info = self.info(plan, parts, fill, variant, times, counts)
        if self.to_device is not None:  # the transfer overlaps the step the device is running
            batch = self.to_device(batch)
            times.transfer_s = clock.lap()
        return {"batch": batch, "info": info}

    def variant(self, plan: StepPlan, batch: dict) -> tuple[dict, str]:
        """The step's program: the pipelined one's variant (pipeline.encoder_fractions: its
        buckets cut), "+long<v>" for a long step (`jaxmllm.plan.ladder`)."""
        variant = "whole"
        if self.variants is not None:  # a compiled program per variant used
            batch, variant = self.variants.pick(plan, self.index, batch)
        if plan.variant:  # (a long step's tile lists: its own program)
            variant += f"+long{plan.variant}"
        return batch, variant

    def info(self, plan: StepPlan, parts, fill, variant: str, times, counts) -> StepInfo:
        """What the step carries to the loop beside its arrays."""
        loader, mix = self.feed.loader, self.index.mixture  # (data.sources: samples per source)
        new_rejects, first_reject = loader.log.take_new()
        return StepInfo(
            step=plan.step,
            samples=plan.samples.copy(),  # the whole step's, on every host
            parts=parts,  # what this host read, trains (text) and encodes
            deferred=plan.deferred,
            fill=fill,
            rejects=loader.counts(),
            new_rejects=new_rejects,
            first_reject=first_reject,
            reject_entries=loader.log.take_entries(),
            variant=variant,
            long=plan.variant,
            sources={} if mix is None else mix.counts(plan.samples),
            host=times,  # this step's time in each stage of the feed
            **counts,
        )

    def close(self) -> None:
        """Stops and joins the loader's worker processes (grain's close only marks the iterator
        closed): a run that ends, by an exception too, leaves no workers behind. Idempotent
        (grain calls it again from __del__)."""
        if self._closed:
            return
        self.feed.close()
        super().close()

    def get_state(self) -> dict:
        """What a checkpoint keeps of the feed: the planner's state and the load-time reject
        counts so far, so a resumed run plans the same next step and its counts carry on."""
        loader = self.feed.loader
        counts = loader.log.counts if loader is not None else self._restored_rejects
        rejects = {k: int(v) for k, v in counts.items() if k.startswith("load_")}
        return {"planner": self.feed.planner.get_state(), "load_rejects": rejects}

    def set_state(self, state: dict) -> None:
        """Restores a checkpoint's state; refuses (PlanStateError) one that does not fit the
        index, rather than resume on other batches without a word."""
        if not isinstance(state, dict):
            raise PlanStateError(f"the checkpoint's data state is not an object: {state!r:.80}")
        check_state(state.get("planner"), len(self.index))
        try:
            self.feed.planner.set_state(state["planner"])
        except (KeyError, TypeError, ValueError) as e:  # (a field this planner lacks)
            raise PlanStateError(
                f"the checkpoint's planner state is not one batch.planner="
                f"{self.cfg.batch.planner} wrote ({type(e).__name__}: {e})"
            ) from None
        # Cumulative load-time reject counts carry across restarts, like the planner's cursor.
        self._restored_rejects = dict(state.get("load_rejects", {}))
        if self.feed.loader is not None:
            self.feed.loader.log.counts.clear()
            self.feed.loader.log.counts.update(self._restored_rejects)


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

    def __init__(self, run: Run, **kwargs):
        """Keeps `run` and the iterator's keyword arguments; every `iter()` makes a fresh
        `StepIterator`."""
        super().__init__()
        self.run, self.kwargs = run, kwargs

    def __iter__(self) -> StepIterator:
        """A new step iterator at the planner's start (grain restores its state with
        `set_state`)."""
        return StepIterator(self.run, **self.kwargs)


def make_pipeline(
    run: Run,
    prefetch: int | None = None,
    *,
    reject_log=None,
    to_device: Callable[[dict[str, np.ndarray]], dict[str, Any]] | None = None,
) -> grain.DatasetIterator:
    """The trainer's data iterator on `run`; planning and loading run ahead in a background
    thread (`prefetch` steps; default data.prefetch, 0: in the caller's thread).

    `to_device` (host arrays -> device arrays, e.g. `sharding.make_global_batch`) puts each
    batch on the devices ahead of the trainer too: in a second thread after the feed's (one
    batch ahead), so the copy overlaps the next step's work. On several hosts each process
    loads and bucketizes only its own positions' rows (`Run.positions`).
    """
    prefetch = run.cfg.data.prefetch if prefetch is None else prefetch
    ds = StepDataset(
        run,
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
        """`to_device`: host arrays -> device arrays (e.g. `sharding.make_global_batch`)."""
        self.to_device = to_device

    def __call__(self, element: dict[str, Any]) -> dict[str, Any]:
        """The element with its batch on the devices, the copy's seconds added to its host times."""
        clock = Stopwatch()
        batch = self.to_device(element["batch"])
        element["info"].host.transfer_s = clock.lap()
        return {**element, "batch": batch}
