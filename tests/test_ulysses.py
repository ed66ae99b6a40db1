"""Context parallelism by the ulysses strategy (issue 57), kernel and layer level.

Attention: context groups' rows dealt to their ranks, attended by all-to-alls over the context
axis (heads for tokens), the group's whole tile list on every rank and all-to-alls back, equal
dense attention over each whole group row (outputs and the gradients of q, k and v), with
fewer KV heads than the group (repeated), heads split over tensor first, and a sliding window.
Gated DeltaNet: the layer over dealt rows (tokens out of order on each rank) equals the layer
over the whole rows, its outputs and every gradient; unpermuted (the tokens left in the
gathered rank order) it does not. The model's same math: `tests/test_context.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_context import _random_docs

import sharding
from jaxmllm.models import blocksparse
from jaxmllm.models import context as ctx
from jaxmllm.models.attention import (
    Packing,
    attention_mask,
    dense_attention,
    packing,
    windowed,
)
from jaxmllm.models.deltanet import GatedDeltaNet, LinearSpec
from jaxmllm.plan import context as split
from jaxmllm.plan import tiles


def _dealt_groups(rng, groups: int, ranks: int, block: int, row_blocks: int, window: int = 0):
    """Per group a row of random documents dealt to `ranks` ranks: (segment ids [G, S],
    positions in documents [G, S], each rank's token indices into its group row [G, C, T],
    each rank's tile list [G, C, cap, 2], per group its tile list in row blocks); the windowed
    lists with `window`."""
    s_len = block * row_blocks
    segs, poss, toks, lists, groups_ = [], [], [], [], []
    for _ in range(groups):
        off, size, row = _random_docs(rng, s_len, 1, 21)
        seg, pos = np.zeros(s_len, np.int32), np.zeros(s_len, np.int32)
        for i, (o, n) in enumerate(zip(off.tolist(), size.tolist(), strict=True)):
            seg[o : o + n], pos[o : o + n] = i + 1, np.arange(n)
        group = tiles.tile_list(off, size, row, row_blocks, block, True)
        owner = split.deal(split.block_weights(group, row_blocks), ranks)
        if window:
            reach = tiles.window_reach(window, block)
            group = tiles.tile_list(off, size, row, row_blocks, block, True, reach)
        lay = split.layout(owner, ranks)
        toks.append((lay[..., None] * block + np.arange(block)).reshape(ranks, -1))
        lists.append(split.rank_tiles(group, owner, ranks, row_blocks * row_blocks))
        segs.append(seg), poss.append(pos), groups_.append(group.tolist())
    return (*map(np.stack, (segs, poss, toks, lists)), groups_)


def _dealt(x_gs, tok_gct):
    """Group rows [G, S, ...] -> each rank's dealt tokens [G * C, T, ...]."""
    g, c, t = tok_gct.shape
    return jnp.take_along_axis(
        x_gs, tok_gct.reshape(g, c * t, *([1] * (x_gs.ndim - 2))), axis=1
    ).reshape(g * c, t, *x_gs.shape[2:])


def _undealt(x_dt, tok_gct):
    """`_dealt`'s inverse: each rank's tokens back into their group rows [G, S, ...]."""
    g, c, t = tok_gct.shape
    x = x_dt.reshape(g, c * t, *x_dt.shape[2:])
    at = jnp.argsort(tok_gct.reshape(g, -1), axis=1)
    return jnp.take_along_axis(x, at.reshape(*at.shape, *([1] * (x.ndim - 2))), axis=1)


@pytest.mark.parametrize(
    "mesh, heads, kv, window",
    [("data=2 context=4", 4, 1, 0), ("data=2 context=2 tensor=2", 4, 2, 5)],
)
def test_ulysses_attention_of_dealt_rows_is_dense_attention(mesh, heads, kv, window, monkeypatch):
    """Two groups of random documents, each dealt to its ranks: ulysses' attention equals dense
    attention over each group row, outputs and gradients (1 KV head for 4 ranks: repeated 4
    times; heads split over tensor=2, then context=2, each rank's KV head repeated 2 times,
    with a window of 5 over the windowed lists), and equals the gather strategy's."""
    monkeypatch.setattr(blocksparse, "CHUNK_SCORES", 5 * 4 * 4 * 4)  # (several chunks)
    sizes = {k: int(v) for k, v in (w.split("=") for w in mesh.split())}
    sizes = {"data": 1, "fsdp": 1, "tensor": 1} | sizes
    c, block, row_blocks, e = sizes["context"], 4, 16, 8
    rng = np.random.default_rng(7)
    seg, pos, tok, lists, _ = _dealt_groups(rng, sizes["data"], c, block, row_blocks, window)
    groups, s_len = seg.shape
    q, k, v, w = (
        jnp.asarray(rng.normal(size=(groups, s_len, h, e)), jnp.float32)
        for h in (heads, kv, kv, heads)
    )
    real = jnp.asarray(seg > 0)[..., None, None]
    rank_seg, rank_pos = _dealt(jnp.asarray(seg), tok), _dealt(jnp.asarray(pos), tok)
    rank_tiles = jnp.asarray(lists.reshape(groups * c, *lists.shape[2:]))
    mesh = sharding.make_mesh(sizes)

    def split_loss(attend, q, k, v):
        args = (_dealt(q, tok), _dealt(k, tok), _dealt(v, tok), rank_seg, rank_pos, rank_tiles)
        out = attend(*args, block=block, causal=True, window=window)
        out = _undealt(out, tok)
        return jnp.sum(jnp.where(real, out * w, 0.0)), out

    def dense_loss(q, k, v):
        mask = attention_mask(jnp.asarray(seg), causal=True)
        mask = windowed(mask, window) if window else mask
        out = dense_attention(q, k, v, mask, jnp.float32)
        return jnp.sum(jnp.where(real, out * w, 0.0)), out

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
    with jax.set_mesh(mesh):
        (got, out_u), g_u = grad(lambda *a: split_loss(ctx.ulysses_attend, *a))(q, k, v)
        (gathered, _), g_g = grad(lambda *a: split_loss(ctx.attend, *a))(q, k, v)
    (want, out_d), g_d = grad(dense_loss)(q, k, v)
    np.testing.assert_allclose(np.where(real, out_u, 0), np.where(real, out_d, 0), atol=2e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got, gathered, rtol=1e-5)
    for a, b, g in zip(g_u, g_d, g_g, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(a, g, rtol=1e-4, atol=1e-5)


def test_group_tiles_are_the_union_of_the_ranks_lists_in_the_gathered_order():
    """Every tile of a group's rows, once, each rank's query blocks renumbered into the
    gathered order (two groups: each gets its own)."""
    rng = np.random.default_rng(3)
    c, block, row_blocks = 4, 4, 16
    _, _, tok, lists, group = _dealt_groups(rng, 2, c, block, row_blocks)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "context": c, "tensor": 1})
    spec = jax.sharding.PartitionSpec(("data", "context"))
    body = lambda t: ctx.group_tiles(t, row_blocks // c)
    with jax.set_mesh(mesh):
        got = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(
            jnp.asarray(lists.reshape(-1, *lists.shape[2:]))
        )
    got = np.asarray(got).reshape(2, c, -1, 2)
    for g in range(2):
        assert (got[g] == got[g, :1]).all()  # (every rank of a group: the same list)
        blocks = tok[g].reshape(-1, block)[:, 0] // block  # gathered block -> its row block
        real = got[g, 0][got[g, 0, :, 0] >= 0]
        assert len(real) == len(group[g])
        assert {(blocks[q], blocks[k]) for q, k in real.tolist()} == set(map(tuple, group[g]))


def _linear_loss(graphdef, x_gsd, w_gsd, seg_gs, tok, block: int, order: str):
    """Loss of a Gated DeltaNet layer over group rows (`order`: "whole" rows unsplit; "dealt"
    to the ranks by ulysses; "unordered": dealt, the gathered tokens left in rank order)."""
    real = (seg_gs > 0)[..., None]

    def loss(state, x):
        layer = nnx.merge(graphdef, state)
        if order == "whole":
            out = layer(x, packing(seg_gs, causal=True))
        else:
            seg = _dealt(seg_gs, tok)
            g, c, t = tok.shape
            blocks = tok.reshape(g * c, -1, block)[..., 0] // block  # (`llm_blocks`)
            perm = ctx.group_order(jnp.asarray(blocks, jnp.int32), block)
            if order == "unordered":
                every = jnp.broadcast_to(
                    jnp.arange(perm[0].shape[1], dtype=jnp.int32), perm[0].shape
                )
                perm = (every, every)
            # (the layer reads a packing's segment ids, and under ulysses its group order)
            pack = Packing(seg, group_order=perm, row=t)  # (a group's row: C x t tokens)
            out = _undealt(layer(_dealt(x, tok), pack), tok)
        return jnp.sum(jnp.where(real, out * w_gsd, 0.0)), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


# (4 key heads over data=2 context=4, and 2 repeated over tensor=2 context=2 (keys=2): the slow
# model-level hybrid cases of tests/test_context.py, which hold every gradient to the same bound;
# this layer-level case, the cheapest (~6 s against ~11 s with repeats), is the layout they
# leave)
@pytest.mark.parametrize("mesh", ["data=2 context=2 tensor=2"])
def test_gated_deltanet_over_dealt_rows_is_the_layer_over_whole_rows(mesh):
    """Two groups of random documents dealt to their ranks (blocks out of order): the layer by
    ulysses (its 4 key heads over tensor=2 then context=2; with `keys=2`, 2 key heads, one a
    tensor rank, repeated for 2 context ranks, each copy with 2 of its 4 value heads) equals
    the layer over each whole row: outputs and the gradients of the inputs and every
    parameter, each to 1e-4 of its tensor's largest entry (float32's rounding: in float64 the
    repeated heads' case agrees to 3e-15 of it, where in float32 one entry of 4096 of the
    inputs' gradient misses atol=1e-5 rtol=1e-4 by 4e-7). Left in the gathered (rank) order,
    the same layer is far off."""
    sizes = {k: int(v) for k, v in (w.split("=") for w in mesh.split())}
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, "keys": 4} | sizes
    c, block, row_blocks, width = sizes["context"], 4, 16, 32
    rng = np.random.default_rng(11)
    seg, _, tok, _, _ = _dealt_groups(rng, sizes["data"], c, block, row_blocks)
    keys = sizes.pop("keys")
    spec = LinearSpec(key_heads=keys, value_heads=8, key_dim=8, value_dim=8, chunk=16)
    graphdef, state = nnx.split(GatedDeltaNet(width, spec, rngs=nnx.Rngs(0)))
    x, w = (jnp.asarray(rng.normal(size=(*seg.shape, width)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(seg)
    mesh = sharding.make_mesh(sizes)
    run = lambda order: _linear_loss(graphdef, x, w, seg, tok, block, order)(state, x)
    (want, out_w), (gs_w, gx_w) = run("whole")
    with jax.set_mesh(mesh):
        (got, out_d), (gs_d, gx_d) = run("dealt")
        (off, _), _ = run("unordered")
    real = np.asarray(seg > 0)[..., None]
    np.testing.assert_allclose(np.where(real, out_d, 0), np.where(real, out_w, 0), atol=2e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    same = lambda a, b, msg="": np.testing.assert_allclose(
        a, b, rtol=0, atol=1e-4 * np.abs(b).max(), err_msg=msg
    )
    same(np.asarray(gx_d), np.asarray(gx_w))
    want_params = dict(nnx.to_flat_state(gs_w))
    for path, a in nnx.to_flat_state(gs_d):
        same(np.asarray(a[...]), np.asarray(want_params[path][...]), str(path))
    assert abs(off - want) > 100 * abs(got - want) + 1e-3  # (the permutation matters)
