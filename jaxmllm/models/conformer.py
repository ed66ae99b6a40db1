"""Gemma 4's audio encoder, a conformer (USM), over packed log-mel frames
(`model.audio.stem: conformer`; transformers' Gemma4AudioModel).

- Stem: two 3x3 convolutions of stride 2 over (frames, mel bins), each followed by a LayerNorm
  over its channels (no bias) and ReLU, then a Linear from the (mel bins x channels) left to the
  width: one row per 4 frames. Each time tap reads only its own clip's valid frames (zero
  across a clip's edge, as transformers' zero padding and input mask do for a clip alone).
- Blocks: a feed-forward scaled by `residual_weight` (macaron), chunked local attention, a
  light convolution, a second feed-forward, a final RMSNorm; activations clamped to
  [-clamp, clamp] around the norms; the linears' inputs and outputs clamped by bounds the
  checkpoint holds (`clipped_linears`: `layers.Dense`'s `clipped`, never trained).
- Attention: a query sees itself and the context_left - 2 rows before it, the
  context_right - 1 after it, within its clip; its scores get a relative position term (the
  query against a projection of a sinusoid table of distances), are soft-capped, and are
  computed a chunk of queries at a time against that chunk's context: linear in frames.
- The output projection (with a bias) to `out_dim`.
- LoRA (`model.audio.lora`): adapters on the attention's q, k, v, o and the feed-forwards'
  fc1, fc2 (a target adapts that matrix of both feed-forwards), inside the bounds as PEFT's
  on a clipped linear's `.linear`; the light convolution's linears take none.

A frame is valid where its segment id is > 0 and its position >= 0: a clip padded to a whole
LLM token (4 frames) carries position -1 on its padding frames (`jaxmllm.data.media.audio`), as
transformers masks the frames past the clip (Gemma4AudioFeatureExtractor's mask). A row is
valid where its first frame is: a clip of V frames gives ceil(V / 4) rows, each an LLM token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmllm.config import AudioConfig
from jaxmllm.config.spec import Inputs
from jaxmllm.models import lora
from jaxmllm.models.audio import clip_windows
from jaxmllm.models.deltanet import causal_conv, document_starts
from jaxmllm.models.inputs import decode
from jaxmllm.models.layers import Dense, LayerNorm, RMSNorm, param_key
from jaxmllm.models.positions import sinusoids
from jaxmllm.models.transformer import remat_policy, stack_modules

INVALID = -1e9  # a masked score (transformers' attention_invalid_logits_value)
FIXED_EPS = 1e-6  # the blocks' norms whose epsilon transformers does not take from the config


def adapters(a: AudioConfig) -> dict[str, lora.Adapter]:
    """The LoRA adapters of the blocks' matrices, by target (q, k, v, o, fc1, fc2)."""
    return dict(lora.adapters(a.lora, a.adapter_targets))


def clamp(x: jax.Array, bound: float) -> jax.Array:
    """x clamped to [-bound, bound] (transformers' gradient_clipping, held to the dtype's
    range as it holds it)."""
    bound = min(bound, float(jnp.finfo(x.dtype).max))
    return jnp.clip(x, -bound, bound)


class SubsampleLayer(nnx.Module):
    """A 3x3 convolution of stride 2 over (frames, mel bins), padding 1, no bias; a LayerNorm
    over its channels without a bias; ReLU. The kernel is [time tap, mel tap, in, out]."""

    def __init__(self, c_in: int, c_out: int, *, eps: float, dtype, param_dtype, rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.conv = Dense((3, 3, c_in), c_out, (None, None, None, None), rngs=rngs, **kw)
        self.norm = LayerNorm(c_out, use_bias=False, eps=eps, axis=None, **kw)

    def __call__(self, x_btmc: jax.Array, valid_bt: jax.Array) -> jax.Array:
        """[B, T, M, C] -> [B, T / 2, ceil(M / 2), C_out]: output row r from frames 2r - 1,
        2r, 2r + 1 of its clip (`valid_bt`: each frame's clip id, 0 where it is not one)."""
        b, t, m, c = x_btmc.shape
        taps = clip_windows(x_btmc.reshape(b, t, m * c), valid_bt)[:, ::2]
        taps = taps.reshape(b, t // 2, 3, m, c)
        m_out = (m + 1) // 2
        padded = jnp.pad(taps, [(0, 0), (0, 0), (0, 0), (1, 2 * m_out - m), (0, 0)])
        windows = [padded[:, :, :, k : k + 2 * m_out : 2] for k in range(3)]
        x = jnp.stack(windows, axis=3)  # [B, T/2, time tap, mel tap, M_out, C]
        x = jnp.moveaxis(x, 4, 2)  # [B, T/2, M_out, time tap, mel tap, C]
        return jax.nn.relu(self.norm(self.conv(x)))


class FeedForward(nnx.Module):
    """The conformer's feed-forward: clamp, RMSNorm, fc2(silu(fc1 x)), clamp, RMSNorm, scaled
    by `residual_weight`, added to its input."""

    def __init__(self, a: AudioConfig, *, dtype, param_dtype, rngs):
        c, on = a.conformer, adapters(a)
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        lin = dict(clipped=c.clipped_linears, rngs=rngs, **kw)
        self.pre_norm = RMSNorm(a.width, eps=FIXED_EPS, **kw)
        self.fc1 = Dense(a.width, a.mlp_dim, ("embed", "mlp"), lora=on.get("fc1"), **lin)
        self.fc2 = Dense(a.mlp_dim, a.width, ("mlp", "embed"), lora=on.get("fc2"), **lin)
        self.post_norm = RMSNorm(a.width, eps=FIXED_EPS, **kw)
        self.bound, self.weight = c.clamp, c.residual_weight

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        y = self.fc2(jax.nn.silu(self.fc1(self.pre_norm(clamp(x_btd, self.bound)))))
        return x_btd + self.post_norm(clamp(y, self.bound)) * jnp.asarray(self.weight, x_btd.dtype)


class LightConv(nnx.Module):
    """The conformer's convolution module: RMSNorm, a Linear to twice the width, GLU, a causal
    depthwise convolution within each clip, clamp, RMSNorm, SiLU, a Linear; added to its input.
    The kernel is [taps, width] (tap K - 1 on the row itself)."""

    def __init__(self, a: AudioConfig, *, dtype, param_dtype, rngs):
        c, w = a.conformer, a.width
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        lin = dict(clipped=c.clipped_linears, rngs=rngs, **kw)
        self.pre_norm = RMSNorm(w, eps=a.norm_eps, **kw)
        self.start = Dense(w, 2 * w, ("embed", "mlp"), **lin)
        kernel = jax.random.normal(param_key(rngs), (c.conv_kernel, w)) / math.sqrt(c.conv_kernel)
        self.kernel = nnx.Param(kernel.astype(param_dtype), axes=(None, "embed"))
        self.conv_norm = RMSNorm(w, eps=a.norm_eps, **kw)
        self.end = Dense(w, w, ("mlp", "embed"), **lin)
        self.bound, self.dtype = c.clamp, dtype

    def __call__(self, x_btd: jax.Array, starts_bt: jax.Array) -> jax.Array:
        h = self.start(self.pre_norm(x_btd))
        value, gate = jnp.split(h, 2, axis=-1)
        h = causal_conv(value * jax.nn.sigmoid(gate), self.kernel[...], starts_bt)
        h = self.conv_norm(clamp(h.astype(self.dtype), self.bound))
        return x_btd + self.end(jax.nn.silu(h))


class LocalAttention(nnx.Module):
    """Chunked local attention with a relative position term and a logit cap (the module
    docstring). Queries scale by head_dim^-1/2 / ln 2 x softplus(per_dim_scale), keys by
    ln(1 + e) / ln 2, as transformers' Gemma4AudioAttention."""

    def __init__(self, a: AudioConfig, *, dtype, param_dtype, rngs):
        c, w, h, on = a.conformer, a.width, a.heads, adapters(a)
        e = w // h
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        lin = dict(clipped=c.clipped_linears, **kw)
        qkv = ("embed", "heads", "head_dim")
        self.query = Dense(w, (h, e), qkv, lora=on.get("q"), **lin)
        self.key = Dense(w, (h, e), qkv, lora=on.get("k"), **lin)
        self.value = Dense(w, (h, e), qkv, lora=on.get("v"), **lin)
        self.out = Dense((h, e), w, ("heads", "head_dim", "embed"), lora=on.get("o"), **lin)
        self.relative = Dense(w, (h, e), qkv, **kw)
        self.per_dim_scale = nnx.Param(jnp.zeros((e,), param_dtype), axes=("head_dim",))
        self.c, self.width, self.dtype = c, w, dtype

    def __call__(self, x_btd: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
        e = self.per_dim_scale.shape[0]
        scale = e**-0.5 / math.log(2) * jax.nn.softplus(self.per_dim_scale[...].astype(jnp.float32))
        q = self.query(x_btd).astype(jnp.float32) * scale
        k = self.key(x_btd).astype(jnp.float32) * (math.log(1 + math.e) / math.log(2))
        v = self.value(x_btd).astype(jnp.float32)
        # The sinusoids of the distances, farthest first (transformers' position_ids run from
        # context // 2 down to 0): a constant, as its non-persistent buffer
        table = sinusoids(self.c.relative_positions, self.width)[::-1]
        rel = self.relative(jnp.asarray(table, self.dtype)).astype(jnp.float32)
        out = local_attention(q, k, v, rel, segment_ids_bt, self.c)
        return self.out(out.astype(self.dtype))


def local_attention(q_bthe, k_bthe, v_bthe, rel_phe, segment_ids_bt, c) -> jax.Array:
    """Each query against the keys of its window in its clip (`ConformerConfig` c), a chunk of
    queries at a time against the chunk's context of `c.context` rows: scores [B, H, chunks,
    chunk, context], fp32. The relative term of a key j rows past the context's start of the
    query's own row is the query against `rel_phe[j]` (0 past the table), as transformers'
    relative shift gives it. Returns [B, T, H, E] fp32."""
    b, t, h, e = q_bthe.shape
    chunk, past, n_rel = c.chunk, c.context_left - 1, rel_phe.shape[0]
    n = -(-t // chunk)
    pad_t = n * chunk - t
    q = jnp.pad(q_bthe, [(0, 0), (0, pad_t), (0, 0), (0, 0)]).reshape(b, n, chunk, h, e)
    seg = jnp.pad(segment_ids_bt, [(0, 0), (0, pad_t)])
    # the context of chunk i: rows i * chunk - past ... i * chunk + chunk + right - 1
    index = np.arange(n)[:, None] * chunk + np.arange(c.context)[None, :]  # [chunks, context]
    around = [(0, 0), (past, pad_t + c.context_right)]
    k = jnp.pad(k_bthe, around + [(0, 0), (0, 0)])[:, index]  # [B, chunks, context, H, E]
    v = jnp.pad(v_bthe, around + [(0, 0), (0, 0)])[:, index]
    seg_k = jnp.pad(seg, around)[:, index]  # [B, chunks, context] (0 outside the row)
    scores = jnp.einsum("bnqhe,bnshe->bhnqs", q, k)
    rel = jnp.einsum("bnqhe,phe->bhnqp", q, rel_phe)  # [B, H, chunks, chunk, positions]
    shift = np.arange(c.context)[None, :] - np.arange(chunk)[:, None]  # [chunk, context]
    inside = (shift >= 0) & (shift < n_rel)
    rel = jnp.take_along_axis(rel, jnp.asarray(np.clip(shift, 0, n_rel - 1))[None, None, None], -1)
    scores = scores + jnp.where(inside, rel, 0.0)
    scores = jnp.tanh(scores / c.logit_cap) * c.logit_cap
    distance = np.arange(chunk)[:, None] + past - np.arange(c.context)[None, :]  # query - key
    behind = (distance >= 0) & (distance < past)
    window = behind | ((distance < 0) & (-distance < c.context_right))
    seg_q = seg.reshape(b, n, chunk)
    allowed = window & (seg_k[:, :, None, :] == seg_q[..., None]) & (seg_k[:, :, None, :] > 0)
    scores = jnp.where(allowed[:, None], scores, INVALID)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhnqs,bnshe->bnqhe", probs, v)
    return out.reshape(b, n * chunk, h, e)[:, :t]


class ConformerBlock(nnx.Module):
    """One conformer block (the module docstring)."""

    def __init__(self, a: AudioConfig, *, dtype, param_dtype, rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = dict(eps=FIXED_EPS, dtype=dtype, param_dtype=param_dtype)
        self.ff1 = FeedForward(a, **kw)
        self.attn_norm = RMSNorm(a.width, **norm)
        self.attn = LocalAttention(a, **kw)
        self.attn_post_norm = RMSNorm(a.width, **norm)
        self.conv = LightConv(a, **kw)
        self.ff2 = FeedForward(a, **kw)
        self.out_norm = RMSNorm(a.width, **norm)
        self.bound = a.conformer.clamp

    def __call__(self, x_btd, segment_ids_bt, starts_bt) -> jax.Array:
        x_btd = self.ff1(x_btd)
        y = self.attn(self.attn_norm(clamp(x_btd, self.bound)), segment_ids_bt)
        x_btd = x_btd + self.attn_post_norm(clamp(y, self.bound))
        x_btd = self.ff2(self.conv(x_btd, starts_bt))
        return self.out_norm(clamp(x_btd, self.bound))


class ConformerEncoder(nnx.Module):
    """Gemma 4's audio encoder over packed frames (the module docstring): the stem, the blocks
    stacked on a leading `layers` axis and scanned, the output projection."""

    def __init__(
        self,
        cfg: AudioConfig,
        *,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        remat: str = "none",
        inputs: Inputs | None = None,
        rngs: nnx.Rngs,
        **_attention,
    ):
        """`_attention`: the model's attention kind, block and documents, which the other
        encoders take; the conformer's attention is its own (local, linear in frames)."""
        c0, c1 = cfg.conformer.channels
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.inputs = inputs
        self.layer0 = SubsampleLayer(1, c0, eps=cfg.norm_eps, **kw)
        self.layer1 = SubsampleLayer(c0, c1, eps=cfg.norm_eps, **kw)
        mels = ((cfg.n_mels + 1) // 2 + 1) // 2  # mel bins after the two stride-2 convolutions
        self.input_proj = Dense((mels, c1), cfg.width, (None, None, "embed"), **kw)
        blocks = [ConformerBlock(cfg, **kw) for _ in range(cfg.depth)]
        self.blocks = stack_modules(blocks, "layers")
        self.output_proj = Dense(cfg.width, cfg.out_width, ("embed", None), use_bias=True, **kw)
        self.remat = remat
        self.stride = cfg.stride

    def __call__(
        self,
        frames_bfm: jax.Array,
        segment_ids_bf: jax.Array,
        positions_bf: jax.Array,
        tiles_bk2: jax.Array | None = None,
    ) -> jax.Array:
        """Encodes packed frames.

        Args:
          frames_bfm: log-mel frames [B, F, n_mels]; F a multiple of 4, each clip starting at a
            multiple of 4 frames.
          segment_ids_bf: which clip each frame belongs to, 0 for padding [B, F].
          positions_bf: frame index within its clip, -1 on a clip's padding frames [B, F].
          tiles_bk2: unused (the conformer's attention is local).

        Returns:
          Features [B, F // 4, out_dim] in the compute dtype, one row per 4 frames.
        """
        frames_bfm = decode(frames_bfm, segment_ids_bf, self.inputs)
        valid_bf = jnp.where(positions_bf >= 0, segment_ids_bf, 0)
        x = self.layer0(frames_bfm[..., None], valid_bf)
        x = self.layer1(x, valid_bf[:, ::2])
        seg_bn = valid_bf[:, :: self.stride]
        x_bnd = self.input_proj(x)
        starts = document_starts(seg_bn)
        graphdef, stacked = nnx.split(self.blocks)

        def block(x_bnd, state, j):
            with lora.salted(j):  # (each layer's adapters draw their own dropout masks)
                return nnx.merge(graphdef, state)(x_bnd, seg_bn, starts)

        policy = remat_policy(self.remat)
        if policy is not None:
            block = jax.checkpoint(block, policy=policy, prevent_cse=False)
        depth = jax.tree.leaves(stacked)[0].shape[0]
        xs = (stacked, jnp.arange(depth))
        x_bnd, _ = jax.lax.scan(lambda x, s_j: (block(x, *s_j), None), x_bnd, xs)
        return self.output_proj(x_bnd)
