"""Llama-style decoder: RMSNorm, RoPE, grouped-query attention, gated MLP; and its loss.

The same module holds the HF decoder families it imports (Llama 3.x with its rope scaling,
Qwen2 / Qwen2.5 with q/k/v biases, Qwen3 with QK-norm, Qwen3-MoE and Qwen2-MoE with their
experts, Qwen3.5 with its Gated DeltaNet layers): their differences are `LLMConfig` options. A
decoder whose layers differ in kind stacks each kind apart (`kind_stacks`): a mixture of
experts' `moe` and `dense` layers (`model.llm.moe.every`, `dense_layers`), a hybrid's `linear`
and `full` attention ones (`model.llm.linear`), Gemma's `sliding` window and `full` ones
(`model.llm.window`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmllm.config import LLMConfig
from jaxmllm.config.decoder import LayerKind, RopeScaling
from jaxmllm.models import context as ctx
from jaxmllm.models.attention import Packing, packing
from jaxmllm.models.deltanet import LinearSpec
from jaxmllm.models.layers import Dense, Embed
from jaxmllm.models.loss import Head, loss_sum, token_logps, token_logps_and_entropy
from jaxmllm.models.moe import MoESpec, RouterStats
from jaxmllm.models.per_layer import PerLayerInputs
from jaxmllm.models.transformer import BlockSpec, Transformer, layer_places
from jaxmllm.models.vocab import vocab_axes


class Decoder(nnx.Module):
    """Token embedding, causal transformer over packed rows, and the output projection.

    Embedding and decoding are separate calls so the caller can replace placeholder embeddings
    with encoder outputs in between; `hidden` and `logits` are separate so the loss can project
    a slice of tokens at a time (`chunked_token_losses`).
    """

    def __init__(
        self,
        cfg: LLMConfig,
        *,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        remat: str = "none",
        attention: str = "dense",
        block: int = 0,
        documents: int = 0,
        context_strategy: str = "gather",
        grouped: bool = False,
        rngs: nnx.Rngs,
    ):
        self.attention, self.block = attention, block  # model.attention, batch.attention_block
        # mesh.context_strategy: how rows split over context groups attend; the linear layers'
        # need of their tokens in order under ulysses (`models.context.group_order`)
        self.ulysses = context_strategy == "ulysses"
        # Rows planned for the mesh's context groups (`mesh.context`), split over its context
        # axis; else each row whole on its device, the context axis one more data-parallel one
        # (a step variant planned without groups runs so on the same mesh and parameters)
        self.grouped = grouped
        self.in_order = self.ulysses and cfg.linear.enabled
        self.dtype = dtype  # the compute dtype (the loss's matmuls take it too)
        self.documents = documents  # batch.*_documents (cudnn attention)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.embed = Embed(
            cfg.vocab_size,
            cfg.width,
            vocab_parallel=cfg.vocab_parallel,
            scale=math.sqrt(cfg.width) if cfg.embed_scale else 1.0,
            **kw,
        )
        spec = BlockSpec.of(
            cfg,
            kv_heads=cfg.kv_heads,  # grouped-query attention
            rope=rope_kind(cfg),
            head_dim=cfg.head_dim,
            rope_scaling=cfg.rope_scaling,
            rope_sections=tuple(cfg.mrope_section),
            rotary_dim=cfg.rotary_dim if cfg.rotary_dim < cfg.head_width else 0,
            attn_gate=cfg.attn_gate,
            attn_scalar=cfg.attn_scalar,
            post_norms=cfg.post_norms,
            v_norm=cfg.v_norm,
            layer_scalar=cfg.layer_scalar,
            spans=cfg.bidirectional_full,
            per_layer_dim=cfg.per_layer_dim,
        )
        kinds, pattern = layer_kinds(cfg, spec)
        self.transformer = Transformer(
            cfg.depth,
            spec,
            remat=remat,
            kinds=kinds,
            pattern=pattern,
            kv_sources=kv_sources(cfg),
            **kw,
        )
        self.per_layer = (
            PerLayerInputs(
                cfg.per_layer_vocab_size,
                cfg.width,
                cfg.depth,
                cfg.per_layer_dim,
                eps=cfg.norm_eps,
                vocab_parallel=cfg.vocab_parallel,
                **kw,
            )
            if cfg.per_layer_dim
            else None
        )
        self.per_layer_pad_id = cfg.per_layer_pad_id
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else Dense(
                cfg.width,
                cfg.vocab_size,
                (None, "vocab_split") if cfg.vocab_parallel else ("embed", "vocab"),
                out_dtype=jnp.float32,
                **kw,
            )
        )
        # Unit-scale rows give unit-scale logits over sqrt(width) (jaxmllm's init).
        self.tied_divisor = math.sqrt(cfg.width) if cfg.tied_logits_scaled else 1.0
        self.softcap = cfg.logit_softcap  # (0: none)
        self.logits_chunk = cfg.logits_chunk
        self.vocab_parallel = cfg.vocab_parallel

    def __call__(
        self,
        x_btd: jax.Array,
        segment_ids_bt: jax.Array,
        positions_bt: jax.Array,
        tiles_bk2: jax.Array | None = None,
        ids_bt: jax.Array | None = None,
    ) -> jax.Array:
        """Logits [B, T, vocab] in float32 of embedded rows (see `hidden`)."""
        h = self.hidden(x_btd, segment_ids_bt, positions_bt, tiles_bk2, ids_bt=ids_bt)
        return self.logits(h)

    def hidden(
        self,
        x_btd: jax.Array,
        segment_ids_bt: jax.Array,
        positions_bt: jax.Array,
        tiles_bk2: jax.Array | None = None,
        row: int = 0,
        ids_bt: jax.Array | None = None,
    ) -> jax.Array:
        """Decodes embedded rows up to the final norm.

        Args:
          x_btd: input embeddings [B, T, width].
          segment_ids_bt: which sample each token belongs to, 0 for padding [B, T].
          positions_bt: position within the sample, for RoPE [B, T] ([B, T, 3]: time, row,
            column for M-RoPE, `model.llm.mrope_section`).
          tiles_bk2: block-sparse attention's tiles [B, K, 2] (a device's rows are then one
            row B of all their tokens: tiles never pair blocks of two rows).
          row: tokens a row when rows lie end to end in one (block-sparse); 0: T.
          ids_bt: the ids the per-layer table is read at [B, T] (`per_layer.per_layer_ids`),
            where the decoder has per-layer inputs (`model.llm.per_layer_dim`).

        Returns:
          Final hidden states [B, T, width] in the compute dtype.
        """
        return self.hidden_and_router(
            x_btd, segment_ids_bt, positions_bt, tiles_bk2, row, ids_bt=ids_bt
        )[0]

    def hidden_and_router(
        self,
        x_btd: jax.Array,
        segment_ids_bt: jax.Array,
        positions_bt: jax.Array,
        tiles_bk2: jax.Array | None = None,
        row: int = 0,
        added_kbtd: jax.Array | None = None,
        order_bt: jax.Array | None = None,
        window_tiles_bk2: jax.Array | None = None,
        spans_bt: jax.Array | None = None,
        ids_bt: jax.Array | None = None,
        blocks_bn: jax.Array | None = None,
    ) -> tuple[jax.Array, RouterStats | None]:
        """`hidden`, and the MoE layers' router statistics ([MoE layers, ...]; None for a
        dense decoder); `added_kbtd` [K, B, T, width]: DeepStack's features, added to the
        hidden states after each of the first K layers (zero where a token is not an image's);
        `order_bt`: each token's index in its document, under context groups with M-RoPE;
        `window_tiles_bk2`: the sliding-window layers' tiles, `spans_bt` the bidirectional
        spans (`attention.Packing`); `ids_bt`: as `hidden`'s; `blocks_bn`: under context
        groups by ulysses, each of a device's blocks' index in its group's rows (`llm_blocks`),
        which the linear layers need."""
        pack = self.packing(segment_ids_bt, tiles_bk2, row, order_bt, window_tiles_bk2, spans_bt)
        if pack.context and self.in_order:  # (once a step, for every linear layer)
            if blocks_bn is None:
                raise ValueError("ulysses' linear layers need the batch's llm_blocks")
            pack = dataclasses.replace(pack, group_order=ctx.group_order(blocks_bn, self.block))
        per_layer = self.per_layer_inputs(x_btd, ids_bt)
        h, stats = self.transformer.run(
            x_btd, pack, positions_bt, added=added_kbtd, per_layer=per_layer
        )
        return self.transformer.norm(h), stats

    def per_layer_inputs(self, x_btd: jax.Array, ids_bt: jax.Array | None) -> jax.Array | None:
        """Each layer's per-layer input [L, B, T, P] of the input embeddings and the ids
        (`models.per_layer`); None where the decoder has none.

        Raises:
          ValueError: the decoder has per-layer inputs and no ids were given.
        """
        if self.per_layer is None:
            return None
        if ids_bt is None:
            raise ValueError(
                "the decoder's per-layer inputs (model.llm.per_layer_dim) read a table by token "
                "id: pass ids_bt beside the embeddings"
            )
        return self.per_layer(x_btd, ids_bt)

    def packing(
        self,
        segment_ids_bt: jax.Array,
        tiles_bk2: jax.Array | None = None,
        row: int = 0,
        order_bt: jax.Array | None = None,
        window_tiles_bk2: jax.Array | None = None,
        spans_bt: jax.Array | None = None,
    ) -> Packing:
        """Causal attention within each packed document (arguments as in `hidden_and_router`)."""
        return packing(
            segment_ids_bt,
            causal=True,
            kind=self.attention,
            tiles_bk2=tiles_bk2,
            block=self.block,
            documents=self.documents,
            context=self.grouped,  # split over the mesh's context groups
            row=row,
            order_bt=order_bt,
            window_tiles_bk2=window_tiles_bk2,
            spans_bt=spans_bt,
            ulysses=self.ulysses,
        )

    def head(self) -> tuple[jax.Array, bool, float]:
        """The output projection (weight, rows_first, divisor): the tied table [vocab, width]
        or the head kernel [width, vocab]; logits = h . weight / divisor."""
        if self.lm_head is None:
            return self.embed.embedding[...], True, self.tied_divisor
        return self.lm_head.kernel[...], False, 1.0

    def logits(self, h_btd: jax.Array) -> jax.Array:
        """Float32 logits of final hidden states: the output projection, or the tied table;
        soft-capped where the decoder caps them (`model.llm.logit_softcap`)."""
        if self.lm_head is None:
            logits = self.embed.attend(h_btd) / self.tied_divisor
        else:
            logits = self.lm_head(h_btd)
        return soft_capped(logits, self.softcap)


def soft_capped(logits: jax.Array, cap: float) -> jax.Array:
    """cap x tanh(logits / cap) (Gemma's final_logit_softcapping); cap 0: the logits."""
    return cap * jnp.tanh(logits / cap) if cap else logits


def rope_kind(cfg: LLMConfig) -> str:
    """The decoder's rotary (`layers.ROPE`): 1d, or M-RoPE in sections or interleaved."""
    if not any(cfg.mrope_section):
        return "1d"
    return "mrope_interleaved" if cfg.mrope_interleaved else "mrope"


MLP_TARGETS = ("gate", "up", "down")  # a gated MLP's adapter targets (config.lora)


def kind_stacks(cfg: LLMConfig) -> list[tuple[str, LayerKind, tuple[int, ...]]]:
    """The decoder's stacks of layers: (attribute under `transformer`, their kind, the layers
    in it): one `blocks` of every layer, or each kind's apart (a mixture of experts' MoE and
    dense layers, a hybrid's linear and full-attention ones)."""
    kinds = [cfg.layer_kind(i) for i in range(cfg.depth)]
    places = layer_places([k.name for k in kinds])
    out = []
    for kind in dict.fromkeys(kinds):
        ids = tuple(i for i, k in enumerate(kinds) if k == kind)
        out.append((places[ids[0]][0], kind, ids))
    return out


def kv_sources(cfg: LLMConfig) -> dict[str, int]:
    """{kind: the layer whose keys and values its layers attend over} of the kinds of layers
    without their own (`LLMConfig.kv_source`: Gemma 4's last layers); {} where none."""
    out = {}
    for i in range(cfg.depth - cfg.kv_shared_layers, cfg.depth):
        out.setdefault(cfg.layer_kind(i).name, cfg.kv_source(i))
    return out


def layer_kinds(cfg: LLMConfig, spec: BlockSpec) -> tuple[dict | None, tuple[str, ...]]:
    """({kind: BlockSpec}, each layer's kind) of a decoder (`LLMConfig.layer_kind`): a mixture of
    experts' `moe` and `dense` layers, a hybrid's `linear` and `full` attention ones; (None,
    ()) for one kind of layer."""
    kinds = [cfg.layer_kind(i) for i in range(cfg.depth)]
    pattern = tuple(k.name for k in kinds)
    if not any(pattern):
        return None, ()
    # (the MLP targets adapt the routed experts, as PEFT does on transformers' MoE models: a
    # dense layer's MLP among them takes none; with a shared expert they adapt it, and a dense
    # layer's MLP, as PEFT matches their Linears: `moe.MoE`)
    attention = tuple((t, a) for t, a in spec.lora if t not in MLP_TARGETS)

    def spec_of(kind: LayerKind) -> BlockSpec:
        """The shared BlockSpec with the kind's own parts: its experts or, where dense among
        them, no MLP adapters; its linear attention; its sliding window, with the windowed
        layers' own rotary base (unscaled), reading the spans both ways; beside windows, the
        full layers' own head width, key-value heads and values from keys
        (`model.llm.full_*`); without keys and values of its own where it reuses another
        layer's, its MLP twice as wide with `kv_shared_wide_mlp`."""
        out = spec
        if kind.moe:
            out = dataclasses.replace(out, moe=MoESpec.of(cfg.moe, cfg.mlp))
        elif cfg.moe.enabled and not cfg.moe.shared_mlp_dim:
            out = dataclasses.replace(out, lora=attention)
        if kind.linear:
            out = dataclasses.replace(out, linear=LinearSpec.of(cfg.linear))
        if kind.sliding:
            w = cfg.window
            out = dataclasses.replace(
                out,
                window=w.size,
                rope_theta=w.rope_theta,
                rope_scaling=RopeScaling(),
                spans=True,
            )
        elif cfg.window.enabled and not kind.linear:  # (Gemma 4's full layers: their own)
            out = dataclasses.replace(
                out,
                head_dim=cfg.full_head_dim or out.head_dim,
                kv_heads=cfg.full_kv_heads or out.kv_heads,
                k_eq_v=cfg.full_k_eq_v,
            )
        if kind.kv_shared:
            wide = 2 if cfg.kv_shared_wide_mlp else 1
            out = dataclasses.replace(out, kv_shared=True, mlp_dim=wide * out.mlp_dim)
        return out

    return {k.name: spec_of(k) for k in dict.fromkeys(kinds)}, pattern


def chunked_token_losses(
    decoder: Decoder, h_dnw: jax.Array, targets_dn: jax.Array, loss_mask_dn: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Summed masked cross entropy over tokens, projecting `decoder.logits_chunk` at a time.

    A 152k vocabulary makes [tokens, vocab] fp32 logits the largest array of a step; the loss
    (`jaxmllm.models.loss`) projects one slice of every device's tokens at a time, once, and
    leaves the backward pass only a scaling, so a step holds [D, chunk, vocab] logits at most.
    Equal to the unchunked `token_losses` of the full logits up to float summation order.

    Args:
      decoder: the decoder whose output projection gives the logits.
      h_dnw: final hidden states [D, N, width] (D leads, so the data sharding stays).
      targets_dn: target ids [D, N].
      loss_mask_dn: float weights [D, N], 0 where a token carries no loss.

    Returns:
      (sum of loss * mask, sum of mask), float32 scalars.
    """
    weight, head, (h, targets, mask), _ = _sliced(decoder, h_dnw, targets_dn, loss_mask_dn)
    total = loss_sum(weight, h, targets, mask, head)
    return total, jnp.sum(loss_mask_dn.astype(jnp.float32))


def chunked_token_logps(decoder: Decoder, h_dnw: jax.Array, targets_dn: jax.Array) -> jax.Array:
    """Each token's target log-probability [D, N] (fp32), projecting `decoder.logits_chunk`
    tokens at a time (`jaxmllm.models.loss.token_logps`: no [tokens, vocab] logits held, in
    the forward pass or the backward)."""
    weight, head, (h, targets), unslice = _sliced(decoder, h_dnw, targets_dn)
    return unslice(token_logps(weight, h, targets, head))


def chunked_token_logps_and_entropy(
    decoder: Decoder, h_dnw: jax.Array, targets_dn: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """`chunked_token_logps`, and each token's next-token distribution's entropy [D, N]
    (`jaxmllm.models.loss.token_logps_and_entropy`: a metric, no gradient)."""
    weight, head, (h, targets), unslice = _sliced(decoder, h_dnw, targets_dn)
    logps, entropy = token_logps_and_entropy(weight, h, targets, head)
    return unslice(logps), unslice(entropy)


def _sliced(decoder: Decoder, h_dnw: jax.Array, *per_token: jax.Array) -> tuple:
    """(the output projection, its `Head`, `h_dnw` and the per-token arrays [D, N] cut into
    [C, D, chunk(, width)] slices, the inverse for a per-token result [C, D, chunk])."""
    d, n, _ = h_dnw.shape
    chunk = min(decoder.logits_chunk, n)
    pad = -n % chunk
    padded = [
        jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) for x in (h_dnw, *per_token)
    ]
    slices = lambda x: jnp.moveaxis(x.reshape(d, -1, chunk, *x.shape[2:]), 1, 0)
    unslice = lambda x: jnp.moveaxis(x, 0, 1).reshape(d, -1)[:, :n]
    weight, rows_first, divisor = decoder.head()
    size = weight.shape[0] if rows_first else weight.shape[1]
    # The projection split by vocabulary rows over the model axes (jaxmllm.models.vocab).
    axes = vocab_axes(size, d) if decoder.vocab_parallel else ()
    head = Head(rows_first, divisor, axes, decoder.dtype, decoder.softcap)
    return weight, head, [slices(x) for x in padded], unslice
