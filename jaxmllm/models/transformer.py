"""The transformer stack shared by the encoders and the decoder: pre-norm blocks, scanned.

Each transformer is ONE `Block` whose parameters are stacked on a leading `layers` axis and
applied with `jax.lax.scan`, so the compiled program holds one block whatever the depth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmllm.config.remat import REMAT_POLICIES
from jaxmllm.models import lora
from jaxmllm.models.attention import Attention, Packing
from jaxmllm.models.layers import NORMS, make_mlp


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """What one transformer block is made of; a tower's config says (`BlockSpec.of`)."""

    width: int
    heads: int
    kv_heads: int
    mlp_dim: int
    head_dim: int = 0  # 0: width / heads
    norm: str = "rms"  # layers.NORMS
    norm_eps: float = 1e-6
    mlp: str = "gated_silu"  # layers.make_mlp
    attn_bias: str = ""  # projections with a bias, of "qkvo"
    mlp_bias: bool = False
    rope: str = "1d"  # layers.ROPE: 1d | 2d | none
    rope_theta: float = 10000.0
    rope_scaling: Any = None  # config.model.RopeScaling, or None
    rope_sections: tuple[int, ...] = ()  # mrope: frequencies turned by time, row, column
    # LoRA adapters: (target, lora.Adapter) of the matrices that have one (q, k, v, o, ...)
    lora: tuple[tuple[str, lora.Adapter], ...] = ()

    @classmethod
    def of(cls, cfg: Any, *, kv_heads: int | None = None, rope: str, **extra) -> BlockSpec:
        """The spec of a tower config (`config.model.BlockOptions` + width, heads, ...)."""
        return cls(
            lora=lora.adapters(cfg.lora, cfg.adapter_targets),
            width=cfg.width,
            heads=cfg.heads,
            kv_heads=kv_heads or cfg.heads,
            mlp_dim=cfg.mlp_dim,
            norm=cfg.norm,
            norm_eps=cfg.norm_eps,
            mlp=cfg.mlp,
            attn_bias=cfg.attn_bias,
            mlp_bias=cfg.mlp_bias,
            rope=rope,
            rope_theta=cfg.rope_theta,
            **extra,
        )

    def norm_layer(self, *, dtype: jnp.dtype, param_dtype: jnp.dtype) -> nnx.Module:
        return NORMS[self.norm](self.width, eps=self.norm_eps, dtype=dtype, param_dtype=param_dtype)


class Block(nnx.Module):
    """Pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    def __init__(
        self,
        spec: BlockSpec,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        adapters = dict(spec.lora)
        self.attn_norm = spec.norm_layer(**kw)
        self.attn = Attention(
            spec.width,
            spec.heads,
            spec.kv_heads,
            head_dim=spec.head_dim,
            bias=spec.attn_bias,
            rope=spec.rope,
            rope_theta=spec.rope_theta,
            rope_scaling=spec.rope_scaling,
            rope_sections=spec.rope_sections,
            lora=adapters,
            rngs=rngs,
            **kw,
        )
        self.mlp_norm = spec.norm_layer(**kw)
        self.mlp = make_mlp(
            spec.mlp,
            spec.width,
            spec.mlp_dim,
            use_bias=spec.mlp_bias,
            lora=adapters,
            rngs=rngs,
            **kw,
        )

    def __call__(self, x_btd: jax.Array, pack: Packing, positions: jax.Array) -> jax.Array:
        x_btd = x_btd + self.attn(self.attn_norm(x_btd), pack, positions)
        return x_btd + self.mlp(self.mlp_norm(x_btd))


def remat_policy(name: str) -> Callable | None:
    """The `jax.checkpoint` policy of a remat policy's name (`config.remat.REMAT_POLICIES`:
    the activations it keeps, by the names the blocks tag them with); None: no remat."""
    policy = REMAT_POLICIES[name]
    if not policy.remat:
        return None
    if policy.offload:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(),
            names_which_can_be_offloaded=policy.names,
            offload_src="device",
            offload_dst="pinned_host",
        )
    return jax.checkpoint_policies.save_only_these_names(*policy.names)


class Transformer(nnx.Module):
    """A stack of pre-norm blocks scanned over a leading `layers` axis, then a final norm.

    `blocks` is ONE `Block` whose parameters are stacked [depth, ...] (logical axis "layers"
    first); `jax.lax.scan` applies it layer by layer, so the compiled program holds one block
    whatever the depth. Each block is rematerialised under the `remat` policy (a name of
    `config.remat.REMAT_POLICIES`; none: not at all).
    `final_norm` False: no norm after the blocks (a tower read before its last norm).
    `full_layers`: with a `local` packing given to `layers`, the layers that attend by `pack`
    (the others by `local`: windows within the documents); one block is compiled per packing.
    """

    def __init__(
        self,
        depth: int,
        spec: BlockSpec,
        *,
        remat: str = "none",
        final_norm: bool = True,
        full_layers: tuple[int, ...] = (),
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat {remat!r} is not one of {', '.join(REMAT_POLICIES)}")
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        # Layer by layer from the shared RNG stream, then stacked: every layer draws exactly
        # what separate blocks drew (init runs once; only the train step must not grow).
        layers = [Block(spec, rngs=rngs, **kw) for _ in range(depth)]
        self.blocks = stack_modules(layers, "layers")
        self.final_norm = spec.norm_layer(**kw) if final_norm else None
        self.remat = remat
        self.full_layers = tuple(full_layers)

    def __call__(
        self, x_btd: jax.Array, pack: Packing, positions: jax.Array, local: Packing | None = None
    ) -> jax.Array:
        return self.norm(self.layers(x_btd, pack, positions, local=local))

    def norm(self, x_btd: jax.Array) -> jax.Array:
        """The final norm (none: x as it is)."""
        return x_btd if self.final_norm is None else self.final_norm(x_btd)

    def layers(
        self,
        x_btd: jax.Array,
        pack: Packing,
        positions: jax.Array,
        count: jax.Array | None = None,
        local: Packing | None = None,
    ) -> jax.Array:
        """The stacked blocks without the final norm; with `count`, only the first `count`
        (a pipeline stage's slab of layers padded to the largest stage's); with `local`, the
        layers outside `full_layers` attend by it."""
        graphdef, stacked = nnx.split(self.blocks)
        depth = jax.tree.leaves(stacked)[0].shape[0]
        index = jnp.arange(depth)  # (each layer folds its own into the adapters' dropout key)

        def block(x_btd, block_state, j, pack=pack):
            with lora.salted(j):
                return nnx.merge(graphdef, block_state)(x_btd, pack, positions)

        policy = remat_policy(self.remat)
        if policy is not None:
            # Inside a scan XLA cannot merge the recomputation with the forward pass, so the
            # guard against that (prevent_cse) would only block optimisations.
            block = jax.checkpoint(block, policy=policy, prevent_cse=False)
        if local is not None:
            assert count is None, "windowed layers do not run in pipeline stages"
            full = jnp.asarray([i in self.full_layers for i in range(depth)])

            def either(x_btd, step):  # the layer's own packing: whole documents or windows
                block_state, is_full, j = step
                whole = lambda x: block(x, block_state, j, pack)
                windowed = lambda x: block(x, block_state, j, local)
                return jax.lax.cond(is_full, whole, windowed, x_btd), None

            x_btd, _ = jax.lax.scan(either, x_btd, (stacked, full, index))
            return x_btd
        if count is None:
            x_btd, _ = jax.lax.scan(lambda x, xs: (block(x, *xs), None), x_btd, (stacked, index))
            return x_btd

        def masked(x_btd, step):  # a padding slot is skipped, not computed
            j, block_state = step
            skip = lambda x, *_: x
            return jax.lax.cond(j < count, block, skip, x_btd, block_state, j), None

        x_btd, _ = jax.lax.scan(masked, x_btd, (index, stacked))
        return x_btd


def stack_modules(modules: Sequence[nnx.Module], axis_name: str) -> nnx.Module:
    """One module like `modules[0]` whose variables stack all modules' on a new leading axis.

    Each variable's `axes` metadata gains `axis_name` first, so the stacked axis has a rule.
    """
    graphdef, first = nnx.split(modules[0])
    states = [first] + [nnx.split(m)[1] for m in modules[1:]]
    is_var = lambda x: isinstance(x, nnx.Variable)

    def stack(*variables: nnx.Variable) -> nnx.Variable:
        value = jnp.stack([v.get_value() for v in variables])
        axes = variables[0].get_metadata().get("axes", (None,) * (value.ndim - 1))
        return variables[0].replace(value, axes=(axis_name, *axes))

    return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=is_var))
