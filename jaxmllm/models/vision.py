"""ViT over packed native-resolution patches.

Each device holds one packed row of patches from several images of any size. Images never attend
to each other (segment mask) and positions are 2D rotary (row, column within the image), so no
image size is baked into the parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmllm.config import VisionConfig
from jaxmllm.models.attention import packing
from jaxmllm.models.layers import Dense
from jaxmllm.models.transformer import Transformer


class VisionEncoder(nnx.Module):
    """Patch embedding + bidirectional transformer with 2D RoPE."""

    def __init__(
        self,
        cfg: VisionConfig,
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
        patch_dim = cfg.patch_size * cfg.patch_size * cfg.channels
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.patch_embed = Dense(patch_dim, cfg.width, ("patch", "embed"), use_bias=True, **kw)
        self.transformer = Transformer(
            depth=cfg.depth,
            width=cfg.width,
            heads=cfg.heads,
            kv_heads=cfg.heads,  # plain multi-head attention
            mlp_dim=cfg.mlp_dim,
            rope="2d",
            rope_theta=cfg.rope_theta,
            remat=remat,
            remat_policy=remat_policy,
            **kw,
        )

    def __call__(
        self,
        patches_bpc: jax.Array,
        segment_ids_bp: jax.Array,
        positions_bp2: jax.Array,
        tiles_bk2: jax.Array | None = None,
    ) -> jax.Array:
        """Encodes packed patches.

        Args:
          patches_bpc: flattened patch pixels [B, P, patch_size**2 * channels].
          segment_ids_bp: which image each patch belongs to, 0 for padding [B, P].
          positions_bp2: (row, col) of each patch within its image [B, P, 2].
          tiles_bk2: block-sparse attention's tiles [B, K, 2].

        Returns:
          Patch features [B, P, width] in the compute dtype.
        """
        return self.transformer(
            *self.prepare(patches_bpc, segment_ids_bp, positions_bp2, tiles_bk2)
        )

    def prepare(self, patches_bpc, segment_ids_bp, positions_bp2, tiles_bk2=None):
        """What the transformer takes (the arguments as in `__call__`): the embedded patches,
        their packing and positions (a pipeline runs the stack's layers stage by stage)."""
        pack = packing(
            segment_ids_bp,
            causal=False,
            kind=self.attention,
            tiles_bk2=tiles_bk2,
            block=self.block,
            documents=self.documents,
        )
        return self.patch_embed(patches_bpc), pack, positions_bp2
