"""KV-cache decoding of a `MultimodalLM`: prefill a batch of prompts, then one token a step.

A prompt batch is a microbatch of the batch contract (`jaxmllm.batch.prompts`): B buckets of
one right-padded row of P tokens each, with that prompt's images and clips. Prefill
embeds it exactly as training does (`MultimodalLM.inputs`: token embeddings, encoders,
projectors, placeholder slots) and runs the decoder's scanned block over it, writing every
layer's keys and values into a cache of a fixed total length S; a step embeds one new token per
row, writes its keys and values at the row's next index and attends over the cache. Prefill and
step are each one compiled program whatever the prompts, as long as (B, P, S) and the encoder
buckets stay.

Row b's tokens sit at cache indices 0, 1, ... (right padding): a query attends to the keys at
indices up to its own. Rotary positions are the batch's own (`llm_positions`: the index, or
M-RoPE's (time, row, column)), and a generated token's is given with it (`step`). Padding
queries of a short prompt write garbage keys past the prompt; the row's generated tokens
overwrite them before any query can reach them.

The block's own sub-modules do the work (`attn_norm`, `attn.project`, `attn.output`,
`mlp_branch`), so a cached key is exactly the key training computes. Prefill's attention
is training's own over the prompt rows (`attention.packing`: the run's block-sparse tiles or
cuDNN's segments, or a dense causal mask), never over the cache's empty S - P positions; a
step's is the dense attention of one query over the cache under a [B, 1, 1, S] mask. A layer
with a sliding window W shorter than S (Gemma's local layers) keeps a ring of W slots instead:
the token at index i sits in slot i % W, overwriting the one W before it, which no later query
sees; prefill fills each slot with the row's last prompt token that maps to it. A layer that
reuses an earlier layer's keys and values (Gemma 4's last layers, `Transformer.kv_sources`)
keeps no cache: prefill attends over that layer's keys of the prompt, computed again from its
input as training does, and a step over that layer's cache with the new token's keys written in,
which is the cache that layer returns. A
linear-attention layer (Gated DeltaNet) caches its convolution's last inputs and its state instead
(`GatedDeltaNet.extend`): a prompt runs the chunked rule from the empty state, a step the rule
for one token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmllm.models.attention import Packing, dense_attention, packing
from jaxmllm.models.deltanet import GatedDeltaNet
from jaxmllm.models.mllm import MultimodalLM
from jaxmllm.models.transformer import layer_places


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Cache:
    """Every decoder layer's keys and values, stacked like the layers' parameters: per kind of
    layer (one, `""`, unless a mixture of experts or a hybrid stacks its kinds apart); a
    linear-attention layer's (Gated DeltaNet) are its convolution's window and its state."""

    # kind -> [its layers, B, S (a windowed kind: min(window, S)), kv_heads, head_dim], in the
    # compute dtype
    k: dict[str, jax.Array]
    v: dict[str, jax.Array]
    # linear kinds: [its layers, B, conv_width - 1, key heads, group], compute dtype
    window: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    state: dict[str, jax.Array] = dataclasses.field(default_factory=dict)  # [layers, B, ...]
    length: int = dataclasses.field(default=0, metadata=dict(static=True))  # S


def empty_cache(model: MultimodalLM, rows: int, length: int) -> Cache:
    """A zero cache for `rows` prompts of at most `length` tokens in all."""
    transformer = model.llm.transformer
    k, v, window, state = {}, {}, {}, {}
    for kind in transformer.kinds:
        attn = transformer.stack(kind).attn
        if isinstance(attn, GatedDeltaNet):
            s = attn.spec
            depth, taps, heads, group = attn.conv.shape  # [layers, taps, key heads, group]
            window[kind] = jnp.zeros((depth, rows, taps - 1, heads, group), attn.dtype)
            r = s.value_heads // s.key_heads
            shape = (depth, rows, s.key_heads, r, s.key_dim, s.value_dim)
            state[kind] = jnp.zeros(shape, jnp.float32)
            continue
        if attn.key is None:  # (its layers read another's keys and values: no cache)
            continue
        depth, _, kv_heads, head_dim = attn.key.kernel.shape  # [layers, width, kv, head_dim]
        slots = min(attn.window, length) if attn.window else length
        k[kind] = v[kind] = jnp.zeros((depth, rows, slots, kv_heads, head_dim), attn.dtype)
    return Cache(k, v, window, state, length)


def prefill(
    model: MultimodalLM, mb: dict[str, jax.Array], length: int, pack: Packing | None = None
) -> tuple[jax.Array, Cache]:
    """Runs the prompts; returns each row's next-token logits and the filled cache.

    Args:
      model: the model (the encoders use its attention kind: build it with dense attention for
        prompt batches, which carry no encoder tile lists).
      mb: one prompt batch [B, 1, P, ...] (`jaxmllm.batch.prompts.prompt_batch`).
      length: S, the cache's length (prompt and generated tokens of a row), >= P.
      pack: how the decoder's attention layers score the prompt among itself, as training
        does (`attention.packing` of the prompt rows' segment ids: block-sparse tiles, cuDNN's
        segments, or a dense causal mask, the default); the cache is not read, so nothing
        scores the S - P positions no prompt token may see.

    Returns:
      (logits [B, vocab] float32 at each row's last prompt token, cache).
    """
    x_brpw, added_kbrpw = model.inputs_and_added(mb)
    x_bpw = x_brpw[:, 0]
    added = None if added_kbrpw is None else added_kbrpw[:, :, 0]  # (DeepStack's)
    rows = x_bpw.shape[0]
    positions_bp = mb["llm_positions"][:, 0]
    valid_bp = mb["llm_segment_ids"][:, 0] > 0
    lengths_b = valid_bp.sum(-1)
    start_b = jnp.zeros((rows,), jnp.int32)
    cache = empty_cache(model, rows, length)
    spans = mb["llm_spans"][:, 0] if "llm_spans" in mb else None  # (images both ways)
    pack = pack or packing(mb["llm_segment_ids"][:, 0], causal=True, spans_bt=spans)
    per_layer = model.llm.per_layer_inputs(x_bpw, model.per_layer_ids(mb, valid_bp.shape))
    h_bpw, cache = _decode(
        model, x_bpw, positions_bp, start_b, cache, valid_bp, added, pack, per_layer
    )
    last_bw = jnp.take_along_axis(h_bpw, jnp.maximum(lengths_b - 1, 0)[:, None, None], axis=1)
    return model.llm.logits(last_bw)[:, 0], cache


def step(
    model: MultimodalLM,
    tokens_b: jax.Array,
    index_b: jax.Array,
    cache: Cache,
    positions_b: jax.Array | None = None,
) -> tuple[jax.Array, Cache]:
    """One new token per row at cache index `index_b`: its logits, the cache.

    Args:
      tokens_b: the token each row appends [B].
      index_b: where it goes in each row [B] (the row's tokens so far).
      positions_b: its rotary position [B]; default its index. With M-RoPE (Qwen2-VL) text
        after an image counts on from the image's position plus its grid's longer side, so a
        row's positions run ahead of (or behind) its indices by a fixed delta; a generated
        token takes the same position in time, row and column.

    Returns:
      (logits [B, vocab] float32 for the token after it, the cache with its keys and values).
    """
    x_b1w = model.llm.embed(tokens_b[:, None])
    positions_b1 = (index_b if positions_b is None else positions_b)[:, None]
    transformer = model.llm.transformer
    rope = lambda k: getattr(transformer.stack(k).attn, "rope", "")  # (a linear layer has none)
    if any(rope(k).startswith("mrope") for k in transformer.kinds):
        positions_b1 = jnp.repeat(positions_b1[..., None], 3, axis=-1)  # [B, 1, 3]
    per_layer = model.llm.per_layer_inputs(x_b1w, tokens_b[:, None])
    h_b1w, cache = _decode(model, x_b1w, positions_b1, index_b, cache, None, per_layer=per_layer)
    return model.llm.logits(h_b1w)[:, 0], cache


def _decode(
    model: MultimodalLM,
    x_btw: jax.Array,
    positions_bt: jax.Array,
    start_b: jax.Array,
    cache: Cache,
    valid_bt: jax.Array | None,
    added_kbtw: jax.Array | None = None,
    pack: Packing | None = None,
    per_layer: jax.Array | None = None,
) -> tuple[jax.Array, Cache]:
    """The decoder's scanned block over T new tokens per row written at cache indices
    start_b, start_b + 1, ... (rotary positions [B, T], or [B, T, 3] with M-RoPE; `valid_bt`:
    a prompt's tokens, None: every one; DeepStack's additions after the first K layers,
    `added_kbtw`; each layer's per-layer input [L, B, T, P], `per_layer`); returns the final
    hidden states [B, T, width] and the cache. With `pack` (prefill: the rows start empty), the
    T tokens attend among themselves as `pack` says; without, each attends over the cache up to
    its own index, densely."""
    transformer = model.llm.transformer
    graphdefs = {k: nnx.graphdef(transformer.stack(k)) for k in transformer.kinds}
    t, s = x_btw.shape[1], cache.length
    index_bt = start_b[:, None] + jnp.arange(t)
    valid_bt = jnp.ones(x_btw.shape[:2], bool) if valid_bt is None else valid_bt

    def attend(attn, q_bthe, k_bthe, v_bthe, k_bske, v_bske) -> jax.Array:
        """The new queries over the new keys (prefill, by `pack`) or the cache (a step)."""
        if pack is not None:
            return attn.attend(q_bthe, k_bthe, v_bthe, pack, positions_bt)
        mask = _seen(index_bt, k_bske.shape[1])
        return dense_attention(q_bthe, k_bske, v_bske, mask, attn.dtype)

    def written(k_bske, v_bske, k_bthe, v_bthe) -> tuple[jax.Array, jax.Array]:
        """A layer's cache with the new keys and values in (a ring: the prompt's last)."""
        slots = k_bske.shape[1]  # (S, or a windowed layer's ring: `empty_cache`)
        if pack is not None and slots < s:  # (a prompt into a ring: its last tokens)
            return _fill(k_bske, k_bthe, valid_bt), _fill(v_bske, v_bthe, valid_bt)
        return _write(k_bske, k_bthe, start_b % slots), _write(v_bske, v_bthe, start_b % slots)

    def finish(block, x_btw, out_btw, j) -> jax.Array:
        """The layer's output of its attention's: the MLP, the per-layer input, the scalar."""
        x_btw = x_btw + block.attn_out(out_btw)
        x_btw = x_btw + block.mlp_out(block.mlp_branch(x_btw)[0])
        own = None if per_layer is None else jax.lax.dynamic_index_in_dim(per_layer, j, 0, False)
        return block.finished(x_btw, own)

    def layer(kind, block_state, x_btw, cached, j):
        block = nnx.merge(graphdefs[kind], block_state)
        h_btw = block.attn_norm(x_btw)
        if isinstance(block.attn, GatedDeltaNet):  # (its convolution's window and its state)
            out_btw, *cached = block.attn.extend(h_btw, *cached, valid_bt)
        else:
            q_bthe, k_bthe, v_bthe, gate = block.attn.project(h_btw, positions_bt)
            cached = written(*cached, k_bthe, v_bthe)
            out_bthe = attend(block.attn, q_bthe, k_bthe, v_bthe, *cached)
            out_btw = block.attn.output(out_bthe, gate)
        return finish(block, x_btw, out_btw, j), tuple(cached)

    def reuse(inputs):  # (the layers reading an earlier layer's keys and values)
        new = transformer.shared_kv(inputs, positions_bt)
        kv = {}
        for kind, source in transformer.kv_sources.items():
            own, at = transformer.pattern[source], layer_places(transformer.pattern)[source][1]
            kv[kind] = (*new[kind], *written(cache.k[own][at], cache.v[own][at], *new[kind]))

        def reusing(kind, block_state, x_btw, _, j):
            block = nnx.merge(graphdefs[kind], block_state)
            q_bthe, gate = block.attn.project_query(block.attn_norm(x_btw), positions_bt)
            out_btw = block.attn.output(attend(block.attn, q_bthe, *kv[kind]), gate)
            return finish(block, x_btw, out_btw, j), ()

        return reusing

    held = {**{k: (cache.k[k], cache.v[k]) for k in cache.k}}
    held.update({k: (cache.window[k], cache.state[k]) for k in cache.window})
    x_btw, ys = transformer.scan(layer, x_btw, held, added=added_kbtw, reuse=reuse)
    k = {kind: ys[kind][0] for kind in cache.k}
    v = {kind: ys[kind][1] for kind in cache.k}
    window = {kind: ys[kind][0] for kind in cache.window}
    state = {kind: ys[kind][1] for kind in cache.window}
    return transformer.final_norm(x_btw), Cache(k, v, window, state, s)


def _seen(index_bt: jax.Array, slots: int) -> jax.Array:
    """Which cache slots a query at index i sees, [B, 1, T, slots]: slot j holds the token at
    i - ((i - j) mod slots), the latest written there (tokens sit at index mod slots), and is
    seen when that index is 0 or more. With slots = S that is every index up to i; with a
    windowed layer's ring (slots = W) the W indices i - W + 1 .. i, its window, as training's
    `attention.windowed`: key index > query index - W."""
    held_bts = index_bt[:, :, None] - (index_bt[:, :, None] - jnp.arange(slots)) % slots
    return (held_bts >= 0)[:, None]


def _fill(ring_bwe: jax.Array, new_bthe: jax.Array, valid_bt: jax.Array) -> jax.Array:
    """A ring of W slots filled from a prompt of T tokens starting at index 0: slot j takes
    the row's last prompt token whose index is j mod W (the row's length from `valid_bt`; a
    slot no prompt token reaches stays zero, unseen until a step writes it)."""
    w = ring_bwe.shape[1]
    last_b1 = valid_bt.sum(-1, keepdims=True) - 1
    held_bw = last_b1 - (last_b1 - jnp.arange(w)) % w  # (the index slot j holds)
    rows_bwhe = jnp.take_along_axis(new_bthe, jnp.maximum(held_bw, 0)[:, :, None, None], axis=1)
    return jnp.where((held_bw >= 0)[:, :, None, None], rows_bwhe, 0).astype(ring_bwe.dtype)


def _write(cache_bske: jax.Array, new_bthe: jax.Array, start_b: jax.Array) -> jax.Array:
    """Each row's new entries written at its own start index."""
    write = lambda c, n, i: jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), i, axis=0)
    return jax.vmap(write)(cache_bske, new_bthe, start_b)


def pick(
    logits_bv: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array
) -> jax.Array:
    """The next token of each row: the most likely at temperature 0, else a sample of the
    softmax at that temperature restricted to the smallest set of tokens whose probability
    reaches `top_p` (nucleus sampling; 1.0 keeps every token).

    Temperature and top_p are traced, so changing them reuses the compiled program.
    """
    greedy_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    scaled_bv = logits_bv / jnp.maximum(temperature, 1e-6)
    sorted_bv = jnp.sort(scaled_bv, axis=-1, descending=True)
    probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
    # A token stays if the tokens more likely than it hold less than top_p (the first always).
    before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
    kept = jnp.sum(before_bv < top_p, axis=-1, keepdims=True)
    threshold_b1 = jnp.take_along_axis(sorted_bv, jnp.maximum(kept - 1, 0), axis=-1)
    masked_bv = jnp.where(scaled_bv >= threshold_b1, scaled_bv, -jnp.inf)
    sampled_b = jax.random.categorical(key, masked_bv, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled_b, greedy_b)
