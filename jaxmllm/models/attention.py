"""Attention over packed rows: where each query may look (`Packing`), and the attention module.

A packed row holds several documents (samples, images, clips) one after another, padding after
them; a query attends to keys of its own document (and, causal, not after itself). `Packing`
says so in one of two forms, and `Attention` computes with whichever it gets:

- dense: a boolean mask [B, 1, T, T] (`attention_mask`), every pair scored, the reference;
- block-sparse: the segment ids [B, T] and a list of (query block, key block) tiles [B, K, 2]
  that the planner made (`jaxmllm.plan.tiles`), so only those tiles are scored
  (`jaxmllm.models.blocksparse`): cost and memory follow the documents, not T^2;
- cudnn: cuDNN's fused attention (GPU), from the documents' offsets and lengths (read off the
  segment ids once, here, not in every layer of the scan).

A layer with a sliding window (`Attention.window`: Gemma's local layers) narrows whichever form
it gets: a query sees itself and the `window` - 1 tokens before it, of its own document still
(`windowed`; transformers' convention, key index > query index - window). The packing is the
row's, shared by every layer; the window is the layer's. Block-sparse packing may carry a second
tile list for the windowed layers (`Packing.window_tiles`, `jaxmllm.plan.tiles.window_reach`):
only the tiles some window reaches, so the tiles wholly outside every window are skipped, not
scored and masked (with context groups, each rank's: its query blocks' tiles a window reaches);
without it those layers take the row's list.

Bidirectional spans (`Packing.spans`: an image's tokens in Gemma 3, transformers'
`token_type_ids`) widen a causal packing: the tokens of one span see each other both ways,
inside their document, and nothing else changes; a window still narrows them (transformers'
AND of the window and OR(causal, span)). The spans are the row's, like its segments: the batch
carries them (`llm_spans`), so they hold wherever the images were encoded. A layer may leave
them out (`Attention.spans` false: Gemma 4's full-attention layers stay causal over images,
its sliding ones read them both ways), so a dense packing keeps them beside its causal mask
and each layer widens the mask itself.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmllm.config.remat import QKV
from jaxmllm.models import blocksparse, cudnn
from jaxmllm.models import context as ctx
from jaxmllm.models.layers import ROPE, Dense, RMSNorm
from jaxmllm.models.lora import Adapter


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packing:
    """Where the queries of a batch of packed rows may look (see the module docstring)."""

    segment_ids: jax.Array  # [B, T] document of each token, 0 for padding
    mask: jax.Array | None = None  # [B, 1, T, T] dense
    tiles: jax.Array | None = None  # [B, K, 2] block-sparse, -1 for padding tiles
    # [B, K', 2] block-sparse: the tiles the sliding-window layers compute (those some window
    # reaches, K' <= K); None: they take `tiles` and mask what is outside their window
    window_tiles: jax.Array | None = None
    # [B, T] bidirectional spans (causal only): tokens of one id > 0 see each other both ways
    # in the layers that read them (`Attention.spans`); None: none
    spans: jax.Array | None = None
    block: int = dataclasses.field(default=0, metadata=dict(static=True))
    causal: bool = dataclasses.field(default=False, metadata=dict(static=True))
    kind: str = dataclasses.field(default="dense", metadata=dict(static=True))
    offsets: jax.Array | None = None  # [B, documents + 1] cudnn: where each document starts
    lengths: jax.Array | None = None  # [B, documents] cudnn: its length (-1 past the last)
    # block-sparse rows split over the mesh's context groups (`jaxmllm.models.context`)
    context: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # tokens a row when a device's rows lie end to end in one (block-sparse); 0: T, each row
    # one (linear attention restarts its state at a row's first token as at a document's)
    row: int = dataclasses.field(default=0, metadata=dict(static=True))
    # context groups: each token's index in its document [B, T], which a gathered key is
    # masked by (causal: key <= query); None: the rotary positions are it (1D RoPE). M-RoPE's
    # are not in token order (an image's tokens share a time), so they come apart.
    order: jax.Array | None = None
    # context groups by the ulysses strategy (`mesh.context_strategy`): attention moves heads,
    # not keys (`jaxmllm.models.context.ulysses_attend`)
    ulysses: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # ... and, for the layers that read a document's tokens in order (Gated DeltaNet), the
    # permutation of the gathered group's tokens into documents in order and its inverse
    # (`jaxmllm.models.context.group_order`); None otherwise
    group_order: tuple[jax.Array, jax.Array] | None = None


def packing(
    segment_ids_bt: jax.Array,
    *,
    causal: bool,
    kind: str = "dense",
    tiles_bk2: jax.Array | None = None,
    block: int = 0,
    documents: int = 0,
    context: bool = False,
    row: int = 0,
    order_bt: jax.Array | None = None,
    window_tiles_bk2: jax.Array | None = None,
    spans_bt: jax.Array | None = None,
    ulysses: bool = False,
) -> Packing:
    """The `Packing` of rows with these segment ids for attention `kind` (`model.attention`);
    `documents`: cudnn's bound on documents per row (`batch.*_documents`, 0: the row length);
    `context`: block-sparse rows split over the mesh's context groups, when it has them;
    `row`: tokens a row when several lie end to end in one (`Packing.row`); `order_bt`: each
    token's index in its document where the rotary positions are not it (`Packing.order`);
    `window_tiles_bk2`: the windowed layers' tiles (`Packing.window_tiles`; with context
    groups a rank's, as `tiles_bk2` is);
    `spans_bt`: bidirectional spans (`Packing.spans`; causal block-sparse or dense);
    `ulysses`: split rows attend by the ulysses strategy (`Packing.ulysses`)."""
    if kind == "block_sparse":
        if tiles_bk2 is None:
            raise ValueError("block-sparse attention needs the tile list (batch *_tiles)")
        context = context and ctx.context_size() > 1
        return Packing(
            segment_ids_bt,
            tiles=tiles_bk2,
            window_tiles=window_tiles_bk2,
            spans=spans_bt,
            block=block,
            causal=causal,
            kind=kind,
            context=context,
            row=row,
            order=order_bt if context else None,
            ulysses=context and ulysses,
        )
    if kind == "cudnn":
        if spans_bt is not None:  # (config load refuses it first, naming the keys)
            raise ValueError("cudnn attention has no bidirectional spans: use block_sparse")
        offsets, lengths = cudnn.segments(segment_ids_bt, documents or segment_ids_bt.shape[1])
        return Packing(
            segment_ids_bt, causal=causal, kind=kind, offsets=offsets, lengths=lengths, row=row
        )
    mask = attention_mask(segment_ids_bt, causal=causal)
    return Packing(segment_ids_bt, mask=mask, spans=spans_bt, causal=causal, kind="dense", row=row)


def attention_mask(segment_ids_bt: jax.Array, *, causal: bool) -> jax.Array:
    """Boolean mask [B, 1, T, T]: same non-padding segment (and key <= query when causal).

    Every position may also attend to itself, so padding queries (segment 0) get a finite
    softmax instead of NaN; their outputs are never used.
    """
    seg_q = segment_ids_bt[:, :, None]
    seg_k = segment_ids_bt[:, None, :]
    mask = (seg_q == seg_k) & (seg_k > 0)
    length = segment_ids_bt.shape[-1]
    if causal:
        mask &= jnp.tril(jnp.ones((length, length), bool))
    mask |= jnp.eye(length, dtype=bool)
    return mask[:, None]


def bidirectional(
    mask_b1ts: jax.Array, segment_ids_bt: jax.Array, spans_bt: jax.Array
) -> jax.Array:
    """A dense mask widened by bidirectional spans: the tokens of one span (one id > 0 in
    `spans_bt` [B, T]) of one document see each other both ways."""
    span = spans_bt[:, :, None]
    same = (span == spans_bt[:, None, :]) & (span > 0)
    same &= segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    return mask_b1ts | same[:, None]


def windowed(mask_b1ts: jax.Array, window: int) -> jax.Array:
    """A dense mask narrowed to a sliding window: key index > query index - `window` (the
    query itself and the window - 1 tokens before it). A document's tokens lie in order in its
    row, so the distance of two indices is their distance in the document, and the segment
    mask already keeps the window inside it."""
    t, s = mask_b1ts.shape[-2:]
    distance = jnp.arange(t)[:, None] - jnp.arange(s)[None, :]
    return mask_b1ts & (distance < window)


def dense_attention(
    q_bthe: jax.Array, k_bske: jax.Array, v_bske: jax.Array, mask_b1ts: jax.Array, dtype
) -> jax.Array:
    """Every (query, key) pair of a row scored, masked, softmaxed: [B, T, heads, head_dim]."""
    b, t, heads, head_dim = q_bthe.shape
    kv_heads = k_bske.shape[2]
    q_btkge = q_bthe.reshape(b, t, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum(
        "btkge,bske->bkgts", q_btkge, k_bske, preferred_element_type=jnp.float32
    ) / math.sqrt(head_dim)
    scores = jnp.where(mask_b1ts[:, :, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out_btkge = jnp.einsum("bkgts,bske->btkge", probs, v_bske)
    return out_btkge.reshape(b, t, heads, head_dim)


class Attention(nnx.Module):
    """Multi-head attention with grouped-query KV heads and rotary positions, over packed rows."""

    def __init__(
        self,
        width: int,
        heads: int,
        kv_heads: int,
        *,
        head_dim: int = 0,
        bias: str = "",
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        rope: str = "1d",
        rope_theta: float = 10000.0,
        rope_scaling: Any = None,
        rope_sections: tuple[int, ...] = (),
        rotary_dim: int = 0,
        gate: bool = False,
        norm_offset: bool = False,
        window: int = 0,
        scalar: float = 0.0,
        v_norm: bool = False,
        k_eq_v: bool = False,
        spans: bool = True,
        kv_shared: bool = False,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        lora: dict[str, Adapter] | None = None,
        clipped: bool = False,
        rngs: nnx.Rngs,
    ):
        """`head_dim` 0 = width / heads; `bias`: which of the q, k, v, o projections have one;
        `qk_norm`: an RMSNorm (epsilon `norm_eps`; scaling by 1 + its weight with
        `norm_offset`) over each head's queries and keys before the rotary positions (Qwen3,
        Qwen3.5); `rope`: 1d | 2d | mrope, mrope_interleaved (`rope_sections`) | none
        (positions enter elsewhere), on the first `rotary_dim` of each head (0: all of it);
        `rope_scaling` as `rope_frequencies`; `gate`: the output gated by sigmoid(x W_gate),
        W_gate beside each head's queries in the query kernel [width, heads, 2 head_dim]
        (Qwen3.5's q_proj); `window`: each query sees itself and the window - 1 tokens before
        it in its document (0: the whole document; `windowed`); `scalar`: scores scale by
        1 / sqrt(scalar) (Gemma's query_pre_attn_scalar; 0: the head width); `v_norm`: an
        RMSNorm without a scale over each head's values (Gemma 4); `k_eq_v`: no value
        projection, the values are the key projection's output before its norm and rotary
        (Gemma 4's attention_k_eq_v); `spans`: whether it reads a packing's bidirectional
        spans both ways (false: causal over them, Gemma 4's full layers); `kv_shared`: no key
        and value projections, the keys and values are another layer's (`__call__`'s `kv`:
        Gemma 4's num_kv_shared_layers); `lora`: adapters of the projections it names (q, k,
        v, o); `clipped`: the projections' inputs and outputs clamped to bounds (`Dense`'s;
        Gemma 4's vision tower)."""
        assert heads % kv_heads == 0, (heads, kv_heads)
        head_dim = head_dim or width // heads
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        own = lambda name: dict(
            use_bias=name in bias, lora=(lora or {}).get(name), clipped=clipped, **kw
        )
        qkv = ("embed", "kv_heads", "head_dim")
        q_width = 2 * head_dim if gate else head_dim
        self.query = Dense(width, (heads, q_width), ("embed", "heads", "head_dim"), **own("q"))
        self.key = None if kv_shared else Dense(width, (kv_heads, head_dim), qkv, **own("k"))
        own_v = not (k_eq_v or kv_shared)
        self.value = Dense(width, (kv_heads, head_dim), qkv, **own("v")) if own_v else None
        self.out = Dense((heads, head_dim), width, ("heads", "head_dim", "embed"), **own("o"))
        if qk_norm:
            norm = dict(
                eps=norm_eps,
                dtype=dtype,
                param_dtype=param_dtype,
                axis="head_dim",
                offset=norm_offset,
            )
            self.q_norm = RMSNorm(head_dim, **norm)
            self.k_norm = None if kv_shared else RMSNorm(head_dim, **norm)
        else:
            self.q_norm = self.k_norm = None
        self.v_norm = v_norm
        self.norm_eps = norm_eps
        self.kv_heads = kv_heads
        self.rope = rope
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.rope_sections = tuple(rope_sections)
        self.rotary_dim = rotary_dim if 0 < rotary_dim < head_dim else 0
        self.gate = gate
        self.window = window
        self.spans = spans
        # Every attention path divides the scores by sqrt(head_dim): the queries carry the rest
        self.query_factor = math.sqrt(head_dim / scalar) if scalar else 1.0
        self.dtype = dtype

    def __call__(
        self, x_btd: jax.Array, pack: Packing, positions: jax.Array, kv: tuple | None = None
    ) -> jax.Array:
        """Attends within each document of the packed rows.

        Args:
          x_btd: inputs [B, T, width].
          pack: where each query may look (`packing`).
          positions: [B, T] for 1D rotary, [B, T, 2] for 2D.
          kv: the keys and values attended over, another layer's (`keys_values`), where this
            one has no projections of its own (`kv_shared`); None: its own.

        Returns:
          [B, T, width] in the compute dtype.
        """
        # Named for the remat policies (config/remat.py): what a block may keep for backward.
        if kv is None:
            q_bthe, k_bske, v_bske, gate = self.project(x_btd, positions)
        else:
            (q_bthe, gate), (k_bske, v_bske) = self.project_query(x_btd, positions), kv
        q_bthe, k_bske, v_bske = map(checkpoint_name, (q_bthe, k_bske, v_bske), QKV)
        out_bthe = self.attend(q_bthe, k_bske, v_bske, pack, positions)
        return checkpoint_name(self.output(out_bthe, gate), "attention_out")

    def attend(self, q_bthe, k_bske, v_bske, pack: Packing, positions: jax.Array) -> jax.Array:
        """The attention of projected queries, keys and values by `pack`'s kind."""
        narrow = self.window and pack.window_tiles is not None
        if pack.context:  # (block-sparse, the row split over a context group)
            split = ctx.ulysses_attend if pack.ulysses else ctx.attend
            out_bthe = split(
                q_bthe,
                k_bske,
                v_bske,
                pack.segment_ids,
                positions if pack.order is None else pack.order,
                pack.window_tiles if narrow else pack.tiles,
                block=pack.block,
                causal=pack.causal,
                window=self.window,
            )
        elif pack.kind == "block_sparse":
            out_bthe = blocksparse.attend(
                q_bthe,
                k_bske,
                v_bske,
                pack.segment_ids,
                pack.window_tiles if narrow else pack.tiles,
                block=pack.block,
                causal=pack.causal,
                window=self.window,
                spans_bt=pack.spans if self.spans else None,
            )
        elif pack.kind == "cudnn":
            if self.window:  # (config load refuses it first, naming model.attention)
                raise ValueError("cudnn attention has no sliding windows: use block_sparse")
            out_bthe = cudnn.attend(
                q_bthe,
                k_bske,
                v_bske,
                pack.segment_ids,
                pack.offsets,
                pack.lengths,
                causal=pack.causal,
            )
        else:
            mask = pack.mask
            if pack.spans is not None and self.spans:
                mask = bidirectional(mask, pack.segment_ids, pack.spans)
            mask = windowed(mask, self.window) if self.window else mask
            out_bthe = dense_attention(q_bthe, k_bske, v_bske, mask, self.dtype)
        return out_bthe

    def output(self, out_bthe: jax.Array, gate_bthe: jax.Array | None) -> jax.Array:
        """Attention's output projection (training and decoding both call it), gated by
        sigmoid(gate) first when the attention has one (`project`'s)."""
        out_bthe = out_bthe.astype(self.dtype)
        if gate_bthe is not None:
            gated = out_bthe * jax.nn.sigmoid(gate_bthe.astype(jnp.float32))
            out_bthe = gated.astype(self.dtype)
        return self.out(out_bthe)

    def project(self, x_btd: jax.Array, positions: jax.Array) -> tuple[jax.Array, ...]:
        """Queries, keys and values of `x` at `positions`, rotated: what attention scores.

        Training and KV-cache decoding both call this, so a cached key is exactly the key the
        full-sequence pass computes.

        Returns:
          q [B, T, heads, head_dim], k and v [B, T, kv_heads, head_dim], and the output gate's
          logits [B, T, heads, head_dim] (None without a gate).
        """
        q_bthe, gate = self.project_query(x_btd, positions)
        return q_bthe, *self.keys_values(x_btd, positions), gate

    def project_query(self, x_btd: jax.Array, positions: jax.Array) -> tuple:
        """The queries of `x` at `positions`, normed, rotated and scaled [B, T, heads,
        head_dim], and the output gate's logits (None without a gate)."""
        q_bthe = self.query(x_btd)
        gate = None
        if self.gate:  # (each head's queries, then its gate)
            q_bthe, gate = jnp.split(q_bthe, 2, axis=-1)
        if self.q_norm is not None:  # (QK-norm: each head's queries, before rotary)
            q_bthe = self.q_norm(q_bthe)
        q_bthe = self.rotate(q_bthe, positions)
        if self.query_factor != 1.0:  # (an attention scale other than 1 / sqrt(head_dim))
            q_bthe = (q_bthe * jnp.asarray(self.query_factor, q_bthe.dtype)).astype(q_bthe.dtype)
        return q_bthe, gate

    def keys_values(self, x_btd: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The keys of `x` at `positions`, normed and rotated, and its values (normed with
        `v_norm`), each [B, T, kv_heads, head_dim]: what a layer reusing them reads too."""
        k_bthe = self.key(x_btd)
        v_bthe = k_bthe if self.value is None else self.value(x_btd)
        if self.v_norm:  # (an RMSNorm of each head's values, without a scale)
            v32 = v_bthe.astype(jnp.float32)
            v32 = v32 * jax.lax.rsqrt(jnp.mean(v32 * v32, axis=-1, keepdims=True) + self.norm_eps)
            v_bthe = v32.astype(v_bthe.dtype)
        if self.k_norm is not None:  # (QK-norm: each head's keys, before rotary)
            k_bthe = self.k_norm(k_bthe)
        return self.rotate(k_bthe, positions), v_bthe

    def rotate(self, x_bthe: jax.Array, positions: jax.Array) -> jax.Array:
        """Queries or keys turned by their rotary positions (the first `rotary_dim` of each
        head where that is a part)."""
        extra = {"sections": self.rope_sections} if self.rope.startswith("mrope") else {}
        turn = lambda x: ROPE[self.rope](x, positions, self.rope_theta, self.rope_scaling, **extra)
        cut = self.rotary_dim
        if not cut:
            return turn(x_bthe)
        return jnp.concatenate([turn(x_bthe[..., :cut]), x_bthe[..., cut:]], -1)
