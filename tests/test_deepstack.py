"""The block options Qwen3-VL brings, each against its definition: interleaved M-RoPE's
frequency layout (transformers' own), a learned table resized bilinearly with align_corners
(torch's), DeepStack's taps and additions in the scanned stacks (the blocks run one by one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmllm.models.attention import packing
from jaxmllm.models.layers import mrope_axes
from jaxmllm.models.positions import resized_table
from jaxmllm.models.transformer import BlockSpec, Transformer, pieces


@pytest.mark.torch
@pytest.mark.parametrize("sections", [(24, 20, 20), (4, 4, 4), (2, 5, 5), (16, 24, 24)])
def test_interleaved_mrope_turns_transformers_frequencies(sections):
    """Which of time, row and column turns each rotary frequency: transformers' Qwen3-VL
    recomposition (time everywhere, then rows and columns interleaved in), run on the axis
    numbers themselves."""
    import torch
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    half = sum(sections)
    freqs = torch.arange(3, dtype=torch.float)[:, None, None, None].expand(3, 1, 1, half).clone()
    rotary = Qwen3VLTextRotaryEmbedding.__new__(Qwen3VLTextRotaryEmbedding)
    rotary.mrope_section = list(sections)
    theirs = rotary.recomposition_frequencies(freqs)[0, 0, :half].numpy()
    np.testing.assert_array_equal(mrope_axes(sections, interleaved=True), theirs)
    assert (mrope_axes(sections) == np.repeat(np.arange(3), sections)).all()


@pytest.mark.torch
def test_a_learned_table_resized_bilinearly_is_torchs():
    """Two images of other grids packed in one row read the 6 x 6 table as
    `F.interpolate(mode="bilinear", align_corners=True)` resizes it to each grid."""
    import torch

    grid, width = 6, 5
    table = np.random.default_rng(0).normal(size=(grid * grid, width)).astype(np.float32)
    grids = [(4, 9), (7, 3)]
    pos = np.concatenate([np.stack(np.mgrid[0:h, 0:w], -1).reshape(-1, 2) for h, w in grids])
    seg = np.repeat([1, 2], [h * w for h, w in grids])
    ours = np.asarray(resized_table(jnp.asarray(table), seg[None], pos[None], "bilinear"))[0]
    square = torch.from_numpy(table.T.reshape(1, width, grid, grid))
    theirs = []
    for h, w in grids:
        out = torch.nn.functional.interpolate(square, (h, w), mode="bilinear", align_corners=True)
        theirs.append(out[0].reshape(width, -1).T.numpy())
    np.testing.assert_allclose(ours, np.concatenate(theirs), atol=1e-6)


def _stack(kinds=None, pattern=()):
    spec = BlockSpec(width=16, heads=2, kv_heads=2, mlp_dim=24, rope="none")
    return Transformer(4, spec, kinds=kinds, pattern=pattern, rngs=nnx.Rngs(0))


def _one_by_one(t: Transformer, x, pack, pos):
    """Each layer's output, the blocks run one at a time."""
    out = []
    for j, kind in enumerate(t.pattern):
        x = _one_by_one_layer(t, j, kind, x, pack, pos)
        out.append(x)
    return out


@pytest.mark.parametrize("mixed", [False, True])
def test_deepstack_taps_and_additions_are_the_blocks_run_one_by_one(mixed):
    """`tapped` keeps x after the tapped layers and `run(added=...)` adds each level after
    each of the first layers, in scans cut at those layers (one kind of layer, or two kinds
    stacked apart), exactly as running the blocks one by one and adding by hand."""
    kinds = pattern = None
    if mixed:
        spec = BlockSpec(width=16, heads=2, kv_heads=2, mlp_dim=24, rope="none")
        wide = BlockSpec(width=16, heads=2, kv_heads=2, mlp_dim=40, rope="none")
        kinds, pattern = {"a": spec, "b": wide}, ("b", "a", "a", "b")
    t = _stack(kinds, pattern or ())
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(1, 8, 16)), jnp.float32)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0]])
    pack, pos = packing(seg, causal=False, kind="dense"), jnp.zeros((1, 8), jnp.int32)
    each = _one_by_one(t, x, pack, pos)
    out, kept = t.tapped(x, pack, pos, (0, 2))
    np.testing.assert_allclose(out, each[-1], atol=1e-5)
    np.testing.assert_allclose(kept, jnp.stack([each[0], each[2]]), atol=1e-5)

    added = jnp.asarray(rng.normal(size=(2, 1, 8, 16)), jnp.float32)
    y = x
    for j, kind in enumerate(t.pattern):  # (by hand: after layers 0 and 1)
        y = _one_by_one_layer(t, j, kind, y, pack, pos)
        y = y + added[j] if j < 2 else y
    got, _ = t.run(x, pack, pos, added=added)
    np.testing.assert_allclose(got, y, atol=1e-5)


def _one_by_one_layer(t, j, kind, x, pack, pos):
    row = sum(k == kind for k in t.pattern[:j])
    graphdef, state = nnx.split(t.stack(kind))
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[row], state))(x, pack, pos)


def test_pieces_never_cross_a_bound():
    """The scans of a stack cut at DeepStack's layers: every layer once, in order, no piece
    across a bound, repeating units kept within a piece."""
    pattern = ("d", "m", "m", "m", "m", "m", "m")
    got = pieces(pattern, (3, 5))
    layers = [s.start + k for s in got for k in range(len(s.unit) * s.repeats)]
    assert layers == list(range(len(pattern)))
    for s in got:
        end = s.start + len(s.unit) * s.repeats
        assert not any(s.start < b < end for b in (3, 5)), got


def test_the_cost_model_counts_deepstacks_projectors_and_additions():
    """DeepStack's added work per patch, x3 to train: its K projectors' matmuls (2 x their
    weights over the merge area, as the model builds them) and the K additions of their rows
    to the LLM's hidden states; its LoRA adapters likewise."""
    import math

    from jaxmllm.config import Config, from_dict
    from jaxmllm.cost.model import CostModel
    from jaxmllm.hf.adapter_load import shapes_of

    raw = lambda deep: {
        "model": {
            "vision": {"width": 32, "heads": 4, "depth": 3, "mlp_dim": 48, "deepstack": deep},
            "llm": {"width": 64, "depth": 2, "heads": 4, "kv_heads": 2, "mlp_dim": 96},
            "audio": {"enabled": False},
        }
    }
    plain, deep = (from_dict(Config, raw(d)) for d in ([], [0, 2]))
    shapes = shapes_of(deep)
    added = sum(
        math.prod(v.shape)
        for p, v in shapes.items()
        if p.startswith("vision_projector/deepstack/") and p.endswith("/kernel")
    )
    v, width = deep.model.vision, deep.model.llm.width
    cost = lambda c: CostModel.from_model(c.model).phase("vision").linear
    want = 3 * (2 * added + len(v.deepstack) * width) / v.merge**2
    assert cost(deep) - cost(plain) == pytest.approx(want)
