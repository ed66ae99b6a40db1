"""Per-layer inputs (Gemma 4's per-layer embeddings, `model.llm.per_layer_dim`): beside the
residual stream, every decoder layer reads an input of its own, P wide, which it adds after its
MLP through a gate (`transformer.Block.per_layer_added`).

The inputs of all L layers are made once, before the first layer, of two parts
(transformers' `get_per_layer_inputs` and `project_per_layer_inputs`):

- the token's identity: a table [per-layer vocabulary, L x P] read at the token's id, its rows
  times sqrt(P);
- its context: the decoder's input embeddings (the token embeddings with the encoders' rows in
  their slots) projected to L x P, over sqrt(width), each layer's P normed;

summed over sqrt(2). The table is read by id, so the decoder takes the ids beside the
embeddings. An encoder row's slot (an image's or a clip's soft token) reads the pad id's row,
as transformers' Gemma4Model does: `per_layer_ids`, what a whole model calls.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmllm.models.layers import Dense, Embed, RMSNorm


def per_layer_ids(tokens_bt: jax.Array, slots_bt: jax.Array, pad_id: int) -> jax.Array:
    """The ids the per-layer table is read at: each token's own, the pad id where an encoder
    row fills the token's slot (`slots_bt`: an image's or a clip's soft tokens; transformers'
    Gemma4Model sets their ids to pad_token_id before `get_per_layer_inputs`)."""
    return jnp.where(slots_bt, jnp.asarray(pad_id, tokens_bt.dtype), tokens_bt)


class PerLayerInputs(nnx.Module):
    """Every layer's per-layer input from the decoder's input embeddings and the token ids
    (module docstring): `embed` the identity table, `projection` the context's, `norm` its
    norm over each layer's P."""

    def __init__(
        self,
        vocab: int,
        width: int,
        depth: int,
        dim: int,
        *,
        eps: float,
        vocab_parallel: bool,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        """`vocab` rows of `depth` x `dim` (each layer's `dim` side by side), a projection from
        `width`, the norm's epsilon `eps`; `vocab_parallel`: the table stored split by rows,
        as the decoder's."""
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.embed = Embed(
            vocab, depth * dim, vocab_parallel=vocab_parallel, scale=math.sqrt(dim), rngs=rngs, **kw
        )
        self.projection = Dense(width, (depth, dim), ("embed", None, None), rngs=rngs, **kw)
        self.norm = RMSNorm(dim, eps=eps, axis=None, **kw)
        self.depth, self.dim, self.width = depth, dim, width
        self.dtype = dtype

    def __call__(self, x_btd: jax.Array, ids_bt: jax.Array) -> jax.Array:
        """Each layer's input [L, B, T, P] of the input embeddings [B, T, width] and the ids
        [B, T] (`per_layer_ids`; an id past the table reads zeros: padding)."""
        b, t = ids_bt.shape
        tokens = self.embed(ids_bt).reshape(b, t, self.depth, self.dim)
        context = self.projection(x_btd) * jnp.asarray(self.width**-0.5, self.dtype)
        both = (self.norm(context.astype(self.dtype)) + tokens) * jnp.asarray(2**-0.5, self.dtype)
        return jnp.moveaxis(both.astype(self.dtype), 2, 0)
