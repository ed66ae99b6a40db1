"""The grain pipeline: plan a step, load only its samples, bucketize, prefetch in a thread.

    source (grain.MapDataset, random access) ─┐
    lengths index -> planner (carried state) ─┴─> StepIterator -> ThreadPrefetch -> trainer

The iterator is a `grain.DatasetIterator`, so its state (the planner's) is checkpointed with
grain's own orbax handler and a restored pipeline replays the exact same steps.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from jaxmllm.config import Config
from jaxmllm.data.bucketize import bucketize, fill_stats
from jaxmllm.data.planner import Capacities, make_planner
from jaxmllm.data.samples import LengthsIndex
from jaxmllm.data.synthetic import SyntheticSource


def make_source(cfg: Config) -> tuple[grain.MapDataset, LengthsIndex]:
    """The record source named by data.source and its lengths index."""
    source = SyntheticSource(cfg)
    return grain.MapDataset.source(source), source.lengths()


class StepIterator(grain.DatasetIterator):
    """Yields one host batch per step: {"batch": arrays, "info": plan summary}."""

    def __init__(self, cfg: Config, devices: int):
        super().__init__()
        self.cfg = cfg
        self.source, self.index = make_source(cfg)
        self.caps = Capacities.from_config(cfg, devices)
        self.planner = make_planner(cfg, self.index, devices)

    def __next__(self) -> dict[str, Any]:
        plan = self.planner.plan()
        samples = {int(s): self.source[int(s)] for s in np.unique(plan.samples)}
        batch = bucketize(plan, samples, self.cfg, self.caps)
        info = {
            "step": plan.step,
            "samples": plan.samples.copy(),
            "deferred": plan.deferred,
            "fill": fill_stats(batch),
        }
        return {"batch": batch, "info": info}

    def get_state(self) -> dict:
        return {"planner": self.planner.get_state()}

    def set_state(self, state: dict) -> None:
        self.planner.set_state(state["planner"])


class StepDataset(grain.IterDataset):
    """grain dataset wrapper so the step iterator composes with grain's prefetching."""

    def __init__(self, cfg: Config, devices: int):
        super().__init__()
        self.cfg, self.devices = cfg, devices

    def __iter__(self) -> StepIterator:
        return StepIterator(self.cfg, self.devices)


def make_pipeline(cfg: Config, devices: int, prefetch: int = 2) -> grain.DatasetIterator:
    """The trainer's data iterator; planning and loading run ahead in a background thread."""
    ds = StepDataset(cfg, devices)
    if prefetch > 0:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
    return iter(ds)
