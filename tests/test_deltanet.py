"""Gated DeltaNet (jaxmllm/models/deltanet.py): the chunked delta rule against transformers'
reference kernels, packed rows whose documents restart the state and the convolution, its
gradients against the token-by-token rule's, bf16 operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmllm.models import deltanet as D

B, T, KH, R, DK, DV = 2, 150, 2, 3, 8, 12
chunked = jax.jit(D.chunked_delta_rule, static_argnames=("chunk", "dtype"))
recurrent = jax.jit(D.recurrent_delta_rule)


def inputs(seed: int = 0, t: int = T):
    """Random q, k (unnormalised), v, g <= 0, beta in (0, 1), as transformers takes them."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, t, KH, DK)).astype(np.float32)
    k = rng.normal(size=(B, t, KH, DK)).astype(np.float32)
    v = rng.normal(size=(B, t, KH * R, DV)).astype(np.float32)
    g = (-np.abs(rng.normal(size=(B, t, KH * R))) * 0.5).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(B, t, KH * R))))).astype(np.float32)
    return q, k, v, g, beta


def ours(q, k, v, g, beta):
    """The same inputs in our layout: q, k normalised (q scaled), value heads by key head."""
    qn = D.l2_normalised(q) * DK**-0.5
    kn = D.l2_normalised(k)
    t = q.shape[1]
    return qn, kn, v.reshape(B, t, KH, R, DV), g.reshape(B, t, KH, R), beta.reshape(B, t, KH, R)


def packed_segments() -> np.ndarray:
    """Documents of several lengths, one ending on a chunk boundary of 16, one of a single
    token, padding in the middle of a chunk."""
    seg = np.zeros((B, T), np.int32)
    seg[0, :40], seg[0, 40:100], seg[0, 100:140] = 1, 2, 3
    seg[1, :48], seg[1, 48:49], seg[1, 49:150] = 1, 2, 3
    return seg


def test_the_chunked_rule_is_transformers_reference():
    """One document a row, a key head serving 3 value heads, 150 tokens (not a multiple of the
    chunk): our chunked rule and our token-by-token rule equal transformers' kernels."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as M

    q, k, v, g, beta = inputs()
    t = torch.from_numpy
    theirs, _ = M.torch_recurrent_gated_delta_rule(
        t(q), t(k), t(v), g=t(g), beta=t(beta), use_qk_l2norm_in_kernel=True
    )
    theirs = theirs.numpy()
    starts = np.zeros((B, T), bool)
    starts[:, 0] = True
    args = (*ours(q, k, v, g, beta), starts)
    ours_ = np.asarray(chunked(*args, chunk=64)).reshape(theirs.shape)
    token_by_token = np.asarray(recurrent(*args)[0]).reshape(theirs.shape)
    assert np.abs(theirs).max() > 0.3
    np.testing.assert_allclose(ours_, theirs, atol=1e-5)
    np.testing.assert_allclose(token_by_token, theirs, atol=1e-5)


@pytest.mark.parametrize("chunk", [16, 64])
def test_each_packed_document_gets_the_outputs_it_has_alone(chunk):
    """The state restarts at each document of a packed row (documents starting mid-chunk, on a
    chunk's first token, one token long): each document's outputs are the token-by-token
    rule's on it alone; without the restarts they are not."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as M

    raw = inputs()
    q, k, v, g, beta = ours(*raw)
    seg = packed_segments()
    starts = np.asarray(D.document_starts(jnp.asarray(seg)))
    out = np.asarray(chunked(q, k, v, g, beta, starts, chunk=chunk)).reshape(B, T, KH * R, DV)
    worst = 0.0
    for b in range(B):
        for s in np.unique(seg[b]):
            m = seg[b] == s
            q1, k1, v1, g1, beta1 = (torch.from_numpy(x[b : b + 1, m]) for x in raw)
            alone, _ = M.torch_recurrent_gated_delta_rule(
                q1, k1, v1, g=g1, beta=beta1, use_qk_l2norm_in_kernel=True
            )
            worst = max(worst, float(np.abs(out[b, m] - alone.numpy()[0]).max()))
    assert worst < 1e-5
    row_starts = np.zeros((B, T), bool)
    row_starts[:, 0] = True
    unrestarted = np.asarray(chunked(q, k, v, g, beta, row_starts, chunk=chunk))
    assert np.abs(unrestarted.reshape(out.shape) - out).max() > 0.1


def test_documents_restart_at_each_row_of_rows_laid_end_to_end():
    """Block-sparse attention lays a device's rows end to end in one: a row's first document
    starts there even when its segment id is the previous row's last one."""
    seg = jnp.asarray([[1, 1, 1, 1, 1, 1, 2, 2]])
    assert D.document_starts(seg, row=4).tolist() == [[1, 0, 0, 0, 1, 0, 1, 0]]
    assert D.document_starts(seg).tolist() == [[1, 0, 0, 0, 0, 0, 1, 0]]


def test_the_convolution_restarts_at_each_document():
    """Each document's convolution is the one it has alone: its first tokens see zeros before
    them (transformers' left padding), not the previous document's tokens."""
    rng = np.random.default_rng(1)
    seg = packed_segments()
    x = rng.normal(size=(B, T, 5)).astype(np.float32)
    kernel = rng.normal(size=(4, 5)).astype(np.float32)
    starts = D.document_starts(jnp.asarray(seg))
    out = np.asarray(jax.jit(D.causal_conv)(x, kernel, starts))
    for b in range(B):
        for s in np.unique(seg[b]):
            m = seg[b] == s
            padded = np.concatenate([np.zeros((3, 5), np.float32), x[b, m]])
            ref = sum(kernel[j] * padded[j : j + m.sum()] for j in range(4))
            np.testing.assert_allclose(out[b, m], ref, atol=1e-5)


def test_gradients_are_the_token_by_token_rule_s():
    """The chunked rule's gradients (through the triangular solve, the masks and the
    checkpointed scan) equal those of the token-by-token rule, packed documents included."""
    q, k, v, g, beta = ours(*inputs(2))
    starts = D.document_starts(jnp.asarray(packed_segments()))
    w = jnp.asarray(np.random.default_rng(3).normal(size=(B, T, KH, R, DV)), jnp.float32)
    by_chunks = lambda *a: jnp.sum(D.chunked_delta_rule(*a, starts, chunk=16) * w)
    by_tokens = lambda *a: jnp.sum(D.recurrent_delta_rule(*a, starts)[0] * w)
    ours_ = jax.jit(jax.grad(by_chunks, argnums=range(5)))(q, k, v, g, beta)
    ref = jax.jit(jax.grad(by_tokens, argnums=range(5)))(q, k, v, g, beta)
    for a, b in zip(ours_, ref, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-4)


def test_bf16_multiplies_bf16_operands_with_float32_state():
    """Under bf16 compute every matmul takes bf16 operands (fp32 accumulation, the state kept
    float32 where it accumulates) and the outputs stay within bf16's rounding of fp32's."""
    from jaxmllm.bench import hlo

    q, k, v, g, beta = ours(*inputs())
    starts = D.document_starts(jnp.asarray(packed_segments()))
    args = (q, k, v, g, beta, starts)
    full = chunked(*args, chunk=64)
    run = lambda *a: D.chunked_delta_rule(*a, chunk=64, dtype=jnp.bfloat16)
    half = jax.jit(run)(*args)
    assert half.dtype == jnp.bfloat16
    assert float(jnp.abs(half.astype(jnp.float32) - full).max()) < 0.05
    step = jax.jit(jax.grad(lambda *a: jnp.sum(run(*a).astype(jnp.float32)), argnums=range(5)))
    dots = hlo.dot_dtypes(step.lower(*args).as_text())
    assert dots and all(lhs == rhs == "bf16" for lhs, rhs, _ in dots), dots


def test_a_linear_layer_s_step_memory_grows_linearly_in_tokens():
    """A Gated DeltaNet layer's training step (bench.linear's) compiled for rows of 2,048 and
    8,192 tokens: its memory per token (XLA's memory analysis: arguments, outputs and
    temporaries) is flat, where attention's dense scores would grow 4x."""
    from flax import nnx

    from jaxmllm.bench import linear as L
    from jaxmllm.bench.attention import _peak_bytes

    args = L.parser().parse_args(["--width", "256", "--key-heads", "2", "--value-heads", "4"])
    per_token = {}
    for t in (2048, 8192):
        grad, params = L.step_fn(L.mixer("linear", args, nnx.Rngs(0)))
        compiled = grad.lower(params, *L.inputs(t, args)).compile()
        per_token[t] = _peak_bytes(compiled) / t
    assert per_token[8192] <= 1.1 * per_token[2048], per_token
