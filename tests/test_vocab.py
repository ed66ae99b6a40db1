"""Vocabulary-parallel embedding and loss (jaxmllm.models.vocab) on 8 CPU devices: the same
loss and every gradient as the unsplit reference, tied and untied, several meshes (the expert
axis's devices hold buckets of their own: the vocabulary splits over it as over fsdp)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sharding
from jaxmllm.config import LLMConfig
from jaxmllm.models import param_axes
from jaxmllm.models.llm import Decoder, chunked_token_logps_and_entropy, chunked_token_losses
from jaxmllm.models.vocab import vocab_axes

VOCAB, T = 272, 48


def decoder_loss(cfg: LLMConfig, scores: bool = False):
    """(pure params, jitted value_and_grad(params, ids, targets, mask)) of a decoder; `scores`:
    the jitted (params, ids, targets) -> each token's (log-prob, entropy) instead."""
    kw = dict(dtype=jnp.float32, param_dtype=jnp.float32, remat="none", attention="dense")
    graphdef, state = nnx.split(Decoder(cfg, **kw, rngs=nnx.Rngs(0)))

    def hidden(pure, ids):
        filled = jax.tree.map(lambda x: x, state)
        nnx.replace_by_pure_dict(filled, pure)
        dec = nnx.merge(graphdef, filled)
        seg = jnp.ones_like(ids)
        pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        return dec, dec.hidden(dec.embed(ids), seg, pos)

    def loss(pure, ids, targets, mask):
        total, count = chunked_token_losses(*hidden(pure, ids), targets, mask)
        return total / count

    if scores:
        return state, jax.jit(lambda p, ids, t: chunked_token_logps_and_entropy(*hidden(p, ids), t))
    return state, jax.jit(jax.value_and_grad(loss))


def placed(state, mesh):
    """The parameters in the shardings their logical axes give on `mesh` (as the trainer's)."""
    pure = nnx.to_pure_dict(state)
    return jax.device_put(pure, sharding.param_shardings(param_axes(state), pure, mesh))


SLOW = pytest.mark.slow  # (two cases in the default suite: three axes split, tied and untied)
# (The tied head on data 2 x fsdp 2 x tensor 2: the untied case's mesh, the tied head split
# over three axes by tied-e2f2t2; tied on fsdp 8: the one axis of untied-f8, the tied head's
# by tied-d4t2 and tied-e2f2t2.)
CASES = [  # (data, expert, fsdp, tensor)
    pytest.param(False, (2, 1, 2, 2), id="untied-d2f2t2"),
    pytest.param(True, (1, 2, 2, 2), id="tied-e2f2t2"),
    pytest.param(False, (1, 1, 8, 1), id="untied-f8", marks=SLOW),
    pytest.param(False, (1, 8, 1, 1), id="untied-e8", marks=SLOW),
    pytest.param(True, (4, 1, 1, 2), id="tied-d4t2", marks=SLOW),
]


@pytest.mark.parametrize(("tied", "shape"), CASES)
def test_vocab_parallel_equals_the_unsplit_loss_and_gradients(tied, shape):
    data, expert, fsdp, tensor = shape
    cfg = LLMConfig(
        vocab_size=VOCAB,
        width=32,
        depth=1,
        heads=4,
        kv_heads=2,
        mlp_dim=64,
        tie_embeddings=tied,
        logits_chunk=16,
    )
    rng = np.random.default_rng(0)
    d = data * expert * fsdp
    ids = jnp.asarray(rng.integers(0, VOCAB, (d, T)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, VOCAB, (d, T)), jnp.int32)
    mask = jnp.asarray(rng.random((d, T)) < 0.7, jnp.float32)
    params, value_and_grad = decoder_loss(cfg)
    want, want_grads = value_and_grad(params, ids, targets, mask)  # no mesh: the reference
    _, scores = decoder_loss(cfg, scores=True)  # (each token's log-prob and entropy: RL's)
    want_scores = scores(params, ids, targets)
    mesh = sharding.make_mesh({"data": data, "expert": expert, "fsdp": fsdp, "tensor": tensor})
    with jax.set_mesh(mesh):
        split = (("expert", expert), ("fsdp", fsdp), ("tensor", tensor))
        assert vocab_axes(VOCAB, d) == tuple(a for a, n in split if n > 1)
        got, got_grads = value_and_grad(params, ids, targets, mask)
        got_scores = scores(params, ids, targets)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_scores, want_scores, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    flat_want, flat_got = nnx.to_flat_state(want_grads), nnx.to_flat_state(got_grads)
    for (path, w), (_, g) in zip(flat_want, flat_got, strict=True):
        np.testing.assert_allclose(
            np.asarray(g.get_value()),
            np.asarray(w.get_value()),
            rtol=1e-4,
            atol=1e-6,
            err_msg=str(path),
        )


@pytest.mark.slow
def test_the_split_path_holds_shards_of_the_table_only():
    """Compiled for data 1 x fsdp 8 with a 32k vocabulary: XLA's default path holds the whole
    table (and its gradient) several times over on every device; the split path a few of its
    1/8 shards (the loop's carries, the gradient's accumulator)."""
    cfg = LLMConfig(
        vocab_size=32768,
        width=256,
        depth=1,
        heads=4,
        kv_heads=2,
        mlp_dim=64,
        tie_embeddings=True,
        logits_chunk=64,
    )
    table_bytes = 32768 * 256 * 4
    ids = jnp.zeros((8, 128), jnp.int32)
    mask = jnp.ones((8, 128), jnp.float32)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
    temp = {}
    for split in (True, False):
        state, value_and_grad = decoder_loss(dataclasses.replace(cfg, vocab_parallel=split))
        with jax.set_mesh(mesh):
            compiled = value_and_grad.lower(placed(state, mesh), ids, ids, mask).compile()
        temp[split] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[False] > 2 * table_bytes and 4 * temp[True] < temp[False], (temp, table_bytes)
