"""Online RL as an objective of the one step: GRPO's clipped surrogate over packed completions.

A rollout's completions are samples like any other (`jaxmllm.loop.rollouts`): a prompt's group
is one sample of a document per prompt-and-completion, its media encoded once, which the
planner packs into a row of a fixed-shape bucket, and bucketize writes, on every token of a
completion, its advantage (`llm_advantage`: its own in its group, the same on all of its
tokens) and its weight in the step's loss (`llm_weight`: 1 under `rl.loss_aggregation: token`,
1 / the completion's learned tokens under `sequence`). With the target log-probs p of the
fused output projection (no [tokens, vocab] logits), the sampling policy's p_old
(`llm_old_logps` where `llm_old_given`: a rollout trained over more than one step, its
log-probs computed before its first; else p itself, without gradient: the ratio is 1 and its
gradient p's), and A, each learned token's loss is
(p at the sampling temperature: logits / `rl.temperature`, as TRL scores)

    l = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + kl_beta (exp(q - p) - (q - p) - 1),

r = exp(p - p_old), q the reference policy's log-prob (`jaxmllm.step.preference`'s reference:
the starting weights, adapters off, or a checkpoint). The step's loss is sum(w l) / sum(w) over
all its microbatches and devices, so it does not depend on where the planner put a completion:
the mean over the step's completion tokens (`token`) or over its completions of each one's mean
(`sequence`). These are TRL's GRPOTrainer formulas (`_compute_loss`, loss_type bnpo and grpo;
tests/test_grpo.py holds them to it).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxmllm.config import Config
from jaxmllm.models import lora, moe
from jaxmllm.step.preference import reference_weights, uses_reference
from jaxmllm.step.router import add_microbatch, router_metrics

# What a step logs of its completions' tokens: means over the step's learned tokens (TRL's
# clip_ratio/low_mean, high_mean, region_mean; the ratio r; the policy's entropy at the
# sampling temperature, TRL's entropy; the k3 KL where there is a reference)
TOKEN_METRICS = ("rl/clip_low", "rl/clip_high", "rl/clip_region", "rl/ratio", "rl/entropy")


def token_terms(
    cfg: Config, logps: jax.Array, mb: dict, ref_logps: jax.Array | None
) -> tuple[jax.Array, dict]:
    """Each token's loss `l` (the module's docstring) and its metrics' per-token values, on one
    microbatch's target log-probs [D, R, L] (tokens that learn nothing included: the caller
    weighs them by the loss mask)."""
    rl = cfg.rl
    adv = mb["llm_advantage"]
    given = mb["llm_old_given"][:, None, None] > 0  # [D] -> [D, R, L]
    old = jnp.where(given, mb["llm_old_logps"], jax.lax.stop_gradient(logps))
    ratio = jnp.exp(logps - old)
    clipped = jnp.clip(ratio, 1 - rl.clip_low, 1 + rl.clip_high)
    loss = -jnp.minimum(ratio * adv, clipped * adv)
    low = (ratio < 1 - rl.clip_low) & (adv < 0)
    high = (ratio > 1 + rl.clip_high) & (adv > 0)
    terms = {
        "rl/clip_low": low,
        "rl/clip_high": high,
        "rl/clip_region": low | high,
        "rl/ratio": ratio,
    }
    if ref_logps is not None:
        delta = ref_logps - logps
        kl = jnp.exp(delta) - delta - 1
        loss = loss + rl.kl_beta * kl
        terms["rl/kl"] = kl
    stop = lambda x: jax.lax.stop_gradient(x.astype(jnp.float32))
    return loss, {k: stop(v) for k, v in terms.items()}


def make_grpo_loss_and_grads(cfg: Config, parts, router=None) -> Callable:
    """(params, frozen, batch [M, D, ...], reference) -> (loss, grads, metrics) over every
    microbatch of a step: sum(w l) / sum(w) over the step's learned tokens (`token_terms`), each
    microbatch's share divided by the step's sum(w); the reference policy's log-probs computed
    forward only, before the policy's (no gradient, no residuals kept). An MoE decoder's router
    losses are added as in SFT."""
    with_ref = uses_reference(cfg)

    def loss_fn(params, frozen, mb, ref_logps, denom, tokens, m):
        """One microbatch's share of the step's loss, the router losses a 1/m share each; the
        token metrics' sums (over the step's learned tokens: divided by `tokens`) beside it.
        The log-probs at the sampling temperature (the policy that sampled: TRL's logits /
        temperature), with their distributions' entropies (a metric)."""
        model = parts.merge(params, frozen)
        logps, entropy, stats = model.token_logps_entropy_and_router(mb, cfg.rl.temperature)
        mask = mb["llm_loss_mask"].astype(jnp.float32)
        per_token, terms = token_terms(cfg, logps, mb, ref_logps)
        terms["rl/entropy"] = entropy
        loss = jnp.sum(per_token * mask * mb["llm_weight"]) / denom
        sums = {k: jnp.sum(v * mask) / tokens for k, v in terms.items()}
        if router is None:
            return loss, (sums, None)
        aux, z = moe.balance_loss(stats), moe.z_loss(stats)
        loss = loss + (router.aux * aux + router.z * z) / m
        return loss, (sums, (stats, aux / m, z / m))

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def loss_and_grads(params, frozen, batch, reference=None):
        """The step's GRPO loss and gradients over its microbatches (a scan), and its token
        metrics (and the router's when the decoder has experts)."""
        mask = batch["llm_loss_mask"].astype(jnp.float32)
        denom = jnp.maximum(jnp.sum(mask * batch["llm_weight"]), 1e-6)
        tokens = jnp.maximum(jnp.sum(mask), 1.0)
        m = batch["llm_tokens"].shape[0]
        ref_params = reference_weights(params, frozen, reference or {}) if with_ref else None

        def ref_of(mb):
            """The reference policy's target log-probs of `mb` (None without a KL term)."""
            if ref_params is None:
                return None
            model = parts.merge(*ref_params)
            return jax.lax.stop_gradient(model.token_logps_and_router(mb, cfg.rl.temperature)[0])

        def microbatch(acc, xs):
            """Adds one microbatch's loss, gradients and metric sums (and router statistics)
            to the running sums; the adapters' dropout salted by its index."""
            mb, i = xs
            ref = ref_of(mb)
            with lora.salted(i):
                (loss, (sums, routed)), grads = grad_fn(params, frozen, mb, ref, denom, tokens, m)
            return add_microbatch(acc, (loss, grads, sums), routed), None

        names = TOKEN_METRICS + (("rl/kl",) if with_ref else ())
        zero_sums = {k: jnp.zeros((), jnp.float32) for k in names}
        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params), zero_sums)
        if router is not None:  # (the router statistics' shapes: from a trace of one)
            first = jax.tree.map(lambda x: x[0], batch)
            ref0 = None if ref_params is None else jnp.zeros(first["llm_tokens"].shape)
            shapes = jax.eval_shape(lambda: grad_fn(params, frozen, first, ref0, denom, tokens, m))
            zero = (*zero, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[0][1][1]))
        out, _ = jax.lax.scan(microbatch, zero, (batch, jnp.arange(m)))
        metrics = dict(out[2])
        metrics["rl/completion_tokens"] = tokens
        if router is not None:
            metrics.update(router_metrics(router, *out[3]))
        return out[0], out[1], metrics

    return loss_and_grads


def make_logps_program(cfg: Config, parts) -> Callable:
    """(params, frozen, batch [M, D, ...]) -> each token's target log-prob [M, D, R, L] under
    these weights, forward only: a rollout's sampling policy's, kept as `llm_old_logps` for its
    later steps (`llm_old_given`)."""

    def logps(params, frozen, batch):
        """The target log-probs of every microbatch (a scan: one microbatch's activations at a
        time)."""

        def one(_, mb):
            """One microbatch's target log-probs."""
            model = parts.merge(params, frozen)
            return None, model.token_logps_and_router(mb, cfg.rl.temperature)[0]

        return jax.lax.scan(one, None, batch)[1]

    return logps
