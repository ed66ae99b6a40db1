"""`python -m jaxmllm.hf check DIR --data PAIRS`: preference pairs' log-probs against transformers.

A preference record is one sample of two documents (`Sample.documents`: its prompt with the
chosen completion, then its prompt with the rejected one; its media listed once). What DPO
trains on is, per pair, the summed log-probs of each completion's tokens. Here:

- ours are training's own: the pairs packed into ONE row (`--one-per-row`: a row each) by
  `batch.prompts.packed_row` (bucketize itself, under `train.objective: dpo`: each document its
  own segment with positions from 0, the media encoded once and their rows filling both
  documents' slots, each token's pair and side in `llm_sequence`), the model's
  `token_logps_and_router` (the fused projection's per-token log-probs) summed by
  `step.preference.pair_sums` over the loss mask: the completions' tokens;
- transformers' are each document run alone (the pair's media given again with each), the
  log-softmax of its logits at every next token, summed over the tokens the document's loss
  mask marks (token t's log-prob of token t + 1 where t + 1 is learned).

The line of a pair: both sums and both token counts by each side, and the largest difference
(of the sums, and of the counts: a completion counted differently is a failure too).

A checkpoint whose vocabulary `hf import` grew (placeholder rows transformers' model lacks,
`check.own_columns`): ours are normalised over the checkpoint's own columns, from our logits.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmllm.batch.prompts import packed_row
from jaxmllm.config import Config
from jaxmllm.config.spec import BatchSpec
from jaxmllm.data.samples import Sample
from jaxmllm.step.preference import pair_sums

SIDES = ("chosen", "rejected")


@nnx.jit
def _training_logps(model, mb):
    """Training's per-token target log-probs of one microbatch [D, R, L]."""
    return model.token_logps_and_router(mb)[0]


@nnx.jit
def _logits(model, mb):
    return model(mb)


def documents(sample: Sample) -> tuple[Sample, Sample]:
    """A pair's chosen and rejected documents, each a sample of its own with the pair's media
    and grids (both documents hold every item's placeholder rows)."""
    n = sample.documents[0]
    cut = lambda lo, hi: dataclasses.replace(
        sample, tokens=sample.tokens[lo:hi], loss=sample.loss[lo:hi], documents=()
    )
    return cut(0, n), cut(n, len(sample.tokens))


def completion_mask(doc: Sample) -> np.ndarray:
    """Which positions t of a document count: those whose next token t + 1 is learned (its
    completion's); the last predicts nothing. bool [T]."""
    return np.append(np.asarray(doc.loss[1:], bool), False)


def document_logps(logits: np.ndarray, doc: Sample) -> tuple[float, int]:
    """transformers' summed log-probs of a document's completion tokens, and their count:
    `logits` [T, vocab] of the document alone, log-softmax (float64) at each counted position
    of its next token."""
    mask = completion_mask(doc)[:-1]  # (the last position predicts nothing)
    x = np.asarray(logits, np.float64)[:-1][mask]
    targets = np.asarray(doc.tokens)[1:][mask]
    top = x.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))[:, 0]
    return float((x[np.arange(len(x)), targets] - lse).sum()), int(mask.sum())


def dpo_config(cfg: Config) -> Config:
    """`cfg` under `train.objective: dpo` (so bucketize writes each token's pair and side),
    with the reference the step runs (nothing the batch brings)."""
    pref = dataclasses.replace(cfg.preference, reference="base")
    train = dataclasses.replace(cfg.train, objective="dpo")
    return dataclasses.replace(cfg, train=train, preference=pref)


def our_sums(cfg: Config, model, pairs: list[Sample], specials, vocab: int) -> list[dict]:
    """Each pair's sums and counts as training computes them, the pairs packed into one row:
    [{"chosen", "rejected", "chosen_tokens", "rejected_tokens"}] in order. `vocab`: the
    checkpoint's own columns (fewer than the model's: normalised over those, from the logits)."""
    dpo = dpo_config(cfg)
    mb, _ = packed_row(pairs, dpo, specials)
    mb = {k: jnp.asarray(v) for k, v in mb.items()}
    # The model as a DPO run builds it: its spec's `media_copies`, so a pair's media rows fill
    # both its documents' slots (an SFT-built model fills one slot a row: one document's
    # stay empty)
    was, model.copies = model.copies, BatchSpec.of(dpo, resolved=False).media_copies
    try:
        if vocab < cfg.model.llm.vocab_size:
            logits = np.asarray(_logits(model, mb), np.float64)[..., :vocab]
            top = logits.max(-1, keepdims=True)
            lse = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
            targets = np.minimum(np.asarray(mb["llm_targets"]), vocab - 1)  # (pads: masked)
            picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
            logps = jnp.asarray((picked - lse).astype(np.float32))
        else:
            logps = _training_logps(model, mb)
    finally:
        model.copies = was
    sums = pair_sums(logps, mb["llm_sequence"], mb["llm_loss_mask"])
    sums = {k: np.asarray(v)[0] for k, v in sums._asdict().items()}  # (one bucket: [K])
    return [
        {
            "chosen": float(sums["chosen"][k]),
            "rejected": float(sums["rejected"][k]),
            "chosen_tokens": int(round(float(sums["chosen_tokens"][k]))),
            "rejected_tokens": int(round(float(sums["rejected_tokens"][k]))),
        }
        for k in range(len(pairs))
    ]


def pair_line(
    name: str, desc: str, rid: str, mine: dict, theirs: dict, k: int, n: int, where: str
) -> dict:
    """A pair's figures: the `figures` keys ("max_abs_diff" over both sums and both counts,
    "max_abs_ref" the larger of transformers' sums' magnitudes), its record id, and per side
    the log-prob sum and token count by jaxmllm and transformers."""
    gaps = [abs(mine[s] - theirs[s]) for s in SIDES]
    gaps += [abs(mine[f"{s}_tokens"] - theirs[f"{s}_tokens"]) for s in SIDES]
    by = lambda key: {"jaxmllm": mine[key], "transformers": theirs[key]}
    sums = lambda s: {**by(s), "abs_diff": abs(mine[s] - theirs[s])}
    return {
        "role": "model",
        "family": name,
        "what": f"completion log-prob sums of pair {k + 1} of {n} ({desc}); {where}",
        "max_abs_diff": float(max(gaps)),
        "max_abs_ref": float(max(abs(theirs[s]) for s in SIDES)),
        "id": rid,
        **{f"{s}_logps": sums(s) for s in SIDES},
        **{f"{s}_tokens": by(f"{s}_tokens") for s in SIDES},
    }


def describe_pair(result: dict) -> str:
    """A pair's line in words."""
    sides = "; ".join(
        f"{s} {result[f'{s}_logps']['jaxmllm']:.6g} over {result[f'{s}_tokens']['jaxmllm']} "
        f"tokens (transformers {result[f'{s}_logps']['transformers']:.6g} over "
        f"{result[f'{s}_tokens']['transformers']})"
        for s in SIDES
    )
    return (
        f"{result['family']} {result['role']}: {result['what']}: {sides}: largest difference "
        f"{result['max_abs_diff']:.3g}"
    )
