"""The LM loss: masked cross entropy of the output projection, fused with its own gradient.

A 152k vocabulary makes the logits the largest array of a step (fp32 [tokens, vocab]: ~5 GB a
GPU and microbatch for the 2B recipe). Here they exist one slice of tokens at a time, and once:
the forward pass projects a slice (compute-dtype operands, fp32 accumulation), takes its
log-sum-exp and target logit, and, when a gradient is wanted, turns the slice at once into the
gradient of its logits, `(softmax - onehot) * mask`, cast to the compute dtype, and multiplies
that back with the projection and the hidden states (compute-dtype operands again): the
backward pass then only scales what the forward pass left (the hidden states' and the
projection's gradients) by the loss's cotangent. So a step projects the logits once (not again
in a rematerialised backward), never multiplies fp32 matrices under bf16 compute, and never
scatters into the logits (the target's one-hot is a compare with the vocabulary's iota, not the
gradient of a gather). This is Liger-Kernel's fused linear cross entropy, written for XLA;
the softmax statistics, the loss sum and the projection's gradient stay in fp32.

Vocab-parallel (`jaxmllm.models.vocab`): the projection split by vocabulary over the model
axes, each device projects its group's tokens (expert x fsdp) onto its vocabulary shard; the
softmax's max, normaliser and target logit are reduced over the shards (Megatron's
vocab-parallel cross entropy), the hidden states' gradient summed over the shards back to the
tokens' owners, the projection's over the data groups that share a shard.

The gradient is computed only for what is differentiated (`jax.custom_vjp`'s symbolic zeros):
a frozen output projection gets none and costs no matmul; evaluation (no gradient at all)
projects once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.sharding import PartitionSpec as P

from jaxmllm.models.vocab import gather_group, group_axes, scatter_group
from sharding import DATA_AXES, varying_as


@dataclasses.dataclass(frozen=True)
class Head:
    """How the logits come from hidden states h: `h . weight / divisor`, soft-capped to
    softcap x tanh(. / softcap) where `softcap` is set."""

    rows_first: bool  # weight is the tied table [vocab, width], else the head [width, vocab]
    divisor: float
    axes: tuple[str, ...] = ()  # the model axes the vocabulary is split over (vocab_axes)
    dtype: Any = jnp.float32  # the compute dtype: the matmuls' operands
    softcap: float = 0.0  # (Gemma's final_logit_softcapping; 0: none)

    def project(self, h_xw: jax.Array, w: jax.Array) -> jax.Array:
        """fp32 logits [..., vocab shard] of hidden states [..., width]."""
        eq = "...w,vw->...v" if self.rows_first else "...w,wv->...v"
        raw = jnp.einsum(eq, h_xw, w, preferred_element_type=jnp.float32) / self.divisor
        return self.softcap * jnp.tanh(raw / self.softcap) if self.softcap else raw

    def capped_grad(self, g_xv: jax.Array, logits_xv: jax.Array) -> jax.Array:
        """A gradient by the soft-capped logits as one by the uncapped ones: times
        1 - tanh^2, tanh = logits / softcap (the gradient itself without a cap)."""
        if not self.softcap:
            return g_xv
        return g_xv * (1.0 - jnp.square(logits_xv / self.softcap))

    def back(self, g_xv: jax.Array, w: jax.Array) -> jax.Array:
        """The hidden states' gradient [..., width] (fp32) of a logits gradient [..., vocab]."""
        eq = "...v,vw->...w" if self.rows_first else "...v,wv->...w"
        return jnp.einsum(eq, g_xv, w, preferred_element_type=jnp.float32)

    def weight_grad(self, h_xw: jax.Array, g_xv: jax.Array) -> jax.Array:
        """The projection's gradient (fp32, the weight's layout) over every leading index."""
        eq = "...w,...v->vw" if self.rows_first else "...w,...v->wv"
        return jnp.einsum(eq, h_xw, g_xv, preferred_element_type=jnp.float32)


def loss_sum(
    weight: jax.Array,
    h_cdnw: jax.Array,
    targets_cdn: jax.Array,
    mask_cdn: jax.Array,
    head: Head,
) -> jax.Array:
    """The fp32 sum of cross entropy x mask over every token of every slice.

    Args:
      weight: the output projection as `head` says (the parameter itself, any dtype: it is
        cast to the compute dtype for the matmuls, and its gradient returned in its own dtype).
      h_cdnw: hidden states [C, D, chunk, width]: C slices of every bucket's tokens; D leads
        the bucket axis, split over the data axes under a mesh.
      targets_cdn: target ids [C, D, chunk]; mask_cdn: float weights [C, D, chunk].
      head: the projection's layout, divisor, vocabulary axes and compute dtype.
    """
    return _loss_sum(weight, h_cdnw, targets_cdn, mask_cdn, head)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _loss_sum(weight, h_cdnw, targets_cdn, mask_cdn, head):
    total, _, _ = _run(head, weight, h_cdnw, targets_cdn, mask_cdn, False, False)
    return total


def _fwd(weight, h_cdnw, targets_cdn, mask_cdn, head):
    want_w, want_h = weight.perturbed, h_cdnw.perturbed
    w, h = weight.value, h_cdnw.value
    total, dw, dh = _run(head, w, h, targets_cdn.value, mask_cdn.value, want_w, want_h)
    dw = None if dw is None else dw.astype(w.dtype)
    return total, (dw, dh)


def _bwd(head, residuals, g):
    dw, dh = residuals
    if isinstance(g, SymbolicZero):
        return None, None, None, None
    scale = lambda x: None if x is None else (g * x.astype(jnp.float32)).astype(x.dtype)
    return scale(dw), scale(dh), None, None


_loss_sum.defvjp(_fwd, _bwd, symbolic_zeros=True)


def token_logps(weight: jax.Array, h_cdnw: jax.Array, targets_cdn: jax.Array, head: Head):
    """The fp32 log-probability of each token's target, [C, D, chunk]: what a preference or
    RL loss sums per sequence and weighs per token.

    The same slices as `loss_sum`, with no [tokens, vocab] logits held: the forward pass
    projects each slice and keeps its log-sum-exp and target logit only; the backward pass,
    given each token's cotangent g (how the objective weighs that log-prob), projects the
    slices again and computes the gradients of sum g x logp exactly as `loss_sum` does those
    of a masked sum (the mask being -g). A weight that depends on every sequence's sum (DPO's
    sigmoid of a pair's margin) is known only after the forward pass, so the projection is
    computed twice, where the SFT loss computes it once.
    """
    return _token_logps(weight, h_cdnw, targets_cdn, head, False)


def token_logps_and_entropy(
    weight: jax.Array, h_cdnw: jax.Array, targets_cdn: jax.Array, head: Head
) -> tuple[jax.Array, jax.Array]:
    """`token_logps`, and each token's entropy of its whole next-token distribution [C, D,
    chunk] (fp32, nats): log-sum-exp minus the expected logit, summed over the vocabulary in
    the same pass, slice by slice, as the log-sum-exp (what RL logs of its policy: TRL's
    `entropy`). The entropy is a metric: no gradient flows through it."""
    logps, entropy = _token_logps(weight, h_cdnw, targets_cdn, head, True)
    return logps, jax.lax.stop_gradient(entropy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _token_logps(weight, h_cdnw, targets_cdn, head, entropy):
    ones = jnp.ones(targets_cdn.shape, jnp.float32)
    _, _, out = _run(head, weight, h_cdnw, targets_cdn, ones, False, False, _per_token(entropy))
    return _logps_out(out, entropy)


def _per_token(entropy: bool) -> int:
    """How many per-token values `_run` returns: the cross entropy, and the entropy."""
    return 2 if entropy else 1


def _logps_out(out: jax.Array, entropy: bool):
    """The log-probs (and entropies) of `_run`'s per-token values."""
    return (-out[..., 0], out[..., 1]) if entropy else -out[..., 0]


def _logps_fwd(weight, h_cdnw, targets_cdn, head, entropy):
    w, h, t = weight.value, h_cdnw.value, targets_cdn.value
    ones = jnp.ones(t.shape, jnp.float32)
    _, _, out = _run(head, w, h, t, ones, False, False, _per_token(entropy))
    return _logps_out(out, entropy), (w, h, t, weight.perturbed, h_cdnw.perturbed)


def _logps_bwd(head, entropy, residuals, g):
    w, h, t, want_w, want_h = residuals
    g = g[0] if entropy else g  # (the entropy's cotangent is dropped: a metric)
    if isinstance(g, SymbolicZero) or not (want_w or want_h):
        return None, None, None
    # d(sum g logp) = d(sum (-g) nll): the masked sum's gradients with -g for the mask
    _, dw, dh = _run(head, w, h, t, -g.astype(jnp.float32), want_w, want_h)
    return (None if dw is None else dw.astype(w.dtype)), dh, None


_token_logps.defvjp(_logps_fwd, _logps_bwd, symbolic_zeros=True)


def _run(
    head: Head, weight, h_cdnw, targets_cdn, mask_cdn, want_w: bool, want_h: bool, per_token=0
):
    """(loss sum, the projection's gradient or None, the hidden states' or None), unscaled;
    `per_token` (no gradient wanted) 1 or 2: for the last, each token's cross entropy (and
    its distribution's entropy) [C, D, chunk, per_token]."""
    if not head.axes:
        return _scan(
            head, weight, h_cdnw, targets_cdn, mask_cdn, want_w, want_h, _Local(), per_token
        )
    mesh = jax.sharding.get_abstract_mesh()
    data = tuple(a for a in DATA_AXES if a in mesh.axis_names)
    spec = P(head.axes, None) if head.rows_first else P(None, head.axes)
    weight = jax.lax.with_sharding_constraint(weight, spec)
    batch = P(None, data)
    # Devices of one data group (other data / fsdp-outside-the-vocab positions) hold the same
    # vocabulary shard: its gradient sums over them.
    shared = tuple(a for a in data if a not in head.axes)

    def body(w_l, h_l, t_l, m_l):
        split = _Split(head.axes, w_l.shape[0] if head.rows_first else w_l.shape[1])
        total, dw, dh = _scan(head, w_l, h_l, t_l, m_l, want_w, want_h, split, per_token)
        total = jax.lax.psum(total, data)
        if dw is not None and shared:
            dw = jax.lax.psum(dw, shared)
        return total, dw, dh

    out_specs = (P(), spec if want_w else None, batch if want_h or per_token else None)
    # (check_vma off: nothing differentiates through this map, the custom VJP stands in; its
    # results vary over the enclosing map's axes, a pipeline stage's, as its inputs do)
    out = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(spec, batch, batch, batch),
        out_specs=out_specs,
        check_vma=False,
    )(weight, h_cdnw, targets_cdn, mask_cdn)
    return varying_as(out, weight, h_cdnw, targets_cdn, mask_cdn)


class _Local:
    """The whole vocabulary on hand: the reductions over vocabulary shards are no-ops."""

    first = 0

    def group(self, x):  # the tokens this device projects: its own
        return x

    def max(self, x):
        return x

    def sum(self, x):
        return x

    def own(self, x):  # the group's per-token values -> this device's tokens'
        return x

    def own_sum(self, x):  # per-token partial sums over vocabulary shards -> this device's
        return x


@dataclasses.dataclass(frozen=True)
class _Split:
    """A vocabulary shard per device of the model axes (inside their shard_map): the group's
    tokens (`expert` x `fsdp`: `models.vocab.GROUP_AXES`) are projected onto this device's
    `cols` vocabulary columns."""

    axes: tuple[str, ...]
    cols: int

    @property
    def first(self):
        return jax.lax.axis_index(self.axes) * self.cols

    def group(self, x):
        return gather_group(x, self.axes)

    def max(self, x):
        return jax.lax.pmax(x, self.axes)

    def sum(self, x):
        return jax.lax.psum(x, self.axes)

    def own(self, x):
        group = group_axes(self.axes)
        if not group:
            return x
        own = x.shape[0] // jax.lax.axis_size(group)
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(group) * own, own, axis=0)

    def own_sum(self, x):
        if "tensor" in self.axes:
            x = jax.lax.psum(x, "tensor")
        return scatter_group(x, self.axes)


def _scan(head: Head, weight, h_cdnw, targets_cdn, mask_cdn, want_w, want_h, vocab, per_token):
    """The slices one after another: the loss sum and the wanted gradients, unscaled (or,
    `per_token`, each token's cross entropy, and with 2 its distribution's entropy, [..., k] in
    the gradient's place)."""
    w = weight.astype(head.dtype)
    cols = w.shape[0] if head.rows_first else w.shape[1]
    want = want_w or want_h

    def one(carry, xs):
        total, dw = carry
        h_dcw, t_dc, m_dc = xs
        h_g = vocab.group(h_dcw.astype(head.dtype))  # [G, chunk, width]
        local = vocab.group(t_dc) - vocab.first
        logits = head.project(h_g, w)  # [G, chunk, cols] fp32
        top = vocab.max(logits.max(-1))
        norm = vocab.sum(jnp.exp(logits - top[..., None]).sum(-1))
        lse = top + jnp.log(norm)
        inside = (local >= 0) & (local < cols)
        picked = jnp.take_along_axis(logits, jnp.clip(local, 0, cols - 1)[..., None], -1)
        target = vocab.sum(jnp.where(inside, picked[..., 0], 0.0))
        mask = m_dc.astype(jnp.float32)
        nll = vocab.own(lse - target)
        total = total + jnp.sum(nll * mask)
        if not want:
            if not per_token:
                return (total, dw), None
            if per_token == 1:
                return (total, dw), nll[..., None]
            # entropy = lse - E[logit]: the expected logit summed over the vocabulary shards
            expected = vocab.sum(jnp.sum(jnp.exp(logits - lse[..., None]) * logits, -1))
            return (total, dw), jnp.stack([nll, vocab.own(lse - expected)], -1)
        # d loss / d logits, this device's columns of every group token: softmax - onehot
        onehot = jnp.arange(cols) == local[..., None]
        scale = (vocab.group(mask) / head.divisor)[..., None]
        g = head.capped_grad((jnp.exp(logits - lse[..., None]) - onehot) * scale, logits)
        g = g.astype(head.dtype)
        dh = vocab.own_sum(head.back(g, w)).astype(h_dcw.dtype) if want_h else None
        if want_w:
            dw = dw + head.weight_grad(h_g, g)
        return (total, dw), dh

    zeros = lambda shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
    # (the carries start as varying as the sums the body adds to them: a pipeline stage's)
    init = varying_as((zeros(()), zeros(weight.shape if want_w else ())), h_cdnw, w)
    (total, dw), dh = jax.lax.scan(one, init, (h_cdnw, targets_cdn, mask_cdn))
    return total, (dw if want_w else None), dh
