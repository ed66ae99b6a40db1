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


def write_advantages(text, loaded: list[Sample], docs, flat, aggregation: str) -> None:
    """Each completion's advantage on every one of its tokens, and its tokens' weight in the
    step's loss: 1 (`token`: the mean over the step's learned tokens), or 1 / its learned tokens
    (`sequence`: each completion's mean, averaged over the completions). A completion is a
    document (`docs`: each sample's documents' lengths, `pairs.documents_of`): a group's
    completions of one prompt are one sample's documents, each with its own advantage."""
    doc_n = np.concatenate(docs)
    advantage = np.concatenate(
        [
            np.broadcast_to(np.asarray(0.0 if x.advantage is None else x.advantage), len(d))
            for x, d in zip(loaded, docs, strict=True)
        ]
    ).astype(np.float32)
    text["llm_advantage"].reshape(-1)[flat] = np.repeat(advantage, doc_n)
    weight = np.ones(len(doc_n), np.float32)
    if aggregation == "sequence":  # (the learned tokens: loss shifted onto their predictors)
        loss = np.concatenate([x.loss for x in loaded]).astype(np.int64)
        starts = np.cumsum(doc_n) - doc_n
        loss[starts[doc_n > 0]] = 0  # (a document's first token is no document's target)
        learned = np.add.reduceat(loss, starts) if len(loss) else np.zeros(0, np.int64)
        learned = np.where(doc_n > 0, learned, 0)
        weight = 1.0 / np.maximum(learned, 1).astype(np.float32)
    text["llm_weight"].reshape(-1)[flat] = np.repeat(weight, doc_n)
