"""The fused LM loss (jaxmllm.models.loss): equal to a plain full-vocabulary cross entropy and its
autodiff gradients, in fp32 and (to bf16 precision) under bf16 compute; the matmuls it lowers to
take compute-dtype operands only, and only the gradients asked for are computed."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmllm.models.loss import Head, loss_sum

C, D, CHUNK, WIDTH, VOCAB = 3, 2, 8, 16, 40


def inputs(seed: int = 0):
    """Random hidden states, targets and a mask with zeros and fractional weights."""
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(C, D, CHUNK, WIDTH)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, VOCAB, (C, D, CHUNK)), jnp.int32)
    mask = rng.choice([0.0, 1.0, 0.5], size=(C, D, CHUNK), p=[0.3, 0.6, 0.1])
    return h, targets, jnp.asarray(mask, jnp.float32)


def reference(weight, h, targets, mask, rows_first: bool, divisor: float):
    """optax's cross entropy of the whole fp32 logits at once, summed with the mask."""
    w = weight.T if rows_first else weight
    logits = jnp.einsum("...w,wv->...v", h, w, precision="highest") / divisor
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(losses * mask)


@pytest.mark.parametrize("rows_first", [True, False], ids=["tied", "head"])
def test_loss_and_gradients_equal_the_plain_cross_entropy(rows_first):
    h, targets, mask = inputs()
    shape = (VOCAB, WIDTH) if rows_first else (WIDTH, VOCAB)
    weight = jnp.asarray(np.random.default_rng(1).normal(size=shape), jnp.float32)
    head = Head(rows_first, divisor=3.0)
    fused = lambda w, h: loss_sum(w, h, targets, mask, head)
    plain = lambda w, h: reference(w, h, targets, mask, rows_first, 3.0)
    with jax.default_matmul_precision("highest"):
        got, (gw, gh) = jax.value_and_grad(fused, argnums=(0, 1))(weight, h)
        want, (ww, wh) = jax.value_and_grad(plain, argnums=(0, 1))(weight, h)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(gw, ww, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gh, wh, rtol=1e-5, atol=1e-6)
    # A masked token carries no loss and no gradient.
    assert np.all(np.asarray(gh)[np.asarray(mask) == 0] == 0)


def test_soft_capped_loss_and_gradients_equal_autodiff_of_the_capped_logits(monkeypatch):
    """Gemma's final_logit_softcapping (`Head.softcap`): the fused loss and its hand-written
    gradients are autodiff's of cap x tanh(logits / cap); without the cap's factor in the
    gradient, they are not."""
    h, targets, mask = inputs()
    weight = jnp.asarray(np.random.default_rng(1).normal(size=(WIDTH, VOCAB)), jnp.float32)
    cap = 2.0  # (small: most logits bend under it)

    def plain(w, h):
        logits = jnp.einsum("...w,wv->...v", h, w, precision="highest") / 3.0
        capped = cap * jnp.tanh(logits / cap)
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(capped, targets) * mask)

    with jax.default_matmul_precision("highest"):
        fused = lambda w, h, head: loss_sum(w, h, targets, mask, head)
        grad = jax.value_and_grad(fused, argnums=(0, 1))
        got, (gw, gh) = grad(weight, h, Head(False, 3.0, softcap=cap))
        want, (ww, wh) = jax.value_and_grad(plain, argnums=(0, 1))(weight, h)
        monkeypatch.setattr(Head, "capped_grad", lambda self, g, logits: g)
        _, (bad_w, _) = grad(weight, h, Head(False, 3.0, softcap=cap + 1e-3))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(gw, ww, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gh, wh, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(bad_w) - np.asarray(ww)).max() > 1e-2


def test_bf16_compute_matches_fp32_to_bf16_precision():
    h, targets, mask = inputs(2)
    weight = jnp.asarray(np.random.default_rng(3).normal(size=(WIDTH, VOCAB)) * 0.3, jnp.float32)
    fused = lambda w, h, dtype: loss_sum(w, h, targets, mask, Head(False, 1.0, (), dtype))
    grad = jax.value_and_grad(fused, argnums=(0, 1))
    want, (ww, wh) = grad(weight, h, jnp.float32)
    got, (gw, gh) = grad(weight, h.astype(jnp.bfloat16), jnp.bfloat16)
    assert gw.dtype == jnp.float32 and gh.dtype == jnp.bfloat16  # each in its input's dtype
    np.testing.assert_allclose(got, want, rtol=2e-2)
    for g, w in ((gw, ww), (gh, wh)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.abs(g - w).max() <= 3e-2 * np.abs(w).max(), np.abs(g - w).max()


def dots(fn, *args) -> list[tuple[str, str, str]]:
    """The operand and result dtypes of every dot_general `fn` lowers to."""
    text = jax.jit(fn).lower(*args).as_text()
    pattern = r"stablehlo\.dot_general.*?\(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)>"
    return [tuple(t.split("x")[-1] for t in m) for m in re.findall(pattern, text)]


def test_bf16_matmuls_only_and_only_the_gradients_asked_for():
    h, targets, mask = inputs()
    h = h.astype(jnp.bfloat16)
    weight = jnp.zeros((WIDTH, VOCAB), jnp.float32)  # the fp32 master weight
    head = Head(False, 1.0, (), jnp.bfloat16)
    fused = lambda w, h: loss_sum(w, h, targets, mask, head)
    both = dots(jax.grad(fused, argnums=(0, 1)), weight, h)
    assert len(both) == 3 and all(d == ("bf16", "bf16", "f32") for d in both), both
    frozen_head = dots(jax.grad(fused, argnums=1), weight, h)  # no weight gradient
    assert len(frozen_head) == 2, frozen_head
    assert len(dots(fused, weight, h)) == 1  # evaluation: the projection alone
