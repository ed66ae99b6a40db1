"""Rematerialisation policies by name (`model.remat`, `model.<tower>.remat`): what each block of
a transformer keeps from its forward pass for the backward pass.

A policy is data: the activations it keeps, by the names the blocks tag them with
(`jax.ad_checkpoint.checkpoint_name` in `jaxmllm/models/attention.py` and `layers.py`), and
whether they are kept in device memory or offloaded to the host's. Whatever else the backward
pass needs it recomputes from the block's input. The models build `jax.checkpoint` policies
from this table (`jaxmllm.models.transformer.remat_policy`), the memory bench counts the FLOPs
each recomputes from it (`jaxmllm.bench.memory`), so the two cannot drift apart.

What a block's backward pass needs, per token (d width, f MLP width, q/kv the query and key /
value widths): the query, key and value (q + 2 kv values), the attention kernel's output and
softmax statistics (`attention`: q values and one per head, what a flash-style backward
recomputes the probabilities from; the block-sparse and cuDNN kernels tag them), the attention's
output projection (`attention_out`, d: the residual the MLP's norm reads) and the MLP's input
projections (`mlp_in`: gate and up, 2f, or fc1, f). A policy that keeps q, k, v and
`attention` never reruns the attention's forward pass in the backward; one that does not
recomputes it. No policy keeps the probabilities themselves (a tile of block x block scores
per head), and the dense reference kernel tags nothing: under any policy but `none` it reruns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from jaxmllm.config.checks import ConfigError

log = logging.getLogger("jaxmllm")

# The names the blocks tag their activations with (checkpoint_name), what a policy may keep.
QKV = ("query", "key", "value")  # the attention's projections, after their rotary
ATTENTION = "attention"  # the attention kernel's output and softmax statistics
DOTS = (*QKV, ATTENTION, "attention_out", "mlp_in")  # every matmul's output the backward reads


@dataclass(frozen=True)
class RematPolicy:
    """What a rematerialised block keeps (`names`), where, and what the backward reruns."""

    names: tuple[str, ...]  # the tagged activations kept; the rest is recomputed
    offload: bool = False  # kept in the host's memory (pinned), not the device's
    remat: bool = True  # false: no rematerialisation at all, every activation kept


REMAT_POLICIES = {
    # Every activation kept, nothing recomputed: the most memory (the attention's fp32 scores
    # of every layer too), the fewest FLOPs.
    "none": RematPolicy((), remat=False),
    # Only each block's input: the least memory; the backward reruns the block's forward
    # (all but its last projection, whose output the backward never reads).
    "full": RematPolicy(()),
    # Every matmul's output (q, k, v, the attention kernel's, its output projection, the MLP's
    # input projections): the backward reruns only elementwise ops.
    "save_dots": RematPolicy(DOTS),
    # q, k, v, the attention kernel's output and its output projection: the MLP's input
    # projections (its largest activations, 2 x mlp_dim a token when gated) are recomputed.
    "save_dots_except_mlp": RematPolicy((*QKV, ATTENTION, "attention_out")),
    # q, k, v only: the attention, its output projection and the MLP are recomputed.
    "save_qkv": RematPolicy(QKV),
    # save_dots' activations in the host's memory (GPU: pinned host memory, copied out in the
    # forward and back in the backward pass, overlapped by XLA): the device keeps what full
    # keeps and recomputes what save_dots does. On CPU the host's memory is the device's.
    "offload_dots": RematPolicy(DOTS, offload=True),
}

# `model.remat: true/false` with `model.remat_policy: nothing|dots`, before the names.
LEGACY = {
    (False, "nothing"): "none",
    (False, "dots"): "none",
    (True, "nothing"): "full",
    (True, "dots"): "save_dots",
}
TOWERS = ("vision", "audio", "llm")


def upgrade_legacy(raw: dict, source: str) -> dict:
    """A `model` section written before the policies had names, as it reads now: `remat: true`
    (+ `remat_policy: nothing | dots`) becomes `remat: full | save_dots`, `remat: false`
    becomes `none` (logged, with what to write instead). Runs' config.json files written then
    read back the same way, so their checkpoints resume and generate."""
    remat, policy = raw.get("remat"), raw.get("remat_policy")
    for tower in TOWERS:
        value = raw.get(tower, {}).get("remat") if isinstance(raw.get(tower), dict) else None
        if isinstance(value, bool):
            raise ConfigError(
                f"{source}: model.{tower}.remat: {str(value).lower()} is not a policy; write "
                f"model.{tower}.remat: {'full' if value else 'none'} (one of "
                f"{', '.join(REMAT_POLICIES)})"
            )
    if not isinstance(remat, bool) and policy is None:
        return raw
    if not isinstance(remat, bool | None):
        raise ConfigError(
            f"{source}: model.remat_policy is gone; its choices are model.remat's names now "
            f"(write model.remat: {'save_dots' if policy == 'dots' else 'full'} alone)"
        )
    name = LEGACY.get((bool(remat), policy or "nothing"))
    if name is None:
        raise ConfigError(
            f"{source}: model.remat_policy: {policy!r} is not one of nothing, dots; write "
            f"model.remat: one of {', '.join(REMAT_POLICIES)} instead"
        )
    old = f"remat: {str(bool(remat)).lower()}" + (f", remat_policy: {policy}" if policy else "")
    log.warning("%s: model.{%s} is read as model.remat: %s; write that instead", source, old, name)
    return {**{k: v for k, v in raw.items() if k != "remat_policy"}, "remat": name}
