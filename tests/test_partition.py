"""The pipeline's pure-Python side: schedule tables, per-stage costs, the partitioner."""

import itertools
import math

import pytest

from jaxmllm.config import ConfigError, load_config
from jaxmllm.pipeline.costs import ModelCosts, Segment, Work, model_costs
from jaxmllm.pipeline.partition import (
    PartitionError,
    balanced_split,
    partition,
    segment_stages,
    uniform,
)
from jaxmllm.pipeline.schedule import IDLE, SCHEDULES, gpipe, one_f_one_b
from jaxmllm.resolve.attention import resolve_attention

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

# --- schedule tables ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
@pytest.mark.parametrize("m, s", [(1, 1), (3, 2), (4, 4), (8, 3), (2, 5)])
def test_every_microbatch_runs_once_each_way_in_dependency_order(kind, m, s):
    table = SCHEDULES[kind](m, s)
    when = {}  # (way, stage, microbatch) -> tick
    for t, (fwd, bwd) in enumerate(zip(table.forward, table.backward, strict=True)):
        for stage in range(s):
            for way, i in (("f", fwd[stage]), ("b", bwd[stage])):
                if i != IDLE:
                    assert (way, stage, i) not in when
                    when[way, stage, i] = t
    assert len(when) == 2 * m * s
    for i in range(m):
        for stage in range(1, s):  # activations move one stage a tick, gradients back
            assert when["f", stage, i] > when["f", stage - 1, i]
            assert when["b", stage - 1, i] > when["b", stage, i]
        for stage in range(s):  # (the last stage's backward may follow in the same tick)
            assert when["b", stage, i] >= when["f", stage, i]
    assert when["b", s - 1, m - 1] >= when["f", s - 1, m - 1]


def test_gpipe_is_max_forward_plus_max_backward_per_full_tick():
    fwd, bwd = [1.0, 3.0, 2.0], [2.0, 1.0, 5.0]
    table = gpipe(4, 3)
    # forward ticks: stages {0}, {0,1}, {0,1,2} x 2, {1,2}, {2}; the backward the reverse
    assert table.time(fwd, bwd) == (1 + 3 + 3 + 3 + 3 + 2) + (5 + 5 + 5 + 5 + 2 + 2)
    assert table.time([2.0] * 3, [4.0] * 3) == (4 + 3 - 1) * (2.0 + 4.0)
    assert table.in_flight(0) == 4  # every microbatch held until its backward


def test_1f1b_charges_a_stage_its_own_forward_plus_backward():
    """A frozen stage with no backward beside a trainable one: a full 1f1b tick costs
    max(f + b) = 3, a lock-step gpipe tick max f + max b = 4."""
    fwd, bwd = [2.0, 1.0], [0.0, 2.0]
    assert gpipe(4, 2).time(fwd, bwd) == (2 + 2 + 2 + 2 + 1) + (2 + 2 + 2 + 2 + 0)
    assert one_f_one_b(4, 2).tick_times(fwd, bwd) == [2.0, 3.0, 3.0, 3.0, 3.0, 0.0]
    table = one_f_one_b(16, 4)
    assert [table.in_flight(s) for s in range(4)] == [7, 5, 3, 1]  # not all 16
    balanced = one_f_one_b(8, 4)
    assert balanced.bubble([1.0] * 4, [2.0] * 4) == pytest.approx(3 / (8 + 3))


# --- costs ----------------------------------------------------------------------------------


def small(*extra):
    return resolve_attention(load_config("configs/small.yaml", list(extra)))  # (auto: this CPU's)


def test_backward_multipliers_follow_what_is_frozen_and_what_lies_below():
    trainable = model_costs(small().model, small().batch)
    for seg in trainable.segments:
        assert seg.layer.bwd == pytest.approx(2 * seg.layer.fwd), seg.name
    cfg = small("model.vision.freeze=true")
    vision = model_costs(cfg.model, cfg.batch).segment("vision")
    assert vision.layer.bwd == 0 and vision.enter.bwd == 0  # forward only
    assert vision.leave.bwd == pytest.approx(2 * vision.leave.fwd)  # its projector trains
    cfg = small(
        "model.vision.freeze=true", "model.audio.freeze=true", "model.projector_freeze=true"
    )
    costs = model_costs(cfg.model, cfg.batch)
    assert costs.segment("vision").leave.bwd == 0  # a frozen projector over a frozen encoder
    assert costs.segment("llm").layer.bwd == pytest.approx(2 * costs.segment("llm").layer.fwd)
    cfg = small("model.llm.freeze=true", "model.vision.freeze=true", "model.audio.freeze=true")
    llm = model_costs(cfg.model, cfg.batch).segment("llm")
    assert llm.layer.bwd == pytest.approx(llm.layer.fwd)  # input gradients for the projectors


def test_a_skipped_encoder_costs_nothing_and_a_half_bucket_less():
    cfg = small()
    full = model_costs(cfg.model, cfg.batch)
    half = model_costs(cfg.model, cfg.batch, {"vision": 0.5, "audio": 0.0})
    assert half.encoders == ("vision",)
    full_layer, half_layer = full.segment("vision").layer.fwd, half.segment("vision").layer.fwd
    assert full_layer / 4 < half_layer < full_layer / 2  # linear halves, attention quarters


# --- the partitioner ------------------------------------------------------------------------


def toy(m=4, frozen_vision=False, llm_layers=6, vision_layers=4, head=3.0, audio=True):
    """A made-up chain with round costs (per microbatch)."""
    vb = 0.0 if frozen_vision else 2.0
    segs = []
    if audio:
        segs.append(Segment("audio", 2, Work(0.5, 1.0), Work(0.1, 0.2), Work(0.1, 0.2)))
    segs += [
        Segment("vision", vision_layers, Work(1.0, vb), Work(0.2, vb * 0.2), Work(0.5, 1.0)),
        Segment("llm", llm_layers, Work(1.0, 2.0), Work(), Work(head, 2 * head)),
    ]
    return ModelCosts(m, tuple(segs))


def compositions(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield tuple(b - a for a, b in zip((0, *cuts), (*cuts, n), strict=True))


@pytest.mark.parametrize("k, leave", [(1, True), (2, True), (3, True), (3, False), (4, True)])
def test_balanced_split_is_the_best_contiguous_split(k, leave):
    seg = Segment("llm", 7, Work(1.0, 2.0), Work(0.5, 0.0), Work(4.0, 8.0))
    got = balanced_split(seg, k, leave=leave)
    assert sum(got) == 7 and min(got) >= 1 and len(got) == k
    slowest = lambda split: max(s.work.total for s in segment_stages(seg, split, leave=leave))
    assert slowest(got) == min(slowest(c) for c in compositions(7, k))


def brute_force(costs, stages, schedule):
    """The least predicted step time over every placement, allocation and split."""
    best = math.inf
    names = [s.name for s in costs.segments]
    for piped in itertools.product([False, True], repeat=len(costs.encoders)):
        chain = [n for n, p in zip(costs.encoders, piped, strict=True) if p] + ["llm"]
        depth = {n: costs.segment(n).layers for n in names}
        for alloc in itertools.product(range(1, stages + 1), repeat=len(chain)):
            if sum(alloc) != stages:
                continue
            splits = [list(compositions(depth[n], k)) for n, k in zip(chain, alloc, strict=True)]
            for combo in itertools.product(*splits):
                layers = dict(zip(chain, combo, strict=True))
                rest = {n: "data" for n in costs.encoders if n not in chain}
                plan = partition(costs, stages, schedule=schedule, layers=layers, placement=rest)
                best = min(best, plan.step_time)
    return best


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_partitioner_finds_the_best_plan_of_all(schedule, frozen, stages):
    costs = toy(m=3, frozen_vision=frozen)
    got = partition(costs, stages, schedule=schedule)
    assert got.step_time == pytest.approx(brute_force(costs, stages, schedule))


def test_a_frozen_encoder_takes_fewer_stages_than_a_trainable_one():
    """Forward-only layers cost a third of trainable ones: the frozen-aware split gives a frozen
    encoder one stage for what a trainable one needs two for, and the LLM the rest."""
    placement = {"vision": "stages", "audio": "data"}
    kw = dict(m=8, vision_layers=6, llm_layers=6, head=0.1)
    trained = partition(toy(**kw), 4, schedule="1f1b", placement=placement)
    frozen = partition(toy(frozen_vision=True, **kw), 4, schedule="1f1b", placement=placement)
    assert trained.layers("vision") == (3, 3) and trained.layers("llm") == (3, 3)
    assert frozen.layers("vision") == (6,) and frozen.layers("llm") == (2, 2, 2)
    assert frozen.step_time < trained.step_time


def test_encoders_go_data_parallel_unless_stages_would_idle_there():
    """With the microbatches a multiple of the stages a data-parallel pass has no bubble; with 4
    over 3 stages each rank encodes 2, as long as 6 would take, and a heavy encoder does better
    as stages of its own."""
    kw = dict(llm_layers=4, vision_layers=8, head=0.1, audio=False)
    assert partition(toy(m=8, **kw), 4).data_parallel == ("vision",)
    assert partition(toy(m=4, **kw), 3).layers("vision") == (4, 4)


def test_the_head_runs_data_parallel_under_gpipe_and_on_the_last_stage_under_1f1b():
    costs = toy(m=8, audio=False)
    g = partition(costs, 2, schedule="gpipe", placement={"vision": "data"})
    f = partition(costs, 2, schedule="1f1b", placement={"vision": "data"})
    assert g.layers("llm") == (3, 3)  # balanced: the head is in the passes
    assert f.layers("llm")[-1] < f.layers("llm")[0]  # the last stage also runs the head
    head = costs.segment("llm").leave
    assert g.passes.total == pytest.approx(4 * (costs.segment("vision").whole().total + head.total))


def test_uniform_deals_equal_layer_counts_across_modules():
    plan = uniform(toy(), 4, "gpipe")
    assert [s.layers for s in plan.stages] == [3, 3, 3, 3]  # 2 + 4 + 6 layers
    assert [s.segment for s in plan.stages] == ["audio+vision", "vision", "llm", "llm"]


def test_frozen_aware_beats_uniform_on_small_with_a_frozen_vision_encoder():
    """The issue's target on the predicted times (frozen vision = a third of the layers)."""
    cfg = small("model.vision.freeze=true", "batch.microbatches=16")
    costs = model_costs(cfg.model, cfg.batch)
    for stages in (2, 4, 8):
        aware = partition(costs, stages)
        base = min((uniform(costs, stages, k) for k in SCHEDULES), key=lambda p: p.step_time)
        assert base.step_time / aware.step_time >= 1.2, stages


def test_fixed_layers_are_kept_and_impossible_plans_say_what_to_change():
    plan = partition(toy(), 4, layers={"llm": [1, 5]}, placement={"audio": "data"})
    assert plan.layers("llm") == (1, 5) and len(plan.layers("vision")) == 2
    with pytest.raises(PartitionError, match=r"mesh\.stage=9.*lower mesh\.stage"):
        partition(toy(llm_layers=2, vision_layers=2), 9)
    with pytest.raises(PartitionError, match=r"pipeline\.llm_layers=\[1, 1, 4\]"):
        partition(toy(), 3, layers={"llm": [1, 1, 4]}, placement={"vision": "stages"})


def test_describe_prints_layers_time_and_bubble_per_stage():
    text = partition(toy(), 4, schedule="gpipe").describe(scale=1.0, unit="units")
    assert "pipeline plan: 4 stages, gpipe" in text
    assert "bubble" in text and "data-parallel" in text
    assert (
        len([line for line in text.splitlines() if line.strip().startswith(("0", "1", "2", "3"))])
        >= 4
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"],
            r"mesh\.tensor: .*mesh\.fsdp=2 .*mesh\.stage=2.*mesh\.tensor: 1 or mesh\.fsdp: 1",
        ),
        (
            ["mesh.data=1", "mesh.tensor=2", "model.llm.vocab_parallel=false"],
            r"model\.llm\.vocab_parallel: false with mesh\.tensor=2 .*mesh\.stage=2",
        ),
        (
            [
                "mesh.data=1",
                "mesh.context=2",
                "model.attention=block_sparse",
                "batch.planner=orchestrated",
            ],
            r"mesh\.context: .*mesh\.stage=2",
        ),
    ],
)
def test_what_the_pipeline_does_not_run_is_refused_naming_both_keys(overrides, message):
    stage2 = ["mesh.stage=2", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1"]
    load_config("configs/tiny.yaml", stage2)  # (the defaults run)
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.yaml", [*stage2, *overrides])
    load_config("configs/tiny.yaml", ["mesh.stage=1", *overrides[-1:]])  # fine without stages
