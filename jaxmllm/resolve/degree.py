"""`mesh.context_steps: auto`: which steps split their LLM rows over the context groups, chosen
at start-up from the data.

Both choices run on the same mesh and parameters; they differ in what a step computes and
moves. `all` splits every step's rows over the groups (every step pays the group's exchange,
and its buckets are groups of `mesh.context` devices, whose packing of a group's longer rows
fills them better on some data); `long` splits only the long variants' (the base steps run no
exchange over the `context` axis, a document longer than a device's row waits for a long
step). Each is sized from the data as the trainer sizes it (`sizing.resolve_batch`), then
scored over TRIAL_STEPS of its own plans: the useful FLOPs of the cost model over the FLOPs its
buckets compute plus its exchange priced in FLOPs (`cost.exchange.step_bytes` a rank, every
step whose rows are split, at `cost.exchange.FLOPS_PER_BYTE`). The higher score is kept, and
the run's config.json records it, so a resumed run keeps the choice (`resumed.keep_resolved`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import numpy as np

from jaxmllm.config import Config
from jaxmllm.config.spec import BatchSpec
from jaxmllm.cost.exchange import FLOPS_PER_BYTE, step_bytes
from jaxmllm.cost.model import CostModel
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.plan.contract import Capacities
from jaxmllm.plan.registry import make_planner
from jaxmllm.resolve.sizing import resolve_batch
from jaxmllm.resolve.tilesize import trial_flops

log = logging.getLogger("jaxmllm")

# Plans each choice is scored over: long steps come at most plan.ladder.LONG_WAIT steps apart,
# so a few dozen plans see several of them
TRIAL_STEPS = 64
CHOICES = ("long", "all")  # (in this order: a tie keeps the one that moves less)


class Trial(NamedTuple):
    """One choice's score over its trial plans (FLOPs summed over the plans and devices)."""

    useful: float  # what the samples need (the cost model's FLOPs of their units and tiles)
    computed: float  # what the buckets compute, padding included
    exchange: float  # the bytes the context groups move, priced in FLOPs
    split_steps: int  # trial steps whose rows were split over the groups
    steps: int

    @property
    def goodput(self) -> float:
        """Useful over computed FLOPs, the exchange left out (`bench.balance`'s goodput)."""
        return self.useful / self.computed if self.computed > 0 else 0.0

    @property
    def score(self) -> float:
        """Useful FLOPs over what the step costs: computed FLOPs and the priced exchange."""
        total = self.computed + self.exchange
        return self.useful / total if total > 0 else 0.0


def resolve_sizes(cfg: Config, index: LengthsIndex, devices: int) -> Config:
    """`resolve_batch`, with `mesh.context_steps: auto` settled first (`choose`)."""
    if cfg.mesh.context_steps != "auto":
        return resolve_batch(cfg, index, devices)
    return choose(cfg, index, devices)[0]


def choose(cfg: Config, index: LengthsIndex, devices: int) -> tuple[Config, dict[str, Trial]]:
    """The config of the better of CHOICES (resolved, `mesh.context_steps` set), and each one's
    trial."""
    resolved, trials = {}, {}
    for steps in CHOICES:
        c = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, context_steps=steps))
        resolved[steps] = resolve_batch(c, index, devices)
        trials[steps] = trial(resolved[steps], index, devices)
    best = max(CHOICES, key=lambda s: trials[s].score * (1 - 1e-9 * CHOICES.index(s)))
    log.info(
        "mesh.context_steps=auto: %s (%s)",
        best,
        "; ".join(
            f"{s}: goodput {t.goodput:.3f}, exchange {t.exchange / max(t.computed, 1):.1%} of "
            f"the computed FLOPs in {t.split_steps} of {t.steps} steps, score {t.score:.3f}"
            for s, t in trials.items()
        ),
    )
    return resolved[best], trials


def trial(cfg: Config, index: LengthsIndex, devices: int) -> Trial:
    """The score of a resolved config's first TRIAL_STEPS plans (fewer in a shorter run)."""
    caps = Capacities.of(BatchSpec.of(cfg), devices)
    weights = CostModel.from_model(cfg.model).tile_weights(
        caps.attention_block, caps.per_row, caps.context
    )
    planner = make_planner(cfg.batch.planner, index, caps, cfg.data.seed)
    steps = max(min(cfg.train.steps, TRIAL_STEPS), 1)
    useful, computed, long_steps = trial_flops(planner, index, caps, steps, weights)
    split = steps if cfg.mesh.context_steps == "all" else long_steps
    itemsize = np.dtype(cfg.model.compute_dtype).itemsize
    moved = step_bytes(
        cfg.model.llm,
        cfg.mesh.context_strategy,
        caps.llm_rows * caps.llm_row_len,
        cfg.mesh.context,
        itemsize,
    )
    exchange = split * caps.microbatches * caps.devices * moved * FLOPS_PER_BYTE
    return Trial(useful, computed, exchange, split, steps)
