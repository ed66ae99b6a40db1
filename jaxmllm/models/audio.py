"""Audio encoder over packed log-mel frames.

Subsampling x4 is two kernel-2, stride-2 convolutions. With kernel == stride a convolution is a
reshape (pair up neighbouring frames) followed by a Dense, and because every clip starts at a
multiple of 4 frames and is a multiple of 4 frames long, no output row mixes two clips.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmllm.config import AudioConfig
from jaxmllm.models.attention import packing
from jaxmllm.models.layers import Dense
from jaxmllm.models.transformer import Transformer


class AudioEncoder(nnx.Module):
    """Conv subsampling (x4) + bidirectional transformer with 1D RoPE."""

    def __init__(
        self,
        cfg: AudioConfig,
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
        self.conv1 = Dense(2 * cfg.n_mels, cfg.width, ("mel", "embed"), use_bias=True, **kw)
        # The input dim stays unsharded: naming it "embed" too would map two dims to one axis.
        self.conv2 = Dense(2 * cfg.width, cfg.width, (None, "embed"), use_bias=True, **kw)
        self.transformer = Transformer(
            depth=cfg.depth,
            width=cfg.width,
            heads=cfg.heads,
            kv_heads=cfg.heads,  # plain multi-head attention
            mlp_dim=cfg.mlp_dim,
            rope="1d",
            rope_theta=cfg.rope_theta,
            remat=remat,
            remat_policy=remat_policy,
            **kw,
        )

    def __call__(
        self,
        frames_bfm: jax.Array,
        segment_ids_bf: jax.Array,
        positions_bf: jax.Array,
        tiles_bk2: jax.Array | None = None,
    ) -> jax.Array:
        """Encodes packed frames.

        Args:
          frames_bfm: log-mel frames [B, F, n_mels]; F a multiple of 4.
          segment_ids_bf: which clip each frame belongs to, 0 for padding [B, F].
          positions_bf: frame index within its clip [B, F].
          tiles_bk2: block-sparse attention's tiles over the encoder rows [B, K, 2].

        Returns:
          Features [B, F // 4, width] in the compute dtype, one row per 4 frames.
        """
        return self.transformer(*self.prepare(frames_bfm, segment_ids_bf, positions_bf, tiles_bk2))

    def prepare(self, frames_bfm, segment_ids_bf, positions_bf, tiles_bk2=None):
        """What the transformer takes (the arguments as in `__call__`): the subsampled rows,
        their packing and positions (a pipeline runs the stack's layers stage by stage)."""
        x = jax.nn.gelu(self.conv1(_pair_rows(frames_bfm)))
        x_bnd = jax.nn.gelu(self.conv2(_pair_rows(x)))
        segment_ids_bn, positions_bn = subsample_ids(segment_ids_bf, positions_bf)
        pack = packing(
            segment_ids_bn,
            causal=False,
            kind=self.attention,
            tiles_bk2=tiles_bk2,
            block=self.block,
            documents=self.documents,
        )
        return x_bnd, pack, positions_bn


def _pair_rows(x_btc: jax.Array) -> jax.Array:
    """[B, T, C] -> [B, T/2, 2C]: a kernel-2 stride-2 convolution's input windows."""
    b, t, c = x_btc.shape
    return x_btc.reshape(b, t // 2, 2 * c)


def subsample_ids(
    segment_ids_bf: jax.Array, positions_bf: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Segment ids and positions of the x4-subsampled rows (each row's first frame)."""
    return segment_ids_bf[:, ::4], positions_bf[:, ::4] // 4
