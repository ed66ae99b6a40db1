"""Llama-style decoder: RMSNorm, RoPE, grouped-query attention, gated MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmllm.config import LLMConfig
from jaxmllm.models.attention import Packing, packing
from jaxmllm.models.layers import Dense, Embed
from jaxmllm.models.transformer import Transformer


class Decoder(nnx.Module):
    """Token embedding, causal transformer over packed rows, and the output projection.

    Embedding and decoding are separate calls so the caller can replace placeholder embeddings
    with encoder outputs in between.
    """

    def __init__(
        self,
        cfg: LLMConfig,
        *,
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        remat: bool,
        remat_policy: str = "nothing",
        attention: str = "dense",
        block: int = 0,
        documents: int = 0,
        rngs: nnx.Rngs,
    ):
        self.attention, self.block = attention, block  # model.attention, batch.attention_block
        self.documents = documents  # batch.*_documents (cudnn attention)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.embed = Embed(cfg.vocab_size, cfg.width, **kw)
        self.transformer = Transformer(
            depth=cfg.depth,
            width=cfg.width,
            heads=cfg.heads,
            kv_heads=cfg.kv_heads,  # grouped-query attention
            mlp_dim=cfg.mlp_dim,
            rope="1d",
            rope_theta=cfg.rope_theta,
            remat=remat,
            remat_policy=remat_policy,
            **kw,
        )
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else Dense(cfg.width, cfg.vocab_size, ("embed", "vocab"), out_dtype=jnp.float32, **kw)
        )

    def __call__(
        self,
        x_btd: jax.Array,
        segment_ids_bt: jax.Array,
        positions_bt: jax.Array,
        tiles_bk2: jax.Array | None = None,
    ) -> jax.Array:
        """Decodes embedded rows.

        Args:
          x_btd: input embeddings [B, T, width].
          segment_ids_bt: which sample each token belongs to, 0 for padding [B, T].
          positions_bt: position within the sample, for RoPE [B, T].
          tiles_bk2: block-sparse attention's tiles [B, K, 2] (a device's rows are then one
            row B of all their tokens: tiles never pair blocks of two rows).

        Returns:
          Logits [B, T, vocab] in float32.
        """
        x_btd = self.transformer(x_btd, self.packing(segment_ids_bt, tiles_bk2), positions_bt)
        return self.head(x_btd)

    def packing(self, segment_ids_bt: jax.Array, tiles_bk2: jax.Array | None = None) -> Packing:
        """Causal attention within each packed document (arguments as in `__call__`)."""
        return packing(
            segment_ids_bt,
            causal=True,
            kind=self.attention,
            tiles_bk2=tiles_bk2,
            block=self.block,
            documents=self.documents,
        )

    def head(self, x_btd: jax.Array) -> jax.Array:
        """Float32 logits of the final hidden states (after the transformer's final norm)."""
        if self.lm_head is None:
            return self.embed.attend(x_btd)
        return self.lm_head(x_btd)
