"""A planner's carried state, checked before a resumed run plans from it.

The state comes back from a checkpoint (`get_state` -> JSON -> `set_state`). One that does not
fit the lengths index it is restored against (written for another data set, edited, damaged)
would have the resumed run plan other batches than the interrupted one, or index past the data,
without a word; `check_state` refuses it with a message instead. What every planner's state
holds is checked: the plan step and the stream cursor (whole numbers >= 0), the deferred samples
(ids within the index, pulled at a step between 0 and the plan step: their ages), grain's
packing frontier (ids >= 0).
"""

from __future__ import annotations

from jaxmllm.config import ConfigError


class PlanStateError(ConfigError):
    """A restored planner state that does not fit the index: the run stops, naming it."""


def check_state(state: object, samples: int) -> None:
    """Raises PlanStateError unless `state` is a planner state that fits an index of `samples`
    samples (see the module docstring)."""
    problem = _problem(state, samples)
    if problem:
        raise PlanStateError(
            f"the checkpoint's planner state does not fit this data set's index of {samples} "
            f"samples ({problem}): it was written for another index, or is damaged. Resume "
            "with the data and index it was trained on, or use a new train.output_dir"
        )


def _problem(state: object, samples: int) -> str:
    whole = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0
    if not isinstance(state, dict) or not whole(state.get("step")):
        return "no plan step (a whole number >= 0)"
    step = state["step"]
    if "cursor" in state and not whole(state["cursor"]):
        return f"cursor {state['cursor']!r:.40} is not a whole number >= 0"
    deferred = state.get("deferred", [])
    if not isinstance(deferred, list) or not all(
        isinstance(d, list) and len(d) == 2 and all(map(whole, d)) for d in deferred
    ):
        return "the deferred samples are not [sample, step pulled] pairs of whole numbers"
    for sample, pulled in deferred:
        if sample >= samples:
            return f"deferred sample {sample} is past the index's last, {samples - 1}"
        if pulled > step:
            return f"deferred sample {sample} was pulled at step {pulled}, after step {step}"
    frontier = state.get("frontier", [])
    if not isinstance(frontier, list) or not all(map(whole, frontier)):
        return "grain's packing frontier is not a list of whole numbers >= 0"
    return ""
