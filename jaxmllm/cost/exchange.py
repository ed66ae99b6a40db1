"""What a context group's exchange moves, from the shapes: the bytes a rank sends over the
`context` axis per layer and microbatch under each `mesh.context_strategy`
(`jaxmllm.models.context`), and what a step's exchange costs against its compute.

gather: each attention layer all-gathers the group's keys and values ((C - 1) of a rank's own,
each) with the segment ids and positions (int32); backward, their gradients are
reduce-scattered (as much again). ulysses: q, k, v and the output are all-to-all'd ((C - 1) / C
of a rank's each; KV heads repeated to lcm(kv, C) where C does not divide them), forward, and
their transposes backward; the ids and positions gathered as gather's, and the tile lists. A
Gated DeltaNet layer under ulysses all-to-alls its fused projection, beta's and the decay's
logits and its output each way (gather cannot run it). `python -m jaxmllm.bench.context --bytes`
holds these to the collectives of XLA's compiled programs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxmllm.config.decoder import LinearConfig, LLMConfig

# What a byte a rank sends over its group's links costs, in the FLOPs the rank could have
# computed meanwhile: an H100 SXM's dense bfloat16 989 TFLOP/s over NVLink's 450 GB/s a
# direction (~2,200; an A100's 312 TFLOP/s over 300 GB/s: ~1,000). The exchange is priced as if
# it never overlapped compute: an upper bound (XLA overlaps what it can), so a choice that pays
# it (`jaxmllm.resolve.degree`) is made only where it pays for itself on this price.
FLOPS_PER_BYTE = 2200.0


def attention_bytes(
    tokens: int, ranks: int, heads: int, kv: int, head_dim: int, itemsize: int, tiles: int = 0
) -> dict[str, dict[str, int]]:
    """Per strategy, a rank's bytes over the context axis for one attention layer (forward and
    backward) of `tokens` tokens a rank, and the extra memory it holds ("held"), from the
    shapes (`tiles`: a rank's tile list, which ulysses gathers)."""
    c, t, e, b = ranks, tokens, head_dim, itemsize
    ints = 2 * (c - 1) * t * 4  # (segment ids and positions, gathered once a layer)
    kv_bytes = 2 * (c - 1) * t * kv * e * b
    gather = {"forward": kv_bytes + ints, "backward": kv_bytes, "held": kv_bytes}
    kv_u = math.lcm(kv, c) if kv % c else kv
    moved = (c - 1) * t * e * b * (2 * heads + 2 * kv_u) // c
    listed = (c - 1) * tiles * 2 * 4
    ulysses = {
        "forward": moved + ints + listed,
        "backward": moved,
        "held": 2 * t * (kv_u - kv) * e * b,
    }
    return {"gather": gather, "ulysses": ulysses}


def linear_bytes(tokens: int, ranks: int, linear: LinearConfig, itemsize: int) -> int:
    """A Gated DeltaNet layer's bytes a rank sends under ulysses, forward and backward: the
    fused projection [T, 2 key heads x key dim + value heads x value dim], beta's and the
    decay's logits [T, value heads], the outputs [T, value heads, value dim] all-to-all'd each
    way, and the segment ids and positions gathered (int32) for the order."""
    kh, vh, dk, dv = linear.key_heads, linear.value_heads, linear.key_dim, linear.value_dim
    per_token = (2 * kh * dk + vh * dv) + 2 * vh + vh * dv
    moved = (ranks - 1) * tokens * per_token * itemsize // ranks
    return 2 * moved + 2 * (ranks - 1) * tokens * 4


def step_bytes(lm: LLMConfig, strategy: str, tokens: int, ranks: int, itemsize: int) -> int:
    """A rank's bytes over the context axis in one microbatch of `tokens` tokens a rank, forward
    and backward, every decoder layer (each attention layer at its own heads: Gemma 4's
    full-attention layers' own head width and KV heads; a Gated DeltaNet layer's
    `linear_bytes`). 0 for a group of one."""
    if ranks <= 1:
        return 0
    total = 0
    for i in range(lm.depth):
        kind = lm.layer_kind(i)
        if kind.linear:
            total += linear_bytes(tokens, ranks, lm.linear, itemsize)
            continue
        own = not kind.sliding and lm.window.enabled  # (a full layer beside windowed ones)
        head = (own and lm.full_head_dim) or lm.head_width
        kv = (own and lm.full_kv_heads) or lm.kv_heads
        moved = attention_bytes(tokens, ranks, lm.heads, kv, head, itemsize)[strategy]
        total += moved["forward"] + moved["backward"]
    return total
