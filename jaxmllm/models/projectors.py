"""Projectors from encoder features to LLM embeddings (the encoders end in a norm already).

Both are `fc2(act(fc1 x))` over `merge` neighbouring encoder rows concatenated: the vision
projector merges merge x merge patches (Qwen2-VL's patch merger is exactly this, with a hidden
width of 4x the encoder's and exact GELU), the audio projector merges the rows of one LLM token
(1 for the pairs stem, 2 for Whisper's stride-2 stem). Qwen2-Audio's is one Linear from
each of its pooled rows (`LinearProjector`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmllm.config import ModelConfig
from jaxmllm.models.layers import MLP, Dense
from jaxmllm.models.lora import Adapter, adapters


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
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        lora: dict[str, Adapter] | None = None,
        rngs: nnx.Rngs,
    ):
        """`hidden`: fc1's width (0: `out_width`); `lora`: adapters of fc1, fc2."""
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

    def __call__(self, x_bnd: jax.Array) -> jax.Array:
        """[B, N, in_width] -> [B, N / group, out_width]."""
        b, n, d = x_bnd.shape
        return super().__call__(x_bnd.reshape(b, n // self.group, self.group * d))


class LinearProjector(nnx.Module):
    """One Linear with a bias from each encoder row to an LLM token (Qwen2-Audio's)."""

    def __init__(
        self, in_width: int, out_width: int, *, dtype, param_dtype, lora=None, rngs: nnx.Rngs
    ):
        kw = dict(use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.fc = Dense(in_width, out_width, (None, "embed"), lora=(lora or {}).get("fc"), **kw)

    def __call__(self, x_bnd: jax.Array) -> jax.Array:
        return self.fc(x_bnd)


def vision_projector(cfg: ModelConfig, **kw) -> Projector:
    """The projector from `cfg.vision`'s patch features to `cfg.llm`'s embeddings."""
    v = cfg.vision
    kw["lora"] = _adapters(cfg, "vision_projector")
    return Projector(
        v.width, cfg.llm.width, v.merge**2, hidden=v.projector_dim, activation=v.projector_act, **kw
    )


def audio_projector(cfg: ModelConfig, **kw) -> Projector | LinearProjector:
    """The projector from `cfg.audio`'s encoder rows (subsample / (stride x pool) per token)."""
    a = cfg.audio
    kw["lora"] = _adapters(cfg, "audio_projector")
    if a.projector == "linear":
        return LinearProjector(a.width, cfg.llm.width, **kw)
    group = a.rows_per_token  # encoder rows per LLM token
    return Projector(
        a.width, cfg.llm.width, group, hidden=a.projector_dim, activation=a.projector_act, **kw
    )


def _adapters(cfg: ModelConfig, module: str) -> dict[str, Adapter]:
    """The adapters of a projector's matrices (`model.projector_lora`)."""
    return dict(adapters(cfg.projector_lora, cfg.adapted(module)))
