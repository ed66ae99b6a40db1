"""ViT over packed native-resolution patches.

Each device holds one packed row of patches from several images of any size. Images never attend
to each other (segment mask). Positions are 2D rotary (row, column within the image; also the
Qwen2-VL vision tower's scheme), so no image size is baked into the parameters, or a learned
SigLIP table resized to each image's grid (`jaxmllm.models.positions`), or both (Qwen3-VL's
tower: its table resized bilinearly, and 2D rotary in every block), or two learned tables read
at each patch's column and row, beside 2D rotary whose head halves turn by column then row
(Gemma 4's tower: `position_axes`, `rope_axes: cols_first`).

DeepStack (`model.vision.deepstack`, Qwen3-VL): the outputs of a few blocks are kept
(`tapped`) for their own projectors, whose rows the LLM adds to its first layers' hidden states
at the image's tokens (`jaxmllm.models.mllm`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmllm.config import VisionConfig
from jaxmllm.config.model import ROPE_AXES
from jaxmllm.config.spec import Inputs
from jaxmllm.models import vision_rows as vr
from jaxmllm.models.attention import packing
from jaxmllm.models.inputs import decode
from jaxmllm.models.layers import NORMS, Dense, normal_param
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
        remat: str = "none",
        attention: str = "dense",
        block: int = 0,
        documents: int = 0,
        inputs: Inputs | None = None,
        rngs: nnx.Rngs,
    ):
        self.attention, self.block = attention, block  # model.attention, batch.attention_block
        self.documents = documents  # batch.*_documents (cudnn attention)
        self.inputs = inputs  # how its patches travel: uint8 pixels are normalised here
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
            if cfg.position_grid
            else None
        )
        self.position_resize = cfg.position_resize
        self.position_axes = (
            normal_param(
                rngs,
                (2, cfg.position_axes, cfg.width),
                0.02,
                (None, "positions", "embed"),
                param_dtype,
            )
            if cfg.position_axes
            else None
        )
        self.deepstack = tuple(cfg.deepstack)  # the blocks whose outputs DeepStack reads
        # CLIP: a learned class token and its own row of the position table; a norm first.
        token = lambda: normal_param(rngs, (cfg.width,), 0.02, ("embed",), param_dtype)
        self.class_embedding = token() if cfg.class_token else None
        self.class_position = token() if cfg.class_token else None
        norm = NORMS[cfg.norm]
        self.pre_norm = (
            norm(cfg.width, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)
            if cfg.pre_norm
            else None
        )
        self.merge, self.window = cfg.merge, cfg.window
        rope = ROPE_AXES[cfg.rope_axes] if cfg.positions == "rope" else "none"
        spec = BlockSpec.of(  # plain multi-head attention
            cfg,
            rope=rope,
            post_norms=cfg.post_norms,
            v_norm=cfg.v_norm,
            attn_scalar=cfg.attn_scalar,
            clipped=cfg.clipped_linears,
        )
        self.transformer = Transformer(
            cfg.depth,
            spec,
            remat=remat,
            final_norm=cfg.final_norm,
            full_layers=cfg.full_blocks,
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
            temporal_patch frames side by side (frame-major) where the model takes videos:
            uint8 (normalised here by `inputs`: what the batch holds) or normalised values.
          segment_ids_bp: which image each patch belongs to, 0 for padding [B, P].
          positions_bp2: (row, col) of each patch within its image [B, P, 2].
          tiles_bk2: block-sparse attention's tiles [B, K, 2].

        Returns:
          Patch features [B, P, width] in the compute dtype.
        """
        rows = self.rows(patches_bpc, segment_ids_bp, positions_bp2, tiles_bk2)
        return rows.finish(self.transformer(rows.x, rows.pack, rows.positions, rows.local))

    def tapped(
        self,
        patches_bpc: jax.Array,
        segment_ids_bp: jax.Array,
        positions_bp2: jax.Array,
        tiles_bk2: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """`__call__`'s features, and the outputs of the blocks `deepstack` names (before any
        norm) [K, B, P, width], each as the row's patches."""
        rows = self.rows(patches_bpc, segment_ids_bp, positions_bp2, tiles_bk2)
        h, kept = self.transformer.tapped(rows.x, rows.pack, rows.positions, self.deepstack)
        return rows.finish(self.transformer.norm(h)), jax.vmap(rows.finish)(kept)

    def prepare(self, patches_bpc, segment_ids_bp, positions_bp2, tiles_bk2=None):
        """What the transformer takes (the arguments as in `__call__`): the embedded patches,
        their packing and positions (a pipeline runs the stack's layers stage by stage; a tower
        with class tokens or windows does not run there)."""
        rows = self.rows(patches_bpc, segment_ids_bp, positions_bp2, tiles_bk2)
        return rows.x, rows.pack, rows.positions

    def rows(self, patches_bpc, segment_ids_bp, positions_bp2, tiles_bk2=None) -> vr.Rows:
        """The embedded row as the blocks take it (`vision_rows`: class rows, window order)."""
        patches_bpc = decode(patches_bpc, segment_ids_bp, self.inputs)
        frames = self.patch_embed.kernel.shape[0] // patches_bpc.shape[-1]
        if frames > 1:  # (one frame a patch: images only; an image repeats its frame)
            patches_bpc = jnp.concatenate([patches_bpc] * frames, axis=-1)
        x_bpd = self.patch_embed(patches_bpc)
        if self.position_embedding is not None:
            table = self.position_embedding[...]
            pos_bpd = resized_table(
                table, segment_ids_bp, positions_bp2, self.position_resize, x_bpd.dtype
            )
            x_bpd = (x_bpd.astype(jnp.float32) + pos_bpd).astype(x_bpd.dtype)
        if self.position_axes is not None:  # (a column's row of one table, a row's of the other)
            tables = self.position_axes[...].astype(x_bpd.dtype)
            pos_bpd = tables[0][positions_bp2[..., 1]] + tables[1][positions_bp2[..., 0]]
            x_bpd = x_bpd + pos_bpd
        seg, pos, tiles = segment_ids_bp, positions_bp2, tiles_bk2
        b, n = seg.shape
        sparse = self.attention == "block_sparse"
        if self.class_embedding is not None:
            slots = vr.class_slots(n, self.documents, self.merge, self.block if sparse else 0)
            token = self.class_embedding[...] + self.class_position[...]
            x_bpd = jnp.concatenate(
                [x_bpd, jnp.broadcast_to(token.astype(x_bpd.dtype), (b, slots, token.shape[0]))], 1
            )
            seg = jnp.concatenate([seg, vr.row_documents(seg, slots)], axis=1)
            pos = jnp.concatenate([pos, jnp.zeros((b, slots, 2), pos.dtype)], axis=1)
            if sparse:
                tiles = vr.class_tiles(tiles, n // self.block, slots // self.block)
        if self.pre_norm is not None:
            x_bpd = self.pre_norm(x_bpd)
        kw = dict(causal=False, kind=self.attention, block=self.block, documents=self.documents)
        order = local = None
        if self.window:
            order, windows = vr.window_order(seg, pos, self.window)
            take = lambda a: jnp.take_along_axis(a, order.reshape(b, n, *(1,) * (a.ndim - 2)), 1)
            x_bpd, pos, seg = take(x_bpd), take(pos), take(seg)
            band = vr.band_tiles(b, n, self.block, self.window**2) if sparse else None
            local = packing(windows, tiles_bk2=band, **kw)
        pack = packing(seg, tiles_bk2=tiles, **kw)
        return vr.Rows(x_bpd, pack, pos, local, order, n)
