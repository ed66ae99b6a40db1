"""A mixture-of-experts decoder's router losses and metrics in a step: what the SFT and the
preference objectives add alike (`jaxmllm.step.program`, `jaxmllm.step.preference`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmllm.config import Config


@dataclasses.dataclass(frozen=True)
class RouterLoss:
    """A mixture-of-experts decoder's router losses (`model.llm.moe`): their coefficients and
    the decoder layers they come from (for the per-layer load in the metrics)."""

    aux: float  # moe.aux_loss_coef: the load-balancing loss's weight
    z: float  # moe.z_loss_coef
    layers: tuple[int, ...]  # the MoE layers, in order

    @classmethod
    def of(cls, cfg: Config) -> RouterLoss | None:
        """The router losses of `cfg`'s decoder, or None when it has no mixture of experts."""
        llm = cfg.model.llm
        if not llm.moe.enabled:
            return None
        return cls(llm.moe.aux_loss_coef, llm.moe.z_loss_coef, llm.moe_layers)


def add_microbatch(acc: tuple, sums: tuple, routed) -> tuple:
    """The running sums of a step's scan over microbatches after one more: `sums` (the loss,
    the gradients, an objective's totals) added to the first of `acc`, and the microbatch's
    router statistics and losses (an MoE decoder's; None for a dense one) to its last (the
    busiest device's rows summed too: the metrics' ratio is then over the step)."""
    total = jax.tree.map(jnp.add, acc[: len(sums)], sums)
    return total if routed is None else (*total, jax.tree.map(jnp.add, acc[-1], routed))


def router_metrics(router: RouterLoss, stats, aux, z) -> dict:
    """A step's MoE metrics: the load-balancing and z losses (unscaled), each MoE layer's
    experts' load (the most assignments of an expert over the mean), the rows the busiest
    device received over the mean, the share of assignments sent to another device's
    experts, and the assignments dropped by a capacity (0 when dropless)."""
    counts = stats.counts  # [layers, E]
    load = counts.max(-1) / jnp.maximum(counts.mean(-1), 1e-9)
    out = {
        "moe/aux_loss": aux,
        "moe/z_loss": z,
        "moe/load_max_mean": load.mean(),
        "moe/load_max_mean_worst": load.max(),
        "moe/recv_max_mean": jnp.mean(stats.recv_max / jnp.maximum(stats.recv_mean, 1e-9)),
        "moe/sent_remote_share": stats.sent_remote.sum() / jnp.maximum(counts.sum(), 1.0),
        "moe/dropped": stats.dropped.sum(),
    }
    for j, layer in enumerate(router.layers):
        out[f"moe/load_max_mean/layer_{layer}"] = load[j]
    return out
