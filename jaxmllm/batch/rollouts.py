"""A rollout's completions in the step's batch (`train.objective: grpo`, `jaxmllm.step.grpo`)."""

from __future__ import annotations

import numpy as np

from jaxmllm.config import Config
from jaxmllm.data.samples import Sample


def rollout_shapes(cfg: Config, lead: tuple[int, ...], llm: tuple[int, ...]) -> dict:
    """The batch's arrays of a GRPO step ({} for another objective): a completion's advantage
    and loss weight on each of its tokens, and the sampling policy's log-probs with whether
    they are given (a rollout trained over more than one step: filled on the devices before
    its first, `loop.rollouts`; else the step's own, the ratio 1)."""
    if cfg.train.objective != "grpo":
        return {}
    out = {"llm_advantage": (llm, np.float32), "llm_weight": (llm, np.float32)}
    out["llm_old_logps"] = (llm, np.float32)
    out["llm_old_given"] = (lead, np.int32)
    return out


def write_advantages(text, loaded: list[Sample], n: np.ndarray, flat, aggregation: str) -> None:
    """Each completion's advantage on every one of its tokens, and its tokens' weight in the
    step's loss: 1 (`token`: the mean over the step's learned tokens), or 1 / its learned tokens
    (`sequence`: each completion's mean, averaged over the completions)."""
    advantage = np.array([x.advantage or 0.0 for x in loaded], np.float32)
    text["llm_advantage"].reshape(-1)[flat] = np.repeat(advantage, n)
    weight = np.ones(len(loaded), np.float32)
    if aggregation == "sequence":  # (the learned tokens: loss shifted onto their predictors)
        learned = np.array([max(int(x.loss[1:].sum()), 1) for x in loaded], np.float32)
        weight = 1.0 / learned
    text["llm_weight"].reshape(-1)[flat] = np.repeat(weight, n)
