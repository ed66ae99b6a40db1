"""Gated DeltaNet linear attention over packed rows (Qwen3.5's `linear_attention` layers).

Each value head keeps a state S [key dim, value dim] that every token decays and corrects by the
gated delta rule (Yang et al., "Gated Delta Networks", 2024):

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

with q, k L2-normalised (q also scaled by key_dim^-1/2), beta in (0, 1) a token's write
strength and g <= 0 its log decay. A key head serves `value_heads / key_heads` consecutive value
heads (grouped as attention's kv heads are).

**Chunked form.** Token by token the rule is T sequential rank-one updates. Over chunks of C
tokens (`chunked_delta_rule`) the updates inside a chunk are solved at once: a unit
lower-triangular C x C system (the UT transform) turns the chunk's values and keys into
corrections u and decayed keys w, the chunk's outputs are its own causal attention (C x C
matmuls) plus its queries reading the state it started with, and the state moves on by one
[key dim, value dim] update a chunk: a `lax.scan` of T / C steps. Work is linear in T (C x C
per chunk, and the state's d_k x d_v), memory too: the kernel runs under `jax.checkpoint`
keeping only its inputs for the backward pass (as flash-linear-attention keeps q, k, v, g, beta
and recomputes the chunk states), so a step holds one layer's chunk states and C x C matrices
at a time, never a layer's for every layer. C = 64 as transformers and flash-linear-attention
use: the triangular inverse's C^3 a chunk (C^2 a token) against T / C sequential scan steps.

**Packed rows.** A row holds several documents; the state and the convolution's window restart
at each (`document_starts`: a new segment id, or a row's first token), so a document's outputs
are those it has alone. Inside a chunk, pairs of tokens of two documents are masked out of the
UT system and the chunk's attention, the state read is masked to the tokens still in the
document the chunk started in, and the state carried to the next chunk holds only the last
document's tokens. The mask is exact: no large negative decay stands in for a restart.

**Precision.** The state, decays, norms and the triangular inverse are float32 (the inverse
by products and sums, as exact on a GPU as on a CPU: flash-linear-attention keeps it in IEEE
float32 too); under bf16 compute the matmuls take bf16 operands with float32 accumulation, the
state cast to bf16 where it is multiplied, kept float32 where it accumulates.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmllm.models import context as ctx
from jaxmllm.models.layers import Dense, param_key
from jaxmllm.models.lora import Adapter

L2_EPS = 1e-6  # transformers' and flash-linear-attention's l2norm epsilon


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    """A Gated DeltaNet layer's sizes (`config.decoder.LinearConfig`)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int = 4
    chunk: int = 64

    @classmethod
    def of(cls, cfg) -> LinearSpec:
        return cls(
            cfg.key_heads, cfg.value_heads, cfg.key_dim, cfg.value_dim, cfg.conv_width, cfg.chunk
        )

    @property
    def group(self) -> int:
        """A key head's channels of the fused projection: its query, key and values."""
        return 2 * self.key_dim + self.value_heads // self.key_heads * self.value_dim


def document_starts(segment_ids_bt: jax.Array, row: int = 0) -> jax.Array:
    """Where a document begins in packed rows [B, T]: a token whose segment id differs from
    the one before it, or the first of a row (`row`: tokens a row, when a device's rows are
    laid end to end in one; 0: each of the T is one row). Padding (segment 0) after a
    document is a document of its own, whose outputs nothing reads."""
    t = segment_ids_bt.shape[-1]
    first = jnp.arange(t) % (row or t) == 0
    changed = jnp.concatenate(
        [
            jnp.ones_like(segment_ids_bt[..., :1], bool),
            segment_ids_bt[..., 1:] != segment_ids_bt[..., :-1],
        ],
        axis=-1,
    )
    return changed | first


def since_start(starts_bt: jax.Array) -> jax.Array:
    """Each token's index within its document [B, T] (0 at a start)."""
    t = jnp.arange(starts_bt.shape[-1])
    return t - jax.lax.cummax(jnp.where(starts_bt, t, 0), axis=starts_bt.ndim - 1)


def causal_conv(x_btc: jax.Array, kernel_kc: jax.Array, starts_bt: jax.Array) -> jax.Array:
    """Depthwise causal convolution within documents, float32: out[t] = sum_j kernel[K-1-j] *
    x[t-j] over the j < K tokens of t's document up to t (transformers' conv1d with K - 1
    zeros of left padding, restarted at each document). x [B, T, ...channels], kernel [K,
    ...channels]."""
    width = kernel_kc.shape[0]
    offset = since_start(starts_bt)
    x32 = x_btc.astype(jnp.float32)
    out = jnp.zeros_like(x32)
    for j in range(width):
        shifted = jnp.pad(x32, [(0, 0), (j, 0)] + [(0, 0)] * (x32.ndim - 2))[:, : x32.shape[1]]
        inside = (offset >= j).reshape(offset.shape + (1,) * (x32.ndim - 2))
        out = out + jnp.where(inside, shifted, 0.0) * kernel_kc[width - 1 - j].astype(jnp.float32)
    return out


def l2_normalised(x: jax.Array) -> jax.Array:
    """x / sqrt(sum x^2 + eps) over the last axis, float32 (transformers' l2norm)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + L2_EPS)


def _dot(spec: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """einsum `spec` ("x,y->z") of operands cast to the compute dtype, float32 out; under bf16
    its backward's matmuls take bf16 operands too (the cotangent cast), as XLA's transpose of
    a float32-output dot would multiply float32 x float32."""
    if jnp.dtype(dtype) == jnp.float32:
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
    return _mixed_dot(spec, jnp.dtype(dtype), a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mixed_dot(spec, dtype, a, b):
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def _mixed_fwd(spec, dtype, a, b):
    return _mixed_dot(spec, dtype, a, b), (a, b)


def _mixed_bwd(spec, dtype, res, g):
    a, b = res
    ins, out = spec.split("->")
    x, y = ins.split(",")
    g = g.astype(dtype)
    da = jnp.einsum(f"{out},{y}->{x}", g, b.astype(dtype), preferred_element_type=jnp.float32)
    db = jnp.einsum(f"{x},{out}->{y}", a.astype(dtype), g, preferred_element_type=jnp.float32)
    return da.astype(a.dtype), db.astype(b.dtype)


_mixed_dot.defvjp(_mixed_fwd, _mixed_bwd)


def unit_lower_inverse(lower: jax.Array, dtype) -> jax.Array:
    """(I + lower)^-1 of strictly lower-triangular matrices [..., C, C] (C a power of two),
    float32; its backward, -T^T dT T^T, by matmuls in the compute dtype (`_dot`)."""
    return _inverse(jnp.dtype(dtype), lower)


def _product(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b of float32 blocks [..., s, s] as products and a sum: exact float32 on every
    backend (a float32 dot may run as TF32 on a GPU), and no dot of float32 operands."""
    return jnp.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _inverse(dtype, lower):
    # Doubling, as flash-linear-attention merges its inverted 16 x 16 blocks (in float32):
    # the inverse of [[A, 0], [L, D]] is [[A^-1, 0], [-D^-1 L A^-1, D^-1]], from the inverses
    # of blocks of 1 (ones) to the whole C. (A triangular solve is XLA:CPU's LAPACK custom
    # call, which parallelises its batch over XLA's thread pool and waits for it: two of them
    # running at once on a two-thread pool wait for each other forever.)
    c = lower.shape[-1]
    assert c & (c - 1) == 0, f"{c}: the chunk must be a power of two"
    lead = lower.shape[:-2]
    inverse = jnp.ones((*lead, c, 1, 1), jnp.float32)  # [..., blocks, s, s]
    s = 1
    while s < c:
        n = c // (2 * s)
        pairs = lower.reshape(*lead, n, 2 * s, n, 2 * s)
        diagonal = jnp.einsum("...iaib->...iab", pairs)  # each pair's [2s, 2s] block
        below = diagonal[..., s:, :s]
        first, second = (inverse.reshape(*lead, n, 2, s, s)[..., j, :, :] for j in (0, 1))
        off = -_product(_product(second, below), first)
        top = jnp.concatenate([first, jnp.zeros_like(first)], axis=-1)
        inverse = jnp.concatenate([top, jnp.concatenate([off, second], axis=-1)], axis=-2)
        s *= 2
    return inverse[..., 0, :, :]


def _inverse_fwd(dtype, lower):
    inverse = _inverse(dtype, lower)
    return inverse, inverse


def _inverse_bwd(dtype, inverse, g):
    # d(A^-1) = -A^-1 dA A^-1, so dA = -A^-T g A^-T, on A's strictly lower entries
    left = _dot("...ji,...jk->...ik", inverse, g, dtype)
    grad = -_dot("...ik,...lk->...il", left, inverse, dtype)
    return (jnp.tril(grad, -1),)


_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def chunked_delta_rule(
    q_btkd: jax.Array,
    k_btkd: jax.Array,
    v_btkrv: jax.Array,
    g_btkr: jax.Array,
    beta_btkr: jax.Array,
    starts_bt: jax.Array,
    *,
    chunk: int = 64,
    dtype=jnp.float32,
    final_state: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The gated delta rule over packed rows, a chunk of tokens at a time (module docstring).

    Args:
      q_btkd, k_btkd: queries and keys [B, T, key heads, key dim], normalised and scaled.
      v_btkrv: values [B, T, key heads, value heads a key head, value dim].
      g_btkr: log decays <= 0 [B, T, key heads, value heads a key head], float32.
      beta_btkr: write strengths in (0, 1), same shape, float32.
      starts_bt: where documents begin (`document_starts`) [B, T].
      chunk: C, tokens a chunk.
      dtype: the matmuls' operand dtype (the compute dtype).
      final_state: return the state after the last token too (a prompt's, for decoding:
        tokens with g = 0 and beta = 0 after it leave it as it is).

    Returns:
      Outputs [B, T, key heads, value heads a key head, value dim] in `dtype` (and the final
      state [B, key heads, value heads a key head, key dim, value dim] float32).
    """
    args = (q_btkd, k_btkd, v_btkrv, g_btkr, beta_btkr, starts_bt)
    out, state = _chunked(*args, chunk, jnp.dtype(dtype))
    return (out, state) if final_state else out


GROUP = 8  # at most this many chunks a step of the outer scan (each step rematerialised)


def _chunked(q, k, v, g, beta, starts, chunk, dtype):
    """The chunked rule: a scan over groups of `group` chunks (the largest divisor of the
    chunk count up to GROUP), each group's intra-chunk work vectorised, then its chunks'
    states in order; each group's step rematerialised in the backward pass, so the pass keeps
    one state a group and holds one group's C x C matrices at a time."""
    b, t = starts.shape
    pad = -t % chunk
    if pad:  # (tokens past the row: no decay, no write: the state passes them unchanged)
        width = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
        q, k, v, g, beta, starts = (jnp.pad(x, width(x)) for x in (q, k, v, g, beta, starts))
    n = (t + pad) // chunk
    group = max(d for d in range(1, min(GROUP, n) + 1) if n % d == 0)
    # [groups, group, B, C, ...]: groups lead, for the scan
    cut = lambda x: jnp.moveaxis(x.reshape(b, n // group, group, chunk, *x.shape[2:]), 0, 2)
    xs = tuple(map(cut, (q, k, v, g, beta, starts)))

    def step(state, xs):  # one group: state [B, k, r, d, v] float32
        return _group(state, *xs, dtype=dtype)

    step = jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable)
    kh, r, d, dv = *g.shape[-2:], q.shape[-1], v.shape[-1]
    state = jnp.zeros((b, kh, r, d, dv), jnp.float32)
    state, out = jax.lax.scan(step, state, xs)  # [groups, group, B, k, r, C, v]
    out = jnp.moveaxis(out.reshape(n, b, kh, r, chunk, dv), 0, 1)  # [B, n, k, r, C, v]
    return jnp.moveaxis(out, 4, 2).reshape(b, n * chunk, kh, r, dv)[:, :t], state


def _group(state, q, k, v, g, beta, starts, *, dtype):
    """A group's chunks [n, B, C, ...] from the state before them: (the state after, their
    outputs [n, B, k, r, C, v])."""
    chunk = starts.shape[-1]
    doc = jnp.cumsum(starts.astype(jnp.int32), axis=-1)  # a token's document within its chunk
    carried = doc == 0  # [n, B, C]: still in the document the chunk's state belongs to
    same = doc[..., :, None] == doc[..., None, :]  # [n, B, C, C]
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    keep = same & causal  # (i, j): j at or before i, in i's document
    cum = jnp.cumsum(g, axis=2)  # [n, B, C, k, r]: log decay from the chunk's start
    # decay from j to i: exp(cum_i - cum_j) where kept (the double where keeps gradients finite)
    diff = cum[:, :, :, None] - cum[:, :, None, :]  # [n, B, C(i), C(j), k, r]
    kept = keep[..., None, None]
    decay = jnp.where(kept, jnp.exp(jnp.where(kept, diff, 0.0)), 0.0)
    kk = _dot("nbikd,nbjkd->nbijk", k, k, dtype)[..., None]  # [n, B, C, C, k, 1]
    qk = _dot("nbikd,nbjkd->nbijk", q, k, dtype)[..., None]
    strict = (keep & ~jnp.eye(chunk, dtype=bool))[..., None, None]
    lower = jnp.where(strict, beta[:, :, :, None] * kk * decay, 0.0)  # [n, B, C, C, k, r]
    # the UT transform: (I + lower)^-1 applied to the chunk's values and decayed keys
    inverse = unit_lower_inverse(jnp.moveaxis(lower, (2, 3), (-2, -1)), dtype)  # [n,B,k,r,C,C]
    grow = jnp.exp(cum) * carried[..., None, None]  # decay from the chunk's start, if carried
    vb = jnp.moveaxis(v * beta[..., None], 2, -2)  # [n, B, k, r, C, v]
    kb = jnp.moveaxis(k[..., None, :] * (beta * grow)[..., None], 2, -2)  # [n, B, k, r, C, d]
    u = _dot("nbkrij,nbkrjv->nbkriv", inverse, vb, dtype)  # corrections, before the state's
    w = _dot("nbkrij,nbkrjd->nbkrid", inverse, kb, dtype)  # what the chunk's state predicts
    qs = jnp.moveaxis(q[..., None, :] * grow[..., None], 2, -2)  # [n, B, k, r, C, d]
    attn = jnp.moveaxis(qk * decay, (2, 3), (-2, -1))  # the chunk's own attention [n,B,k,r,C,C]
    last = cum[:, :, -1:] - cum  # decay from each token to the chunk's end
    tail = jnp.where(same[:, :, -1][..., None, None], jnp.exp(last), 0.0)  # [n, B, C, k, r]
    kt = jnp.moveaxis(k[..., None, :] * tail[..., None], 2, -2)  # [n, B, k, r, C, d]
    through = jnp.exp(cum[:, :, -1]) * carried[:, :, -1][..., None, None]  # [n, B, k, r]

    def step(state, xs):  # state [B, k, r, d, v] float32
        u, w, qs, attn, kt, through = xs
        fresh = u - _dot("bkrcd,bkrdv->bkrcv", w, state, dtype)
        out = _dot("bkrcd,bkrdv->bkrcv", qs, state, dtype) + _dot(
            "bkrij,bkrjv->bkriv", attn, fresh, dtype
        )
        state = state * through[..., None, None] + _dot("bkrcd,bkrcv->bkrdv", kt, fresh, dtype)
        return state, out.astype(dtype)

    return jax.lax.scan(step, state, (u, w, qs, attn, kt, through))


def recurrent_delta_rule(
    q_btkd, k_btkd, v_btkrv, g_btkr, beta_btkr, starts_bt, state=None
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token, float32 (the reference `chunked_delta_rule` is held
    to; KV-cache decoding's step): (outputs [B, T, k, r, v], the final state [B, k, r, d, v]).
    `state`: the state before the first token (zeros by default)."""
    b, _, kh, r, dv = v_btkrv.shape
    d = q_btkd.shape[-1]
    if state is None:
        state = jnp.zeros((b, kh, r, d, dv), jnp.float32)

    def step(state, xs):
        q, k, v, g, beta, start = (x.astype(jnp.float32) for x in xs)
        state = state * jnp.where(start[:, None, None], 0.0, jnp.exp(g))[..., None, None]
        predicted = jnp.einsum("bkrdv,bkd->bkrv", state, k)
        delta = (v - predicted) * beta[..., None]
        state = state + jnp.einsum("bkd,bkrv->bkrdv", k, delta)
        return state, jnp.einsum("bkrdv,bkd->bkrv", state, q)

    xs = (q_btkd, k_btkd, v_btkrv, g_btkr, beta_btkr, starts_bt)
    state, out = jax.lax.scan(step, state, jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), xs))
    return jnp.moveaxis(out, 0, 1), state


class GatedDeltaNet(nnx.Module):
    """Qwen3.5's linear attention: projections, the causal convolution, the gated delta rule,
    a gated RMSNorm per value head and the output projection.

    Parameters, laid out for tensor parallelism by key head (each key head's group of
    channels whole on one device): `qkv` [width, key heads, 2 key_dim + r value_dim] (a key
    head's query, key and its r values; transformers' in_proj_qkv with its channels regrouped),
    `conv` [conv_width, key heads, group] (its conv1d), `z` (the output gate), `b` (beta's
    logits), `a` (the decay's), `dt_bias`, `a_log`, `norm` [value_dim], `out`.
    """

    def __init__(
        self,
        width: int,
        spec: LinearSpec,
        *,
        norm_eps: float = 1e-6,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        lora: dict[str, Adapter] | None = None,
        rngs: nnx.Rngs,
    ):
        """`lora`: adapters of the projections it names (in_qkv, in_z, in_b, in_a,
        out_proj: `config.lora.LINEAR_TARGETS`)."""
        s = spec
        assert s.value_heads % s.key_heads == 0, (s.value_heads, s.key_heads)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        on = lambda name: (lora or {}).get(name)
        heads = ("embed", "heads", "head_dim")
        self.qkv = Dense(
            width, (s.key_heads, s.group), ("embed", "kv_heads", None), lora=on("in_qkv"), **kw
        )
        self.z = Dense(width, (s.value_heads, s.value_dim), heads, lora=on("in_z"), **kw)
        self.b = Dense(width, s.value_heads, ("embed", "heads"), lora=on("in_b"), **kw)
        self.a = Dense(width, s.value_heads, ("embed", "heads"), lora=on("in_a"), **kw)
        self.out = Dense(
            (s.value_heads, s.value_dim),
            width,
            ("heads", "head_dim", "embed"),
            lora=on("out_proj"),
            **kw,
        )
        conv = jax.random.normal(param_key(rngs), (s.conv_width, s.key_heads, s.group))
        self.conv = nnx.Param(
            (conv / s.conv_width**0.5).astype(param_dtype), axes=(None, "kv_heads", None)
        )
        self.dt_bias = nnx.Param(jnp.ones((s.value_heads,), param_dtype), axes=("heads",))
        a = jax.random.uniform(param_key(rngs), (s.value_heads,), jnp.float32, 1.0, 16.0)
        self.a_log = nnx.Param(jnp.log(a).astype(param_dtype), axes=("heads",))
        self.norm = nnx.Param(jnp.ones((s.value_dim,), param_dtype), axes=("head_dim",))
        self.spec, self.norm_eps, self.dtype = spec, norm_eps, dtype

    def __call__(self, x_btd: jax.Array, pack, positions: jax.Array | None = None) -> jax.Array:
        """Mixes each document of the packed rows (`pack`: an `attention.Packing`; positions
        are unused: order is the recurrence's; a context group's rows go through
        `models.context.ulysses_linear`, `Packing.group_order`). Returns [B, T, width] in the
        compute dtype.

        The elementwise work between the matmuls (the convolution and the gates, the gated
        norm) is rematerialised in the backward pass: the layer keeps its projections'
        outputs, not their float32 intermediates."""
        projected, b_logits, a_logits = self.qkv(x_btd), self.b(x_btd), self.a(x_btd)
        params = (self.conv[...], self.dt_bias[...], self.a_log[...])
        if pack.group_order is not None:  # (a context group's rows, by the ulysses strategy)
            args = (projected, b_logits, a_logits, params, pack.segment_ids, pack.group_order)
            row, key_dim = pack.row * ctx.context_size(), self.spec.key_dim
            out = ctx.ulysses_linear(self.mix, *args, row=row, key_dim=key_dim)
        else:
            args = (projected, pack.segment_ids, b_logits, a_logits, *params)
            out = self.mix(*args, self.spec.key_heads, row=pack.row)
        return self.output(out, x_btd)

    def mix(
        self,
        projected: jax.Array,
        segment_ids_bt: jax.Array,
        b_logits: jax.Array,
        a_logits: jax.Array,
        conv: jax.Array,
        dt_bias: jax.Array,
        a_log: jax.Array,
        key_heads: int,
        row: int = 0,
    ) -> jax.Array:
        """The layer's token mixing: the convolution, the gates and the delta rule over packed
        rows (`row` as `document_starts`'s), of `key_heads` of the key heads (all of them, or
        a context rank's share under ulysses, `models.context.ulysses_linear`, where copies of
        a key head may each carry some of its value heads) with their value heads (those of
        `b_logits`) and their parameters' share. Returns [B, T, key_heads, value heads a key
        head, value_dim]."""
        s = self.spec
        spec = dataclasses.replace(s, key_heads=key_heads, value_heads=b_logits.shape[-1])
        starts = document_starts(segment_ids_bt, row)
        run = functools.partial(_inputs, spec=spec, skip=0, dtype=self.dtype)
        run = jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)
        q, k, v, g, beta = run(projected, starts, b_logits, a_logits, conv, dt_bias, a_log)
        return chunked_delta_rule(q, k, v, g, beta, starts, chunk=s.chunk, dtype=self.dtype)

    def extend(
        self, x_btd: jax.Array, window: jax.Array, state: jax.Array, valid_bt: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """KV-cache decoding's: T new tokens of one document a row after the convolution's
        `window` (its last conv_width - 1 inputs [B, K - 1, k, group]) and the delta rule's
        `state` [B, k, r, d, v] (zeros before a prompt); `valid_bt`: the tokens that are the
        row's (a right-padded prompt's; the others change nothing). Returns (outputs [B, T,
        width], the window and the state after each row's last valid token)."""
        t, taps = x_btd.shape[1], self.spec.conv_width - 1
        projected = self.qkv(x_btd)
        seen = jnp.concatenate([window.astype(projected.dtype), projected], axis=1)
        starts = jnp.zeros(seen.shape[:2], bool).at[:, 0].set(True)  # ([B, K - 1 + T])
        q, k, v, g, beta = self.inputs(seen, starts, x_btd, skip=taps)
        keep = valid_bt[..., None, None]
        g, beta = jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)
        if t == 1:  # (a decode step: the rule token by token from the cached state)
            first = jnp.zeros_like(valid_bt)
            out, state = recurrent_delta_rule(q, k, v, g, beta, first, state)
            out = out.astype(self.dtype)
        else:  # (a prompt, from the empty state)
            first = jnp.zeros_like(valid_bt).at[:, 0].set(True)
            run = dict(chunk=self.spec.chunk, dtype=self.dtype, final_state=True)
            out, state = chunked_delta_rule(q, k, v, g, beta, first, **run)
        last = jnp.sum(valid_bt, axis=1)  # the window ends at each row's last valid token
        at = last[:, None] + jnp.arange(taps)  # (in `seen`, token i is at taps + i)
        window = jnp.take_along_axis(seen, at.reshape(*at.shape, 1, 1), axis=1)
        return self.output(out, x_btd), window, state

    def inputs(
        self, projected: jax.Array, starts_bt: jax.Array, x_btd: jax.Array, skip: int = 0
    ) -> tuple[jax.Array, ...]:
        """The delta rule's q, k [B, T, k, d] (normalised, q scaled), v [B, T, k, r, v] in the
        compute dtype, g, beta [B, T, k, r] float32, from the fused projection's outputs
        [B, skip + T, k, group] (`skip`: a decoding window's before the T) through the
        convolution, and the layer's inputs x (beta's and the decay's logits)."""
        s = self.spec
        run = functools.partial(_inputs, spec=s, skip=skip, dtype=self.dtype)
        run = jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)
        params = (self.conv[...], self.dt_bias[...], self.a_log[...])
        return run(projected, starts_bt, self.b(x_btd), self.a(x_btd), *params)

    def output(self, out_btkrv: jax.Array, x_btd: jax.Array) -> jax.Array:
        """The delta rule's outputs through the gated RMSNorm and the output projection."""
        run = functools.partial(_gated_norm, eps=self.norm_eps, dtype=self.dtype)
        run = jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)
        return self.out(run(out_btkrv, self.z(x_btd), self.norm[...]))


def _inputs(projected, starts, b_logits, a_logits, conv, dt_bias, a_log, *, spec, skip, dtype):
    """`GatedDeltaNet.inputs`' elementwise part: the convolution, SiLU, the split into q, k,
    v, their norms, and the gates."""
    s = spec
    mixed = jax.nn.silu(causal_conv(projected, conv, starts)[:, skip:])
    q, k, v = jnp.split(mixed, [s.key_dim, 2 * s.key_dim], axis=-1)
    v = v.reshape(*v.shape[:-1], -1, s.value_dim).astype(dtype)
    q = (l2_normalised(q) * s.key_dim**-0.5).astype(dtype)
    k = l2_normalised(k).astype(dtype)
    group = lambda x: x.reshape(*x.shape[:-1], s.key_heads, -1)  # value heads by key head
    beta = group(jax.nn.sigmoid(b_logits.astype(jnp.float32)))
    rate = jax.nn.softplus(a_logits.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    g = group(-jnp.exp(a_log.astype(jnp.float32)) * rate)
    return q, k, v, g, beta


def _gated_norm(out_btkrv, z_bthv, weight, *, eps, dtype):
    """RMSNorm over each value head's outputs (float32, cast to the compute dtype before its
    weight, as transformers' Qwen3_5RMSNormGated), gated by SiLU(z)."""
    o32 = out_btkrv.reshape(z_bthv.shape).astype(jnp.float32)
    normed = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    scaled = normed.astype(dtype).astype(jnp.float32) * weight.astype(jnp.float32)
    return (scaled * jax.nn.silu(z_bthv.astype(jnp.float32))).astype(dtype)
