"""The planners by name (`batch.planner`): the one list config validates against.

The top of `jaxmllm.plan`: it imports the implementations, nothing here imports it back.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxmllm.data.samples import LengthsIndex
from jaxmllm.plan.balancer import BalancedPlanner, OrchestratedPlanner
from jaxmllm.plan.baselines import FirstFitPlanner, GrainPlanner, NaivePlanner
from jaxmllm.plan.contract import Capacities, Planner

PlannerFactory = Callable[[LengthsIndex, Capacities, int], Planner]

# name -> factory(index, caps, seed)
PLANNERS: dict[str, PlannerFactory] = {
    "orchestrated": OrchestratedPlanner,
    "balanced": BalancedPlanner,
    "grain": GrainPlanner,
    "naive": NaivePlanner,
    "first_fit": FirstFitPlanner,
}


def make_planner(name: str, index: LengthsIndex, caps: Capacities, seed: int) -> Planner:
    """The planner called `name` over `index`, with bucket capacities `caps`, drawing its sample
    stream from `seed`."""
    if name not in PLANNERS:
        raise ValueError(f"unknown planner {name!r}: one of {', '.join(sorted(PLANNERS))}")
    return PLANNERS[name](index, caps, seed)
