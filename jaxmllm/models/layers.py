"""Building blocks of the transformers: dense layers, embedding, norms, rotary, MLPs.

Every parameter is an `nnx.Param` created in `param_dtype` with an `axes` metadata tuple of
logical axis names, one per dimension; the sharding code maps those names to mesh axes. We do not
use flax's `sharding` metadata because flax 0.12 shards such params eagerly at creation time.
Activations run in `dtype` (the compute dtype): parameters are cast on use, so bf16 compute keeps
fp32 master weights.

The activations a rematerialised block may keep are tagged with `checkpoint_name` (`mlp_in`
here, the attention's in attention.py): `jaxmllm/config/remat.py` names what each policy keeps.

Shape letters in names: b batch row, t/s query/key position, d width, h heads, k kv heads,
g query heads per kv head, e head dim, f MLP width.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import sharding
from jaxmllm.models import lora as lora_
from jaxmllm.models.vocab import lookup, vocab_axes

Axes = tuple[str | None, ...]

NORM_EPS = 1e-6
UNBOUNDED = float(np.finfo(np.float32).max)  # a clipped Dense's bound where it has none


def param_key(rngs: nnx.Rngs) -> jax.Array:
    """The `params` stream's next key: `rngs.params()`'s (its key folded with its count, the
    count then one more), the count set whole. flax's `count[...] += 1` compares both arrays'
    `sharding`, which a tracer refuses, and jax 0.10.2's refusal walks the whole trace so far to
    say where the tracer came from: a model built under `eval_shape` or `jit` took time
    quadratic in its parameters (a 24-layer tiny LLM: 1.2 s to trace its shapes)."""
    stream = rngs.params
    count = stream.count.get_value()
    key = jax.random.fold_in(stream.key.get_value(), count)
    stream.count.set_value(count + 1)
    return key


def normal_param(
    rngs: nnx.Rngs, shape: Sequence[int], std: float, axes: Axes, param_dtype: jnp.dtype
) -> nnx.Param:
    """A normally initialised parameter tagged with its logical axes."""
    assert len(axes) == len(shape), (shape, axes)
    value = std * jax.random.normal(param_key(rngs), tuple(shape), jnp.float32)
    return nnx.Param(value.astype(param_dtype), axes=tuple(axes))


class Dense(nnx.Module):
    """`y = x . W (+ b)` contracting the trailing `in_shape` dims of x with the leading dims of W.

    Multi-dimensional in/out shapes let attention keep heads as their own (shardable) axis.
    `out_dtype` (default: `dtype`) set to float32 keeps the matmul's fp32 accumulator, for logits.
    `lora`: a LoRA adapter beside the kernel (`jaxmllm.models.lora`: `lora_a`, `lora_b`).
    `clipped`: its input and output clamped to bounds (transformers' Gemma4ClippableLinear, a
    LoRA update inside them as PEFT adapts its `.linear`): `bounds` [input min, input max, output
    min, output max], read from a checkpoint, never trained. No bound is the largest float32
    (`UNBOUNDED`), not ±inf: a train state is finite, or its update is skipped.
    """

    def __init__(
        self,
        in_shape: int | Sequence[int],
        out_shape: int | Sequence[int],
        axes: Axes,
        *,
        use_bias: bool = False,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        out_dtype: jnp.dtype | None = None,
        lora: lora_.Adapter | None = None,
        clipped: bool = False,
        rngs: nnx.Rngs,
    ):
        """A kernel [*in_shape, *out_shape] under logical `axes` (one name per dimension), and its
        bias where `use_bias`. `lora`: this matrix's adapter (A, B and their scale), None: none.
        `out_dtype` is what the matmul accumulates and returns (default `dtype`). `clipped`:
        bounds on its input and output (the class docstring), none until a checkpoint sets
        them."""
        in_shape = _as_shape(in_shape)
        out_shape = _as_shape(out_shape)
        # Fan-in scaling keeps activations at unit scale through the stack at init.
        std = 1.0 / math.sqrt(math.prod(in_shape))
        self.kernel = normal_param(rngs, in_shape + out_shape, std, axes, param_dtype)
        self.adapter = lora
        if lora is not None:  # (its init folds the kernel's key: the base's draws stay)
            stream = rngs.params
            key = jax.random.fold_in(stream.key[...], stream.count[...] - 1)
            a = lora_.init_a(jax.random.fold_in(key, lora_.SALT), in_shape, lora.rank)
            self.lora_a = nnx.Param(a, axes=(*axes[: len(in_shape)], None))
            b = jnp.zeros((lora.rank, *out_shape), jnp.float32)
            self.lora_b = nnx.Param(b, axes=(None, *axes[len(in_shape) :]))
        bias_axes = tuple(axes[len(in_shape) :])
        self.bias = (
            nnx.Param(jnp.zeros(out_shape, param_dtype), axes=bias_axes) if use_bias else None
        )
        top = UNBOUNDED
        bounds = jnp.asarray([-top, top, -top, top], jnp.float32)
        self.bounds = nnx.Param(bounds, axes=(None,)) if clipped else None
        self.n_in = len(in_shape)
        self.dtype = dtype
        self.out_dtype = dtype if out_dtype is None else out_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., *in_shape] contracted with the kernel in the compute dtype, accumulated in
        `out_dtype` (fp32 for bf16 inputs where asked); plus the bias and the adapter's update;
        where clipped, of the clamped input, the output clamped."""
        if self.bounds is None:
            return self.unclipped(x)
        b = jax.lax.stop_gradient(self.bounds[...])
        y = self.unclipped(jnp.clip(x, b[0].astype(x.dtype), b[1].astype(x.dtype)))
        return jnp.clip(y, b[2].astype(y.dtype), b[3].astype(y.dtype))

    def unclipped(self, x: jax.Array) -> jax.Array:
        """`__call__` without the bounds."""
        kernel = self.kernel[...].astype(self.dtype)
        contract = (tuple(range(x.ndim - self.n_in, x.ndim)), tuple(range(self.n_in)))
        y = jnp.tensordot(
            x.astype(self.dtype), kernel, axes=contract, preferred_element_type=self.out_dtype
        )
        if self.bias is not None:
            y = y + self.bias[...].astype(self.out_dtype)
        if self.adapter is not None:
            delta = lora_.update(x, self.lora_a[...], self.lora_b[...], self.adapter, self.dtype)
            y = y + delta.astype(y.dtype)
        return y


def _as_shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    """A shape given as one size or several, as a tuple."""
    return (shape,) if isinstance(shape, int) else tuple(shape)


class Embed(nnx.Module):
    """Token embedding table [vocab, width]; `attend` reuses it as a tied output projection."""

    def __init__(
        self,
        vocab_size: int,
        width: int,
        *,
        vocab_parallel: bool = False,
        scale: float = 1.0,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        """A [vocab_size, width] table of unit-scale rows; `vocab_parallel`: stored split by rows
        over the model axes, as the lookup and the output projection read it; `scale`: what the
        looked-up rows are multiplied by (Gemma's sqrt(width)), not the tied projection."""
        # Unit-scale rows, like the encoders' projector outputs that replace some of them.
        # Vocab-parallel: stored split by rows as it is used (a reshard would gather it).
        axes = ("vocab_split", None) if vocab_parallel else ("vocab", "embed")
        self.embedding = normal_param(rngs, (vocab_size, width), 1.0, axes, param_dtype)
        self.dtype = dtype
        self.vocab_parallel = vocab_parallel
        self.vocab_size = vocab_size  # ids from here on look up zeros (unused tokens)
        self.scale = scale

    def __call__(self, ids: jax.Array) -> jax.Array:
        """The rows of `ids` [B, T] as [B, T, width] in the compute dtype, times `scale` rounded
        to that dtype first (transformers' Gemma rounds its factor to the embedding's dtype:
        sqrt(1152) = 33.94 is 34.0 in bf16), so a bf16 run scales as a bf16 transformers model
        does."""
        rows = self.look_up(ids)
        if self.scale == 1.0:
            return rows
        return rows * jnp.asarray(self.scale, self.dtype)

    def look_up(self, ids: jax.Array) -> jax.Array:
        """The rows of `ids` [B, T] as [B, T, width] in the compute dtype: looked up where they are
        stored (split by vocabulary rows, or gathered from FSDP's shards first)."""
        table = self.embedding[...]
        axes = vocab_axes(table.shape[0], ids.shape[0]) if self.vocab_parallel else ()
        mesh = jax.sharding.get_abstract_mesh()
        if self.vocab_parallel and sharding.STAGE_AXIS in mesh.manual_axes:
            # Inside the pipeline's shard_map over the stages the lookup takes the table
            # gathered whole: the split lookup's backward, in the first stage's branch of the
            # tick loop, is refused by XLA's partitioner (Shardy: an unknown value in the
            # nested manual computation), and a gather from the table still split by rows
            # there aborts jax 0.11.2's (spmd_partitioner_util.cc: a check on the device
            # groups of the all-reduce it adds). The loss stays split.
            table = jax.lax.with_sharding_constraint(table, jax.P(None, None))
            return jnp.take(table, ids, axis=0, mode="fill", fill_value=0).astype(self.dtype)
        if axes:  # rows split by vocabulary: no device ever holds the whole table
            return lookup(table, ids, axes, self.dtype)
        if not mesh.empty and "fsdp" in mesh.axis_names:
            # FSDP: gather the table's `embed` shards for the lookup (its gradient then
            # reduce-scatters back); a gather from an embed-sharded table makes XLA replicate
            # the whole activation in the backward pass instead.
            vocab = sharding.mesh_axes_of("vocab")  # the vocab dim keeps its rule's axes
            vocab = tuple(a for a in vocab if a in mesh.axis_names) or None
            table = jax.lax.with_sharding_constraint(table, jax.P(vocab, None))
        # An id past the table looks up zeros and its gradient is dropped (MultimodalLM's
        # placeholder and padding tokens).
        return jnp.take(table, ids, axis=0, mode="fill", fill_value=0).astype(self.dtype)

    def attend(self, x_btd: jax.Array) -> jax.Array:
        """Float32 logits `x . E^T` (the tied output projection)."""
        table = self.embedding[...].astype(self.dtype)
        return jnp.einsum(
            "...d,vd->...v", x_btd.astype(self.dtype), table, preferred_element_type=jnp.float32
        )


class RMSNorm(nnx.Module):
    """Root-mean-square norm with a learned scale, computed in fp32."""

    def __init__(
        self,
        width: int,
        *,
        eps: float = NORM_EPS,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        axis: str = "embed",
        offset: bool = False,
    ):
        """`axis`: the scale's logical axis (a head's width: head_dim, QK-norm's); `offset`:
        the scale is 1 + the stored weight, which starts at 0 (Qwen3.5's, Gemma's)."""
        init = jnp.zeros if offset else jnp.ones
        self.scale = nnx.Param(init((width,), param_dtype), axes=(axis,))
        self.eps = eps
        self.dtype = dtype
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        """x / rms(x) times the scale (1 + scale with `offset`), in fp32, returned in `dtype`."""
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (x32 * (1.0 + scale if self.offset else scale)).astype(self.dtype)


class LayerNorm(RMSNorm):
    """Layer norm (centred, scaled, shifted) with a learned scale and bias, computed in fp32."""

    def __init__(self, width: int, *, use_bias: bool = True, **kw):
        """The RMSNorm's scale (no offset) and a bias beside it, under the same axis
        (`use_bias` false: none, as torch's LayerNorm(bias=False))."""
        super().__init__(width, offset=False, **kw)
        axes = self.scale.get_metadata()["axes"]
        self.bias = nnx.Param(jnp.zeros_like(self.scale[...]), axes=axes) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """(x - mean) / std times the scale plus the bias, in fp32, returned in `dtype`."""
        x32 = x.astype(jnp.float32)
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        x32 = x32 * self.scale[...].astype(jnp.float32)
        if self.bias is not None:
            x32 = x32 + self.bias[...].astype(jnp.float32)
        return x32.astype(self.dtype)


# config.blocks.NORMS names these
NORMS = {"rms": RMSNorm, "rms_offset": functools.partial(RMSNorm, offset=True), "layer": LayerNorm}


# ----------------------------------------------------------------------------- rotary


def rope_frequencies(dim: int, theta: float, scaling: Any = None) -> np.ndarray:
    """Angular frequencies of a rotary embedding over `dim` features (`dim // 2` of them).

    `theta ** (-2i / dim)`, optionally scaled as HF's `rope_scaling` does (`scaling`: a
    `jaxmllm.config.decoder.RopeScaling`): linear divides every frequency by the factor; llama3
    divides the low frequencies (wavelengths past original / low_freq_factor) by it, keeps the
    high ones (wavelengths under original / high_freq_factor) and blends in between;
    proportional keeps the first `fraction` of them (divided by the factor) and zeroes the
    rest, whose features then do not turn (transformers' proportional rope). Computed
    in float64 on the host: the frequencies are constants of the program.
    """
    freqs = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    kind = getattr(scaling, "type", "none")
    if kind == "proportional":  # (Gemma 4: the first fraction turn, as over the whole head)
        turning = int(scaling.fraction * dim // 2)
        return np.where(np.arange(dim // 2) < turning, freqs, 0.0) / scaling.factor
    if kind == "linear":
        return freqs / scaling.factor
    if kind == "llama3":
        s = scaling
        wavelen = 2 * math.pi / freqs
        low = np.where(
            wavelen > s.original_max_positions / s.low_freq_factor, freqs / s.factor, freqs
        )
        smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        blended = (1 - smooth) * low / s.factor + smooth * low
        medium = (wavelen >= s.original_max_positions / s.high_freq_factor) & (
            wavelen <= s.original_max_positions / s.low_freq_factor
        )
        return np.where(medium, blended, low)
    return freqs


def rope_1d(
    x_bthe: jax.Array, positions_bt: jax.Array, theta: float, scaling: Any = None
) -> jax.Array:
    """Rotary position embedding (rotate-half layout, as HF's Llama) by integer positions.

    Args:
      x_bthe: queries or keys [..., T, heads, head_dim]; head_dim must be even.
      positions_bt: positions [..., T].
      theta: rotary base.
      scaling: frequency scaling (`rope_frequencies`), None for none.

    Returns:
      x rotated, same shape and dtype.
    """
    freqs = jnp.asarray(rope_frequencies(x_bthe.shape[-1], theta, scaling), jnp.float32)
    angles = positions_bt.astype(jnp.float32)[..., None, None] * freqs  # [..., T, 1, half]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x_bthe.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthe.dtype)


def rope_2d(
    x_bthe: jax.Array, positions_bt2: jax.Array, theta: float, scaling: Any = None
) -> jax.Array:
    """2D rotary embedding: the first half of each head rotates by row, the second by column.

    Args:
      x_bthe: queries or keys [..., T, heads, head_dim]; head_dim must be divisible by 4.
      positions_bt2: (row, col) positions [..., T, 2].
      theta: rotary base.
      scaling: frequency scaling of each half (`rope_frequencies`).
    """
    rows, cols = jnp.split(x_bthe, 2, axis=-1)
    rows = rope_1d(rows, positions_bt2[..., 0], theta, scaling)
    cols = rope_1d(cols, positions_bt2[..., 1], theta, scaling)
    return jnp.concatenate([rows, cols], axis=-1)


def rope_2d_cols_first(
    x_bthe: jax.Array, positions_bt2: jax.Array, theta: float, scaling: Any = None
) -> jax.Array:
    """`rope_2d` with the halves' axes swapped: the first half of each head rotates by column,
    the second by row (Gemma 4's axial rotary: transformers' `apply_multidimensional_rope` of
    the (x, y) patch positions, each half its own rotate-half rotary)."""
    return rope_2d(x_bthe, positions_bt2[..., ::-1], theta, scaling)


def rope_multi(
    x_bthe: jax.Array,
    positions_bt3: jax.Array,
    theta: float,
    scaling: Any = None,
    sections: tuple[int, ...] = (),
    interleaved: bool = False,
) -> jax.Array:
    """Multimodal rotary (Qwen2-VL's M-RoPE): rotate-half rotary whose frequencies are turned
    by the (time, row, column) positions [..., T, 3] (`mrope_axes`: in `sections`, or
    interleaved as Qwen3-VL's); with three equal positions it is `rope_1d`."""
    freqs = jnp.asarray(rope_frequencies(x_bthe.shape[-1], theta, scaling), jnp.float32)
    axis = mrope_axes(sections, interleaved)  # which position turns frequency k
    angles = positions_bt3.astype(jnp.float32)[..., axis][..., None, :] * freqs  # [..., T, 1, half]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x_bthe.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthe.dtype)


def mrope_axes(sections: tuple[int, ...], interleaved: bool = False) -> np.ndarray:
    """Which of (time, row, column) turns each rotary frequency of M-RoPE, `sum(sections)` of
    them: in sections (Qwen2-VL: the first sections[0] by time, then rows, then columns), or
    interleaved (Qwen3-VL: t, r, c, t, r, c, ... while each of rows and columns has frequencies
    left, the rest by time), as transformers' `recomposition_frequencies` lays them out."""
    if not interleaved:
        return np.repeat(np.arange(len(sections)), sections)
    axis = np.zeros(sum(sections), np.int64)
    for dim in (1, 2):
        axis[dim : sections[dim] * 3 : 3] = dim
    return axis


def no_rope(x_bthe: jax.Array, positions: jax.Array, theta: float, scaling: Any = None):
    """Positions enter elsewhere (learned or sinusoidal tables at the tower's input)."""
    return x_bthe


ROPE = {
    "1d": rope_1d,
    "2d": rope_2d,
    "2d_cols_first": rope_2d_cols_first,  # Gemma 4's vision tower
    "none": no_rope,
    "mrope": rope_multi,  # M-RoPE in sections (Qwen2-VL), interleaved (Qwen3-VL)
    "mrope_interleaved": functools.partial(rope_multi, interleaved=True),
}


# ----------------------------------------------------------------------------- MLPs

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # HF gelu_pytorch_tanh / gelu_new
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # the exact erf form
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # CLIP's, Qwen2-VL's vision MLP
    "silu": jax.nn.silu,
}


class GatedMLP(nnx.Module):
    """`down(act(x W_gate) * (x W_up))`: SiLU (Llama, Qwen2), or the tanh GELU (Gemma's
    GeGLU)."""

    def __init__(
        self,
        width: int,
        mlp_dim: int,
        *,
        use_bias: bool = False,
        activation: str = "silu",
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        lora: dict[str, lora_.Adapter] | None = None,
        clipped: bool = False,
        rngs: nnx.Rngs,
    ):
        """`activation`: the gate's (`ACTIVATIONS`); `lora`: adapters of the matrices it names
        (gate, up, down); `clipped`: their inputs and outputs clamped to bounds (`Dense`'s)."""
        kw = dict(use_bias=use_bias, clipped=clipped, dtype=dtype, param_dtype=param_dtype)
        kw["rngs"] = rngs
        on = lora or {}
        self.gate = Dense(width, mlp_dim, ("embed", "mlp"), lora=on.get("gate"), **kw)
        self.up = Dense(width, mlp_dim, ("embed", "mlp"), lora=on.get("up"), **kw)
        self.down = Dense(mlp_dim, width, ("mlp", "embed"), lora=on.get("down"), **kw)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        """down(act(gate(x)) * up(x)); the two input projections are named `mlp_in` for the remat
        policies that save them."""
        gate, up = checkpoint_name(self.gate(x), "mlp_in"), checkpoint_name(self.up(x), "mlp_in")
        return self.down(ACTIVATIONS[self.activation](gate) * up)


class MLP(nnx.Module):
    """`fc2(act(x W_fc1))` (SigLIP, Whisper, the Qwen2-VL vision tower, the projectors)."""

    def __init__(
        self,
        width: int,
        mlp_dim: int,
        *,
        activation: str,
        out_width: int | None = None,
        use_bias: bool = True,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        lora: dict[str, lora_.Adapter] | None = None,
        clipped: bool = False,
        rngs: nnx.Rngs,
    ):
        """`lora`: adapters of the matrices it names (fc1, fc2); `clipped`: their inputs and
        outputs clamped to bounds (`Dense`'s)."""
        kw = dict(use_bias=use_bias, clipped=clipped, dtype=dtype, param_dtype=param_dtype)
        kw["rngs"] = rngs
        on = lora or {}
        self.fc1 = Dense(width, mlp_dim, ("embed", "mlp"), lora=on.get("fc1"), **kw)
        self.fc2 = Dense(mlp_dim, out_width or width, ("mlp", "embed"), lora=on.get("fc2"), **kw)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        """fc2(activation(fc1(x))); fc1's output is named `mlp_in` for the remat policies."""
        return self.fc2(ACTIVATIONS[self.activation](checkpoint_name(self.fc1(x), "mlp_in")))


# The gated MLP kinds (config.blocks.GATED_MLPS) and their gates' activations
GATED = {"gated_silu": "silu", "gated_gelu_tanh": "gelu_tanh"}


def make_mlp(kind: str, width: int, mlp_dim: int, *, use_bias: bool, **kw) -> nnx.Module:
    """The block MLP `kind` names (`config.blocks.MLPS`); `lora` in `kw`: the adapters of the
    matrices it names (the others are the attention's)."""
    if kind in GATED:
        return GatedMLP(width, mlp_dim, use_bias=use_bias, activation=GATED[kind], **kw)
    return MLP(width, mlp_dim, activation=kind, use_bias=use_bias, **kw)
