"""Audio encoder over packed log-mel frames.

Two stems turn frames into encoder rows, each within its clip (a packed row holds several):

- pairs (jaxmllm's own): two kernel-2, stride-2 convolutions, one row per 4 frames. With kernel
  == stride a convolution is a reshape (pair up neighbouring frames) followed by a Dense, and
  because every clip starts at a multiple of 4 frames and is a multiple of 4 frames long, no
  output row mixes two clips.
- whisper: kernel-3 convolutions with stride 1 then 2 (one row per 2 frames), GELU, and a fixed
  sinusoidal position table, as Whisper's encoder. Each tap that would read across a clip's
  edge reads zero, as Whisper's zero padding does at the edges of its 30 s window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmllm.config import AudioConfig
from jaxmllm.config.spec import Inputs
from jaxmllm.models.attention import packing
from jaxmllm.models.inputs import decode
from jaxmllm.models.layers import ACTIVATIONS, Dense
from jaxmllm.models.positions import sinusoids
from jaxmllm.models.transformer import BlockSpec, Transformer


class AudioEncoder(nnx.Module):
    """Conv subsampling (pairs: x4, whisper: x2) + bidirectional transformer."""

    def __init__(
        self,
        cfg: AudioConfig,
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
        self.inputs = inputs  # how its frames travel (`config.spec.Inputs`)
        self.stem, self.stride, self.pool = cfg.stem, cfg.stride, cfg.pool
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        taps = 3 if cfg.stem == "whisper" else 2
        self.conv1 = Dense(taps * cfg.n_mels, cfg.width, ("mel", "embed"), use_bias=True, **kw)
        # The input dim stays unsharded: naming it "embed" too would map two dims to one axis.
        self.conv2 = Dense(taps * cfg.width, cfg.width, (None, "embed"), use_bias=True, **kw)
        self.positions = (
            nnx.Param(
                jnp.asarray(sinusoids(cfg.max_positions, cfg.width), param_dtype),
                axes=("positions", "embed"),
            )
            if cfg.positions == "sinusoidal"
            else None
        )
        rope = "1d" if cfg.positions == "rope" else "none"
        self.transformer = Transformer(
            cfg.depth,
            BlockSpec.of(cfg, rope=rope),  # plain multi-head attention
            remat=remat,
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
          Features [B, F // (stride * pool), width] in the compute dtype, one row per `stride`
          frames, averaged in runs of `pool` rows (within a clip: each starts at a multiple of
          4 frames) before the final norm.
        """
        x_bnd = self.transformer.layers(
            *self.prepare(frames_bfm, segment_ids_bf, positions_bf, tiles_bk2)
        )
        if self.pool > 1:  # Qwen2-Audio's average pooling
            b, n, d = x_bnd.shape
            pooled = x_bnd.astype(jnp.float32).reshape(b, n // self.pool, self.pool, d).mean(2)
            x_bnd = pooled.astype(x_bnd.dtype)
        return self.transformer.norm(x_bnd)

    def prepare(self, frames_bfm, segment_ids_bf, positions_bf, tiles_bk2=None):
        """What the transformer takes (the arguments as in `__call__`): the subsampled rows,
        their packing and positions (a pipeline runs the stack's layers stage by stage)."""
        frames_bfm = decode(frames_bfm, segment_ids_bf, self.inputs)
        if self.stem == "whisper":
            x_bnd = self._whisper_stem(frames_bfm, segment_ids_bf)
        else:
            x = jax.nn.gelu(self.conv1(_pair_rows(frames_bfm)))
            x_bnd = jax.nn.gelu(self.conv2(_pair_rows(x)))
        segment_ids_bn, positions_bn = subsample_ids(segment_ids_bf, positions_bf, self.stride)
        if self.positions is not None:  # fixed: Whisper never trains its table
            table = jax.lax.stop_gradient(self.positions[...])
            rows = jnp.clip(positions_bn, 0, table.shape[0] - 1)
            x_bnd = (x_bnd.astype(jnp.float32) + table[rows].astype(jnp.float32)).astype(
                x_bnd.dtype
            )
        pack = packing(
            segment_ids_bn,
            causal=False,
            kind=self.attention,
            tiles_bk2=tiles_bk2,
            block=self.block,
            documents=self.documents,
        )
        return x_bnd, pack, positions_bn

    def _whisper_stem(self, frames_bfm: jax.Array, segment_ids_bf: jax.Array) -> jax.Array:
        """Whisper's stem on packed frames [B, F, mels]: two 3-tap convolutions (the second of
        stride 2) with GELU, each tap reading only its own clip's frames (`segment_ids_bf`)."""
        gelu = ACTIVATIONS["gelu"]
        x = gelu(self.conv1(clip_windows(frames_bfm, segment_ids_bf)))
        windows = clip_windows(x, segment_ids_bf)[:, ::2]  # stride 2: taps 2j-1, 2j, 2j+1
        return gelu(self.conv2(windows))


def _pair_rows(x_btc: jax.Array) -> jax.Array:
    """[B, T, C] -> [B, T/2, 2C]: a kernel-2 stride-2 convolution's input windows."""
    b, t, c = x_btc.shape
    return x_btc.reshape(b, t // 2, 2 * c)


def clip_windows(x_btc: jax.Array, segment_ids_bt: jax.Array) -> jax.Array:
    """[B, T, C] -> [B, T, 3C]: each step's (previous, own, next) inputs, zero across a clip's
    edge: a kernel-3, padding-1 convolution's windows, clip by clip."""
    zero_row = jnp.zeros_like(x_btc[:, :1])
    zero_seg = jnp.zeros_like(segment_ids_bt[:, :1]) - 1
    prev = jnp.concatenate([zero_row, x_btc[:, :-1]], axis=1)
    nxt = jnp.concatenate([x_btc[:, 1:], zero_row], axis=1)
    prev_seg = jnp.concatenate([zero_seg, segment_ids_bt[:, :-1]], axis=1)
    next_seg = jnp.concatenate([segment_ids_bt[:, 1:], zero_seg], axis=1)
    prev = jnp.where((prev_seg == segment_ids_bt)[..., None], prev, 0)
    nxt = jnp.where((next_seg == segment_ids_bt)[..., None], nxt, 0)
    return jnp.concatenate([prev, x_btc, nxt], axis=-1)


def subsample_ids(
    segment_ids_bf: jax.Array, positions_bf: jax.Array, stride: int = 4
) -> tuple[jax.Array, jax.Array]:
    """Segment ids and positions of the subsampled rows (each row's first frame)."""
    return segment_ids_bf[:, ::stride], positions_bf[:, ::stride] // stride
