"""Projectors from encoder features to LLM embeddings (the encoders end in a norm already)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmllm.models.layers import Dense


class MLPProjector(nnx.Module):
    """`Dense -> GELU -> Dense` from `in_width` to the LLM width."""

    def __init__(
        self,
        in_width: int,
        out_width: int,
        *,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.fc1 = Dense(in_width, out_width, ("embed", "mlp"), use_bias=True, **kw)
        self.fc2 = Dense(out_width, out_width, ("mlp", "embed"), use_bias=True, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class VisionProjector(MLPProjector):
    """Merges each merge x merge block of patches into one LLM token, then an MLP."""

    def __init__(
        self,
        vision_width: int,
        llm_width: int,
        merge: int,
        *,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        super().__init__(
            merge * merge * vision_width, llm_width, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.group = merge * merge

    def __call__(self, x_bpd: jax.Array) -> jax.Array:
        """[B, P, vision_width] -> [B, P / merge**2, llm_width].

        Patches arrive in merge order (each run of merge**2 patches is one block), so the merge
        is a reshape.
        """
        b, p, d = x_bpd.shape
        return super().__call__(x_bpd.reshape(b, p // self.group, self.group * d))


class AudioProjector(MLPProjector):
    """MLP from audio encoder rows (already subsampled x4) to LLM embeddings."""
