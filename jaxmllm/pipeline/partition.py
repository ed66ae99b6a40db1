"""The frozen-aware partitioner: which layers each pipeline stage holds and where each encoder
runs, chosen by the predicted step time of the schedule actually run. Pure Python.

The model is a chain of segments (`costs.Segment`): the encoders that run as pipeline stages
(audio, then vision), then the LLM. Every stage holds layers of one segment only, a contiguous
run of them, at least one; stages may hold different numbers of layers. An encoder not in the
chain runs data-parallel across the stage axis before the pipeline: each stage rank encodes a
share of the step's microbatches (ceil(M / S) of them), so its cost is paid once per step, not
per tick. Under gpipe the LLM's final norm, head and loss run the same way after the pipeline;
under 1f1b they run on the last stage (its backward starts there, right after its forward).

A plan's predicted step time is the schedule table's length over the stages' per-microbatch
work (`schedule.Schedule.time`: each tick as long as its slowest stage) plus the data-parallel
passes. The costs carry the training multipliers (`costs`): a frozen encoder with nothing
trainable below it has no backward, so under 1f1b its stage costs only its forward, and under
gpipe (a lock-step tick pays the slowest forward plus the slowest backward) it can take as much
forward work as a trainable stage's forward, not its forward + backward. A uniform split (equal
layer counts) ignores both.

The search: every placement of each encoder (stages or data-parallel), every allocation of the
stages among the chain's segments, within each segment the split that minimises its slowest
stage (its layers are identical; the first stage also embeds, the last also projects), and both
schedules; the plan with the least predicted step time wins (ties: fewer encoder stages, then
gpipe).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from jaxmllm.pipeline.costs import ModelCosts, Segment, Work
from jaxmllm.pipeline.schedule import SCHEDULES


class PartitionError(ValueError):
    """No plan fits the stages; the message says which setting to change."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: a contiguous run of one segment's layers (the uniform baseline may
    cross segments: `segment` then names them all, "vision+llm")."""

    segment: str
    first: int  # its first layer within the segment (the chain, for a crossing stage)
    layers: int
    work: Work  # per microbatch


@dataclasses.dataclass(frozen=True)
class Plan:
    """A partition, its schedule and its predicted cost (in the costs' unit)."""

    schedule: str
    microbatches: int
    stages: tuple[Stage, ...]
    data_parallel: tuple[str, ...]  # encoders run data-parallel across the stages
    passes: Work  # per stage rank and step: the data-parallel encoders (and gpipe's head)
    pipeline_time: float
    bubble: float  # idle share of the pipeline's stage-time

    @property
    def step_time(self) -> float:
        """A step's predicted time: the pipeline's schedule plus the data-parallel passes each
        stage rank runs outside it."""
        return self.pipeline_time + self.passes.total

    @property
    def bottleneck(self) -> float:
        """A full tick: slowest forward + slowest backward (gpipe), slowest forward + backward
        of one stage (1f1b)."""
        if self.schedule == "gpipe":
            return max(s.work.fwd for s in self.stages) + max(s.work.bwd for s in self.stages)
        return max(s.work.total for s in self.stages)

    def layers(self, segment: str) -> tuple[int, ...]:
        """Layers per stage of `segment`, in order (empty when it is not in the pipeline)."""
        return tuple(s.layers for s in self.stages if s.segment == segment)

    def stage_range(self, segment: str) -> range:
        """The stage indices that hold `segment`."""
        idx = [i for i, s in enumerate(self.stages) if s.segment == segment]
        return range(idx[0], idx[-1] + 1) if idx else range(0)

    def describe(self, scale: float = 1e9, unit: str = "GFLOP") -> str:
        """The plan as printed at start-up: layers and predicted time per stage, the bubble."""
        head = "head on the last stage" if self.schedule == "1f1b" else "head data-parallel"
        lines = [
            f"pipeline plan: {len(self.stages)} stages, {self.schedule} ({head}), "
            f"{self.microbatches} microbatches"
            + (
                f"; data-parallel across stages: {', '.join(self.data_parallel)}"
                if self.data_parallel
                else ""
            ),
            f"stage  segment  layers   fwd {unit}  bwd {unit}  per microbatch",
        ]
        for i, s in enumerate(self.stages):
            span = f"{s.first}-{s.first + s.layers - 1}"
            lines.append(
                f"{i:>5}  {s.segment:<7}  {s.layers:>2} {span:<6} {s.work.fwd / scale:>9.2f}  "
                f"{s.work.bwd / scale:>9.2f}  {s.work.total / scale:>9.2f}"
            )
        lines.append(
            f"predicted per step ({unit}): pipeline {self.pipeline_time / scale:.2f} "
            f"(bubble {self.bubble:.1%}), data-parallel passes {self.passes.total / scale:.2f}, "
            f"total {self.step_time / scale:.2f}"
        )
        return "\n".join(lines)


def partition(
    costs: ModelCosts,
    stages: int,
    *,
    schedule: str = "auto",
    placement: dict[str, str] | None = None,
    layers: dict[str, Sequence[int]] | None = None,
) -> Plan:
    """The plan with the least predicted step time.

    Args:
      costs: The model's per-microbatch costs.
      stages: Pipeline stages (`mesh.stage`).
      schedule: gpipe, 1f1b or auto (both tried).
      placement: Per encoder, stages, data or auto (default auto).
      layers: Per segment, fixed layers per stage (`pipeline.*_layers`); the segment then gets
        exactly those stages (an encoder among them runs as stages).

    Raises:
      PartitionError: No placement and split fits (too few layers for the stages, or fixed
        layer counts that need more stages than there are).
    """
    placement, layers = placement or {}, {k: tuple(v) for k, v in (layers or {}).items() if v}
    kinds = list(SCHEDULES) if schedule == "auto" else [schedule]
    options = []
    for name in costs.encoders:
        where = placement.get(name, "auto")
        where = "stages" if name in layers else where
        options.append(["stages", "data"] if where == "auto" else [where])
    best, best_key = None, None
    for choice in itertools.product(*options):
        piped = [n for n, w in zip(costs.encoders, choice, strict=True) if w == "stages"]
        chain = [costs.segment(n) for n in piped] + [costs.segment("llm")]
        dp = tuple(n for n in costs.encoders if n not in piped)
        for counts in _allocations(chain, stages, layers):
            for kind in kinds:
                plan = _plan(costs, chain, counts, dp, kind, layers)
                key = (plan.step_time, len(piped), kinds.index(kind))
                if best_key is None or key < best_key:
                    best, best_key = plan, key
    if best is None:
        raise PartitionError(_no_fit(costs, stages, layers))
    return best


def _allocations(chain: list[Segment], stages: int, fixed: dict) -> list[tuple[int, ...]]:
    """Stages per chain segment: each at least 1, at most its layers (or as fixed), all used."""
    ranges = []
    for seg in chain:
        if seg.name in fixed:
            ranges.append([len(fixed[seg.name])])
        else:
            ranges.append(range(1, min(seg.layers, stages) + 1))
    return [c for c in itertools.product(*ranges) if sum(c) == stages]


def _plan(costs, chain, counts, dp, kind, fixed) -> Plan:
    """The best plan of this placement and allocation: each segment's balanced split, then
    single layers moved across a stage boundary while the schedule's length shrinks (stages of
    equal cost are not equal to a schedule: 1f1b's ramps charge the first stages' forwards and
    backwards alone)."""
    head_in_pipeline = kind == "1f1b"
    leaves = [seg.name != "llm" or head_in_pipeline for seg in chain]
    splits = [
        list(fixed.get(seg.name) or balanced_split(seg, k, leave=leave))
        for seg, k, leave in zip(chain, counts, leaves, strict=True)
    ]
    share = math.ceil(costs.microbatches / sum(counts))  # microbatches a rank runs data-parallel
    passes = Work()
    for name in dp:
        passes = passes + costs.segment(name).whole().times(share)
    if not head_in_pipeline:
        passes = passes + costs.segment("llm").leave.times(share)

    def build(splits) -> Plan:
        """The plan of these per-segment layer splits (the data-parallel passes fixed above)."""
        stage_list = []
        for seg, split, leave in zip(chain, splits, leaves, strict=True):
            stage_list += segment_stages(seg, split, leave=leave)
        return _evaluate(kind, costs.microbatches, tuple(stage_list), dp, passes)

    best = build(splits)
    while True:
        moves = [
            _moved(splits, i, j, step)
            for i, seg in enumerate(chain)
            if seg.name not in fixed
            for j in range(len(splits[i]) - 1)
            for step in (1, -1)
        ]
        tried = [build(m) for m in moves if m is not None]
        better = min(tried, key=lambda p: p.step_time, default=None)
        if better is None or better.step_time >= best.step_time * (1 - 1e-12):
            return best
        best, splits = better, [list(best_plan) for best_plan in _splits_of(better, chain)]


def _moved(splits, i, j, step):
    """`splits` with one layer of segment i moved from stage j to j + 1 (step 1) or back."""
    counts = list(splits[i])
    src, dst = (j, j + 1) if step == 1 else (j + 1, j)
    if counts[src] <= 1:
        return None
    counts[src] -= 1
    counts[dst] += 1
    return [counts if k == i else s for k, s in enumerate(splits)]


def _splits_of(plan: Plan, chain) -> list[tuple[int, ...]]:
    """Each chained segment's layers per stage, as `plan` splits them."""
    return [plan.layers(seg.name) for seg in chain]


def _evaluate(kind, microbatches, stage_list, dp, passes) -> Plan:
    """The plan of these stages under schedule `kind`: the schedule's length from the stages'
    forward and backward work, and its bubble (idle share)."""
    table = SCHEDULES[kind](microbatches, len(stage_list))
    fwd = [s.work.fwd for s in stage_list]
    bwd = [s.work.bwd for s in stage_list]
    return Plan(
        kind, microbatches, stage_list, dp, passes, table.time(fwd, bwd), table.bubble(fwd, bwd)
    )


def reprice(plan: Plan, costs: ModelCosts) -> Plan:
    """The same stages, placements and schedule under other costs (a step variant's buckets); a
    segment the costs lack (its encoder skipped) leaves its stages idle."""
    head_in_pipeline = plan.schedule == "1f1b"
    present = {seg.name for seg in costs.segments}
    stage_list = []
    for stage in plan.stages:
        work = Work()
        if stage.segment in present:
            seg = costs.segment(stage.segment)
            last = stage.first + stage.layers == seg.layers
            work = seg.layer.times(stage.layers) + (seg.enter if stage.first == 0 else Work())
            if last and (seg.name != "llm" or head_in_pipeline):
                work = work + seg.leave
        stage_list.append(dataclasses.replace(stage, work=work))
    share = math.ceil(costs.microbatches / len(stage_list))
    passes = Work()
    for name in plan.data_parallel:
        if name in present:
            passes = passes + costs.segment(name).whole().times(share)
    if not head_in_pipeline:
        passes = passes + costs.segment("llm").leave.times(share)
    return _evaluate(
        plan.schedule, costs.microbatches, tuple(stage_list), plan.data_parallel, passes
    )


def segment_stages(seg: Segment, split: Sequence[int], *, leave: bool) -> list[Stage]:
    """The stages of `seg` split as given: the first also embeds, the last also leaves (its
    projector; the LLM's head when `leave`)."""
    out, first = [], 0
    for j, n in enumerate(split):
        work = seg.layer.times(n)
        if j == 0:
            work = work + seg.enter
        if j == len(split) - 1 and leave:
            work = work + seg.leave
        out.append(Stage(seg.name, first, n, work))
        first += n
    return out


def balanced_split(seg: Segment, k: int, *, leave: bool = True) -> tuple[int, ...]:
    """Layers per stage for `k` stages of `seg`, minimising the slowest stage's forward +
    backward: the first stage's embedding and the last's projector or head take the place of
    layers there, so those stages may hold fewer."""
    if not 1 <= k <= seg.layers:
        raise PartitionError(f"{seg.name}: {seg.layers} layers cannot fill {k} stages")
    per = seg.layer.total
    ends = [seg.enter.total] + [0.0] * (k - 2) + [seg.leave.total if leave else 0.0]
    if k == 1:
        return (seg.layers,)
    if per <= 0:  # free layers (a skipped encoder): spread them evenly
        return tuple(seg.layers // k + (j < seg.layers % k) for j in range(k))
    caps = lambda bound: [max(int((bound - e) // per + 1e-9), 0) for e in ends]
    candidates = sorted({m * per + e for m in range(1, seg.layers + 1) for e in set(ends)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:  # the least bound whose per-stage layer caps hold every layer, >= 1 each
        mid = (lo + hi) // 2
        got = caps(candidates[mid])
        lo, hi = (lo, mid) if min(got) >= 1 and sum(got) >= seg.layers else (mid + 1, hi)
    counts = [min(c, seg.layers) for c in caps(candidates[lo])]
    while sum(counts) > seg.layers:  # shave the costliest stage with a layer to spare
        j = max((j for j in range(k) if counts[j] > 1), key=lambda j: counts[j] * per + ends[j])
        counts[j] -= 1
    return tuple(counts)


def uniform(costs: ModelCosts, stages: int, schedule: str) -> Plan:
    """The frozen-blind baseline: every encoder in the pipeline and the chain's layers dealt out
    in equal counts (a stage may then hold the end of one segment and the start of the next)."""
    chain = list(costs.segments)
    total = sum(seg.layers for seg in chain)
    if total < stages:
        raise PartitionError(f"{total} layers cannot fill {stages} stages")
    sizes = [total // stages + (j < total % stages) for j in range(stages)]
    flat = [(seg, i) for seg in chain for i in range(seg.layers)]
    head_in_pipeline = schedule == "1f1b"
    stage_list, start = [], 0
    for n in sizes:
        run = flat[start : start + n]
        work = Work()
        for seg, i in run:
            work = work + seg.layer
            if i == 0:
                work = work + seg.enter
            if i == seg.layers - 1 and (seg.name != "llm" or head_in_pipeline):
                work = work + seg.leave
        names = "+".join(dict.fromkeys(seg.name for seg, _ in run))
        stage_list.append(Stage(names, start, n, work))
        start += n
    share = math.ceil(costs.microbatches / stages)
    passes = Work() if head_in_pipeline else costs.segment("llm").leave.times(share)
    return _evaluate(schedule, costs.microbatches, tuple(stage_list), (), passes)


def _no_fit(costs: ModelCosts, stages: int, fixed: dict) -> str:
    """The error message when no split of the layers gives every stage at least one layer: the
    layer counts, the stages fixed by pipeline.*_layers, and the keys that help."""
    depth = {s.name: s.layers for s in costs.segments}
    given = ", ".join(f"pipeline.{k}_layers={list(v)}" for k, v in fixed.items())
    return (
        f"mesh.stage={stages}: no split of the layers ({depth}) fits: every stage holds at "
        f"least one layer of one module"
        + (f", and {given} fix some stages" if given else "")
        + "; lower mesh.stage, or place more encoders as stages (pipeline.vision / audio)"
    )
