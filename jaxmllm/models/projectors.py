"""Projectors from encoder features to LLM embeddings (the encoders end in a norm already).

Both are `fc2(act(fc1 x))` over `merge` neighbouring encoder rows concatenated: the vision
projector merges merge x merge patches (Qwen2-VL's patch merger is exactly this, with a hidden
width of 4x the encoder's and exact GELU), the audio projector merges the rows of one LLM token
(1 for the pairs stem, 2 for Whisper's stride-2 stem). Qwen2-Audio's is one Linear from
each of its pooled rows (`LinearProjector`). Gemma 3's pools instead of concatenating
(`model.vision.projector: pool`, `PoolProjector`): the mean of a token's merge x merge patches
(its average pooling over a k x k window of the patch grid, the rows already in merge order),
an RMSNorm scaling by 1 + w, one Linear without a bias. Gemma 4's (`pool_embed`)
scales the mean by sqrt(the tower's width), standardises it per channel where `standardize`
says (its tower's std_bias and std_scale: (x - bias) x scale), then an RMSNorm without a scale
and the Linear (its pooler, then `embed_vision`). Gemma 4's audio projector
(`model.audio.projector: embed`, its `embed_audio`) is that embedder alone: the same
`PoolProjector` over runs of one row, unscaled, the RMSNorm without a scale and the Linear.

A vision tower with DeepStack (`model.vision.deepstack`: Qwen3-VL) has one more projector per
tapped block, beside the main one (`vision_projector/deepstack`, stacked on a leading `layers`
axis): each a norm over the merged width (the tapped blocks' outputs are not normalised),
then the same MLP (Qwen3-VL's `deepstack_merger_list`, its `use_postshuffle_norm`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmllm.config import ModelConfig
from jaxmllm.models.layers import MLP, NORMS, Dense
from jaxmllm.models.lora import Adapter, adapters
from jaxmllm.models.transformer import stack_modules


class Projector(MLP):
    """Merges each run of `group` rows into one LLM token, then `fc2(act(fc1 x))`.

    Rows arrive in merge order (each run of `group` rows belongs to one token: merge blocks of
    patches, pairs of audio rows), so the merge is a reshape.
    """

    def __init__(
        self,
        in_width: int,
        out_width: int,
        group: int,
        *,
        hidden: int = 0,
        activation: str = "gelu_tanh",
        norm: str = "",
        norm_eps: float = 1e-6,
        deepstack: int = 0,
        deep_norm: str = "layer",
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        lora: dict[str, Adapter] | None = None,
        rngs: nnx.Rngs,
    ):
        """`hidden`: fc1's width (0: `out_width`); `norm`: a norm (`layers.NORMS`) over the
        merged rows before fc1 ("": none), of epsilon `norm_eps`; `deepstack`: DeepStack's
        projectors beside this one (the module docstring), each with a `deep_norm`; `lora`:
        adapters of fc1, fc2 (of every projector)."""
        super().__init__(
            group * in_width,
            hidden or out_width,
            activation=activation,
            out_width=out_width,
            dtype=dtype,
            param_dtype=param_dtype,
            lora=lora,
            rngs=rngs,
        )
        self.group = group
        kw = dict(eps=norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.norm = NORMS[norm](group * in_width, **kw) if norm else None
        level = lambda: Projector(
            in_width,
            out_width,
            group,
            hidden=hidden,
            activation=activation,
            norm=deep_norm,
            norm_eps=norm_eps,
            dtype=dtype,
            param_dtype=param_dtype,
            lora=lora,
            rngs=rngs,
        )
        levels = [level() for _ in range(deepstack)]
        self.deepstack = stack_modules(levels, "layers") if levels else None

    def __call__(self, x_bnd: jax.Array) -> jax.Array:
        """[B, N, in_width] -> [B, N / group, out_width]."""
        b, n, d = x_bnd.shape
        x_bnd = x_bnd.reshape(b, n // self.group, self.group * d)
        if self.norm is not None:
            x_bnd = self.norm(x_bnd)
        return super().__call__(x_bnd)

    def deep(self, taps_kbnd: jax.Array) -> jax.Array:
        """DeepStack's rows [K, B, N / group, out_width] of the tapped blocks' outputs
        [K, B, N, in_width], each through its own projector."""
        graphdef, state = nnx.split(self.deepstack)
        return jax.vmap(lambda st, x: nnx.merge(graphdef, st)(x))(state, taps_kbnd)


class LinearProjector(nnx.Module):
    """One Linear with a bias from each encoder row to an LLM token (Qwen2-Audio's)."""

    def __init__(
        self, in_width: int, out_width: int, *, dtype, param_dtype, lora=None, rngs: nnx.Rngs
    ):
        """One Dense from the encoder's rows to the LLM's width (`lora`: its `fc` adapter)."""
        kw = dict(use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.fc = Dense(in_width, out_width, (None, "embed"), lora=(lora or {}).get("fc"), **kw)

    def __call__(self, x_bnd: jax.Array) -> jax.Array:
        """x [B, N, in_width] projected to [B, N, out_width]."""
        return self.fc(x_bnd)


class PoolProjector(nnx.Module):
    """The mean of each run of `group` rows, an RMSNorm scaling by 1 + w, one Linear without a
    bias (the module docstring: Gemma 3's `mm_soft_emb_norm`, `mm_input_projection_weight`);
    with `embed`, Gemma 4's embedder (`Gemma4MultimodalEmbedder`): the mean times `scale`
    (its vision pooler's sqrt(in_width); 1 for audio), standardised (`standardize`), an RMSNorm
    without a scale, the Linear."""

    def __init__(
        self,
        in_width: int,
        out_width: int,
        group: int,
        *,
        norm_eps: float,
        embed: bool = False,
        scale: float = 1.0,
        standardize: bool = False,
        dtype,
        param_dtype,
        lora=None,
        rngs: nnx.Rngs,
    ):
        """`group` rows a token, pooled; `norm_eps`: the norm's epsilon; `embed`, `scale`,
        `standardize`: Gemma 4's (the class docstring); `lora`: fc's adapter."""
        self.group = group
        self.norm = (
            None
            if embed
            else NORMS["rms_offset"](in_width, eps=norm_eps, dtype=dtype, param_dtype=param_dtype)
        )
        self.eps, self.dtype = norm_eps, dtype
        self.scale = scale
        channel = lambda init: nnx.Param(init((in_width,), param_dtype), axes=("embed",))
        self.std_bias = channel(jnp.zeros) if standardize else None
        self.std_scale = channel(jnp.ones) if standardize else None
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.fc = Dense(in_width, out_width, (None, "embed"), lora=(lora or {}).get("fc"), **kw)

    def __call__(self, x_bnd: jax.Array) -> jax.Array:
        """[B, N, in_width] -> [B, N / group, out_width]: the mean in fp32, as the norm."""
        b, n, d = x_bnd.shape
        x_bngd = x_bnd.reshape(b, n // self.group, self.group, d).astype(jnp.float32)
        pooled = jnp.mean(x_bngd, axis=2)
        if self.norm is not None:
            return self.fc(self.norm(pooled))
        pooled = pooled * self.scale  # (Gemma 4: in fp32, as its pooler scales)
        if self.std_bias is not None:
            bias, scale = (p[...].astype(jnp.float32) for p in (self.std_bias, self.std_scale))
            pooled = (pooled - bias) * scale
        # (an RMSNorm without a scale, in fp32, as Gemma4RMSNorm(with_scale=False))
        pooled = pooled * jax.lax.rsqrt(jnp.mean(pooled * pooled, -1, keepdims=True) + self.eps)
        return self.fc(pooled.astype(self.dtype))


def vision_projector(cfg: ModelConfig, **kw) -> Projector | PoolProjector:
    """The projector from `cfg.vision`'s patch features to `cfg.llm`'s embeddings."""
    v = cfg.vision
    kw["lora"] = _adapters(cfg, "vision_projector")
    if v.projector == "pool":
        scale = math.sqrt(v.width) if v.pool_embed else 1.0  # (Gemma 4's pooler's)
        embed = dict(embed=v.pool_embed, scale=scale, standardize=v.standardize)
        return PoolProjector(v.width, cfg.llm.width, v.merge**2, norm_eps=v.norm_eps, **embed, **kw)
    return Projector(
        v.width,
        cfg.llm.width,
        v.merge**2,
        hidden=v.projector_dim,
        activation=v.projector_act,
        norm_eps=v.norm_eps,
        deepstack=len(v.deepstack),
        deep_norm=v.norm,
        **kw,
    )


def audio_projector(cfg: ModelConfig, **kw) -> Projector | LinearProjector | PoolProjector:
    """The projector from `cfg.audio`'s encoder rows (subsample / (stride x pool) per token)."""
    a = cfg.audio
    kw["lora"] = _adapters(cfg, "audio_projector")
    if a.projector == "linear":
        return LinearProjector(a.out_width, cfg.llm.width, **kw)
    if a.projector == "embed":  # (Gemma 4's embed_audio: one row a token)
        return PoolProjector(a.out_width, cfg.llm.width, 1, norm_eps=a.norm_eps, embed=True, **kw)
    group = a.rows_per_token  # encoder rows per LLM token
    return Projector(
        a.out_width, cfg.llm.width, group, hidden=a.projector_dim, activation=a.projector_act, **kw
    )


def _adapters(cfg: ModelConfig, module: str) -> dict[str, Adapter]:
    """The adapters of a projector's matrices (`model.projector_lora`)."""
    return dict(adapters(cfg.projector_lora, cfg.adapted(module)))
