"""The planners held to data they were not tuned on: random workloads of the bench's family
(`bench.mixes.random_mix`) and raw lengths off the phases' granularity (rounded by the
documented rule, `bench.mixes.rounded`), at bench-sized capacities; the held tile capacity
chosen by the cost model."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxmllm.bench.balance import PHASES
from jaxmllm.bench.mixes import from_arrays, random_mix, rounded
from jaxmllm.bench.sizes import make_caps
from jaxmllm.config import ModelConfig
from jaxmllm.cost.model import CostModel
from jaxmllm.plan.contract import check_plan, step_tiles
from jaxmllm.plan.registry import make_planner
from jaxmllm.resolve.tilesize import HELD_TRIAL_STEPS, goodput, held_tiles

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

MERGE_AREA, SUBSAMPLE = 4, 4
PER_TOKEN = {"vision": MERGE_AREA, "audio": SUBSAMPLE}  # (units per LLM token)
PER_ROW = {"vision": 1, "audio": SUBSAMPLE}  # (units per encoder row: the pairs stem)
FLOPS = CostModel.from_model(ModelConfig())
SETTINGS = settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def raw_workloads(draw):
    """Samples with patch and frame counts of any value (not multiples of the merge area or
    the subsampling), rounded as the pipeline rounds real media."""
    n = draw(st.integers(20, 120))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    text = rng.integers(0, 400, n)  # 0: a sample of media only (or nothing: dropped)
    images = [rng.integers(1, 900, rng.integers(0, 4)) for _ in range(n)]
    audio = [rng.integers(1, 700, rng.integers(0, 2)) for _ in range(n)]
    index, counts = rounded(from_arrays(text, images, audio), MERGE_AREA, SUBSAMPLE)
    assert (index.items["vision"].sizes % MERGE_AREA == 0).all() and (
        index.items["audio"].sizes % SUBSAMPLE == 0
    ).all()
    assert (index.llm_tokens(PER_TOKEN) > 0).all()
    return index


def epoch_checks(index, caps, policy: str, seed: int) -> None:
    """Every plan within the capacities and routes (check_plan), every sample's age within
    the bound after every plan, and over two epochs nothing lost and nothing twice."""
    planner = make_planner(policy, index, caps, seed)
    planned = Counter()
    while planner.cursor < 2 * len(index):
        plan = planner.plan()
        check_plan(plan, index, caps)
        assert planner.ages.max(initial=0) <= planner.max_age
        planned.update(plan.samples.tolist())
    waiting = Counter(planner.deferred[:, 0].tolist())
    assert planned + waiting == Counter(planner.stream.take(0, planner.cursor).tolist())


@pytest.mark.parametrize("policy", ["orchestrated", "balanced"])
@SETTINGS
@given(
    workload=raw_workloads(),
    devices=st.sampled_from([2, 4]),
    micro=st.integers(1, 2),
    per_host=st.sampled_from([0, 1, 2]),
)
def test_raw_lengths_plan_within_capacities_once_each(policy, workload, devices, micro, per_host):
    caps = make_caps(workload, devices, 2048, micro, policy, MERGE_AREA, SUBSAMPLE, 0, per_host)
    epoch_checks(workload, caps, policy, seed=0)


@pytest.mark.parametrize(
    ("seed", "devices", "block", "per_host"),
    [(0, 8, 0, 4), (1, 8, 128, 2), (2, 4, 128, 0), (3, 16, 0, 8)],
)
def test_random_family_plans_hold_the_contract(seed, devices, block, per_host):
    """A few of the bench's random mixes (all kinds of samples, any proportions), small, on
    one host or several: capacities (tiles too, held near the need), routes (each item
    encoded once, its rows to its text), ages, exactly once."""
    index = random_mix(seed, 1500)
    caps = make_caps(
        index, devices, 8192, 2, "orchestrated", MERGE_AREA, SUBSAMPLE, block, per_host
    )
    if block:
        make = lambda c: make_planner("orchestrated", index, c, 0)  # noqa: E731
        tiles = held_tiles(make(caps), index, caps, 10)
        caps = dataclasses.replace(caps, tiles=tiles)
    epoch_checks(index, caps, "orchestrated", seed=seed)


@pytest.mark.slow
def test_held_tile_headroom_follows_the_cost_model():
    """Where computed tiles cost nothing the held capacity is looser than where only tiles
    cost; under each cost the chosen capacity's plans do at least the useful work per
    computed FLOP of the default headroom's (over the plans it was chosen on), and the plans
    hold it."""
    index = random_mix(0)
    caps = make_caps(index, 8, 32768, 2, "orchestrated", MERGE_AREA, SUBSAMPLE, 128)
    make = lambda c: make_planner("orchestrated", index, c, 0)  # noqa: E731

    def with_tiles(tiles):
        return dataclasses.replace(caps, tiles=dict(tiles))

    plain = with_tiles(held_tiles(make(caps), index, caps, 12))
    chosen = {}
    for name, w in (("units", (1.0, 0.0)), ("tiles", (0.0, 1.0)), ("flops", None)):
        weights = {p: w for p in PHASES} if w else FLOPS.tile_weights(128, caps.per_row)
        held = with_tiles(held_tiles(make(caps), index, caps, 12, make=make, weights=weights))
        chosen[name] = held
        assert goodput(make(held), index, held, HELD_TRIAL_STEPS, weights) >= goodput(
            make(plain), index, plain, HELD_TRIAL_STEPS, weights
        )
    assert sum(chosen["units"].tile_caps().values()) > sum(chosen["tiles"].tile_caps().values())
    loose = chosen["units"]
    for plan in (make(loose).plan() for _ in range(3)):  # the capacity it holds
        for phase, need in step_tiles(plan, index, loose).items():
            assert need.max(initial=0) <= loose.tile_caps()[phase]
