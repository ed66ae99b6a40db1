"""Context parallelism (issue 14): the split of a group's rows, its kernel, and the same math.

The split: every rank gets as many blocks as any other and at most the group's mean tiles plus
one block's; every tile of the group lands once, on the rank of its query block, naming the key
block where the gathered group holds it. The kernel: a row dealt to ranks, each attending over
the gathered keys, equals dense attention over the whole row (output and gradients). The model:
loss and every gradient with LLM rows split over context groups (data=2 x context=4, data=1 x
context=8; rows the planner packed, and one long sample a group; encoders run with the context
ranks as data-parallel devices) equal the unsplit reference, each sample alone on one device;
by `mesh.context_strategy: ulysses` too, and a hybrid decoder (Gated DeltaNet layers) by ulysses
against the same group rows unsplit (kernel and layer level: `tests/test_ulysses.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_orchestration import assert_equals_alone

import sharding
from jaxmllm.batch.bucketize import bucketize, window_tile_cap
from jaxmllm.config import load_config
from jaxmllm.config.spec import BatchSpec
from jaxmllm.data.media.image import patchify
from jaxmllm.data.samples import Sample
from jaxmllm.data.text import tokenizer as tok
from jaxmllm.models import blocksparse
from jaxmllm.models import context as ctx
from jaxmllm.models.attention import attention_mask, dense_attention, windowed
from jaxmllm.plan import context as split
from jaxmllm.plan import tiles
from jaxmllm.plan.contract import ItemPlan, StepPlan
from jaxmllm.resolve.run import resolve_run
from jaxmllm.resolve.sizing import capacities, planner_from_config
from jaxmllm.step.program import build_program, make_loss_and_grads, model_parts

IMAGE, AUDIO = tok.RESERVED.media["vision"], tok.RESERVED.media["audio"]  # the placeholders

# ----------------------------------------------------------------------------- the split


def _random_docs(rng, row_len: int, rows: int, most: int):
    """(offsets, sizes, rows) of documents of 1..most tokens packed into `rows` rows, now and
    then a gap of a few tokens between two."""
    offs, sizes, where = [], [], []
    for r in range(rows):
        pos = 0
        while True:
            n = int(rng.integers(1, most + 1))
            pos += int(rng.integers(0, 5)) * (rng.random() < 0.1)
            if pos + n > row_len - int(rng.integers(0, 3)):
                break
            offs.append(pos), sizes.append(n), where.append(r)
            pos += n
    return (np.array(x, np.int64) for x in (offs, sizes, where))


def test_deal_gives_ranks_equal_blocks_within_the_mean_plus_the_group_size():
    """Any weights: equal counts, no rank over the mean plus the largest block. A group's causal
    tiles (documents of every size, some starting inside a block): no rank more than C tiles
    above another after the rounds alone (`contract.llm_deal_slack`), swaps only lower it."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        ranks = int(rng.choice([2, 4, 8]))
        blocks = ranks * int(rng.integers(1, 30))
        weights = rng.integers(0, 60, blocks) * (rng.random(blocks) < 0.8)
        owner = split.deal(weights, ranks)
        assert (np.bincount(owner, minlength=ranks) == blocks // ranks).all()
        loads = split.rank_loads(weights, owner, ranks)
        assert loads.max() <= weights.sum() / ranks + weights.max()
    for _ in range(300):
        ranks, block = int(rng.choice([2, 4, 8])), int(rng.choice([1, 4, 16]))
        rows, row_blocks = int(rng.integers(1, 3)), ranks * int(rng.integers(1, 12))
        most = int(rng.choice([3, 40, 2000]))
        off, size, row = _random_docs(rng, block * row_blocks, rows, most)
        group = tiles.tile_list(off, size, row, row_blocks, block, True)
        w = split.block_weights(group, rows * row_blocks)
        rounds = split.rank_loads(w, split.deal(w, ranks, swaps=0), ranks)
        loads = split.rank_loads(w, split.deal(w, ranks), ranks)
        assert rounds.max() - rounds.min() <= ranks
        assert loads.max() <= rounds.max() and loads.max() <= w.sum() / ranks + ranks
    # One long causal document: a block's tiles grow along it; uniform chunks leave the last
    # rank most of them, zigzag pairs the ends, ours does as well or better.
    t = tiles.tile_list(np.array([0]), np.array([4096]), np.array([0]), 64, 64, True)
    w = split.block_weights(t, 64)
    spread = {
        name: split.rank_loads(w, split.split(name, w, 1, 8), 8).max() / (w.sum() / 8)
        for name in split.SPLITS
    }
    assert spread["uniform"] > 1.8 and spread["ours"] <= spread["zigzag"] <= 1.01


def test_rank_tiles_hold_every_tile_once_on_the_rank_of_its_query_block():
    rng = np.random.default_rng(1)
    block, row_blocks, rows, ranks = 4, 16, 2, 4
    off, size, row = _random_docs(rng, block * row_blocks, rows, 23)
    group = tiles.tile_list(off, size, row, row_blocks, block, True)
    owner = split.deal(split.block_weights(group, rows * row_blocks), ranks)
    lay = split.layout(owner, ranks)
    per = lay.shape[1]
    cap = int(np.bincount(owner[group[:, 0]], minlength=ranks).max()) + 2
    got = split.rank_tiles(group, owner, ranks, cap)
    seen = []
    for r in range(ranks):
        real = got[r][got[r, :, 0] >= 0]
        assert (got[r, len(real) :] == tiles.PAD).all()
        seen += [(lay[r, q], lay[k // per, k % per]) for q, k in real.tolist()]
    assert sorted(seen) == sorted(map(tuple, group.tolist()))
    with pytest.raises(ValueError, match="tiles, over"):
        split.rank_tiles(group, owner, ranks, cap - 3)


# ----------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize(
    "causal, window", [(True, 0), (True, 5), pytest.param(False, 0, marks=pytest.mark.slow)]
)
def test_dealt_row_attends_as_the_whole_row(causal, window, monkeypatch):
    """A group row of random documents dealt to 4 ranks, each rank's queries over the gathered
    keys (in chunks of 3 tiles: several chunks, the online softmax and its backward), equal
    dense attention over the whole row: outputs and the gradients of q, k and v; with a
    sliding window of 5 (Gemma's local layers), by the tokens' positions in their documents,
    as the dense reference's window by their indices in the row, each rank computing only the
    tiles of its query blocks the window reaches (the windowed list, in its band's capacity)."""
    monkeypatch.setattr(blocksparse, "CHUNK_SCORES", 3 * 2 * 4 * 4)
    rng = np.random.default_rng(2 + causal)
    block, row_blocks, ranks, heads, kv, e = 4, 16, 4, 2, 1, 8
    s_len = block * row_blocks
    off, size, row = _random_docs(rng, s_len, 1, 21)
    seg = np.zeros(s_len, np.int32)
    pos = np.zeros(s_len, np.int32)
    for i, (o, n) in enumerate(zip(off.tolist(), size.tolist(), strict=True)):
        seg[o : o + n], pos[o : o + n] = i + 1, np.arange(n)
    group = tiles.tile_list(off, size, row, row_blocks, block, causal)
    owner = split.deal(split.block_weights(group, row_blocks), ranks)
    lay = split.layout(owner, ranks)
    if window:  # (the windowed layers' own list, dealt with the causal list's blocks)
        reach = tiles.window_reach(window, block)
        group = tiles.tile_list(off, size, row, row_blocks, block, causal, reach)
        causal_cap = int(np.bincount(owner[group[:, 0]], minlength=ranks).max()) + 9
        cap = tiles.rank_window_capacity(causal_cap, row_blocks // ranks, reach)
        assert cap == (row_blocks // ranks) * (reach + 1) < causal_cap  # (the band binds)
    else:
        cap = int(np.bincount(owner[group[:, 0]], minlength=ranks).max())
    rank_tiles = split.rank_tiles(group, owner, ranks, cap)
    tok_of = (lay[..., None] * block + np.arange(block)).reshape(ranks, -1)  # rank -> tokens
    q, k, v, w = (rng.normal(size=(s_len, h, e)).astype(np.float32) for h in (heads, kv, kv, heads))
    real = jnp.asarray(seg > 0)[:, None, None]

    every = tok_of.ravel()  # the gathered group: rank by rank
    axes = (0, None, None, 0, None, 0, None, None, None, 0, None, None, None)
    rank_attend = jax.vmap(blocksparse.kernel, axes)

    def split_loss(q, k, v):
        out = rank_attend(
            q[tok_of],
            k[every],
            v[every],
            seg[tok_of],
            seg[every],
            pos[tok_of],
            pos[every],
            None,  # (no bidirectional spans)
            None,
            rank_tiles,
            block,
            causal,
            window,
        )
        out = jnp.zeros((s_len, heads, e)).at[every].set(out.reshape(s_len, heads, e))
        return jnp.sum(jnp.where(real, out * w, 0.0)), out

    def dense_loss(q, k, v):
        mask = attention_mask(jnp.asarray(seg)[None], causal=causal)
        mask = windowed(mask, window) if window else mask
        out = dense_attention(q[None], k[None], v[None], mask, jnp.float32)[0]
        return jnp.sum(jnp.where(real, out * w, 0.0)), out

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
    (got, out_s), g_s = grad(split_loss)(q, k, v)
    (want, out_d), g_d = grad(dense_loss)(q, k, v)
    np.testing.assert_allclose(np.where(real, out_s, 0), np.where(real, out_d, 0), atol=2e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(g_s, g_d, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- the model

ROW = 64  # a device's LLM tokens; a group's row is context x this
# a hybrid decoder: Gated DeltaNet layers 0-2, attention in 3 (tiny_hybrid.yaml's, 4 key heads)
LINEAR = ["model.llm.depth=4", "model.llm.linear.every=4", "model.llm.linear.key_heads=4"]
LINEAR += ["model.llm.linear.value_heads=8", "model.llm.linear.key_dim=32"]
LINEAR += ["model.llm.linear.value_dim=32"]


def context_config(data: int, context: int, *extra: str):
    """tiny.yaml on a data x context mesh (`extra` may set more), rows of ROW tokens a
    device, blocks of 32, one microbatch."""
    cfg = load_config(
        "configs/tiny.yaml",
        [
            "data.synthetic.num_samples=256",
            "batch.capacity=fixed",
            "batch.vision_patches=640",
            "batch.audio_frames=256",
            f"mesh.data={data}",
            "mesh.fsdp=1",
            f"mesh.context={context}",
            f"batch.llm_row_len={ROW}",
            "train.steps=4",
            "batch.llm_tiles=40",
            "batch.microbatches=1",
            *extra,  # (a long sample's room)
        ],
    )
    run = resolve_run(cfg)
    return run.cfg, run.source, run.index


def reference_config(cfg):
    """One device, no routing, one row as long as a group's, room for every tile."""
    row = cfg.mesh.context * cfg.batch.llm_row_len
    every = lambda n: (n // cfg.batch.attention_block) ** 2
    return dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cfg.mesh, data=1, context=1, context_steps="all"),
        batch=dataclasses.replace(
            cfg.batch,
            microbatches=1,
            route_pair_capacity=0,
            planner="first_fit",
            llm_row_len=row,
            llm_tiles=every(row),
            vision_tiles=every(cfg.batch.vision_patches),
            audio_tiles=every(cfg.batch.audio_frames // cfg.model.audio.subsample),
        ),
    )


def alone(ref, sample: Sample) -> dict:
    """The reference batch of one sample alone (its images and clips on its device)."""
    z = np.zeros(1, np.int64)

    def items(sizes):
        n = len(sizes)
        return ItemPlan(
            np.zeros(n, np.int64),
            np.arange(n),
            np.zeros(n, np.int64),
            np.cumsum(sizes) - np.asarray(sizes, np.int64),
        )

    plan = StepPlan(
        0, z, z, z, z, z, items={k: items([len(m[0]) for m in v]) for k, v in sample.media.items()}
    )
    return bucketize(plan, {0: sample}, ref, capacities(ref, 1))


_PROGRAMS: dict = {}


def programs(cfg):
    """(mesh, state, the split step, the reference's config and step) of a config, built once
    (the cases of a mesh share them: one compilation each)."""
    if cfg not in _PROGRAMS:
        mesh = sharding.make_mesh(cfg.mesh)
        with jax.set_mesh(mesh):
            prog = build_program(cfg, mesh)
            state = prog.init()
        ref = reference_config(cfg)
        _PROGRAMS[cfg] = (
            mesh,
            state,
            jax.jit(make_loss_and_grads(prog.parts)),
            ref,
            jax.jit(make_loss_and_grads(model_parts(ref)[0])),
        )
    return _PROGRAMS[cfg]


def assert_same_math(cfg, host: dict, samples: dict) -> None:
    """Loss and every gradient of the split step on the mesh against each sample alone."""
    mesh, state, step, ref, reference = programs(cfg)
    with jax.set_mesh(mesh):
        got = step(state["params"], state["frozen"], sharding.make_global_batch(host, mesh))
    state = jax.device_get((state["params"], state["frozen"]))
    batches = (alone(ref, sample) for sample in samples.values())
    assert_equals_alone(got, reference, state, batches, host)


def packed_step(cfg, source, index, data: int, context: int):
    """The planner's first step on the mesh: (host batch, its samples), checked to be split."""
    devices = data * context
    plan = planner_from_config(cfg, index, devices).plan()
    samples = {int(s): source[int(s)] for s in plan.samples}
    host = bucketize(plan, samples, cfg, capacities(cfg, devices))
    # Rows really split: documents of a group on several ranks, images routed within groups
    # (the long step routes from outside them), encoders busy on most ranks.
    group = plan.device[plan.items["vision"].owner]
    assert (plan.items["vision"].device // context == group).any()
    seg = host["llm_segment_ids"].reshape(-1, data, context, host["llm_segment_ids"][0, 0].size)
    shared = [set(seg[0, 0, r][seg[0, 0, r] > 0]) & set(seg[0, 0, 0]) for r in range(context)]
    assert any(shared[1:])
    busy = (host["vision_segment_ids"] > 0).any(-1) | (host["audio_segment_ids"] > 0).any(-1)
    assert busy.mean() > 0.5
    return host, samples


def long_sample(rng, n: int, image_side: int, frames: int, sid: int) -> Sample:
    """Text of about n tokens with an image (merge 2) and a clip (subsample 4) in it."""
    image = patchify(
        rng.integers(0, 256, (image_side * 4, image_side * 4, 3), dtype=np.uint8), 4, 2
    )
    clip = rng.normal(size=(frames, 16)).astype(np.float32)
    text = rng.integers(0, 256, n - image_side**2 // 4 - frames // 4 - 1).astype(np.int32)
    cut = len(text) // 3
    tokens = np.concatenate(
        [
            [tok.BOS],
            text[:cut],
            np.full(image_side**2 // 4, IMAGE),
            text[cut : 2 * cut],
            np.full(frames // 4, AUDIO),
            text[2 * cut :],
        ]
    ).astype(np.int32)
    loss = (tokens < 256) & (np.arange(len(tokens)) > 0)
    media = {"vision": [image], "audio": [(clip, np.arange(frames))]}
    return Sample(sid, tokens, loss, media, grids=[(image_side, image_side)])


def long_step(cfg, data: int, context: int):
    """One sample as long as its group's row (nearly) a group: its image encoded on another
    group's device (data=2: the exchange) and its clip in its own group (the gather), or both
    in the group (data=1). (host batch, its samples), checked to cover the row."""
    rng = np.random.default_rng(data)
    n = context * ROW - 5
    samples = {g: long_sample(rng, n, 8, 32, g) for g in range(data)}
    z = np.zeros(data, np.int64)
    far = (np.arange(data) + 1) % data * context + 1  # a device of the next group
    vision = ItemPlan(np.arange(data), z, far, z)
    audio = ItemPlan(np.arange(data), z, np.arange(data) * context + context - 1, z)
    items = {"vision": vision, "audio": audio}
    plan = StepPlan(0, np.arange(data), z, np.arange(data), z, z, items)
    host = bucketize(plan, samples, cfg, capacities(cfg, data * context))
    positions = host.get("llm_order", host["llm_positions"])[0].reshape(data, -1)
    real = host["llm_segment_ids"][0].reshape(data, -1) > 0
    assert (np.sort(positions[0][real[0]]) == np.arange(n)).all()  # every position, once
    assert (host["llm_tiles"][0, :, :, 0] >= 0).sum(-1).min() > 0  # every rank attends
    return host, samples


@pytest.mark.slow  # each mesh compiles its split step and the reference (~1.5-4.5 min here)
@pytest.mark.parametrize(
    # (data=2 context=4 without M-RoPE is no case of its own: the M-RoPE case runs that mesh,
    # and context=8 the 1D positions)
    "mesh",
    ["data=1 context=8 window=20", "data=1 fsdp=2 context=2 tensor=2"]
    + ["data=2 context=4 mrope=4,6,6 deepstack=0"]
    # (mesh.context_strategy: ulysses: heads over context. Heads over tensor=2, then
    # context=2, with fsdp: the hybrid's tensor case below, whose attention layer takes the
    # same path with its key heads repeated)
    + ["data=2 context=4 window=20 ulysses"],
)
def test_rows_split_over_context_groups_equal_the_unsplit_reference(mesh):
    """Rows the planner packed, then one long sample a group: loss and every gradient (also
    with fsdp-sharded parameters and heads split over tensor inside the groups, and as
    Qwen3-VL is: M-RoPE, whose positions are not in token order (an image's tokens share a
    time: the split's causal mask reads each token's index in its document, `llm_order`;
    masking by M-RoPE's time is 2.9e-3 off), and DeepStack, whose additions must reach the
    image's tokens on the ranks they were dealt to (rolled by a row, 6.9e-4 off)); and with
    Gemma-like sliding windows in every other layer, each rank computing its windowed list.
    By the ulysses strategy too (heads moved, not keys: every rank the group's tiles for its
    heads, 2 KV heads repeated for 4 ranks, the window's union list; heads over tensor, then
    context, in the hybrid's test)."""
    words = dict((x.split("=") if "=" in x else (x, "")) for x in mesh.split())
    mrope, deep = words.pop("mrope", ""), words.pop("deepstack", "")
    window = words.pop("window", "")
    ulysses = words.pop("ulysses", None) is not None
    sizes = {"fsdp": 1, "tensor": 1} | {k: int(v) for k, v in words.items()}
    extra = [f"mesh.{k}={v}" for k, v in sizes.items()]
    extra += [f"model.llm.mrope_section=[{mrope}]"] if mrope else []
    extra += [f"model.vision.deepstack=[{deep}]"] if deep else []
    extra += [f"model.llm.window.size={window}", "model.llm.window.every=2"] if window else []
    extra += ["mesh.context_strategy=ulysses"] if ulysses else []
    cfg, source, index = context_config(sizes["data"], sizes["context"], *extra)
    groups, context = sizes["data"] * sizes["fsdp"], sizes["context"]
    assert_same_math(cfg, *packed_step(cfg, source, index, groups, context))
    assert_same_math(cfg, *long_step(cfg, groups, context))


@pytest.mark.slow  # compiles the base step, the long one and the reference (~55 s)
# (ulysses only: what a strategy changes is the long program alone, and gather's long rows are
# held to the unsplit rows by test_rows_split_over_context_groups_equal_the_unsplit_reference;
# a gather case, 31-43 s, was cut for CI's time)
def test_a_context_degree_per_step_runs_each_variant_with_its_model_on_one_mesh(monkeypatch):
    """A context degree per step (issue 57, mesh.context_steps: long) on data=4 x context=2,
    rows of 96 tokens a device, 192 a group (the samples longer than a device's row make a
    step long): the program's base model runs a base step (a device's own rows, the ranks as
    data-parallel devices: no exchange over the context axis), its long model a long step
    (rows split over the groups, attended by the strategy's exchange); both compiled programs
    take the very parameter arrays as placed (no copy), and each step's loss and every
    gradient equal its samples alone on one device. (Run with the long model, as the decoder
    did on any mesh with a context axis, the base step's loss is 8.3e-3 off; the long step
    does not even compile with the base one: its routes are per group.) By ulysses with a
    Qwen3.5-like hybrid decoder (Gated DeltaNet layers 0-2, attention in 3): its long model
    all-to-alls both kinds of layers, each gradient to 1e-4 of its tensor's largest entry
    (`test_hybrid_rows_split_by_ulysses_equal_the_unsplit_rows`: the delta rule's chunks fall
    elsewhere in a packed row than in a sample alone)."""
    per_step = ["mesh.context_steps=long", "batch.llm_row_len=96", "batch.llm_long_tiles=[]"]
    per_step += ["batch.vision_tiles=400", "batch.audio_tiles=100"]  # (rows alone make steps
    per_step += ["batch.vision_long_tiles=[]", "batch.audio_long_tiles=[]"]  # long)
    per_step += ["mesh.context_strategy=ulysses", *LINEAR]
    cfg, source, index = context_config(4, 2, *per_step)
    mesh, state, _, ref, reference = programs(cfg)
    with jax.set_mesh(mesh):
        prog = build_program(cfg, mesh)
    planner = planner_from_config(cfg, index, 8)
    plans = {}
    while len(plans) < 2:  # (the first base step and the first long one)
        plan = planner.plan()
        plans.setdefault(plan.variant, plan)
    # Which exchanges over the context axis a model traces (none: a device's own rows)
    exchanges = set()
    for name in ("attend", "ulysses_attend", "ulysses_linear"):
        run = getattr(ctx, name)
        traced = lambda *a, name=name, run=run, **k: exchanges.add(name) or run(*a, **k)
        monkeypatch.setattr(ctx, name, traced)
    long = {"ulysses_attend", "ulysses_linear"}
    params = state["params"], state["frozen"]
    for variant, plan in plans.items():
        samples = {int(s): source[int(s)] for s in plan.samples}
        host = bucketize(plan, samples, cfg, capacities(cfg, 8))
        step = jax.jit(make_loss_and_grads(prog.parts_of(variant)))
        exchanges.clear()
        with jax.set_mesh(mesh):
            args = (*params, sharding.make_global_batch(host, mesh))
            taken = step.lower(*args).compile().input_shardings[0][:2]
            assert jax.tree.leaves(taken) == jax.tree.leaves(
                jax.tree.map(lambda x: x.sharding, params)
            )
            got = step(*args)
        assert exchanges == (long if variant else set()), variant
        batches = (alone(ref, sample) for sample in samples.values())
        assert_equals_alone(got, reference, jax.device_get(params), batches, host, 1e-4)


TEXT = ["model.vision.enabled=false", "model.audio.enabled=false", "data.eval.source=none"]
TEXT += ["data.synthetic.image_fraction=0", "data.synthetic.audio_fraction=0"]
TEXT += ["data.synthetic.multi_image_fraction=0", "data.synthetic.video_fraction=0"]


def assert_same_rows_math(cfg, host: dict, plan, samples: dict, groups: int) -> None:
    """Loss and every gradient of the split step on the mesh against the reference step over
    the same group rows unsplit, each group's on one device (text only: nothing routed): each
    gradient within 1e-4 x its tensor's largest |entry| (float32's rounding of sums in another
    order: `test_hybrid_rows_split_by_ulysses_equal_the_unsplit_rows`)."""
    mesh, state, step, ref, reference = programs(cfg)
    with jax.set_mesh(mesh):
        got = step(state["params"], state["frozen"], sharding.make_global_batch(host, mesh))
    rows = bucketize(plan, samples, ref, capacities(ref, groups))
    params, frozen = jax.device_get((state["params"], state["frozen"]))
    want = jax.device_get(reference(params, frozen, rows))
    np.testing.assert_allclose(got[0], want[0], rtol=2e-5)
    flat_got = jax.tree_util.tree_leaves_with_path(jax.device_get(got[1]))
    for (path, grad), w in zip(flat_got, jax.tree.leaves(want[1]), strict=True):
        bound = 1e-4 * np.abs(w).max()
        np.testing.assert_allclose(grad, w, rtol=0, atol=bound, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # compiles its split step and the reference (~30 s-2 min a mesh here)
@pytest.mark.parametrize(
    "mesh",
    # (heads over tensor=2, then context=2, without repeated key heads: the layer-level case
    # in test_ulysses; the model's sharded parameters and M-RoPE there are this case's)
    ["data=2 context=4 mrope=4,6,6", "data=1 fsdp=2 context=2 tensor=2 mrope=4,6,6 keys=2"],
)
def test_hybrid_rows_split_by_ulysses_equal_the_unsplit_rows(mesh):
    """A Qwen3.5-like hybrid (Gated DeltaNet layers 0-2, attention in 3; 4 key heads over 4
    ranks, or 2 key heads over tensor=2, each repeated for the 2 context ranks, each copy
    with 2 of its 4 value heads; M-RoPE, whose positions are not the
    token order) on text rows the planner packed, then one long document a group, split by
    ulysses (the linear layers' tokens put back in their rows' order by `llm_blocks`): loss
    and every gradient equal the same group rows computed unsplit, a group's on one device,
    each gradient to 1e-4 of its tensor's largest entry. (Held entry by entry, atol=2e-6
    rtol=2e-4, on the tensor=2 mesh with 4 key heads, 3 of the 196608 entries of the qkv
    kernel's gradient, 1.2e-4, 8.4e-4 and 1.1e-3 where its largest is 0.35, miss by up to
    9e-7: float32's rounding, the same
    step computed in float64 agreeing with its reference there to 10 digits, and everywhere
    to 1e-13 of each tensor's largest, where float32's reference is 3e-5 to 1.2e-4 of it from
    float64's. Against each sample alone a few entries of the linear layers' gradients miss
    atol by ~3e-6: the delta rule's chunks fall elsewhere in a packed row.)"""
    words = dict(x.split("=") for x in mesh.split())
    mrope, keys = words.pop("mrope", ""), words.pop("keys", "4")
    sizes = {"fsdp": 1, "tensor": 1} | {k: int(v) for k, v in words.items()}
    extra = [f"mesh.{k}={v}" for k, v in sizes.items()] + LINEAR + TEXT
    extra += [f"model.llm.linear.key_heads={keys}"]
    extra += ["mesh.context_strategy=ulysses"]
    extra += [f"model.llm.mrope_section=[{mrope}]"] if mrope else []
    cfg, source, index = context_config(sizes["data"], sizes["context"], *extra)
    groups, context = sizes["data"] * sizes["fsdp"], sizes["context"]
    plan = planner_from_config(cfg, index, groups * context).plan()
    samples = {int(s): source[int(s)] for s in plan.samples}
    host = bucketize(plan, samples, cfg, capacities(cfg, groups * context))
    seg = host["llm_segment_ids"].reshape(groups, context, -1)
    assert any(set(seg[0, r][seg[0, r] > 0]) & set(seg[0, 0]) for r in range(1, context))
    assert_same_rows_math(cfg, host, plan, samples, groups)
    # One long document a group (its row nearly full), as `long_step` without media
    rng = np.random.default_rng(groups)
    n = context * ROW - 5
    samples = {}
    for g in range(groups):
        tokens = np.concatenate([[tok.BOS], rng.integers(0, 256, n - 1)]).astype(np.int32)
        samples[g] = Sample(g, tokens, np.arange(n) > 0, {"vision": [], "audio": []})
    z = np.zeros(groups, np.int64)
    plan = StepPlan(0, np.arange(groups), z, np.arange(groups), z, z, {})
    host = bucketize(plan, samples, cfg, capacities(cfg, groups * context))
    assert (host["llm_tiles"][0, :, :, 0] >= 0).sum(-1).min() > 0  # every rank attends
    assert_same_rows_math(cfg, host, plan, samples, groups)


# ----------------------------------------------------------------------------- the routing


def _read_slots(host: dict, phase: str, cfg, context: int) -> np.ndarray:
    """What every slot of a step's LLM rows reads, the model's routing done in numpy: each
    device's own encoder rows labelled device * N + row, the exchange by the send tables (a
    device receives, from the device at its place in each group, what that one sends its
    group), each device's buffer [own | received], the buffers gathered over its context
    group. -1: no slot. [M, D, R * L]."""
    per = cfg.model.vision.merge**2 if phase == "vision" else cfg.model.audio.subsample
    m_n, d_n = host["llm_tokens"].shape[:2]
    groups = d_n // context
    n = host[f"{phase}_segment_ids"].shape[-1] // per
    send = host[f"{phase}_send"]  # [M, src, group, C]
    assert send.shape[2] == groups  # (a pair per group, not per device)
    own = np.arange(d_n)[:, None] * n + np.arange(n)  # [D, N] labels
    out = np.full((m_n, d_n, host["llm_tokens"][0, 0].size), -1)
    for m in range(m_n):
        received = np.zeros((d_n, groups * send.shape[-1]), np.int64)
        for dst in range(d_n):
            g, place = divmod(dst, context)
            peers = np.arange(groups) * context + place  # (from group h: its device here)
            received[dst] = np.concatenate([own[s][send[m, s, g]] for s in peers])
        # (one group receives from none: a device's buffer is its own rows)
        buffers = np.concatenate([own, received if groups > 1 else received[:, :0]], 1)
        gathered = buffers.reshape(d_n // context, -1)  # a group's buffers, rank by rank
        src = host[f"llm_{phase}_src"][m].reshape(d_n, -1)
        for d in range(d_n):
            slot = src[d] >= 0
            out[m, d, slot] = gathered[d // context][src[d][slot]]
    return out


def test_the_exchange_meets_each_groups_device_at_the_senders_place():
    """`exchange_rows` with send tables per (device, context group) (data=2 x context=4, a
    capacity of 3): device g * 4 + r receives, from the device at place r of each group h, the
    rows that one sends group g, at h * 3 + c: [groups x 3] rows a device, not [devices x 3],
    which the context group then gathers. The mesh's all-to-all (over `data` alone) and the
    transpose written without a mesh agree, forward and backward (each cotangent back on the
    row it came from)."""
    from jaxmllm.models.mllm import exchange_rows

    rng = np.random.default_rng(0)
    data, context, cap, n, width = 2, 4, 3, 5, 2
    devices = data * context
    rows = rng.normal(size=(devices, n, width)).astype(np.float32)
    send = rng.integers(0, n, (devices, data, cap)).astype(np.int32)
    want = np.zeros((devices, data * cap, width), np.float32)
    for dst in range(devices):
        g, place = divmod(dst, context)
        for h in range(data):
            want[dst, h * cap : (h + 1) * cap] = rows[h * context + place][
                send[h * context + place, g]
            ]
    cotangent = rng.normal(size=want.shape).astype(np.float32)

    def exchanged(x, s):
        out, back = jax.vjp(lambda r: exchange_rows([r], [s], context=context)[0], x)
        return out, back(jnp.asarray(cotangent))[0]

    plain, plain_grad = jax.jit(exchanged)(rows, send)
    np.testing.assert_array_equal(plain, want)
    mesh = jax.make_mesh((data, context), ("data", "context"))
    on_mesh = lambda x: jax.device_put(x, jax.NamedSharding(mesh, jax.P(("data", "context"))))
    with jax.set_mesh(mesh):
        got, grad = jax.jit(exchanged)(on_mesh(rows), on_mesh(send))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(grad, plain_grad, rtol=1e-6)
    back = np.zeros_like(rows)  # (each received row's cotangent, added onto the row it was)
    for dst in range(devices):
        g, place = divmod(dst, context)
        for h in range(data):
            np.add.at(
                back[h * context + place],
                send[h * context + place, g],
                cotangent[dst, h * cap : (h + 1) * cap],
            )
    np.testing.assert_allclose(plain_grad, back, rtol=1e-6)


@pytest.mark.parametrize(
    # (one group, which receives from none: its buffers are its own rows; the slow same-math
    # test of data=1 context=8 covers it too)
    "data,context",
    [(2, 4), pytest.param(1, 8, marks=pytest.mark.slow)],
)
def test_every_slot_reads_its_items_rows_through_the_exchange_and_the_gather(data, context):
    """Through plan and bucketize (data=2 x context=4, 3 steps; one group of 8): every
    placeholder of every planned sample, wherever its token was dealt, reads the projector row
    of its item that the plan put on the encoding device, in order."""
    cfg, source, index = context_config(data, context, "batch.microbatches=2")
    planner = planner_from_config(cfg, index, data * context)
    caps = capacities(cfg, data * context)
    crossed = 0
    for _ in range(3):
        plan = planner.plan()
        host = bucketize(plan, {int(s): source[int(s)] for s in plan.samples}, cfg, caps)
        seg = host["llm_segment_ids"].reshape(2, data, -1)  # a group's tokens, rank by rank
        position = host["llm_positions"].reshape(2, data, -1)
        for phase, items, per, slot_token in (
            (
                "vision",
                plan.items["vision"],
                cfg.model.vision.merge**2,
                tok.RESERVED.phase_ids("vision"),  # (an image's or a video's slots)
            ),
            ("audio", plan.items["audio"], cfg.model.audio.subsample, [AUDIO]),
        ):
            reads = _read_slots(host, phase, cfg, context).reshape(2, data, -1)
            sizes = (index.items[phase].sizes, index.items[phase].ptr)
            n = host[f"{phase}_segment_ids"].shape[-1] // per
            for k, s in enumerate(plan.samples.tolist()):
                m, g = int(plan.micro[k]), int(plan.device[k])
                sid = 1 + int(((plan.micro[:k] == m) & (plan.device[:k] == g)).sum())
                mine = np.flatnonzero(
                    (seg[m, g] == sid)
                    & np.isin(host["llm_tokens"].reshape(2, data, -1)[m, g], slot_token)
                )
                got = reads[m, g][mine[np.argsort(position[m, g][mine])]]
                want = []
                for j in np.flatnonzero(items.owner == k)[np.argsort(items.item[items.owner == k])]:
                    rows = sizes[0][sizes[1][s] + items.item[j]] // per
                    want += (
                        items.device[j] * n + items.offset[j] // per + np.arange(rows)
                    ).tolist()
                    crossed += items.device[j] // context != g
                np.testing.assert_array_equal(got, want, err_msg=f"{phase} sample {s}")
    assert crossed > 0 if data > 1 else crossed == 0  # some items came from another group


def test_each_rank_computes_exactly_the_tiles_its_windows_reach():
    """Gemma-like windows (every other layer, 20 tokens) under context groups (data=2 x
    context=4, two planned steps): each rank's windowed list is the set of its causal tiles
    in which some query sees some key of its document within the window, judged token by
    token from the dealt rows and the gathered group, and fits the list's derived capacity."""
    data, context, window = 2, 4, 20
    cfg, source, index = context_config(
        data, context, f"model.llm.window.size={window}", "model.llm.window.every=2"
    )
    assert window_tile_cap(BatchSpec.of(cfg)) > 0
    planner = planner_from_config(cfg, index, data * context)
    block, narrowed = cfg.batch.attention_block, 0
    for _ in range(2):
        plan = planner.plan()
        samples = {int(s): source[int(s)] for s in plan.samples}
        host = bucketize(plan, samples, cfg, capacities(cfg, data * context))
        seg = host["llm_segment_ids"]
        pos = host.get("llm_order", host["llm_positions"])
        pos = pos[..., 0] if pos.ndim == seg.ndim + 1 else pos
        m_n, d_n = seg.shape[:2]
        seg, pos = seg.reshape(m_n, d_n, -1, block), pos.reshape(m_n, d_n, -1, block)
        for m in range(m_n):
            for d in range(d_n):
                g = d // context
                keys_seg = seg[m, g * context : (g + 1) * context].reshape(-1, block)
                keys_pos = pos[m, g * context : (g + 1) * context].reshape(-1, block)
                reached = set()
                for q, k in host["llm_tiles"][m, d].tolist():
                    if q < 0:
                        continue
                    sq, sk = seg[m, d, q][:, None], keys_seg[k][None]
                    back = pos[m, d, q][:, None] - keys_pos[k][None]
                    if ((sq == sk) & (sq > 0) & (back >= 0) & (back < window)).any():
                        reached.add((q, k))
                got = host["llm_window_tiles"][m, d]
                assert set(map(tuple, got[got[:, 0] >= 0].tolist())) == reached
                assert (got[len(reached) :] == -1).all()
                narrowed += (host["llm_tiles"][m, d, :, 0] >= 0).sum() - len(reached)
    assert narrowed > 0  # (the windows skipped tiles the causal lists hold)


# ----------------------------------------------------------------------------- the planner


@pytest.mark.parametrize("mix", ["omni", "chartqa"])
def test_planned_groups_hold_every_capacity_and_plan_every_sample_once(mix):
    """orchestrated with context groups (16 devices, groups of 4) on the omni mix (every
    phase) and chartqa (the LLM binds), capacities sized as the trainer sizes them: every plan
    passes the contract (a group's rows, tiles and route pairs), every rank's dealt tiles stay
    within batch.llm_tiles, the LLM rows are as full as a device's would be, and every sample
    pulled is planned once or still waits."""
    from collections import Counter

    from jaxmllm.bench.mixes import load_mix
    from jaxmllm.config import ModelConfig
    from jaxmllm.cost.model import CostModel
    from jaxmllm.plan.contract import Capacities, check_plan
    from jaxmllm.plan.registry import make_planner
    from jaxmllm.resolve.capacity import encoder_capacities, route_capacity
    from jaxmllm.resolve.tilesize import held_tiles

    index = load_mix(mix)
    per_token, per_row = {"vision": 4, "audio": 4}, {"vision": 1, "audio": 4}
    enc = encoder_capacities(index, 2048, per_token, per_row=per_row, block=128)
    caps = Capacities(
        microbatches=2,
        devices=16,
        llm_rows=1,
        llm_row_len=2048,
        units=enc.units,
        per_token=per_token,
        per_row=per_row,
        route_pair_capacity=enc.units["vision"] // 4,
        attention_block=128,
        context=4,
    )
    make = lambda c: make_planner("orchestrated", index, c, 0)
    route = route_capacity(make(caps), index, caps, 10, 30)
    caps = dataclasses.replace(caps, route_pair_capacity=route)
    weights = CostModel.from_model(ModelConfig()).tile_weights(128, per_row)
    tiles = held_tiles(make(caps), index, caps, 10, make=make, weights=weights)
    caps = dataclasses.replace(caps, tiles=tiles)
    planner = make(caps)
    planned, spread, tokens = Counter(), [], 0
    for _ in range(20):
        plan = planner.plan()
        check_plan(plan, index, caps)
        tokens += index.llm_tokens({"vision": 4, "audio": 4})[plan.samples].sum()
        for w in split.group_weights(plan, index, caps).values():
            loads = split.rank_loads(w, split.deal(w, 4), 4)
            assert loads.max() <= caps.tiles["llm"]
            spread.append(loads.max() / max(loads.mean(), 1))
        planned.update(plan.samples.tolist())
    waiting = Counter(planner.deferred[:, 0].tolist())
    assert planned + waiting == Counter(planner.stream.take(0, planner.cursor).tolist())
    assert np.mean(spread) < 1.02
    assert tokens / (20 * 2 * 16 * 2048) > 0.85  # (a group held to the tiles of C devices)


def test_a_document_as_long_as_the_only_group_is_planned_every_step():
    """One group (data=1): a sample filling its whole row is the whole microbatch, which
    selection otherwise fills only to FILL (room for packing slack); one such sample a step,
    each once, none dropped."""
    from jaxmllm.bench.mixes import from_arrays
    from jaxmllm.plan.contract import Capacities, check_plan
    from jaxmllm.plan.registry import make_planner

    none = [np.zeros(0, np.int64)] * 6
    index = from_arrays(np.array([8192, 8192, 8000, 8192, 8192, 5000]), none, none)
    caps = Capacities(
        microbatches=1,
        devices=8,
        llm_rows=1,
        llm_row_len=1024,
        units={"vision": 0, "audio": 0},
        per_token={"vision": 4, "audio": 4},
        per_row={"vision": 1, "audio": 4},
        route_pair_capacity=1,
        attention_block=128,
        tiles={"llm": (64 * 65 // 2) // 8 + 8},
        context=8,
    )
    planner = make_planner("orchestrated", index, caps, 0)
    planned = []
    for _ in range(6):
        plan = planner.plan()
        check_plan(plan, index, caps)
        assert len(plan.samples) >= 1
        planned += plan.samples.tolist()
    assert sorted(planned) == list(range(6))
