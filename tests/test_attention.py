"""Block-sparse attention: the same math as the dense reference, and tile lists that are exact.

Same math: loss and every gradient (fp32) of the whole model with block-sparse attention equal
those with the dense masked reference, on random packs of every phase, including one-token
documents, a document filling a whole row, empty rows and documents crossing tile boundaries.
Tiles: the list a bucket gets covers exactly the tiles its documents need (each once, checked
against a per-document enumeration), and planned steps never exceed their tile capacity.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_models import (
    CFG,
    assert_trees_close,
    build_batch,
    make_sample,
    model_fns,
)

from jaxmllm.batch.bucketize import window_tile_cap
from jaxmllm.config import BatchConfig
from jaxmllm.models import blocksparse
from jaxmllm.models.attention import attention_mask, dense_attention, windowed
from jaxmllm.plan import tiles

BLOCK = 4
SPARSE_BATCH = BatchConfig(
    llm_rows=2,
    llm_row_len=40,
    vision_patches=48,
    audio_frames=64,  # 16 encoder rows
    route_pair_capacity=0,
    planner="first_fit",
    attention_block=BLOCK,
)
SPARSE = dataclasses.replace(CFG, attention="block_sparse")
DENSE = dataclasses.replace(CFG, attention="dense")


def with_tiles(mb: dict, block: int = BLOCK) -> dict:
    """The batch plus each phase's tile list, as bucketize makes them (capacity: the most)."""
    out = dict(mb)
    for phase, seg, causal in (
        ("llm", mb["llm_segment_ids"], True),
        ("vision", mb["vision_segment_ids"][:, None], False),
        ("audio", mb["audio_segment_ids"][:, None, ::4], False),
    ):
        need = [len(tiles.tile_list(*_docs(s), s.shape[-1] // block, block, causal)) for s in seg]
        out[f"{phase}_tiles"] = tiles.from_segments(seg, block, causal, max(need) + 3)
    return out


def _docs(seg_rt: np.ndarray):
    """(offsets, sizes, rows) of the documents (runs of one non-zero id) of rows [R, T]."""
    offs, sizes, rows = [], [], []
    for r, row in enumerate(seg_rt):
        t = 0
        while t < len(row):
            if row[t] == 0:
                t += 1
                continue
            end = t
            while end < len(row) and row[end] == row[t]:
                end += 1
            offs.append(t), sizes.append(end - t), rows.append(r)
            t = end
    return (np.array(x, np.int64) for x in (offs, sizes, rows))


# ----------------------------------------------------------------------------- the kernel


def _random_rows(rng, b, t, max_doc):
    """Segment ids [b, t]: documents of 1..max_doc tokens one after another, padding after."""
    seg = np.zeros((b, t), np.int32)
    for i in range(b):
        pos, sid = 0, 1
        while True:
            n = int(rng.integers(1, max_doc + 1))
            if pos + n > t - int(rng.integers(0, 3)):
                break
            seg[i, pos : pos + n] = sid
            pos, sid = pos + n, sid + 1
    return seg


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block", [1, 4, 8])
def test_kernel_equals_dense_reference_with_grouped_heads(causal, block):
    rng = np.random.default_rng(block + 10 * causal)
    b, t, heads, kv, e = 3, 32, 4, 2, 8
    seg = _random_rows(rng, b, t, 13)
    seg[2] = 0  # an empty row
    seg[1, :] = 5  # a document filling the whole row
    lists = [tiles.tile_list(*_docs(s[None]), t // block, block, causal) for s in seg]
    need = max(1, *(len(x) for x in lists))
    tl = tiles.from_segments(seg[:, None], block, causal, need + 2)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, e)), jnp.float32) for h in (heads, kv, kv))
    real = jnp.asarray(seg > 0)[..., None, None]
    weights = jnp.asarray(rng.normal(size=(b, t, heads, e)), jnp.float32)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.where(real, fn(q, k, v) * weights, 0.0))

    sparse = lambda q, k, v: blocksparse.attend(
        q, k, v, jnp.asarray(seg), jnp.asarray(tl), block=block, causal=causal
    )
    dense = lambda q, k, v: dense_attention(
        q, k, v, attention_mask(jnp.asarray(seg), causal=causal), jnp.float32
    )
    got = jax.value_and_grad(lambda *a: loss(sparse, *a), argnums=(0, 1, 2))(q, k, v)
    want = jax.value_and_grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 6])
def test_a_windowed_kernel_equals_the_windowed_dense_reference(window):
    """Sliding windows (Gemma's local layers) in the block-sparse kernel: the output and every
    gradient equal the dense reference under its windowed mask (`attention.windowed`), over
    packed documents longer than the window that cross blocks; and the window matters (the
    output differs from the whole document's)."""
    rng = np.random.default_rng(window)
    b, t, heads, kv, e, block = 2, 32, 4, 2, 8, 4
    seg = _random_rows(rng, b, t, 13)
    seg[1, :] = 3  # a document filling the whole row
    lists = [tiles.tile_list(*_docs(s[None]), t // block, block, True) for s in seg]
    tl = jnp.asarray(tiles.from_segments(seg[:, None], block, True, max(map(len, lists)) + 1))
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, e)), jnp.float32) for h in (heads, kv, kv))
    real = jnp.asarray(seg > 0)[..., None, None]
    weights = jnp.asarray(rng.normal(size=(b, t, heads, e)), jnp.float32)
    mask = attention_mask(jnp.asarray(seg), causal=True)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.where(real, fn(q, k, v) * weights, 0.0))

    sparse = lambda q, k, v: blocksparse.attend(
        q, k, v, jnp.asarray(seg), tl, block=block, causal=True, window=window
    )
    dense = lambda q, k, v: dense_attention(q, k, v, windowed(mask, window), jnp.float32)
    whole = lambda q, k, v: dense_attention(q, k, v, mask, jnp.float32)
    got = jax.value_and_grad(lambda *a: loss(sparse, *a), argnums=(0, 1, 2))(q, k, v)
    want = jax.value_and_grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert abs(float(loss(whole, q, k, v)) - float(got[0])) > 1e-2


# ----------------------------------------------------------------------------- the model


def _random_pack(rng):
    """Two devices of two rows each: random samples (images, clips, one-token documents) packed
    until full, the first row of device 0 one whole-row document, device 1's last row empty."""
    rows = [[[], []], [[], []]]
    length = SPARSE_BATCH.llm_row_len
    full = make_sample(rng, length - 1)
    rows[0][0] = [full]
    patches = {0: 0, 1: 0}
    frames = {0: 0, 1: 0}
    for dev, row in ((0, 1), (1, 0)):
        used = 0
        while True:
            kind = int(rng.integers(0, 4))
            side = 2 * int(rng.integers(1, 3)) if kind == 1 else 0
            audio = 4 * int(rng.integers(1, 5)) if kind == 2 else 0
            text = 0 if kind == 3 else int(rng.integers(1, 9))
            if patches[dev] + side * side > SPARSE_BATCH.vision_patches:
                side = 0
            if frames[dev] + audio > SPARSE_BATCH.audio_frames:
                audio = 0
            sample = make_sample(rng, text, image_side=side, audio_frames=audio)
            if used + len(sample.tokens) > length:
                break
            rows[dev][row].append(sample)
            used += len(sample.tokens)
            patches[dev] += side * side
            frames[dev] += audio
    return rows


# (slow, every seed: the default suite's test_image_tokens_attend_both_ways... runs the same
# packs through both kernels, with a window and images both ways besides)
@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_model_loss_and_every_gradient_equal_the_dense_reference(seed):
    rng = np.random.default_rng(seed)
    mb = build_batch(rng, _random_pack(rng), SPARSE_BATCH)
    assert (mb["llm_segment_ids"][1, 1] == 0).all() and (mb["llm_segment_ids"][0, 0] == 1).all()
    assert (mb["vision_segment_ids"] > 0).any() and (mb["audio_segment_ids"] > 0).any()
    _, params, _, dense_grad = model_fns(DENSE, SPARSE_BATCH)
    _, sparse_params, _, sparse_grad = model_fns(SPARSE, SPARSE_BATCH)
    assert_trees_close(params, sparse_params, rtol=0, atol=0)  # the same parameters
    (loss_d, count_d), grads_d = dense_grad(params, mb)
    (loss_s, count_s), grads_s = sparse_grad(params, with_tiles(mb))
    assert count_d == count_s
    np.testing.assert_allclose(loss_s, loss_d, rtol=1e-5)
    assert_trees_close(grads_s, grads_d, rtol=2e-4, atol=2e-5)


def test_xla_flops_of_a_windowed_layer_at_32k_tokens_follow_the_window(monkeypatch):
    """One document of 32k tokens, Gemma 3's window of 1024, blocks of 128: the FLOPs XLA
    counts for the windowed layer's attention over its own tile list are within 1.3x of the
    analytic count (4 heads * head_dim FLOPs a key-query pair the window holds: the cost
    model's `window_sq`), where the causal list, masked to the window, costs 17x it. (The
    kernel's chunks are one here: XLA's cost analysis counts a loop's body once.)"""
    from jaxmllm.cost.model import window_sq

    monkeypatch.setattr(blocksparse, "CHUNK_SCORES", 1 << 40)
    n, block, window, heads, kv, e = 32768, 128, 1024, 8, 2, 64
    one = np.array([0]), np.array([n]), np.array([0])
    q = jax.ShapeDtypeStruct((1, n, heads, e), jnp.float32)
    k = jax.ShapeDtypeStruct((1, n, kv, e), jnp.float32)
    seg = jnp.ones((1, n), jnp.int32)
    attend = jax.jit(
        lambda q, k, v, s, t: blocksparse.attend(
            q, k, v, s, t, block=block, causal=True, window=window
        )
    )
    analytic = 2.0 * heads * e * float(window_sq(n, window))
    ratio = {}
    for name, reach in (("windowed", tiles.window_reach(window, block)), ("causal", None)):
        tl = jnp.asarray(tiles.tile_list(*one, n // block, block, True, reach)[None], jnp.int32)
        flops = attend.lower(q, k, k, seg, tl).compile().cost_analysis()["flops"]
        ratio[name] = flops / analytic
    assert 1.0 <= ratio["windowed"] <= 1.3, ratio
    assert ratio["causal"] > 10, ratio


def test_image_tokens_attend_both_ways_with_the_same_math_dense_and_block_sparse():
    """`model.llm.bidirectional: [vision]` (Gemma 3's images), with a sliding window in one
    layer of two: each image's tokens see each other both ways. Block-sparse, its windowed
    layer over its own list (`llm_window_tiles`, shorter than the causal one) and the spans'
    tiles above the diagonal in both lists, gives the dense reference's loss and every
    gradient. Both matter: without the spans (image tokens causal) the loss differs, and with
    the windowed list emptied too (it is what that layer reads)."""
    from jaxmllm.config.decoder import WindowConfig

    llm = dataclasses.replace(
        CFG.llm, window=WindowConfig(size=6, layers=(0,)), bidirectional=("vision",)
    )
    dense_cfg = dataclasses.replace(DENSE, llm=llm)
    sparse_cfg = dataclasses.replace(SPARSE, llm=llm)
    rng = np.random.default_rng(3)
    mb = build_batch(rng, _random_pack(rng), SPARSE_BATCH)
    # (one image a sample here: its slots' span named by its sample)
    mb["llm_spans"] = np.where(mb["llm_vision_src"] >= 0, mb["llm_segment_ids"], 0)
    spans = mb["llm_spans"]
    block_of = np.broadcast_to(np.arange(spans.shape[-1]) // BLOCK, spans.shape)
    crossing = [
        len(np.unique(block_of[d, r][spans[d, r] == i])) > 1
        for d, r in np.ndindex(spans.shape[:2])
        for i in np.unique(spans[d, r])[1:]
    ]
    assert any(crossing)  # (a span whose tokens lie in two blocks)
    sparse = with_tiles(mb)
    seg, reach = mb["llm_segment_ids"], tiles.window_reach(6, BLOCK)
    sparse["llm_tiles"] = tiles.from_segments(seg, BLOCK, True, 200, None, spans)
    sparse["llm_window_tiles"] = tiles.from_segments(seg, BLOCK, True, 200, reach, spans)
    count = lambda key: (sparse[key][..., 0] >= 0).sum(-1)
    assert (count("llm_window_tiles") <= count("llm_tiles")).all()
    assert count("llm_window_tiles").sum() < count("llm_tiles").sum()
    _, params, _, dense_grad = model_fns(dense_cfg, SPARSE_BATCH)
    _, _, _, sparse_grad = model_fns(sparse_cfg, SPARSE_BATCH)
    (loss_d, _), grads_d = dense_grad(params, mb)
    (loss_s, _), grads_s = sparse_grad(params, sparse)
    np.testing.assert_allclose(loss_s, loss_d, rtol=1e-5)
    assert_trees_close(grads_s, grads_d, rtol=2e-4, atol=2e-5)
    causal = dict(mb, llm_spans=np.zeros_like(spans))  # (no span: every token causal)
    (loss_c, _), _ = dense_grad(params, causal)
    assert abs(float(loss_c) - float(loss_d)) > 1e-4
    emptied = dict(sparse, llm_window_tiles=np.full_like(sparse["llm_window_tiles"], tiles.PAD))
    (loss_e, _), _ = sparse_grad(params, emptied)
    assert abs(float(loss_e) - float(loss_d)) > 1e-3


# ----------------------------------------------------------------------------- tile lists


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block=st.sampled_from([1, 2, 3, 8]),
    sizes=st.lists(st.lists(st.integers(1, 30), max_size=8), min_size=1, max_size=3),
    causal=st.booleans(),
    window=st.sampled_from([0, 1, 2, 5, 9, 40]),
)
def test_tile_list_is_exactly_the_documents_tiles(block, sizes, causal, window):
    """Token by token: a tile is in the list when some query of a document in its query block
    may see some key of that document in its key block (a key not after the query when causal;
    with a sliding window, fewer than `window` tokens before it). The list, and the counts, of
    the planner (`bin_tiles`), of a row's documents laid out (`packed_tiles`) and of the
    windowed capacity's bound (`window_capacity`), agree with it; sorted, without repeats."""
    window = window if causal else 0  # (a window is a decoder's)
    reach = tiles.window_reach(window, block)
    row_len = block * max(1, -(-max((sum(r) for r in sizes), default=1) // block))
    offsets, flat, rows, want, causal_count = [], [], [], set(), set()
    for r, row in enumerate(sizes):
        start = 0
        for n in row:
            offsets.append(start), flat.append(n), rows.append(r)
            base = r * (row_len // block)
            for i in range(start, start + n):  # (query, key) pairs of the document
                for j in range(start, (i + 1) if causal else start + n):
                    tile = (base + i // block, base + j // block)
                    causal_count.add(tile)
                    if not window or i - j < window:
                        want.add(tile)
            start += n
    offsets, flat, rows = (np.array(x, np.int64) for x in (offsets, flat, rows))
    got = tiles.tile_list(offsets, flat, rows, row_len // block, block, causal, reach)
    assert [tuple(x) for x in got.tolist()] == sorted(want)
    counts = tiles.bin_tiles(rows, offsets, flat, len(sizes), block, causal, reach)
    assert counts.sum() == len(want)
    laid = tiles.packed_tiles(offsets, flat, block, causal, reach)
    assert laid.sum() == len(want)
    if reach is not None:
        bound = tiles.window_capacity(len(causal_count), len(sizes), row_len // block, reach)
        assert len(want) <= bound


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block=st.sampled_from([1, 2, 3, 4]),
    docs=st.lists(
        st.tuples(st.integers(1, 24), st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)))),
        min_size=1,
        max_size=4,
    ),
    window=st.sampled_from([0, 2, 5]),
)
def test_span_tiles_are_exactly_what_bidirectional_spans_add(block, docs, window):
    """Token by token, with bidirectional spans (an image's tokens) inside causal documents: a
    tile is in the list when some query of a document may see some key of it there (a key not
    after the query, or both of one span; within the window when there is one, which never
    narrows a key after its query). The list from the segments and spans agrees with that, and
    each document's tiles stay within its causal tiles plus `span_extra` of its spans."""
    row_len = block * -(-sum(n for n, _ in docs) // block)
    seg, spans = np.zeros((1, 1, row_len), np.int32), np.zeros((1, 1, row_len), np.int32)
    at, span_id, extra = 0, 1, 0
    for d, (n, wanted) in enumerate(docs):
        seg[0, 0, at : at + n] = d + 1
        free = at  # (spans of one document: runs one after another, none overlapping)
        for gap, length in wanted:
            lo = free + gap
            hi = min(lo + length, at + n)
            if lo >= hi:
                break
            spans[0, 0, lo:hi] = span_id
            extra += int(tiles.span_extra(np.array([hi - lo]), block)[0])
            span_id, free = span_id + 1, hi
        at += n
    reach = tiles.window_reach(window, block)
    want = set()
    s, p = seg[0, 0], spans[0, 0]
    for i in range(row_len):
        for j in range(row_len):
            if not s[i] or s[i] != s[j]:
                continue
            if (j <= i or (p[i] and p[i] == p[j])) and (not window or i - j < window):
                want.add((i // block, j // block))
    got = tiles.from_segments(seg, block, True, 4 * row_len * row_len, reach, spans)[0]
    got = got[got[:, 0] >= 0]
    assert [tuple(x) for x in got.tolist()] == sorted(want)
    causal = tiles.from_segments(seg, block, True, 4 * row_len * row_len, None)[0]
    need = (causal[:, 0] >= 0).sum() + extra  # (what the planner counts for them)
    assert len(got) <= need
    if reach is not None:  # (the windowed list's capacity, from the longest span possible)
        longest = max([int((spans == i).sum()) for i in range(1, span_id)], default=1)
        upper = int(tiles.span_blocks(np.int64(longest), block)) - 1
        assert len(got) <= tiles.window_capacity(need, 1, row_len // block, reach, upper)


@pytest.mark.parametrize("window", [0, 4])
def test_a_kernel_with_bidirectional_spans_equals_the_dense_reference(window):
    """Spans in the block-sparse kernel (their tiles above the diagonal in the list): the output
    and every gradient equal the dense reference under the same mask (`attention.bidirectional`,
    then the window), over spans crossing blocks; and the spans matter (causal differs)."""
    from jaxmllm.models.attention import bidirectional

    rng = np.random.default_rng(7 + window)
    b, t, heads, kv, e, block = 2, 32, 4, 2, 8, 4
    seg = _random_rows(rng, b, t, 13)
    seg[1, :] = 3
    spans = np.zeros_like(seg)
    spans[0, 3:9] = 4  # (crossing a block boundary; inside the first document or not)
    spans[1, 5:15] = 6
    spans[1, 20:23] = 21
    reach = tiles.window_reach(window, block)
    tl = jnp.asarray(tiles.from_segments(seg[:, None], block, True, 200, reach, spans[:, None]))
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, e)), jnp.float32) for h in (heads, kv, kv))
    real = jnp.asarray(seg > 0)[..., None, None]
    weights = jnp.asarray(rng.normal(size=(b, t, heads, e)), jnp.float32)
    mask = bidirectional(attention_mask(jnp.asarray(seg), causal=True), seg, jnp.asarray(spans))
    mask = windowed(mask, window) if window else mask

    def loss(fn, q, k, v):
        return jnp.sum(jnp.where(real, fn(q, k, v) * weights, 0.0))

    sparse = lambda q, k, v: blocksparse.attend(
        q,
        k,
        v,
        jnp.asarray(seg),
        tl,
        block=block,
        causal=True,
        window=window,
        spans_bt=jnp.asarray(spans),
    )
    dense = lambda q, k, v: dense_attention(q, k, v, mask, jnp.float32)
    got = jax.value_and_grad(lambda *a: loss(sparse, *a), argnums=(0, 1, 2))(q, k, v)
    want = jax.value_and_grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    causal = attention_mask(jnp.asarray(seg), causal=True)
    causal = windowed(causal, window) if window else causal
    plain = lambda q, k, v: dense_attention(q, k, v, causal, jnp.float32)
    assert abs(float(loss(plain, q, k, v)) - float(got[0])) > 1e-2


def test_a_windowed_row_needs_a_band_of_tiles_not_its_triangle():
    """A document much longer than the window: its windowed tiles grow linearly (reach + 1 a
    query block), its causal ones quadratically; shorter than the window, the two agree."""
    block, window = 16, 64
    reach = tiles.window_reach(window, block)
    assert reach == 4
    one = lambda n, r: int(tiles.own_tiles(np.int64(-(-n // block)), True, r))
    assert one(48, reach) == one(48, None) == 6  # (3 blocks: under the window)
    long = 64 * block
    assert one(long, None) == 64 * 65 // 2
    band = 64 + 4 * 5 // 2 + (64 - 1 - 4) * 4  # (310: 5 a query block, fewer in the first 4)
    assert one(long, reach) == band
    assert tiles.window_capacity(10**6, 2, 64, reach) == 2 * band
    assert tiles.window_capacity(100, 2, 64, reach) == 100  # (never more than the causal)


def test_expected_tiles_is_the_mean_over_where_a_document_starts():
    block = 16
    for n in (1, 7, 16, 17, 100, 257):
        for causal, reach in ((True, None), (False, None), (True, 2), (True, 0)):
            at = np.arange(block, 2 * block)
            exact = tiles.item_tiles(at, np.full(block, n), block, causal, at, reach)
            assert tiles.expected_tiles(np.array([n]), block, causal, reach)[0] == pytest.approx(
                exact.mean()
            )


# ----------------------------------------------------------------------------- planned steps


def _omni_caps(devices: int, block: int, scale: float, spans: bool = False):
    """Capacities for the omni mix, tile capacities the suggested ones times `scale` (`spans`:
    images attending both ways)."""
    from jaxmllm.bench.mixes import synthetic_omni
    from jaxmllm.plan.contract import Capacities
    from jaxmllm.resolve.capacity import suggest_capacities
    from jaxmllm.resolve.tilesize import suggest_tiles

    index = synthetic_omni(3000, seed=3)
    per_token, per_row = {"vision": 4, "audio": 4}, {"vision": 1, "audio": 4}
    sug = suggest_capacities(index, 8192, per_token, per_row=per_row, match_llm=True, block=block)
    caps = Capacities(
        microbatches=2,
        devices=devices,
        llm_rows=sug.llm_rows,
        llm_row_len=sug.llm_row_len,
        units=sug.units,
        per_token=per_token,
        per_row=per_row,
        route_pair_capacity=sug.units["vision"] // 4,
        attention_block=block,
        bidirectional=("vision",) if spans else (),
    )
    suggested = suggest_tiles(index, caps)
    alone = {  # a tile capacity is never below the largest document's own tiles
        "llm": index.llm_tokens(per_token),
        "vision": index.items["vision"].sizes,
        "audio": index.items["audio"].sizes // 4,
    }
    tight = {
        p: max(int(n * scale), int(tiles.own_tiles(-(-alone[p] // block), p == "llm").max()))
        for p, n in suggested.items()
    }
    if spans:  # (... nor below a sample's own with its spans')
        from jaxmllm.plan.contract import spans_alone

        tight["llm"] = max(tight["llm"], spans_alone(index, caps)[0])
    return index, dataclasses.replace(caps, tiles=tight)


def test_a_samples_spans_count_in_the_tiles_it_needs_alone():
    """Images attending both ways: a sample of 10 text tokens and an image of 64 LLM tokens
    (256 patches, 4 a token) fills 5 blocks of 16 (15 causal tiles) and its span may touch 5
    blocks, 10 tiles above the diagonal: 25 alone, more than a longer text-only sample. The
    start-up check counts them (a capacity of 20 is refused naming its key, 25 is not), and
    so do the least capacity sized from the data and the tiles a token needs on average."""
    from jaxmllm.bench.mixes import from_arrays
    from jaxmllm.plan.contract import Capacities, OversizeError, check_tiles_fit, spans_alone
    from jaxmllm.resolve.tilesize import largest_doc_tiles, tile_density

    index = from_arrays(np.array([10, 60]), [np.array([256]), np.array([], int)], [[], []])
    caps = Capacities(
        microbatches=1,
        devices=1,
        llm_rows=1,
        llm_row_len=128,
        units={"vision": 512, "audio": 64},
        per_token={"vision": 4, "audio": 4},
        per_row={"vision": 1, "audio": 4},
        route_pair_capacity=0,
        attention_block=16,
        tiles={"llm": 20, "vision": 0, "audio": 0},
    )
    spans = dataclasses.replace(caps, bidirectional=("vision",))
    assert spans_alone(index, spans) == (25, 74)
    check_tiles_fit(index, caps)  # (causal: 15 and 10 tiles)
    with pytest.raises(OversizeError, match=r"needs 25 attention tiles.*batch\.llm_tiles"):
        check_tiles_fit(index, spans)
    check_tiles_fit(index, dataclasses.replace(spans, tiles={"llm": 25, "vision": 0, "audio": 0}))
    assert largest_doc_tiles(index, spans)["llm"] >= spans_alone(index, spans, anywhere=True)[0]
    density = tile_density(index, spans)["llm"] - tile_density(index, caps)["llm"]
    assert density == pytest.approx(10 / 134)  # (the span's 10 tiles over the data's tokens)
    assert spans_alone(index, spans, anywhere=True)[0] > 25  # (a block more, from anywhere)


@pytest.mark.parametrize(
    ("devices", "scale", "spans"), [(8, 1.0, False), (8, 0.7, True), (32, 1.0, False)]
)
def test_orchestrated_plans_hold_the_tile_capacity_and_train_every_sample_once(
    devices, scale, spans
):
    """The tile-balancing planner never plans a bucket past its tile capacity, also when the
    capacity binds hard (0.7x the suggested one: samples wait instead) and images attend both
    ways (their spans' tiles counted), and still plans every sample exactly once."""
    from jaxmllm.plan.contract import check_plan, step_tiles
    from jaxmllm.plan.registry import make_planner

    index, caps = _omni_caps(devices, 128, scale, spans)
    planner = make_planner("orchestrated", index, caps, seed=0)
    planned, most = Counter(), dict.fromkeys(("llm", "vision", "audio"), 0)
    for _ in range(30):
        plan = planner.plan()
        check_plan(plan, index, caps)  # includes the tile capacity
        for phase, need in step_tiles(plan, index, caps).items():
            assert need.max(initial=0) <= caps.tile_caps()[phase], phase
            most[phase] = max(most[phase], int(need.max(initial=0)))
        planned.update(plan.samples.tolist())
    waiting = Counter(planner.deferred[:, 0].tolist())
    pulled = Counter(planner.stream.take(0, planner.cursor).tolist())
    assert planned + waiting == pulled  # nothing lost, nothing twice
    assert planner.ages.max(initial=0) <= planner.max_age + 1  # (+1: see test_plan's xfail)
    if scale < 1:  # the capacity was really in the way somewhere
        assert any(most[p] > 0.9 * caps.tile_caps()[p] for p in most)


@pytest.mark.parametrize(("planner", "window"), [("orchestrated", 33), ("grain", 0)])
def test_every_planned_tile_list_is_exactly_its_documents_tiles(planner, window):
    """Through the real pipeline (plan, load, bucketize) on the tiny config: each bucket's tile
    list, every phase, is the tile set of the documents its segment ids hold, within the
    capacity the config resolved (a dry run for grain, the data's mean need for orchestrated);
    with a sliding window in the decoder's first layer, the windowed layers' list too, within
    its capacity (`window_tile_cap`), and shorter than the causal one where a document is
    longer than the window. Images attend both ways (`model.llm.bidirectional`): each image's
    slots are one span (`llm_spans`), and the LLM's lists hold the spans' tiles above the
    diagonal too, within the capacities the planners kept (their spans' tiles counted)."""
    from jaxmllm.config import load_config
    from jaxmllm.feed.iterator import make_pipeline
    from jaxmllm.resolve.run import resolve_run

    cfg = load_config(
        "configs/tiny.yaml",
        [
            "data.synthetic.num_samples=256",
            f"batch.planner={planner}",
            "train.steps=4",
            f"model.llm.window.size={window}",
            f"model.llm.window.layers=[{0 if window else ''}]",
            "model.llm.bidirectional=[vision]",
        ],
    )
    run = resolve_run(cfg, 8)
    cfg = run.cfg
    caps = run.spec.tile_caps()
    block = cfg.batch.attention_block
    reach = tiles.window_reach(window, block)
    sub = cfg.model.audio.subsample
    data = make_pipeline(run, prefetch=0)
    narrower = 0  # (buckets whose windowed list is shorter than their causal one)
    try:
        for _ in range(4):
            b = next(data)["batch"]
            assert ("llm_window_tiles" in b) == bool(window)
            spans = b["llm_spans"]
            np.testing.assert_array_equal(spans > 0, b["llm_vision_src"] >= 0)
            lists = [
                ("llm", True, b["llm_segment_ids"], caps["llm"], None),
                ("vision", False, b["vision_segment_ids"][:, :, None], caps["vision"], None),
                ("audio", False, b["audio_segment_ids"][:, :, None, ::sub], caps["audio"], None),
            ]
            if window:
                cap = window_tile_cap(run.spec)
                lists.append(("llm_window", True, b["llm_segment_ids"], cap, reach))
            for phase, causal, seg, cap, r in lists:
                got = b[f"{phase}_tiles"]
                assert got.shape[2] == cap
                for m in range(got.shape[0]):
                    for d in range(got.shape[1]):
                        rows = seg[m, d]
                        n_blocks = rows.shape[-1] // block
                        want = tiles.tile_list(*_docs(rows), n_blocks, block, causal, r)
                        if causal:  # (and the spans' tiles above the diagonal)
                            up = tiles.span_tiles(rows, spans[m, d], block)
                            want = np.concatenate([want, up])
                            want = want[np.lexsort((want[:, 1], want[:, 0]))]
                        real = got[m, d][got[m, d, :, 0] >= 0]
                        assert (got[m, d][len(real) :] == tiles.PAD).all()
                        np.testing.assert_array_equal(real, want, err_msg=f"{phase} {m} {d}")
                        if r is not None:
                            narrower += len(real) < (b["llm_tiles"][m, d, :, 0] >= 0).sum()
    finally:
        data.close()
    assert narrower > 0 or not window


def test_cudnn_document_bounds_are_sized_from_the_data_and_held():
    """cuDNN's packed layout has a static number of documents per row: resolved by a dry run of
    the planner (exact for a run no longer than the dry run: the most a row of it holds), never
    above what the data allows (the row over its smallest document), and a bound set too small
    is refused naming the key."""
    from jaxmllm.config import load_config
    from jaxmllm.config.spec import BatchSpec
    from jaxmllm.feed.iterator import make_pipeline
    from jaxmllm.plan.contract import documents
    from jaxmllm.resolve.run import resolve_run

    cfg = load_config(
        "configs/tiny.yaml",
        ["data.synthetic.num_samples=256", "model.attention=cudnn", "train.steps=4"],
    )
    run = resolve_run(cfg, 8)
    cfg, index = run.cfg, run.index
    most = {}
    for phase, (sizes, _, row) in documents(index, run.caps).items():
        assert getattr(cfg.batch, f"{phase}_documents") <= row // int(sizes[sizes > 0].min())
        most[phase] = 0
    data = make_pipeline(run, prefetch=0)
    try:
        for _ in range(4):
            b = next(data)["batch"]
            for phase in most:
                seg = b[f"{phase}_segment_ids"]
                if phase == "audio":
                    seg = seg[..., :: cfg.model.audio.subsample]
                prev = np.concatenate([np.zeros_like(seg[..., :1]), seg[..., :-1]], -1)
                starts = ((seg > 0) & (seg != prev)).sum(-1)
                most[phase] = max(most[phase], int(starts.max()))
    finally:
        data.close()
    for phase, n in most.items():  # the dry run planned these very steps
        assert 0 < n == getattr(cfg.batch, f"{phase}_documents"), phase
    tight = dataclasses.replace(
        cfg, batch=dataclasses.replace(cfg.batch, llm_documents=most["llm"] - 1)
    )
    data = make_pipeline(dataclasses.replace(run, cfg=tight, spec=BatchSpec.of(tight)), prefetch=0)
    try:
        with pytest.raises(ValueError, match=rf"more than batch\.llm_documents={most['llm'] - 1}"):
            for _ in range(4):
                next(data)
    finally:
        data.close()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="tiny.yaml's 8 forced CPU devices")
def test_cudnn_attention_is_refused_off_gpu_with_the_key_to_change(tmp_path):
    from jaxmllm.config import ConfigError, load_config
    from jaxmllm.train import main

    cfg = load_config(
        "configs/tiny.yaml", ["model.attention=cudnn", f"train.output_dir={tmp_path}"]
    )
    with pytest.raises(ConfigError, match=r"model\.attention=cudnn.*block_sparse"):
        main(cfg)


def test_auto_attention_picks_cudnn_on_hopper_and_block_sparse_elsewhere(caplog):
    """Resolved once for the devices (logged), the same sizes as the kernel named outright; a
    kernel the devices cannot run is refused naming the key, and a model never sees auto."""
    import logging
    from types import SimpleNamespace as Device

    from jaxmllm.config import ConfigError, load_config
    from jaxmllm.config.spec import BatchSpec
    from jaxmllm.data.source import make_source
    from jaxmllm.resolve.attention import check_attention, resolve_attention
    from jaxmllm.resolve.run import resolve_run

    h100 = Device(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100 80GB HBM3")
    a100 = Device(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB")
    cfg = load_config("configs/tiny.yaml", ["model.attention=auto"])
    kind = lambda cfg, devices: resolve_attention(cfg, devices).model.attention
    assert kind(cfg, [h100]) == "cudnn"
    assert kind(cfg, [a100]) == kind(cfg, [Device(platform="cpu")]) == "block_sparse"
    split = load_config("configs/long_context.yaml", ["model.attention=auto"])
    assert kind(split, [h100]) == "block_sparse"  # context parallelism deals block-sparse tiles
    for tower in ("model.vision.window=4",):  # (Qwen2.5-VL)
        windowed = load_config("configs/tiny.yaml", ["model.attention=auto", tower])
        assert kind(windowed, [h100]) == "block_sparse", tower  # (cudnn would refuse the tower)
    with caplog.at_level(logging.INFO, logger="jaxmllm"):
        resolved = resolve_attention(cfg)  # this machine's devices
    assert "model.attention: auto -> " in caplog.text
    if jax.default_backend() == "cpu":  # sized as block-sparse: the auto sizes resolve after it
        assert resolved.model.attention == "block_sparse"
        sets = ["data.synthetic.num_samples=256", "train.steps=4"]
        auto = load_config("configs/tiny.yaml", [*sets, "model.attention=auto"])
        named = load_config("configs/tiny.yaml", [*sets, "model.attention=block_sparse"])
        data = make_source(named)
        assert resolve_run(auto, 8, data=data).cfg == resolve_run(named, 8, data=data).cfg
    with pytest.raises(ConfigError, match=r"model\.attention=cudnn.*9\.0.*this one is 8\.0"):
        check_attention(resolve_attention(cfg, [h100]), [a100])
    check_attention(resolve_attention(cfg, [h100]), [h100])
    with pytest.raises(ConfigError, match=r"model\.attention=auto is not resolved"):
        BatchSpec.of(cfg)  # (what every model is built with)


def test_packed_density_counts_aligned_documents_as_aligned():
    """Documents of whole blocks packed back to back stay aligned: each needs exactly its own
    tiles (the uniform guess of `expected_tiles` would count a block more per side)."""
    block, sizes = 8, np.full(50, 32)
    got = tiles.packed_density(sizes, 128, block, causal=False)
    assert got == pytest.approx(16 / 32)  # 4 x 4 tiles per 32-unit document
    assert tiles.expected_tiles(sizes[:1], block, False)[0] > 16


# ----------------------------------------------------------------------------- cuDNN (GPU only)

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(
    not ON_GPU, reason="cuDNN runs on a GPU only (there: JAX_PLATFORMS=cuda pytest -n 0 ...)"
)


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@needs_gpu
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_kernel_equals_dense_reference_with_grouped_heads(causal):
    """bf16 operands (what cuDNN takes) against the fp32 dense reference on the same values:
    relative error of the output and of every gradient at bf16 level, padding outputs zero."""
    from jaxmllm.models import cudnn

    rng = np.random.default_rng(7 + causal)
    b, t, heads, kv, e = 3, 256, 8, 2, 64
    seg = _random_rows(rng, b, t, 90)
    seg[0, :9] = [1, 1, 1, 2, 3, 3, 4, 5, 5]  # one-token documents between others
    seg[0, 9:] = np.where(seg[0, 9:] > 0, seg[0, 9:] + 5, 0)
    seg[2] = 0
    seg[2, :5] = 1  # a five-token document, then padding
    seg[1, :] = 3  # a document filling the whole row
    q, k, v = (
        jnp.asarray(rng.normal(size=(b, t, h, e)), jnp.bfloat16).astype(jnp.float32)
        for h in (heads, kv, kv)
    )
    real = jnp.asarray(seg > 0)[..., None, None]
    weights = jnp.asarray(rng.normal(size=(b, t, heads, e)), jnp.float32)
    mask = attention_mask(jnp.asarray(seg), causal=causal)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.where(real, fn(q, k, v) * weights, 0.0))

    segments = cudnn.segments(jnp.asarray(seg), t)
    fused = lambda q, k, v: cudnn.attend(q, k, v, jnp.asarray(seg), *segments, causal=causal)
    dense = lambda q, k, v: dense_attention(q, k, v, mask, jnp.float32)
    out = jax.jit(fused)(q, k, v)
    assert out.dtype == jnp.float32 and bool(jnp.isfinite(out).all())
    assert not bool(jnp.where(real, 0.0, out).any()), "padding outputs must be zero"
    assert _rel_err(jnp.where(real, out, 0), jnp.where(real, jax.jit(dense)(q, k, v), 0)) < 1e-2
    got = jax.jit(jax.value_and_grad(lambda *a: loss(fused, *a), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2)))(q, k, v)
    assert abs(float(got[0] - want[0])) < 1e-2 * float(jnp.abs(weights).sum()) / heads
    for name, g, w in zip("qkv", got[1], want[1], strict=True):
        assert bool(jnp.isfinite(g).all()), name
        assert _rel_err(g, w) < 2e-2, (name, _rel_err(g, w))


def packed_stand_in(q, k, v, offsets, lengths, *, causal, scale):
    """cuDNN's packed attention on a CPU: the dense reference over the documents the offsets
    and lengths name (the K/V heads arrive repeated to the query heads where jax needs it)."""
    pos = jnp.arange(q.shape[1])
    starts, ends = offsets[:, :-1, None], offsets[:, :-1, None] + lengths[:, :, None]
    inside = (pos >= starts) & (pos < ends) & (lengths[:, :, None] > 0)  # [B, documents, T]
    seg = jnp.where(inside.any(1), jnp.argmax(inside, 1) + 1, 0)
    assert scale == pytest.approx(q.shape[-1] ** -0.5)
    return dense_attention(q, k, v, attention_mask(seg, causal=causal), q.dtype)


@pytest.fixture(params=["gpu", "cpu"])
def fused(request, monkeypatch):
    """cuDNN's kernel on a GPU; elsewhere its stand-in, so the glue around it (segments read
    once outside the layers' scan, the masking, the kept residuals) runs on every CI."""
    from jaxmllm.models import cudnn

    if request.param == "cpu":
        monkeypatch.setattr(cudnn, "_fused_attention", packed_stand_in)
    elif jax.default_backend() != "gpu":
        pytest.skip("cuDNN runs on a GPU only (there: JAX_PLATFORMS=cuda pytest -n 0 ...)")
    return request.param


def test_cudnn_model_loss_and_every_gradient_match_the_dense_reference(fused):
    """The whole model (bf16 compute) with cuDNN attention in every phase against dense."""
    rng = np.random.default_rng(0)
    # (cuDNN's bound on documents per row: the most a row of these buckets can hold)
    batch = dataclasses.replace(
        SPARSE_BATCH, llm_documents=40, vision_documents=48, audio_documents=16
    )
    mb = build_batch(rng, _random_pack(rng), batch)
    bf16 = dataclasses.replace(DENSE, compute_dtype="bfloat16")
    _, params, _, dense_grad = model_fns(bf16, batch)
    _, fused_params, _, fused_grad = model_fns(dataclasses.replace(bf16, attention="cudnn"), batch)
    assert_trees_close(params, fused_params, rtol=0, atol=0)
    (loss_d, count_d), grads_d = dense_grad(params, mb)
    (loss_c, count_c), grads_c = fused_grad(params, mb)
    assert count_d == count_c
    assert abs(float(loss_c) - float(loss_d)) < 2e-2 * abs(float(loss_d))
    from test_models import grad_leaves

    # Relative to each leaf, with a floor: some leaves are exactly zero in the reference (keys
    # of one-row audio documents: a softmax over one key), where bf16 leaves ~1e-9.
    scale = max(float(np.linalg.norm(w)) for w in grad_leaves(grads_d))
    bad = []
    for i, (g, w) in enumerate(zip(grad_leaves(grads_c), grad_leaves(grads_d), strict=True)):
        assert np.isfinite(g).all(), i
        err = float(np.linalg.norm(g - w))
        if err > 5e-2 * float(np.linalg.norm(w)) + 1e-4 * scale:
            bad.append((i, w.shape, err, float(np.linalg.norm(w))))
    assert not bad, bad
