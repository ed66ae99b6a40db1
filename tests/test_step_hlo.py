"""The device step as it lowers and compiles (jaxmllm.bench.hlo): bf16 matmuls only under bf16
compute, no scatter of a row per token in the routing, block-sparse attention's memory following
a chunk of tiles, not every tile's scores."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
from jaxmllm.bench import hlo
from jaxmllm.bench.compile import lower_step, with_depth
from jaxmllm.models import blocksparse
from jaxmllm.models.mllm import exchange_rows, fill_slots


@pytest.mark.parametrize(
    ("config", "overrides"),
    [
        ("configs/gpu/qwen2vl_2b.yaml", []),  # routed, block-sparse, vocab-parallel, FSDP 8
        ("configs/long_context.yaml", ["model.compute_dtype=bfloat16"]),  # context groups
        # a mixture of experts over mesh.expert (router, grouped matmul, the exchange), LoRA
        # on its attention and experts (their updates merged into the experts' weights)
        (
            "configs/tiny_moe.yaml",
            ["model.compute_dtype=bfloat16", "model.llm.lora.rank=4", "batch.capacity=fixed"],
        ),
        # a hybrid: Gated DeltaNet layers (the chunked rule's matmuls, its inverse by products
        # in float32, the gates) beside a gated full-attention layer, LoRA on both kinds
        (
            "configs/tiny_hybrid.yaml",
            ["model.compute_dtype=bfloat16", "model.llm.lora.rank=4", "batch.capacity=fixed"]
            + ["model.llm.linear.every=2"],  # (2 layers deep: one of each kind)
        ),
        # Qwen3-VL: its learned table resized (a matmul of interpolation weights), DeepStack's
        # projectors and additions, interleaved M-RoPE
        ("configs/gpu/qwen3_vl_8b.yaml", ["model.vision.deepstack=[0,1]"]),
    ],
    ids=["qwen2vl_2b", "long_context", "tiny_moe", "tiny_hybrid", "qwen3_vl_8b"],
)
def test_a_bf16_step_multiplies_bf16_operands_only(config, overrides):
    cfg = with_depth(config, 2, overrides)
    _, lowered = lower_step(cfg, sharding.make_mesh(cfg.mesh))
    dots = hlo.dot_dtypes(lowered.as_text())
    assert sum(dots.values()) > 20, dots
    assert all(lhs == rhs == "bf16" for lhs, rhs, _ in dots), dots


def routed(x, rows, send, count, src):
    """A phase's rows through the exchange into their slots (as the model routes them: the
    buffer is the device's own rows, then those it received)."""
    received = exchange_rows([rows], [send], [count])[0]
    return fill_slots(x, jnp.concatenate([rows, received], axis=1), src)


def slots(rng, devices: int, tokens: int, rows: int, filled: int) -> np.ndarray:
    """Per device, `filled` random tokens reading distinct rows (-1 elsewhere)."""
    src = np.full((devices, tokens), -1, np.int32)
    for d in range(devices):
        src[d, rng.choice(tokens, filled, replace=False)] = rng.choice(rows, filled, replace=False)
    return src


def test_the_routing_backward_scatters_no_row_per_token():
    """Its values and gradients are the gather-per-token reference's; its lowered gradient has
    no scatter of a row per token (which on a GPU adds every non-slot token's cotangent onto
    one row)."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    devices, own, cap, length, width = 4, 6, 3, 40, 16
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(devices, own, width)).astype(np.float32)
    send = rng.integers(0, own, (devices, devices, cap)).astype(np.int32)
    count = rng.integers(0, cap + 1, (devices, devices)).astype(np.int32)
    buffer = own + devices * cap
    src = slots(rng, devices, length, buffer, 10).reshape(devices, 1, length)
    x = rng.normal(size=(devices, 1, length, width)).astype(np.float32)
    weights = rng.normal(size=x.shape).astype(np.float32)

    def reference(x, rows):
        def sent(s, d):  # the rows device s sends d: its send slots up to their count
            used = (jnp.arange(cap) < count[s, d])[:, None]
            return jnp.where(used, rows[s][send[s, d]], 0.0)

        received = [jnp.concatenate([sent(s, d) for s in range(devices)]) for d in range(devices)]
        buffers = [jnp.concatenate([rows[d], received[d]]) for d in range(devices)]
        gathered = jnp.stack([b[jnp.maximum(src[d], 0)] for d, b in enumerate(buffers)])
        return jnp.sum(jnp.where(src[..., None] >= 0, gathered, x) * weights)

    loss = lambda x, rows: jnp.sum(routed(x, rows, send, count, src) * weights)
    grad = jax.value_and_grad(loss, argnums=(0, 1))
    put = lambda a: jax.device_put(a, jax.NamedSharding(mesh, jax.P("data")))
    with jax.set_mesh(mesh):
        got, got_grads = jax.jit(grad)(put(x), put(rows))
        text = jax.jit(grad).lower(put(x), put(rows)).as_text()
    want, want_grads = jax.value_and_grad(reference, argnums=(0, 1))(x, rows)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert not hlo.row_scatters(text, devices * length, width), hlo.scatter_updates(text)
    assert hlo.scatter_updates(text)  # (the rows do scatter: into their slots)


def test_block_sparse_memory_follows_a_chunk_not_every_tile(monkeypatch):
    """The gradient of two causal layers, scanned as the models scan them, compiled for two tile
    lists of one row: the second's 464 more tiles add far less than their scores (XLA:CPU's
    temporaries, under a sixteenth of them). The whole list's scores at once (the kernel before
    the chunks) would add 4.7 times that bound; every chunk's mask kept at once, 8 times
    (the layer scan's partial evaluation hoisting what depends on the tiles alone ahead of the
    layers, before `blocksparse._forward`'s checkpoint)."""
    monkeypatch.setattr(blocksparse, "CHUNK_SCORES", 8 * 2 * 128 * 128)  # 8 tiles a chunk
    length, heads, kv, dim, block = 4096, 2, 1, 32, 128
    blocks = length // block
    causal = np.array([(q, k) for q in range(blocks) for k in range(q + 1)], np.int32)

    def temporaries(tiles: np.ndarray) -> int:
        segments, tiles = jnp.ones((1, length), jnp.int32), jnp.asarray(tiles)[None]

        def layer(x, w):  # (the segments and tiles the same in every layer)
            q, k = x * w, x[:, :, :kv]
            return blocksparse.attend(q, k, k, segments, tiles, block=block, causal=True), None

        def loss(x, w):
            return jnp.sum(jax.lax.scan(layer, x, w)[0].astype(jnp.float32))

        x = jax.ShapeDtypeStruct((1, length, heads, dim), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((2, 1, 1, 1, dim), jnp.bfloat16)
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    few, every = temporaries(causal[:64]), temporaries(causal)
    tile_scores = block * block * heads * 4  # one tile's fp32 scores
    assert every - few < (len(causal) - 64) * tile_scores / 16, (few, every)
