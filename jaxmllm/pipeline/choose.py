"""Choices made on the host: the run's pipeline plan, and each step's variant.

The plan (which layers each stage holds, where each encoder runs, the schedule) is made once,
at start-up, from the config: it fixes the train state's layout. A step's variant is chosen in
the data pipeline's thread, ahead of the device (DIP's idea, within fixed shapes): each encoder
bucket may run cut to a fraction of its capacity (`pipeline.encoder_fractions`; 0: the encoder
is skipped in a step without its modality), a modality-specific sub-microbatch size. The plan
is repriced once per variant (the costs of its buckets, the same stages and schedule); each
step takes the variant of least predicted time among those that hold every encoder item the
step's plan placed. Cutting a bucket drops only padding, so the loss and gradients are the same
as with the whole bucket; each variant used is one compiled program.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from jaxmllm.config import Config, ConfigError, phases
from jaxmllm.config.phases import ENCODERS, LLM
from jaxmllm.pipeline.costs import model_costs, variant_tiles
from jaxmllm.pipeline.partition import PartitionError, Plan, partition, reprice

SCHEDULES_RUN = ("gpipe",)  # the schedules the device side implements


def plan_of(cfg: Config, stages: int) -> Plan:
    """The partitioner's plan for this config (`pipeline.*` fixes what it must keep).

    Raises:
      ConfigError: No plan fits, or a schedule the device side does not run.
    """
    p = cfg.pipeline
    if p.schedule not in ("auto", *SCHEDULES_RUN):
        raise ConfigError(
            f"pipeline.schedule={p.schedule}: the device side runs {', '.join(SCHEDULES_RUN)}; "
            "use one of them or auto"
        )
    schedule = SCHEDULES_RUN[0] if p.schedule == "auto" and len(SCHEDULES_RUN) == 1 else p.schedule
    layers = {LLM: p.llm_layers, **{e.name: p.layers(e.name) for e in ENCODERS}}
    try:
        return partition(
            model_costs(cfg.model, cfg.batch),
            stages,
            schedule=schedule,
            placement={  # (a tower only whole runs data-parallel before the pipeline)
                e.name: p.placement(e.name) if e.encoder(cfg.model).stages_ok else "data"
                for e in ENCODERS
            },
            layers=layers,
        )
    except PartitionError as e:
        raise ConfigError(str(e)) from None


class Variants:
    """The step variants of a resolved config and the predicted time of each."""

    def __init__(self, cfg: Config, plan: Plan):
        """Prices every combination of pipeline.encoder_fractions: each encoder's bucket cut to
        that share (in whole merge groups and attention blocks), repriced on `plan`'s partition,
        its predicted step time kept by combination."""
        self.cfg = cfg
        m, b = cfg.model, cfg.batch
        on = phases.in_batch(m, b)
        self.encoders = [p.name for p in on]
        self.capacity = {p.name: p.bucket(b) for p in on}
        self.unit = {p.name: p.per_token(m) for p in on}  # per output row
        self.fractions = cfg.pipeline.encoder_fractions
        block = b.attention_block if m.attention == "block_sparse" else 1
        # A cut bucket keeps whole merge groups / subsampled rows and whole attention blocks.
        self.per_row = {p.name: p.per_row(m) for p in on}  # units per encoder row (its tiles')
        self.step = {p: int(np.lcm(self.unit[p], self.per_row[p] * block)) for p in self.encoders}
        self.time = {}
        for combo in itertools.product(self.fractions, repeat=len(self.encoders)):
            pairs = zip(self.encoders, combo, strict=True)
            cuts = {p: self.cut(p, f) / self.capacity[p] for p, f in pairs}
            self.time[combo] = reprice(plan, model_costs(m, b, cuts)).step_time

    @classmethod
    def of(cls, cfg: Config) -> Variants | None:
        """The variants of a pipelined config that lists fractions besides 1; else None."""
        if cfg.mesh.stage <= 1 or cfg.pipeline.encoder_fractions == (1.0,):
            return None
        return cls(cfg, plan_of(cfg, cfg.mesh.stage))

    def cut(self, phase: str, fraction: float) -> int:
        """The bucket at `fraction` of its capacity, rounded up to whole steps (0 stays 0)."""
        step = self.step[phase]
        return min(self.capacity[phase], -(-int(self.capacity[phase] * fraction) // step) * step)

    def pick(self, plan: Any, index: Any, batch: dict[str, np.ndarray]):
        """(the batch cut to the chosen variant, its name) for a step's plan and host batch.

        The extents come from the plan, which every host computes alike, so every host picks
        the same variant whatever part of the batch it holds.
        """
        need = {p: self._extent(plan, index, p) for p in self.encoders}
        fits = [
            combo
            for combo in self.time
            if all(self.cut(p, f) >= need[p] for p, f in zip(self.encoders, combo, strict=True))
        ]
        # Least predicted time; a tie keeps the larger buckets (fewer programs to compile).
        best = min(fits, key=lambda c: (self.time[c], [-f for f in c]))
        for p, f in zip(self.encoders, best, strict=True):
            if f < 1.0:
                batch = self._cut_batch(batch, p, self.cut(p, f))
        name = ",".join(f"{p}={f:g}" for p, f in zip(self.encoders, best, strict=True))
        return batch, name

    def _extent(self, plan, index, phase: str) -> int:
        """The most patches / frames any encoder bucket of the step holds (items are packed
        from the start of their bucket)."""
        items = plan.items[phase]
        if not len(items.owner):
            return 0
        sizes = index.items[phase].size(plan.samples[items.owner], items.item)
        return int((items.offset + sizes).max())

    def _cut_batch(self, batch: dict, phase: str, cut: int) -> dict:
        """The batch with `phase`'s bucket cut to `cut` units (0: without that phase)."""
        out, p = dict(batch), phases.phase(phase)
        keys = [k for k in batch if k.startswith(f"{phase}_")]
        if cut == 0:
            if (batch[p.src] >= 0).any():
                raise ValueError(f"a step with {p.items} cut to an empty {phase} bucket")
            for k in [*keys, p.src]:
                del out[k]
            return out
        for k in (p.capacity, f"{phase}_segment_ids", f"{phase}_positions"):
            out[k] = batch[k][:, :, :cut]
        rows, cut_rows = self.capacity[phase] // self.unit[phase], cut // self.unit[phase]
        src = batch[p.src]  # [own rows | received]: received ones move down
        out[p.src] = np.where(src >= rows, src - rows + cut_rows, src)
        if p.tiles in batch:
            tiles = batch[p.tiles]
            blocks_of = cut // self.per_row[phase]  # (encoder rows)
            keep = variant_tiles(tiles.shape[2], blocks_of, self.cfg.batch.attention_block)
            if (tiles[:, :, keep:] >= 0).any():
                raise ValueError(f"{phase} tiles past a cut bucket's {keep}")
            out[p.tiles] = tiles[:, :, :keep]
        return out
