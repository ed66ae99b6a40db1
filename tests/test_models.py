"""Model-level tests: packing equivalence, routed exchange, dtypes/remat, scanned layers, axes
metadata, masks.

Batches are built by hand with tiny shapes. Every padding slot (tokens, patches, frames, their
positions) holds random garbage so that the masks, not zeros, are what keeps packing exact.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxmllm.config import (
    REMAT_POLICIES,
    AudioConfig,
    BatchConfig,
    LLMConfig,
    ModelConfig,
    VisionConfig,
)
from jaxmllm.config.spec import BatchSpec
from jaxmllm.models import MultimodalLM, param_axes, token_losses
from jaxmllm.models.attention import Attention, packing
from jaxmllm.models.layers import rope_1d
from jaxmllm.models.mllm import exchange_rows, fill_slots
from jaxmllm.models.transformer import Block, BlockSpec, Transformer
from sharding.rules import axes_leaves, keyed_leaves

BOS, IMAGE, AUDIO = 257, 259, 260
VOCAB = 272
PATCH_DIM = 4 * 4 * 3
N_MELS = 8

CFG = ModelConfig(
    vision=VisionConfig(patch_size=4, channels=3, width=32, depth=2, heads=2, mlp_dim=64),
    audio=AudioConfig(n_mels=N_MELS, width=32, depth=1, heads=2, mlp_dim=64),
    llm=LLMConfig(vocab_size=VOCAB, width=32, depth=2, heads=4, kv_heads=2, mlp_dim=64),
    attention="dense",  # the reference; tests/test_attention.py holds block-sparse to it
)
LOCAL = BatchConfig(
    llm_rows=2,
    llm_row_len=40,
    vision_patches=32,
    audio_frames=24,
    route_pair_capacity=0,
    planner="first_fit",
)
ALLOWED_AXES = {
    "layers",
    "embed",
    "expert",
    "expert_embed",
    "mlp",
    "heads",
    "kv_heads",
    "head_dim",
    "vocab",
    "vocab_split",
    "patch",
    "mel",
    "positions",
    None,
}


# ----------------------------------------------------------------------------- batch building


@dataclass
class Sample:
    """One training sample: tokens with placeholders, plus its image and/or audio clip."""

    tokens: np.ndarray  # [n] int
    patches: np.ndarray | None = None  # [h * w, PATCH_DIM] in merge order
    patch_positions: np.ndarray | None = None  # [h * w, 2]
    frames: np.ndarray | None = None  # [f, N_MELS]


def make_sample(
    rng: np.random.Generator, n_text: int, image_side: int = 0, audio_frames: int = 0
) -> Sample:
    n_image, n_audio = image_side**2 // 4, audio_frames // 4
    tokens = np.concatenate(
        [[BOS], [IMAGE] * n_image, [AUDIO] * n_audio, rng.integers(0, 256, n_text)]
    ).astype(np.int32)
    sample = Sample(tokens)
    if image_side:
        sample.patches = rng.uniform(-1, 1, (image_side**2, PATCH_DIM)).astype(np.float32)
        sample.patch_positions = merge_order_positions(image_side, image_side)
    if audio_frames:
        sample.frames = rng.normal(size=(audio_frames, N_MELS)).astype(np.float32)
    return sample


def merge_order_positions(h: int, w: int) -> np.ndarray:
    """(row, col) of each patch when every 2x2 block is stored as 4 consecutive patches."""
    return np.array(
        [
            (2 * bi + di, 2 * bj + dj)
            for bi in range(h // 2)
            for bj in range(w // 2)
            for di in range(2)
            for dj in range(2)
        ],
        np.int32,
    )


def garbage_batch(rng: np.random.Generator, d: int, bcfg: BatchConfig) -> dict[str, np.ndarray]:
    """A batch that is all padding, filled with random garbage."""
    r, length, p, f = bcfg.llm_rows, bcfg.llm_row_len, bcfg.vision_patches, bcfg.audio_frames
    ints = lambda shape, hi=VOCAB: rng.integers(0, hi, shape).astype(np.int32)
    return {
        "llm_tokens": ints((d, r, length)),
        "llm_segment_ids": np.zeros((d, r, length), np.int32),
        "llm_positions": ints((d, r, length), length),
        "llm_targets": ints((d, r, length)),
        "llm_loss_mask": np.zeros((d, r, length), np.float32),
        "llm_vision_src": np.full((d, r, length), -1, np.int32),
        "llm_audio_src": np.full((d, r, length), -1, np.int32),
        "vision_patches": rng.uniform(-1, 1, (d, p, PATCH_DIM)).astype(np.float32),
        "vision_segment_ids": np.zeros((d, p), np.int32),
        "vision_positions": ints((d, p, 2), 8),
        "audio_frames": rng.normal(size=(d, f, N_MELS)).astype(np.float32),
        "audio_segment_ids": np.zeros((d, f), np.int32),
        "audio_positions": ints((d, f), f),
    }


def build_batch(
    rng: np.random.Generator,
    rows: list[list[list[Sample]]],
    bcfg: BatchConfig = LOCAL,
    vision_start: int = 0,
    audio_start: int = 0,
) -> dict[str, np.ndarray]:
    """Packs `rows[device][row]` = samples into a local-mode batch.

    Each device's images and clips go into its own vision/audio row from `*_start` on.
    """
    mb = garbage_batch(rng, len(rows), bcfg)
    for dev, dev_rows in enumerate(rows):
        cursors = {"v": vision_start, "a": audio_start, "vi": 0, "ai": 0}
        for row, samples in enumerate(dev_rows):
            start = 0
            for seg, sample in enumerate(samples, start=1):
                _place(mb, dev, row, start, seg, sample, cursors)
                start += len(sample.tokens)
    return mb


def _place(mb, dev, row, start, seg, sample, cursors) -> None:
    n = len(sample.tokens)
    span = (dev, row, slice(start, start + n))
    mb["llm_tokens"][span] = sample.tokens
    mb["llm_segment_ids"][span] = seg
    mb["llm_positions"][span] = np.arange(n)
    mb["llm_targets"][dev, row, start : start + n - 1] = sample.tokens[1:]
    # Loss only where the next token is text (not a placeholder).
    mb["llm_loss_mask"][dev, row, start : start + n - 1] = sample.tokens[1:] < 256
    if sample.patches is not None:
        v, k = cursors["v"], len(sample.patches)
        cursors["vi"] += 1
        mb["vision_patches"][dev, v : v + k] = sample.patches
        mb["vision_segment_ids"][dev, v : v + k] = cursors["vi"]
        mb["vision_positions"][dev, v : v + k] = sample.patch_positions
        mb["llm_vision_src"][span] = np.where(
            sample.tokens == IMAGE, v // 4 + np.cumsum(sample.tokens == IMAGE) - 1, -1
        )
        cursors["v"] += k
    if sample.frames is not None:
        a, k = cursors["a"], len(sample.frames)
        cursors["ai"] += 1
        mb["audio_frames"][dev, a : a + k] = sample.frames
        mb["audio_segment_ids"][dev, a : a + k] = cursors["ai"]
        mb["audio_positions"][dev, a : a + k] = np.arange(k)
        mb["llm_audio_src"][span] = np.where(
            sample.tokens == AUDIO, a // 4 + np.cumsum(sample.tokens == AUDIO) - 1, -1
        )
        cursors["a"] += k


def drop_audio(mb: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in mb.items() if "audio" not in k}


# ----------------------------------------------------------------------------- model helpers


@functools.cache
def model_fns(cfg: ModelConfig, bcfg: BatchConfig, abstract: bool = False):
    """(graphdef, params, jitted forward, jitted value_and_grad) for a config, seed 0;
    `abstract`: the params' shapes only (for lowering)."""
    spec = BatchSpec.from_sections(cfg, bcfg)
    build = nnx.eval_shape if abstract else (lambda make: make())
    graphdef, params = nnx.split(build(lambda: MultimodalLM(cfg, spec, rngs=nnx.Rngs(0))))

    def loss(params, mb):
        logits = nnx.merge(graphdef, params)(mb)
        return token_losses(logits, mb["llm_targets"], mb["llm_loss_mask"])

    forward = jax.jit(lambda params, mb: nnx.merge(graphdef, params)(mb))
    return graphdef, params, forward, jax.jit(jax.value_and_grad(loss, has_aux=True))


def grad_leaves(grads) -> list[np.ndarray]:
    return [np.asarray(g) for g in jax.tree.leaves(nnx.to_pure_dict(grads))]


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6) -> None:
    for x, y in zip(grad_leaves(a), grad_leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def three_samples():
    rng = np.random.default_rng(0)
    samples = [
        make_sample(rng, 5, image_side=4),
        make_sample(rng, 6, audio_frames=16),
        make_sample(rng, 11),
    ]
    return rng, samples


# ----------------------------------------------------------------------------- tests


def test_packing_matches_unpacked_loss_and_grads(three_samples):
    rng, samples = three_samples
    _, params, _, value_and_grad = model_fns(CFG, LOCAL)
    # Image and clip start past some leading padding so the *_src offsets are exercised.
    packed = build_batch(rng, [[samples, []]], vision_start=8, audio_start=4)
    (loss, count), grads = value_and_grad(params, packed)

    loss_sum, count_sum, grad_sum = 0.0, 0.0, None
    for sample in samples:
        (l_one, c_one), g_one = value_and_grad(params, build_batch(rng, [[[sample], []]]))
        loss_sum, count_sum = loss_sum + l_one, count_sum + c_one
        grad_sum = g_one if grad_sum is None else jax.tree.map(jnp.add, grad_sum, g_one)

    assert count == count_sum == sum(int((s.tokens[1:] < 256).sum()) for s in samples)
    np.testing.assert_allclose(loss, loss_sum, rtol=1e-5)
    assert all(np.abs(g).max() > 0 for g in grad_leaves(grads))  # every param is used
    # fp32 sums in another order: ~1.5e-6 apart on entries of ~1e-2 (so at d4de775 too).
    assert_trees_close(grads, grad_sum, atol=1e-5)


def test_routed_exchange_matches_local():
    rng = np.random.default_rng(1)
    cfg = dataclasses.replace(CFG, audio=dataclasses.replace(CFG.audio, enabled=False))
    routed_cfg = dataclasses.replace(LOCAL, route_pair_capacity=6)
    x, y, z = (make_sample(rng, 3 + i, image_side=4) for i in range(3))
    local = drop_audio(build_batch(rng, [[[x], []], [[y, z], []]]))

    # Routed: device 0 encodes x's and y's images, device 1 encodes z's; y's goes 0 -> 1.
    routed = {k: v.copy() for k, v in local.items()}
    for key in ("vision_patches", "vision_segment_ids", "vision_positions"):
        routed[key][0, 16:32] = local[key][1, 0:16]
        routed[key][1, 0:16] = local[key][1, 16:32]
    routed["vision_segment_ids"][0, 16:32] = 2  # y's image is device 0's second image
    routed["vision_segment_ids"][1, 16:32] = 0
    send = np.zeros((2, 2, 6), np.int32)
    send[0, 1, :4] = range(4, 8)  # device 0's rows 4..7 (y's image) go to device 1, slots 0..3
    routed["vision_send"] = send
    n_local = routed["vision_patches"].shape[1] // 4
    src = routed["llm_vision_src"][1]
    is_y, is_z = (src >= 0) & (src < 4), src >= 4
    src[is_y] += n_local  # y's rows are received: own rows first, then source 0's slots
    src[is_z] -= 4  # z's image is now device 1's first image: the local path

    _, params, _, local_fn = model_fns(cfg, LOCAL)
    _, routed_params, _, routed_fn = model_fns(cfg, routed_cfg)
    assert "audio" not in nnx.to_pure_dict(params)
    (loss_l, count_l), grads_l = local_fn(params, local)
    (loss_r, count_r), grads_r = routed_fn(routed_params, routed)
    assert count_l == count_r > 0
    np.testing.assert_allclose(loss_l, loss_r, rtol=1e-6)
    assert_trees_close(grads_l, grads_r)


def test_bf16_compute_keeps_fp32_params_and_logits(three_samples):
    rng, samples = three_samples
    mb = build_batch(rng, [[samples, []]])
    bf16 = dataclasses.replace(CFG, compute_dtype="bfloat16")
    _, params16, forward16, _ = model_fns(bf16, LOCAL)
    _, params32, forward32, _ = model_fns(CFG, LOCAL)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params16))
    logits16, logits32 = forward16(params16, mb), forward32(params32, mb)
    assert logits16.shape == (1, 2, 40, VOCAB) and logits16.dtype == jnp.float32
    loss16, count = token_losses(logits16, mb["llm_targets"], mb["llm_loss_mask"])
    loss32, _ = token_losses(logits32, mb["llm_targets"], mb["llm_loss_mask"])
    np.testing.assert_allclose(loss16 / count, loss32 / count, rtol=2e-2)


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_every_remat_policy_gives_the_same_loss_and_every_gradient(three_samples, policy):
    """fp32: each policy (and another for the vision tower, so towers take their own) equals
    no rematerialisation, loss and every gradient."""
    rng, samples = three_samples
    mb = build_batch(rng, [[samples[:2], samples[2:]]])
    _, params, _, plain = model_fns(CFG, LOCAL)
    vision = dataclasses.replace(CFG.vision, remat="full" if policy != "full" else "save_qkv")
    cfg = dataclasses.replace(CFG, remat=policy, vision=vision)
    _, _, _, remat = model_fns(cfg, LOCAL)
    (loss_p, _), grads_p = plain(params, mb)
    (loss_r, _), grads_r = remat(params, mb)
    np.testing.assert_allclose(loss_p, loss_r, rtol=1e-6)
    assert_trees_close(grads_p, grads_r)
    assert all(np.abs(g).max() > 0 for g in grad_leaves(grads_r))


def _names(jaxpr) -> set[str]:
    """The checkpoint names tagged anywhere in a jaxpr, nested ones included."""
    found = set()
    for e in jaxpr.eqns:
        if e.primitive.name == "name":
            found.add(str(e.params["name"]))
        for value in e.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
                    found |= _names(getattr(sub, "jaxpr", sub))
    return found


@pytest.mark.parametrize("kernel", ["block_sparse", "cudnn"])
def test_the_activations_remat_policies_keep_are_tagged_in_every_block(kernel, monkeypatch):
    """Every name a policy keeps is tagged (checkpoint_name) in the forward pass a block's
    gradient runs, for each kind of MLP and each kernel that tags its own residuals (cuDNN's
    CPU stand-in): a misspelt name would keep nothing, silently."""
    from test_attention import packed_stand_in

    from jaxmllm.models import cudnn

    monkeypatch.setattr(cudnn, "_fused_attention", packed_stand_in)
    wanted = {n for p in REMAT_POLICIES.values() for n in p.names}
    segments = jnp.ones((1, 8), jnp.int32)
    tiles = jnp.asarray([[[0, 0], [1, 0], [1, 1]]], jnp.int32)
    pack = packing(segments, causal=True, kind=kernel, tiles_bk2=tiles, block=4, documents=1)
    for mlp in ("gated_silu", "gelu"):
        spec = BlockSpec(32, 4, 2, 64, mlp=mlp, rope="1d")
        block = functools.partial(
            Block(spec, rngs=nnx.Rngs(0)), pack=pack, positions=jnp.arange(8)[None]
        )
        jaxpr = jax.make_jaxpr(lambda x, block=block: jax.vjp(block, x)[0])(jnp.ones((1, 8, 32)))
        assert wanted <= _names(jaxpr.jaxpr), (kernel, mlp, wanted - _names(jaxpr.jaxpr))


def test_param_axes_cover_every_param():
    _, params, _, _ = model_fns(CFG, LOCAL)
    axes = param_axes(params)
    is_axes = lambda x: isinstance(x, tuple)
    pure = nnx.to_pure_dict(params)
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(pure)
    pairs = zip(jax.tree.leaves(axes, is_leaf=is_axes), jax.tree.leaves(pure), strict=True)
    for names, value in pairs:
        assert len(names) == value.ndim and set(names) <= ALLOWED_AXES
        assert len([n for n in names if n]) == len({n for n in names if n})  # no repeats
    assert set(pure) == {"vision", "vision_projector", "audio", "audio_projector", "llm"}
    assert axes["llm"]["transformer"]["blocks"]["attn"]["key"]["kernel"] == (
        "layers",
        "embed",
        "kv_heads",
        "head_dim",
    )
    # Every block parameter is stacked: "layers" first, one entry per layer; nothing else is.
    for part, depth in (("vision", 2), ("audio", 1), ("llm", 2)):
        for path, names in axes_leaves(axes[part]).items():
            stacked = path.startswith("transformer/blocks/")
            assert (names[0] == "layers") == stacked, path
            assert not stacked or keyed_leaves(pure[part])[path].shape[0] == depth


def test_stacked_init_draws_what_separate_blocks_drew():
    """Layer i of the stack holds what the i-th of `depth` separate blocks drew (the unscanned
    model's init), and the RNG stream ends where theirs did, so later modules match too."""
    spec = BlockSpec(32, 4, 2, 64, rope="1d", rope_theta=1e4)
    stack_rngs, block_rngs = nnx.Rngs(7), nnx.Rngs(7)
    stack = Transformer(3, spec, rngs=stack_rngs)
    blocks = [Block(spec, rngs=block_rngs) for _ in range(3)]
    stacked = nnx.to_pure_dict(nnx.state(stack.blocks))
    for i, block in enumerate(blocks):
        layer = jax.tree.map(lambda x, i=i: x[i], stacked)
        jax.tree.map(np.testing.assert_array_equal, layer, nnx.to_pure_dict(nnx.state(block)))
    np.testing.assert_array_equal(
        jax.random.key_data(stack_rngs.params()), jax.random.key_data(block_rngs.params())
    )


def test_init_and_loss_match_the_unscanned_model():
    """Figures recorded with the per-layer (unscanned) model of commit d4de775, same batch."""
    rng = np.random.default_rng(11)
    samples = [
        make_sample(rng, 5, image_side=4),
        make_sample(rng, 6, audio_frames=16),
        make_sample(rng, 11),
    ]
    mb = build_batch(rng, [[samples[:2], samples[2:]]])
    _, params, _, value_and_grad = model_fns(CFG, LOCAL)
    (loss, count), grads = value_and_grad(params, mb)
    pure = nnx.to_pure_dict(params)
    abs_sum = sum(float(np.abs(np.asarray(x, np.float64)).sum()) for x in jax.tree.leaves(pure))
    np.testing.assert_allclose(abs_sum, 16285.8642578125, rtol=1e-6)
    np.testing.assert_allclose(
        np.abs(pure["llm"]["lm_head"]["kernel"]).sum(), 1234.13184, rtol=1e-6
    )
    assert count == 22
    np.testing.assert_allclose(loss, 132.75714111328125, rtol=1e-5)
    grad_norm = optax.tree.norm(nnx.to_pure_dict(grads))
    np.testing.assert_allclose(grad_norm, 69.94707489013672, rtol=1e-5)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_stack_matches_its_blocks_applied_one_by_one(remat):
    spec = BlockSpec(32, 4, 2, 64, rope="1d", rope_theta=1e4)
    stack = Transformer(3, spec, remat=remat, rngs=nnx.Rngs(5))
    graphdef, state = nnx.split(stack)
    block_def, _ = nnx.split(stack.blocks)
    x = jnp.asarray(np.random.default_rng(8).normal(size=(2, 6, 32)), jnp.float32)
    mask = packing(jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]]), causal=True)
    pos = jnp.array([[0, 1, 2, 0, 1, 9], [0, 1, 2, 3, 4, 5]])

    def scanned(state):
        return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x, mask, pos)))

    def one_by_one(state):
        module = nnx.merge(graphdef, state)
        x_btd = x
        for i in range(3):
            layer = jax.tree.map(lambda v, i=i: v[i], nnx.state(module.blocks))
            x_btd = nnx.merge(block_def, layer)(x_btd, mask, pos)
        return jnp.sum(jnp.sin(module.final_norm(x_btd)))

    loss_s, grads_s = jax.jit(jax.value_and_grad(scanned))(state)
    loss_l, grads_l = jax.jit(jax.value_and_grad(one_by_one))(state)
    np.testing.assert_allclose(loss_s, loss_l, rtol=1e-6)
    assert_trees_close(grads_s, grads_l, atol=1e-5)  # fp32, fused differently: ~3e-6 apart
    assert all(np.abs(g).max() > 0 for g in grad_leaves(grads_s))


def test_program_size_does_not_grow_with_depth(three_samples):
    """The scan holds one block: 2 or 7 layers everywhere lower to the same program size."""
    rng, samples = three_samples
    mb = build_batch(rng, [[samples, []]])
    sizes = []
    for depth in (2, 7):
        parts = {p: dataclasses.replace(getattr(CFG, p), depth=depth) for p in ("vision", "audio")}
        llm = dataclasses.replace(CFG.llm, depth=depth)
        cfg = dataclasses.replace(CFG, **parts, llm=llm, remat="full")
        _, params, _, value_and_grad = model_fns(cfg, LOCAL, abstract=True)
        sizes.append(len(value_and_grad.lower(params, mb).as_text()))
    assert sizes[0] == sizes[1]


def test_causal_and_segment_isolation(three_samples):
    rng, samples = three_samples
    _, params, forward, _ = model_fns(CFG, LOCAL)
    mb = build_batch(rng, [[samples, samples[2:]]])
    base = np.asarray(forward(params, mb))[0, 0]
    a_len, b_len = len(samples[0].tokens), len(samples[1].tokens)
    b_end = a_len + b_len

    future = {k: v.copy() for k, v in mb.items()}
    future["llm_tokens"][0, 0, b_end - 2] += 1  # a later text token of sample b
    out = np.asarray(forward(params, future))[0, 0]
    np.testing.assert_array_equal(out[: b_end - 2], base[: b_end - 2])
    np.testing.assert_array_equal(out[b_end:], base[b_end:])
    assert not np.allclose(out[b_end - 2 : b_end], base[b_end - 2 : b_end])

    other = {k: v.copy() for k, v in mb.items()}
    other["vision_patches"][0] += 0.5  # sample a's image (and the padding)
    other["llm_tokens"][0, 0, 1 + 4 : a_len] = 7  # sample a's text
    out = np.asarray(forward(params, other))[0, 0]
    np.testing.assert_array_equal(out[a_len:], base[a_len:])
    assert not np.allclose(out[:a_len], base[:a_len])


def reference_attention(attn: Attention, x, seg, pos):
    """Causal GQA written the slow way: repeat each KV head over its query heads."""
    group = attn.query.kernel.shape[1] // attn.key.kernel.shape[1]
    q = rope_1d(attn.query(x), pos, attn.rope_theta)
    k = jnp.repeat(rope_1d(attn.key(x), pos, attn.rope_theta), group, axis=2)
    v = jnp.repeat(attn.value(x), group, axis=2)
    t = x.shape[1]
    allowed = (seg[:, :, None] == seg[:, None]) & (seg[:, None] > 0) & jnp.tri(t, dtype=bool)
    allowed |= jnp.eye(t, dtype=bool)
    scale = 1 / np.sqrt(q.shape[-1])
    scores = jnp.where(allowed[:, None], jnp.einsum("bthe,bshe->bhts", q, k) * scale, -jnp.inf)
    return attn.out(jnp.einsum("bhts,bshe->bthe", jax.nn.softmax(scores), v))


def test_gqa_attention_matches_repeated_kv_reference():
    attn = Attention(32, heads=4, kv_heads=2, rngs=nnx.Rngs(3))
    assert attn.query.kernel.shape == (32, 4, 8) and attn.key.kernel.shape == (32, 2, 8)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 6, 32)), jnp.float32)
    seg = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    pos = jnp.array([[0, 1, 2, 0, 1, 9], [0, 1, 2, 3, 4, 5]])

    @jax.jit
    def outputs(x, pos):
        # RoPE makes attention depend on relative positions only: shift them all by 7.
        mask = packing(seg, causal=True)
        return attn(x, mask, pos), attn(x, mask, pos + 7), reference_attention(attn, x, seg, pos)

    out, shifted, ref = outputs(x, pos)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, shifted, rtol=1e-4, atol=1e-5)


def test_2d_rope_attention_depends_on_relative_positions():
    attn = Attention(32, heads=2, kv_heads=2, rope="2d", rngs=nnx.Rngs(4))
    x = jnp.asarray(np.random.default_rng(5).normal(size=(1, 8, 32)), jnp.float32)
    mask = packing(jnp.ones((1, 8), jnp.int32), causal=False)
    pos = jnp.asarray(merge_order_positions(2, 4))[None]
    apply = jax.jit(lambda pos: attn(x, mask, pos))
    out = apply(pos)
    np.testing.assert_allclose(out, apply(pos + jnp.array([3, 5])), rtol=1e-4, atol=1e-5)
    assert not np.allclose(out, apply(pos[..., ::-1]), atol=1e-3)  # rows and cols differ


def test_tied_embeddings_reuse_the_table(three_samples):
    rng, samples = three_samples
    tied = dataclasses.replace(CFG, llm=dataclasses.replace(CFG.llm, tie_embeddings=True))
    _, params, forward, _ = model_fns(tied, LOCAL)
    assert "lm_head" not in nnx.to_pure_dict(params)["llm"]
    logits = forward(params, build_batch(rng, [[samples, []]]))
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())
    assert 0.3 < float(logits[0, 0].std()) < 3.0  # unit-scale logits at init


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (tests/conftest.py)")
def test_exchange_is_one_all_to_all_under_a_mesh():
    mesh = jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(6)
    rows = rng.normal(size=(4, 8, 16)).astype(np.float32)
    send = rng.integers(0, 8, (4, 4, 3)).astype(np.int32)
    # Each received row fills at most one slot (an item's rows fill its placeholders one each).
    src = np.full((4, 2 * 5), -1, np.int32)
    for d in range(4):
        slots = rng.choice(2 * 5, 6, replace=False)
        src[d, slots] = rng.choice(12, 6, replace=False)
    src = src.reshape(4, 2, 5)
    x = rng.normal(size=(4, 2, 5, 16)).astype(np.float32)
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, jax.P(("data", "fsdp"))))
    with jax.set_mesh(mesh):
        f = jax.jit(lambda x, rows, send, src: fill_slots(x, exchange_rows([rows], [send])[0], src))
        args = [put(a) for a in (x, rows, send, src)]
        hlo = f.lower(*args).compile().as_text()
        out = f(*args)
    assert "all-to-all" in hlo and "all-gather" not in hlo and "all-reduce" not in hlo
    received = [np.concatenate([rows[s][send[s, d]] for s in range(4)]) for d in range(4)]
    expected = [
        np.where(src[d, ..., None] >= 0, received[d][np.maximum(src[d], 0)], x[d]) for d in range(4)
    ]
    np.testing.assert_allclose(out, np.stack(expected))
