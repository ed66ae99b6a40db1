"""Preference tuning as an objective of the one step: DPO and its variants over packed pairs.

A pair is one sample (`jaxmllm.data.samples.Sample.documents`): its chosen and its rejected
document sit in one row of one bucket, so each bucket sums its own pairs' completion log-probs
(`pair_sums`, no exchange between devices); bucketize numbers each token's sequence in its
bucket (`llm_sequence`: 2k chosen, 2k + 1 rejected) and counts the bucket's pairs
(`llm_pairs`). The step's loss is the mean of the pairs' losses over every pair of the step,
on all devices and microbatches (`make_preference_loss_and_grads`): each microbatch adds its
pairs' losses divided by the step's pair count, as the SFT loss divides by the step's token
count, so the loss and gradient do not depend on where the planner put the pairs.

The formulas are TRL's (`DPOTrainer`, and `CPOTrainer.cpo_loss` for simpo), on sums of the
completions' log-probs: with chosen c, rejected r and the reference's c0, r0,

    sigmoid  -(1 - e) log s(b x d) - e log s(-b x d),    d = (c - c0) - (r - r0)   (cDPO's e)
    ipo      (d' - 1 / (2 b))^2,  d' the same on log-probs averaged over each completion
    simpo    -(1 - e) log s(b x m - g) - e log s(-(b x m - g)),  m = c / |c| - r / |r|

rewards/chosen = b (c - c0), rewards/rejected = b (r - r0) (simpo: b c / |c|, b r / |r|), and
`sft_weight` adds the chosen completion's mean negative log-likelihood (RPO, LLaMA-Factory's
pref_ftx).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

import sharding
from jaxmllm.config import Config
from jaxmllm.config.sections import PreferenceConfig
from jaxmllm.models import lora, moe
from jaxmllm.step.router import add_microbatch, router_metrics
from jaxmllm.step.trees import overlay

# What a step logs of its pairs, TRL's names: means over the step's pairs
PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


class PairSums(NamedTuple):
    """Per bucket and pair slot [D, K]: the chosen and rejected completions' summed log-probs
    and their token counts (0 for a slot no pair fills)."""

    chosen: jax.Array
    rejected: jax.Array
    chosen_tokens: jax.Array
    rejected_tokens: jax.Array

    @property
    def valid(self) -> jax.Array:
        """Which slots hold a pair, float [D, K]."""
        return (self.chosen_tokens > 0).astype(jnp.float32)


def pair_sums(logps_drl: jax.Array, sequence_drl: jax.Array, mask_drl: jax.Array) -> PairSums:
    """Each bucket's pairs' completion log-prob sums (`llm_sequence` 2k / 2k + 1, masked by the
    loss mask: the completions' tokens only); K = half a bucket's tokens, the most pairs it
    can hold (a pair has at least two tokens)."""
    d = logps_drl.shape[0]
    tokens = logps_drl[0].size
    k = max(tokens // 2, 1)
    seq = jnp.where(sequence_drl >= 0, sequence_drl, 2 * k).reshape(d, -1)
    mask = mask_drl.reshape(d, -1).astype(jnp.float32)
    masked = logps_drl.reshape(d, -1) * mask

    def per_bucket(x, s):
        """One bucket's sums by pair slot [K, 2] (chosen, rejected): `x` summed by sequence id,
        padding (id 2K) dropped."""
        return jax.ops.segment_sum(x, s, num_segments=2 * k + 1)[: 2 * k].reshape(k, 2)

    sums = jax.vmap(per_bucket)(masked, seq)
    counts = jax.vmap(per_bucket)(mask, seq)
    return PairSums(sums[..., 0], sums[..., 1], counts[..., 0], counts[..., 1])


def pair_losses(pref: PreferenceConfig, policy: PairSums, ref: PairSums | None) -> dict:
    """Per pair slot [D, K]: the loss and what the metrics average (`PAIR_METRICS`)."""
    b, e = pref.beta, pref.label_smoothing
    per = lambda x, n: x / jnp.maximum(n, 1.0)
    mean_c = per(policy.chosen, policy.chosen_tokens)
    mean_r = per(policy.rejected, policy.rejected_tokens)
    if pref.loss == "simpo":
        z = b * (mean_c - mean_r) - pref.simpo_gamma
        loss = -(1 - e) * jax.nn.log_sigmoid(z) - e * jax.nn.log_sigmoid(-z)
        chosen_reward, rejected_reward = b * mean_c, b * mean_r
    else:
        chosen_ratio, rejected_ratio = policy.chosen - ref.chosen, policy.rejected - ref.rejected
        chosen_reward, rejected_reward = b * chosen_ratio, b * rejected_ratio
        if pref.loss == "ipo":
            d = per(chosen_ratio, policy.chosen_tokens) - per(
                rejected_ratio, policy.rejected_tokens
            )
            loss = (d - 1 / (2 * b)) ** 2
        else:  # sigmoid
            z = b * (chosen_ratio - rejected_ratio)
            loss = -(1 - e) * jax.nn.log_sigmoid(z) - e * jax.nn.log_sigmoid(-z)
    if pref.sft_weight:
        loss = loss - pref.sft_weight * mean_c
    rewards = lambda x: jax.lax.stop_gradient(x)
    return {
        "loss": loss,
        "rewards/chosen": rewards(chosen_reward),
        "rewards/rejected": rewards(rejected_reward),
        "rewards/margins": rewards(chosen_reward - rejected_reward),
        "rewards/accuracies": rewards((chosen_reward > rejected_reward).astype(jnp.float32)),
        "logps/chosen": rewards(policy.chosen),
        "logps/rejected": rewards(policy.rejected),
    }


def pair_totals(pref: PreferenceConfig, policy: PairSums, ref: PairSums | None) -> dict:
    """`pair_losses` summed over the pairs (slots no pair fills left out): the loss and each
    metric, divided by nothing yet (the step divides by its pair count)."""
    valid = policy.valid
    return {k: jnp.sum(v * valid) for k, v in pair_losses(pref, policy, ref).items()}


# ----------------------------------------------------------------------------- the reference


def compares_reference(cfg: Config) -> bool:
    """Whether the loss compares with a reference policy (simpo is reference-free; GRPO's only
    with a KL term, `rl.kl_beta` > 0)."""
    if cfg.train.objective == "grpo":
        return cfg.rl.kl_beta > 0
    return cfg.train.objective == "dpo" and cfg.preference.loss != "simpo"


def reference_given(cfg: Config) -> bool:
    """Whether the batch brings the reference log-probs (`preference.reference: precomputed`)."""
    return compares_reference(cfg) and cfg.preference.reference == "precomputed"


def uses_reference(cfg: Config) -> bool:
    """Whether the step runs a reference policy (not where its log-probs are precomputed)."""
    return compares_reference(cfg) and cfg.preference.reference != "precomputed"


def given_reference(mb: dict) -> PairSums:
    """The pairs' precomputed reference sums (`llm_reference`: each document's on its first
    token) as PairSums (their token counts are not the reference's to give: 1 each)."""
    seq = mb["llm_sequence"]
    return pair_sums(mb["llm_reference"], seq, (seq >= 0).astype(jnp.float32))


def reference_keeps(cfg: Config, parts) -> Callable[[tuple[str, ...]], bool]:
    """Which parameters (by path) the train state's `reference` holds: with `base`, the
    starting values of what trains, adapters aside (frozen parameters are the policy's own, and
    adapters are switched off); with a checkpoint, every parameter but the adapters."""
    if cfg.preference.reference == "base":
        return lambda path: parts.trains(path) and not lora.is_adapter(path)
    return lambda path: not lora.is_adapter(path)


def reference_weights(params: dict, frozen: dict, reference: dict) -> tuple[dict, dict]:
    """The reference policy's (params, frozen): the policy's with every LoRA adapter's
    `lora_b` zeroed (the adapters switched off: x A B = 0) and the leaves `reference` holds
    (the starting weights of what trains, or a reference checkpoint's) in their place."""

    def off(path, x):
        """`x` zeroed where `path` is a LoRA adapter's (switching the adapter off), else as it
        is."""
        return jnp.zeros_like(x) if lora.is_adapter(sharding.rules.key_parts(path)) else x

    params = jax.tree_util.tree_map_with_path(off, params)
    return overlay(params, reference), overlay(frozen, reference)


# ----------------------------------------------------------------------------- the step


def make_preference_loss_and_grads(cfg: Config, parts, router=None) -> Callable:
    """(params, frozen, batch [M, D, ...], reference) -> (loss, grads, metrics) over every
    microbatch of a step: the mean over the step's pairs of `pair_losses`, each microbatch's
    pairs divided by the step's pair count (`llm_pairs` summed); the reference policy's sums
    computed forward only, before the policy's (no gradient, no residuals kept). An MoE
    decoder's router losses are added as in SFT (`make_loss_and_grads`)."""
    pref = cfg.preference
    with_ref, given = uses_reference(cfg), reference_given(cfg)

    def sums(model, mb):
        """The policy's completion log-prob sums per pair slot on one microbatch, and the router
        statistics (MoE) of that forward."""
        logps, stats = model.token_logps_and_router(mb)
        return pair_sums(logps, mb["llm_sequence"], mb["llm_loss_mask"]), stats

    def loss_fn(params, frozen, mb, ref_sums, denom, m):
        """One microbatch's preference loss, over the step's pairs (`denom`) so microbatches add
        up to the step's mean, plus the router losses a 1/m share each; the pair totals (rewards,
        margins, accuracies) and router statistics beside it."""
        policy, stats = sums(parts.merge(params, frozen), mb)
        totals = pair_totals(pref, policy, ref_sums)
        loss = totals.pop("loss") / denom
        if router is None:
            return loss, (totals, None)
        aux, z = moe.balance_loss(stats), moe.z_loss(stats)
        loss = loss + (router.aux * aux + router.z * z) / m
        return loss, (totals, (stats, aux / m, z / m))

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def loss_and_grads(params, frozen, batch, reference=None):
        """The step's preference loss and gradients over its microbatches (a scan), the
        reference's sums from the reference weights or the batch's precomputed ones; the pair
        totals for the metrics, and the router statistics when the decoder has experts."""
        denom = jnp.maximum(batch["llm_pairs"].sum().astype(jnp.float32), 1.0)
        m = batch["llm_tokens"].shape[0]
        ref_params = None
        if with_ref:
            ref_params = reference_weights(params, frozen, reference or {})

        def microbatch(acc, xs):
            """Adds one microbatch's loss, gradients, pair totals (and router statistics) to the
            running sums; the adapters' dropout salted by its index."""
            mb, i = xs
            ref = given_reference(mb) if given else None
            if ref_params is not None:
                ref = jax.lax.stop_gradient(sums(parts.merge(*ref_params), mb)[0])
            with lora.salted(i):
                (loss, (totals, routed)), grads = grad_fn(params, frozen, mb, ref, denom, m)
            return add_microbatch(acc, (loss, grads, totals), routed), None

        zero_totals = {k: jnp.zeros((), jnp.float32) for k in PAIR_METRICS}
        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params), zero_totals)
        if router is not None:
            first = jax.tree.map(lambda x: x[0], batch)
            ref0 = given_reference(first) if given else None
            if ref_params is not None:
                ref0 = jax.eval_shape(lambda: sums(parts.merge(*ref_params), first)[0])
                ref0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), ref0)
            shapes = jax.eval_shape(lambda: grad_fn(params, frozen, first, ref0, denom, m)[0][1][1])
            zero = (*zero, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
        out, _ = jax.lax.scan(microbatch, zero, (batch, jnp.arange(m)))
        metrics = {k: v / denom for k, v in out[2].items()}
        metrics["pairs"] = denom
        if router is not None:
            metrics.update(router_metrics(router, *out[3]))
        return out[0], out[1], metrics

    return loss_and_grads


def make_preference_eval_step(cfg: Config, parts) -> Callable:
    """(params, frozen, reference, step batch [M, D, ...]) -> the sums over the batch's pairs
    of the loss and each of `PAIR_METRICS`, and the pairs' count, [len(PAIR_METRICS) + 2]
    (forward only: evaluation's means over a whole set are these sums' ratios)."""
    pref, with_ref, given = cfg.preference, uses_reference(cfg), reference_given(cfg)

    def eval_step(params, frozen, reference, batch):
        """Sums over the eval batch's microbatches of the loss, the pair metrics (PAIR_METRICS)
        and the number of pairs, with no gradient: a vector, whole on every process."""
        ref_params = reference_weights(params, frozen, reference) if with_ref else None

        def microbatch(total, mb):
            """Adds one microbatch's loss, pair metrics and pair count to the running sums."""
            logps, _ = parts.merge(params, frozen).token_logps_and_router(mb)
            policy = pair_sums(logps, mb["llm_sequence"], mb["llm_loss_mask"])
            ref = given_reference(mb) if given else None
            if ref_params is not None:
                ref_logps, _ = parts.merge(*ref_params).token_logps_and_router(mb)
                ref = pair_sums(ref_logps, mb["llm_sequence"], mb["llm_loss_mask"])
            totals = pair_totals(pref, policy, ref)
            row = [totals["loss"], *(totals[k] for k in PAIR_METRICS), policy.valid.sum()]
            return total + jnp.stack(row), None

        zero = jnp.zeros(len(PAIR_METRICS) + 2, jnp.float32)
        return jax.lax.scan(microbatch, zero, batch)[0]

    return eval_step


def eval_pair_metrics(sums) -> dict[str, float]:
    """The metrics row of `make_preference_eval_step`'s sums: means over the set's pairs."""
    count = max(float(sums[-1]), 1.0)
    row = {"eval/loss": float(sums[0]) / count, "eval/pairs": float(sums[-1])}
    row.update(
        {f"eval/{k}": float(v) / count for k, v in zip(PAIR_METRICS, sums[1:-1], strict=True)}
    )
    return row
