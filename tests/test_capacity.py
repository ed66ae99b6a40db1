"""Capacity suggestion (the ladder of shapes, modality ratios) and the cost model."""

from __future__ import annotations

import dataclasses as dc

import numpy as np
import pytest

from jaxmllm.bench.mixes import from_arrays, synthetic_omni
from jaxmllm.config import ModelConfig
from jaxmllm.cost.model import CostModel
from jaxmllm.resolve.capacity import ladder_values, suggest_capacities

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

MERGE_AREA, SUBSAMPLE = 4, 4
PER_TOKEN = {"vision": MERGE_AREA, "audio": SUBSAMPLE}  # (units per LLM token)
PER_ROW = {"vision": 1, "audio": SUBSAMPLE}  # (units per encoder row: the pairs stem)


def test_capacity_ladder_and_ratios():
    ladder = set(ladder_values().tolist())
    index = synthetic_omni(4000, seed=2)
    sug = suggest_capacities(index, 16384, PER_TOKEN, per_row=PER_ROW)
    for v in (sug.llm_row_len, sug.units["vision"], sug.units["audio"]):
        assert v in ladder
    llm = index.llm_tokens(PER_TOKEN)
    vis = index.items["vision"].per_sample()
    assert sug.llm_rows * sug.llm_row_len >= llm.max()
    assert sug.units["vision"] >= vis.max() and sug.units["vision"] % MERGE_AREA == 0
    ideal = sug.llm_rows * sug.llm_row_len * vis.sum() / llm.sum()
    assert abs(sug.units["vision"] / ideal - 1) < 0.07  # 8 shapes an octave: within 6%
    text_only = from_arrays(
        np.array([100, 300]), [np.zeros(0, np.int64)] * 2, [np.zeros(0, np.int64)] * 2
    )
    sug = suggest_capacities(text_only, 1000, PER_TOKEN, per_row=PER_ROW)
    assert sug.units["vision"] == sug.units["audio"] == 0 and sug.llm_row_len >= 1000 * 0.94
    assert set(sug.batch_overrides()) == {
        "llm_rows",
        "llm_row_len",
        "vision_patches",
        "audio_frames",
    }


def test_capacity_suggestion_matches_modality_demands():
    """The LLM length may move one ladder step if that brings the phases' demands closer."""
    from jaxmllm.plan.summary import summary_of
    from jaxmllm.resolve.capacity import _encoder_caps

    index = synthetic_omni(4000, seed=2)
    llm = index.llm_tokens(PER_TOKEN)
    sug = suggest_capacities(index, 32768, PER_TOKEN, per_row=PER_ROW, match_llm=True)
    plain = _encoder_caps(summary_of(index, PER_TOKEN), llm, 1, 32768, PER_TOKEN, PER_ROW, 8)
    assert (
        suggest_capacities(index, 32768, PER_TOKEN, per_row=PER_ROW) == plain
    )  # default: as asked

    def spread(x):
        return max(x.demand.values()) / min(x.demand.values())

    assert spread(sug) <= spread(plain)
    assert 32768 / 1.2 <= sug.llm_rows * sug.llm_row_len <= 32768 * 1.2


def test_cost_multipliers_follow_what_is_frozen():
    base = ModelConfig()
    trainable = CostModel.from_model(base)
    frozen_vis = CostModel.from_model(dc.replace(base, vision=dc.replace(base.vision, freeze=True)))
    assert frozen_vis.phase("vision").quadratic == pytest.approx(
        trainable.phase("vision").quadratic / 3
    )
    frozen_llm = CostModel.from_model(dc.replace(base, llm=dc.replace(base.llm, freeze=True)))
    assert frozen_llm.phase("llm").quadratic == pytest.approx(
        trainable.phase("llm").quadratic * 2 / 3
    )
    all_frozen = dc.replace(
        base,
        llm=dc.replace(base.llm, freeze=True),
        vision=dc.replace(base.vision, freeze=True),
        audio=dc.replace(base.audio, freeze=True),
        projector_freeze=True,
    )
    assert CostModel.from_model(all_frozen).phase("llm").quadratic == pytest.approx(
        trainable.phase("llm").quadratic / 3
    )
    c = trainable.phase("llm")
    assert c.item_cost(np.array([10]))[0] == pytest.approx(10 * c.linear + 100 * c.quadratic)


def test_a_routed_planners_encoder_bucket_holds_the_largest_item_not_the_largest_sample():
    """Orchestrated places items, not samples (`RoutedAssignment`): its encoder bucket is the
    data's ratio, at least the largest item, where a 64-frame clip (a sample of 25,600
    patches) would size a planner of whole samples' far past it (chats seed 100's vision
    phase filled to 0.78 so); the clip's frames then spread over devices and every plan holds
    its capacities."""
    from jaxmllm.plan.contract import Capacities, check_plan
    from jaxmllm.plan.registry import make_planner
    from jaxmllm.resolve.capacity import encoder_capacities

    n = 600
    images = [np.array([256])] * n
    images[7] = np.full(64, 400)  # (a clip: 64 frames of 20 x 20 patches)
    index = from_arrays(np.full(n, 200), images, [np.zeros(0, np.int64)] * n)
    clip = 64 * 400
    whole = suggest_capacities(index, 4096, PER_TOKEN, per_row=PER_ROW)
    assert whole.units["vision"] >= clip  # (a sample's items share its text's device)
    sug = suggest_capacities(index, 4096, PER_TOKEN, per_row=PER_ROW, routed=True)
    assert (sug.llm_rows, sug.llm_row_len) == (whole.llm_rows, whole.llm_row_len)
    assert 400 <= sug.units["vision"] < clip
    assert sug.units["vision"] in set(ladder_values().tolist())
    llm = index.llm_tokens(PER_TOKEN)
    ideal = sug.llm_rows * sug.llm_row_len * index.items["vision"].sizes.sum() / llm.sum()
    assert abs(sug.units["vision"] / ideal - 1) < 0.07  # (the data's ratio, as without clips)
    enc = encoder_capacities(index, 4096, PER_TOKEN, per_row=PER_ROW, routed=True)
    assert enc.units["vision"] < clip
    caps = Capacities(
        microbatches=2,
        devices=8,
        llm_rows=sug.llm_rows,
        llm_row_len=sug.llm_row_len,
        units=sug.units,
        per_token=PER_TOKEN,
        per_row=PER_ROW,
        route_pair_capacity=sug.units["vision"] // MERGE_AREA,
    )
    planner = make_planner("orchestrated", index, caps, 0)
    placed = []
    for _ in range(12):
        plan = planner.plan()
        check_plan(plan, index, caps)
        placed += plan.samples.tolist()
    assert 7 in placed
