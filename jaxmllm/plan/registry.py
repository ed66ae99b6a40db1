"""The planners by name (`batch.planner`; config validates it against `PLANNER_NAMES`, which a
test holds equal to these).

The top of `jaxmllm.plan`: it imports the implementations, nothing here imports it back.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.plan.assign import JointAssignment, RoutedAssignment
from jaxmllm.plan.balancer import Balancer
from jaxmllm.plan.baselines import FirstFitPlanner, GrainPlanner, NaivePlanner
from jaxmllm.plan.contract import Capacities, Planner

PlannerFactory = Callable[[LengthsIndex, Capacities, int], Planner]

# name -> factory(index, caps, seed); the balancer's take keyword arguments too (max_age,
# lookahead)
PLANNERS: dict[str, PlannerFactory] = {
    "orchestrated": partial(Balancer, assignment=RoutedAssignment()),
    "balanced": partial(Balancer, assignment=JointAssignment()),
    "grain": GrainPlanner,
    "naive": NaivePlanner,
    "first_fit": FirstFitPlanner,
}


# The planners whose tile capacity (block-sparse attention) is set near the data's mean need
# and held: they equalise tiles across devices, bound each microbatch's, and turn away what
# would take a device over (the sample waits). The others get the worst a dry run of their own
# plans needs (`balanced` equalises tiles too, but whole samples per device are too coarse to
# hold a tight capacity without losing fill: omni 0.975 -> 0.92).
HOLDS_TILES = frozenset({"orchestrated"})


# The planners that plan LLM rows per context group (`Capacities.context` > 1).
PLANS_CONTEXT = frozenset({"orchestrated"})


def make_planner(name: str, index: LengthsIndex, caps: Capacities, seed: int) -> Planner:
    """The planner called `name` over `index`, with bucket capacities `caps`, drawing its sample
    stream from `seed`."""
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}: one of {', '.join(sorted(PLANNERS))}")
    if caps.context > 1 and name not in PLANS_CONTEXT:
        raise ValueError(
            f"planner {name!r} plans no context groups (context {caps.context}): "
            f"use one of {', '.join(sorted(PLANS_CONTEXT))}"
        )
    return PLANNERS[name](index, caps, seed)
