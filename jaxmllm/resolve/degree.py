"""`mesh.context_steps: auto`: which steps split their LLM rows over the context groups, chosen
at start-up from the data.

The choices run on the same devices and parameters (replicated over the `context` axis, or
fsdp-sharded, either way); they differ in what a step computes and moves. `all` splits every
step's rows over the groups (every step pays the group's exchange, and its buckets are groups
of `mesh.context` devices, whose packing of a group's longer rows fills them better on some
data); `long` splits only the long variants' (the base steps run no exchange over the
`context` axis, a document longer than a device's row waits for a long step); `none`, where
every document fits a device's row, splits no step's: the run is planned and built with
`mesh.context: 1`, the context axis' devices more data-parallel ones (`mesh.data` times the
context). Each is sized from the data as the trainer sizes it (`sizing.resolve_batch`), then
scored over TRIAL_STEPS of its own plans: the useful FLOPs of the cost model over the FLOPs its
buckets compute plus its exchange priced in FLOPs (`cost.exchange.step_bytes` a rank, every
step whose rows are split, at `cost.exchange.FLOPS_PER_BYTE`). The higher score is kept, and
the run's config.json records it (`none`: as mesh.context 1), so a resumed run keeps the choice
(`resumed.keep_resolved`).
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
from jaxmllm.plan.contract import Capacities, OversizeError
from jaxmllm.plan.registry import make_planner
from jaxmllm.resolve.sizing import resolve_batch
from jaxmllm.resolve.tilesize import trial_flops

log = logging.getLogger("jaxmllm")

# Plans each choice is scored over: long steps come at most plan.ladder.LONG_WAIT steps apart,
# so a few dozen plans see several of them
TRIAL_STEPS = 64
CHOICES = ("none", "long", "all")  # (in this order: a tie keeps the one that moves less)


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
    """The config of the best of CHOICES (resolved, `mesh.context_steps` set; `none`: with
    `mesh.context` 1), and each one's trial."""
    resolved, trials = {}, {}
    for name, c in candidates(cfg, index).items():
        try:
            resolved[name] = resolve_batch(c, index, devices)
        except OversizeError as e:  # (none: a sample's items or tiles no device's bucket holds)
            if name != "none":
                raise
            log.info("mesh.context_steps=auto: not none (%s)", e)
            continue
        trials[name] = trial(resolved[name], index, devices)
    best = max(trials, key=lambda s: trials[s].score * (1 - 1e-9 * CHOICES.index(s)))
    log.info(
        "mesh.context_steps=auto: %s%s (%s)",
        best,
        " (every document fits a device's row: mesh.context=1, its devices data-parallel)"
        if best == "none"
        else "",
        "; ".join(
            f"{s}: goodput {t.goodput:.3f}, exchange {t.exchange / max(t.computed, 1):.1%} of "
            f"the computed FLOPs in {t.split_steps} of {t.steps} steps, score {t.score:.3f}"
            for s, t in trials.items()
        ),
    )
    return resolved[best], trials


def candidates(cfg: Config, index: LengthsIndex) -> dict[str, Config]:
    """Each of CHOICES as a config (`none` only where every document fits a device's row of
    `batch.llm_row_len` tokens: one longer needs a group)."""
    m, out = cfg.mesh, {}
    longest = int(index.llm_tokens(BatchSpec.of(cfg, resolved=False).per_token).max(initial=0))
    if longest <= cfg.batch.llm_row_len:
        data = m.data * m.context if m.data > 0 else m.data  # (-1: the rest, as before)
        none = dataclasses.replace(m, context=1, context_steps="all", data=data)
        out["none"] = dataclasses.replace(cfg, mesh=none)
    else:
        log.info(
            "mesh.context_steps=auto: a document of %d tokens is longer than a device's row "
            "(batch.llm_row_len=%d): long or all (groups of mesh.context=%d)",
            longest,
            cfg.batch.llm_row_len,
            m.context,
        )
    for steps in ("long", "all"):
        out[steps] = dataclasses.replace(cfg, mesh=dataclasses.replace(m, context_steps=steps))
    return out


def trial(cfg: Config, index: LengthsIndex, devices: int) -> Trial:
    """The score of a resolved config's first TRIAL_STEPS plans (fewer in a shorter run)."""
    caps = Capacities.of(BatchSpec.of(cfg), devices)
    weights = CostModel.from_model(cfg.model).tile_weights(
        caps.attention_block, caps.per_row, caps.context
    )
    planner = make_planner(cfg.batch.planner, index, caps, cfg.data.seed)
    steps = max(min(cfg.train.steps, TRIAL_STEPS), 1)
    useful, computed, long_steps = trial_flops(planner, index, caps, steps, weights)
    split = 0 if cfg.mesh.context == 1 else steps if cfg.mesh.context_steps == "all" else long_steps
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
