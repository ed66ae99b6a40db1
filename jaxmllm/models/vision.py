"""ViT over packed native-resolution patches.

Each device holds one packed row of patches from several images of any size. Images never attend
to each other (segment mask). Positions are 2D rotary (row, column within the image; also the
Qwen2-VL vision tower's scheme), so no image size is baked into the parameters, or a learned
SigLIP table resized to each image's grid (`jaxmllm.models.positions`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmllm.config import VisionConfig
from jaxmllm.models.attention import packing
from jaxmllm.models.layers import Dense, normal_param
from jaxmllm.models.positions import resized_table
from jaxmllm.models.transformer import BlockSpec, Transformer


class VisionEncoder(nnx.Module):
    """Patch embedding (+ learned positions) + bidirectional transformer (2D RoPE or none)."""

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
        # A temporal patch embedding reads t frames of a patch; an image repeats its frame.
        self.temporal_patch = cfg.temporal_patch
        self.patch_embed = Dense(
            cfg.temporal_patch * patch_dim,
            cfg.width,
            ("patch", "embed"),
            use_bias=cfg.patch_bias,
            **kw,
        )
        self.position_embedding = (
            normal_param(
                rngs, (cfg.position_grid**2, cfg.width), 0.02, ("positions", "embed"), param_dtype
            )
            if cfg.positions == "learned"
            else None
        )
        rope = "2d" if cfg.positions == "rope" else "none"
        self.transformer = Transformer(
            cfg.depth,
            BlockSpec.of(cfg, rope=rope),  # plain multi-head attention
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
          patches_bpc: flattened patch pixels [B, P, patch_size**2 * channels], of
            temporal_patch frames side by side (frame-major) where the model takes videos.
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
        frames = self.patch_embed.kernel.shape[0] // patches_bpc.shape[-1]
        if frames > 1:  # (one frame a patch: images only; an image repeats its frame)
            patches_bpc = jnp.concatenate([patches_bpc] * frames, axis=-1)
        x_bpd = self.patch_embed(patches_bpc)
        if self.position_embedding is not None:
            table = self.position_embedding[...]
            pos_bpd = resized_table(table, segment_ids_bp, positions_bp2)
            x_bpd = (x_bpd.astype(jnp.float32) + pos_bpd).astype(x_bpd.dtype)
        pack = packing(
            segment_ids_bp,
            causal=False,
            kind=self.attention,
            tiles_bk2=tiles_bk2,
            block=self.block,
            documents=self.documents,
        )
        return x_bpd, pack, positions_bp2
