"""The transformer stack shared by the encoders and the decoder: pre-norm blocks, scanned.

Each transformer is ONE `Block` whose parameters are stacked on a leading `layers` axis and
applied with `jax.lax.scan`, so the compiled program holds one block whatever the depth.

A decoder whose layers differ in kind (a mixture-of-experts decoder with dense layers among its
MoE ones, a hybrid's Gated DeltaNet layers among full-attention ones) stacks each kind's layers
apart (`blocks` the main kind's, `<kind>_blocks` the
others') and runs them as a few scans over repeating units of kinds (`segments`): one scan for
[dense, moe] x 24, two for a dense layer before 47 MoE ones; a block is compiled once per kind
and segment.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmllm.config.remat import REMAT_POLICIES
from jaxmllm.models import lora
from jaxmllm.models.attention import Attention, Packing
from jaxmllm.models.deltanet import GatedDeltaNet, LinearSpec
from jaxmllm.models.layers import ACTIVATIONS, GATED, NORMS, Dense, make_mlp
from jaxmllm.models.moe import MoE, MoESpec


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
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before rotary
    rope: str = "1d"  # layers.ROPE: 1d | 2d | none
    rope_theta: float = 10000.0
    rope_scaling: Any = None  # config.decoder.RopeScaling, or None
    rope_sections: tuple[int, ...] = ()  # mrope: frequencies turned by time, row, column
    rotary_dim: int = 0  # the rotating part of each head (0: all of it)
    attn_gate: bool = False  # attention's output gated by sigmoid(x W_gate) (Qwen3.5)
    window: int = 0  # a query sees itself and window - 1 tokens before it (0: the document)
    attn_scalar: float = 0.0  # scores scale by 1 / sqrt(attn_scalar) (0: the head width)
    post_norms: bool = False  # each branch's output normed before its residual add (Gemma)
    v_norm: bool = False  # an unscaled RMSNorm over each head's values (Gemma 4)
    k_eq_v: bool = False  # the values are the key projection's output (Gemma 4's full layers)
    layer_scalar: bool = False  # the block's output times a learned scalar (Gemma 4)
    spans: bool = True  # reads the packing's bidirectional spans (false: causal over them)
    # No key and value projections: attention reads another layer's (Gemma 4's shared layers)
    kv_shared: bool = False
    per_layer_dim: int = 0  # a per-layer input this wide added after the MLP (models.per_layer)
    # The token mixer is Gated DeltaNet linear attention of these sizes, not attention
    linear: LinearSpec | None = None
    # LoRA adapters: (target, lora.Adapter) of the matrices that have one (q, k, v, o, ...)
    lora: tuple[tuple[str, lora.Adapter], ...] = ()
    moe: MoESpec | None = None  # the MLP is a mixture of experts (models.moe)
    # The attention's and a dense MLP's matrices clamp their inputs and outputs to bounds a
    # checkpoint holds (`layers.Dense`'s `clipped`: Gemma 4's vision tower)
    clipped: bool = False

    @classmethod
    def of(cls, cfg: Any, *, kv_heads: int | None = None, rope: str, **extra) -> BlockSpec:
        """The spec of a tower config (`config.blocks.BlockOptions` + width, heads, ...)."""
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
            qk_norm=cfg.qk_norm,
            rope=rope,
            rope_theta=cfg.rope_theta,
            **extra,
        )

    def norm_layer(self, *, dtype: jnp.dtype, param_dtype: jnp.dtype) -> nnx.Module:
        """A new norm of the block's kind (`norm`: rms or layer) over its width."""
        return NORMS[self.norm](self.width, eps=self.norm_eps, dtype=dtype, param_dtype=param_dtype)


class Block(nnx.Module):
    """Pre-norm transformer block: `x + attn(norm(x))`, then `x + mlp(norm(x))`; with
    `post_norms` each branch's output is normed too (`x + norm(attn(norm(x)))`: Gemma's), with
    `per_layer_dim` the layer's per-layer input added through a gate (`per_layer_added`), with
    `layer_scalar` the block's output scaled by a learned scalar (Gemma 4's)."""

    def __init__(
        self,
        spec: BlockSpec,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        """The block's modules from `spec`: its norms, its token mixer (attention, or Gated DeltaNet
        where `spec.linear`) and its MLP (gated, plain, or the routed experts where `spec.moe`)."""
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        adapters = dict(spec.lora)
        self.attn_norm = spec.norm_layer(**kw)
        if spec.linear is not None:
            self.attn = GatedDeltaNet(
                spec.width, spec.linear, norm_eps=spec.norm_eps, lora=adapters, rngs=rngs, **kw
            )
        else:
            self.attn = Attention(
                spec.width,
                spec.heads,
                spec.kv_heads,
                head_dim=spec.head_dim,
                bias=spec.attn_bias,
                qk_norm=spec.qk_norm,
                norm_eps=spec.norm_eps,
                rope=spec.rope,
                rope_theta=spec.rope_theta,
                rope_scaling=spec.rope_scaling,
                rope_sections=spec.rope_sections,
                rotary_dim=spec.rotary_dim,
                gate=spec.attn_gate,
                norm_offset=spec.norm == "rms_offset",
                window=spec.window,
                scalar=spec.attn_scalar,
                v_norm=spec.v_norm,
                k_eq_v=spec.k_eq_v,
                spans=spec.spans,
                kv_shared=spec.kv_shared,
                lora=adapters,
                clipped=spec.clipped,
                rngs=rngs,
                **kw,
            )
        self.mlp_norm = spec.norm_layer(**kw)
        post = spec.post_norms
        self.attn_post_norm = spec.norm_layer(**kw) if post else None
        self.mlp_post_norm = spec.norm_layer(**kw) if post else None
        if spec.moe is not None:
            eps = spec.norm_eps
            self.mlp = MoE(spec.width, spec.moe, lora=adapters, norm_eps=eps, rngs=rngs, **kw)
            self.branch_norms(spec, **kw)
        else:
            self.mlp = make_mlp(
                spec.mlp,
                spec.width,
                spec.mlp_dim,
                use_bias=spec.mlp_bias,
                lora=adapters,
                clipped=spec.clipped,
                rngs=rngs,
                **kw,
            )
        # (Gemma 4's per_layer_input_gate, per_layer_projection, post_per_layer_input_norm)
        p, w = spec.per_layer_dim, spec.width
        self.per_layer_gate = Dense(w, p, ("embed", "mlp"), rngs=rngs, **kw) if p else None
        self.per_layer_out = Dense(p, w, ("mlp", "embed"), rngs=rngs, **kw) if p else None
        self.per_layer_norm = spec.norm_layer(**kw) if p else None
        self.per_layer_act = GATED.get(spec.mlp, spec.mlp)  # (the MLP's gate's activation)
        # (transformers' layer_scalar: a buffer of ones until a checkpoint sets it)
        ones = jnp.ones((1,), param_dtype)
        self.layer_scalar = nnx.Param(ones, axes=(None,)) if spec.layer_scalar else None

    def branch_norms(self, spec: BlockSpec, **kw) -> None:
        """With the MoE's `branch_norms` (Gemma 4), the norms of its branches: before the routed
        experts (`experts_norm`: pre_feedforward_layernorm_2; the shared expert, Gemma's dense
        MLP, reads `mlp_norm`'s), after them and after the shared expert (post_feedforward_
        layernorm_2, _1); `mlp_post_norm` then norms their sum."""
        on = spec.moe.branch_norms
        self.experts_norm = spec.norm_layer(**kw) if on else None
        self.experts_post_norm = spec.norm_layer(**kw) if on else None
        self.shared_post_norm = spec.norm_layer(**kw) if on else None

    def __call__(self, x_btd: jax.Array, pack: Packing, positions: jax.Array) -> jax.Array:
        """The block's output for x [B, T, width]; `forward` also returns its router's stats."""
        return self.forward(x_btd, pack, positions)[0]

    def forward(
        self,
        x_btd: jax.Array,
        pack: Packing,
        positions: jax.Array,
        per_layer: jax.Array | None = None,
        kv: tuple | None = None,
    ) -> tuple:
        """(the block's output, its router's statistics: `moe.RouterStats`, None when dense);
        `per_layer` [B, T, P]: its per-layer input, `kv`: the keys and values a layer without
        its own attends over (`attention.Attention.keys_values` of the layer that owns them)."""
        h_btd = self.attn_norm(x_btd)
        y_btd = (
            self.attn(h_btd, pack, positions)
            if kv is None
            else self.attn(h_btd, pack, positions, kv)
        )
        x_btd = x_btd + self.attn_out(y_btd)
        y, stats = self.mlp_branch(x_btd, pack.segment_ids > 0)
        return self.finished(x_btd + self.mlp_out(y), per_layer), stats

    def mlp_branch(self, x_btd: jax.Array, valid_bt: jax.Array | None = None) -> tuple:
        """(the MLP's output before `mlp_post_norm`, its router's statistics: None when dense)
        for the residual x (`valid_bt`: the tokens an MoE routes; None: all): the MLP on
        `mlp_norm(x)`; an MoE's router on it or on x (`router_norm`), and with branch norms
        (Gemma 4) its routed experts on their own norm's input, each branch's output normed on
        its own before they are summed."""
        if not isinstance(self.mlp, MoE):
            return self.mlp(self.mlp_norm(x_btd)), None
        if self.experts_norm is None:
            return self.mlp.routed(self.mlp_norm(x_btd), valid_bt, x_btd)
        normed = self.mlp_norm(x_btd)
        routed, shared, stats = self.mlp.branches(self.experts_norm(x_btd), valid_bt, x_btd, normed)
        return self.shared_post_norm(shared) + self.experts_post_norm(routed), stats

    def finished(self, x_btd: jax.Array, per_layer: jax.Array | None) -> jax.Array:
        """The block's output of x after its MLP: its per-layer input added, then scaled."""
        return self.scaled(self.per_layer_added(x_btd, per_layer))

    def per_layer_added(self, x_btd: jax.Array, per_layer_btp: jax.Array | None) -> jax.Array:
        """x + norm(W_out (act(W_gate x) * p)) for the layer's per-layer input p [B, T, P]
        (`models.per_layer`; transformers' per_layer_input_gate, per_layer_projection and
        post_per_layer_input_norm); x where the block has none."""
        if self.per_layer_gate is None:
            return x_btd
        gated = ACTIVATIONS[self.per_layer_act](self.per_layer_gate(x_btd))
        y_btd = self.per_layer_out(gated * per_layer_btp.astype(gated.dtype))
        return x_btd + self.per_layer_norm(y_btd)

    def scaled(self, x_btd: jax.Array) -> jax.Array:
        """The block's output times its `layer_scalar` where it has one (Gemma 4's)."""
        if self.layer_scalar is None:
            return x_btd
        return (x_btd * self.layer_scalar[...].astype(x_btd.dtype)).astype(x_btd.dtype)

    def attn_out(self, y_btd: jax.Array) -> jax.Array:
        """The attention branch's output as the residual adds it: normed with `post_norms`."""
        return y_btd if self.attn_post_norm is None else self.attn_post_norm(y_btd)

    def mlp_out(self, y_btd: jax.Array) -> jax.Array:
        """The MLP branch's output as the residual adds it: normed with `post_norms`."""
        return y_btd if self.mlp_post_norm is None else self.mlp_post_norm(y_btd)


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


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers [start, start + len(unit) x repeats) of a transformer: `unit`'s kinds, repeated
    (one scan of `repeats` steps, each step the unit's blocks in order)."""

    start: int
    unit: tuple[str, ...]
    repeats: int


def segments(pattern: Sequence[str], longest_unit: int = 8) -> tuple[Segment, ...]:
    """The layers of `pattern` (each layer's kind) as scans over repeating units, the fewest
    blocks compiled (a unit's length, plus one a segment): [a] x 48 is one segment of unit
    (a,), [a, b] x 24 one of (a, b), [b] + [a] x 47 two."""
    n = len(pattern)
    if len(set(pattern)) <= 1:
        return (Segment(0, tuple(pattern[:1]), n),) if n else ()
    best = [0] + [math.inf] * n
    choice: list[tuple[int, int]] = [(0, 0)] * (n + 1)
    for end in range(1, n + 1):
        for p in range(1, min(longest_unit, end) + 1):
            start = end - p
            while start >= 0:  # [start, end) repeats its first p kinds
                cost = best[start] + p + 1
                if cost < best[end]:
                    best[end], choice[end] = cost, (start, p)
                before = start - p
                if before < 0 or pattern[before:start] != pattern[start : start + p]:
                    break
                start = before
    out, end = [], n
    while end:
        start, p = choice[end]
        out.append(Segment(start, tuple(pattern[start : start + p]), (end - start) // p))
        end = start
    return tuple(reversed(out))


def pieces(pattern: Sequence[str], bounds: Sequence[int] = ()) -> tuple[Segment, ...]:
    """`segments` of `pattern` that never cross a layer boundary of `bounds` (a layer index
    where a piece must start: after DeepStack's first K layers, after a tapped layer)."""
    cuts = sorted({b for b in bounds if 0 < b < len(pattern)} | {0, len(pattern)})
    out: list[Segment] = []
    for start, end in zip(cuts[:-1], cuts[1:], strict=True):
        out += [Segment(s.start + start, s.unit, s.repeats) for s in segments(pattern[start:end])]
    return tuple(out)


def stack_name(kind: str, main: str) -> str:
    """The attribute holding a kind's stacked layers: `blocks` for the main kind."""
    return "blocks" if kind == main else f"{kind}_blocks"


def layer_places(pattern: Sequence[str]) -> list[tuple[str, int]]:
    """Each layer's (stack attribute, index in it); the first layer's kind... is not the main
    one: the main kind is `pattern`'s `main_kind`."""
    main = main_kind(pattern)
    seen: dict[str, int] = {}
    out = []
    for kind in pattern:
        out.append((stack_name(kind, main), seen.get(kind, 0)))
        seen[kind] = seen.get(kind, 0) + 1
    return out


def main_kind(pattern: Sequence[str]) -> str:
    """The kind whose layers are `blocks`: the most common (the first of those tied)."""
    counts = {k: list(pattern).count(k) for k in dict.fromkeys(pattern)}
    return max(counts, key=counts.get) if counts else ""


class Transformer(nnx.Module):
    """A stack of pre-norm blocks scanned over a leading `layers` axis, then a final norm.

    `blocks` is ONE `Block` whose parameters are stacked [depth, ...] (logical axis "layers"
    first); `jax.lax.scan` applies it layer by layer, so the compiled program holds one block
    whatever the depth. Each block is rematerialised under the `remat` policy (a name of
    `config.remat.REMAT_POLICIES`; none: not at all).
    `final_norm` False: no norm after the blocks (a tower read before its last norm).
    `full_layers`: with a `local` packing given to `layers`, the layers that attend by `pack`
    (the others by `local`: windows within the documents); one block is compiled per packing.
    `kinds`: layers of several kinds, {kind: its BlockSpec}, and `pattern` each layer's kind:
    each kind's layers stacked apart (`stack_name`), run as `segments` (module docstring).
    `kv_sources`: {kind: layer} for the kinds of layers without keys and values of their own
    (the last ones, Gemma 4's shared layers), each attending over the keys and values of that
    earlier layer: computed once more from its input, which the scan keeps (`_scan`).
    """

    def __init__(
        self,
        depth: int,
        spec: BlockSpec,
        *,
        remat: str = "none",
        final_norm: bool = True,
        full_layers: tuple[int, ...] = (),
        kinds: dict[str, BlockSpec] | None = None,
        pattern: tuple[str, ...] = (),
        kv_sources: dict[str, int] | None = None,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        """`depth` blocks of `spec` stacked for the scan (`kinds`/`pattern`: each kind of layer's
        own stack, where the layers differ), rematerialised under `remat`; `full_layers`: the
        layers that attend to the whole row where the others attend within windows (a vision
        tower's); the final norm where `final_norm`; `kv_sources`: the layers whose keys and
        values the kinds without their own read (class docstring)."""
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat {remat!r} is not one of {', '.join(REMAT_POLICIES)}")
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        kinds = kinds or {"": spec}
        pattern = tuple(pattern) or ("",) * depth
        assert len(pattern) == depth and set(pattern) <= set(kinds), (pattern, list(kinds))
        # Layer by layer from the shared RNG stream, then stacked: every layer draws exactly
        # what separate blocks drew (init runs once; only the train step must not grow).
        layers = [Block(kinds[kind], rngs=rngs, **kw) for kind in pattern]
        self.main = main_kind(pattern)
        self.kinds = tuple(dict.fromkeys(pattern))  # in order of first use
        for kind in self.kinds:
            own = [layer for layer, k in zip(layers, pattern, strict=True) if k == kind]
            setattr(self, stack_name(kind, self.main), stack_modules(own, "layers"))
        self.pattern = pattern
        self.final_norm = spec.norm_layer(**kw) if final_norm else None
        self.remat = remat
        self.full_layers = tuple(full_layers)
        self.kv_sources = dict(kv_sources or {})
        reusing = [i for i, kind in enumerate(pattern) if kind in self.kv_sources]
        assert reusing == list(range(depth - len(reusing), depth)), "they are the last layers"
        assert all(s < depth - len(reusing) for s in self.kv_sources.values()), self.kv_sources
        self.first_reusing = depth - len(reusing)  # (depth: none)

    def __call__(
        self, x_btd: jax.Array, pack: Packing, positions: jax.Array, local: Packing | None = None
    ) -> jax.Array:
        """The stack's output for x [B, T, width]: every layer, then the final norm. `local`: the
        windowed layers' packing, where some layers attend within windows."""
        return self.norm(self.layers(x_btd, pack, positions, local=local))

    def norm(self, x_btd: jax.Array) -> jax.Array:
        """The final norm (none: x as it is)."""
        return x_btd if self.final_norm is None else self.final_norm(x_btd)

    def stack(self, kind: str) -> nnx.Module:
        """A kind's stacked layers."""
        return getattr(self, stack_name(kind, self.main))

    def layer(self, i: int) -> Block:
        """Layer `i`'s block (its slice of its kind's stack)."""
        stack, at = layer_places(self.pattern)[i]
        graphdef, stacked = nnx.split(getattr(self, stack))
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[at], stacked))

    def shared_kv(self, inputs: dict[int, jax.Array], positions: jax.Array) -> dict:
        """{kind: (keys, values)} the layers of each kind in `kv_sources` attend over: those of
        its source layer, computed from that layer's input x (`inputs`: {layer: x}, as `_scan`
        keeps them) as the layer computes them."""
        out = {}
        for kind, source in self.kv_sources.items():
            block = self.layer(source)
            with lora.salted(source):
                out[kind] = block.attn.keys_values(block.attn_norm(inputs[source]), positions)
        return out

    def _block_fn(self, kind: str, positions: jax.Array) -> tuple[Callable, Any, Any]:
        """(block(x, state, layer index, pack, per-layer inputs [L, ...] or None, keys and
        values or None) -> (x, stats), graphdef, stacked state) of a kind's stack,
        rematerialised under the policy."""
        graphdef, stacked = nnx.split(self.stack(kind))

        def block(x_btd, block_state, j, pack, per_layer=None, kv=None):
            own = (
                None if per_layer is None else jax.lax.dynamic_index_in_dim(per_layer, j, 0, False)
            )
            with lora.salted(j):
                return nnx.merge(graphdef, block_state).forward(x_btd, pack, positions, own, kv)

        policy = remat_policy(self.remat)
        if policy is not None:
            # Inside a scan XLA cannot merge the recomputation with the forward pass, so the
            # guard against that (prevent_cse) would only block optimisations.
            block = jax.checkpoint(block, policy=policy, prevent_cse=False)
        return block, graphdef, stacked

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
        if count is None:
            return self.run(x_btd, pack, positions, local=local)[0]
        assert len(self.kinds) == 1 and local is None, "pipelined stacks are of one kind"
        assert not self.kv_sources, "pipelined stacks compute their own keys and values"
        block, _, stacked = self._block_fn(self.kinds[0], positions)
        depth = jax.tree.leaves(stacked)[0].shape[0]

        def masked(x_btd, step):  # a padding slot is skipped, not computed
            j, block_state = step
            run = lambda x, state, j: block(x, state, j, pack)[0]
            skip = lambda x, *_: x
            return jax.lax.cond(j < count, run, skip, x_btd, block_state, j), None

        x_btd, _ = jax.lax.scan(masked, x_btd, (jnp.arange(depth), stacked))
        return x_btd

    def run(
        self,
        x_btd: jax.Array,
        pack: Packing,
        positions: jax.Array,
        local: Packing | None = None,
        added: jax.Array | None = None,
        per_layer: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]:
        """The blocks without the final norm, and the MoE layers' router statistics stacked in
        layer order (`moe.RouterStats` [MoE layers, ...]; None without MoE layers).
        `added` [K, B, T, width]: added to x after each of the first K layers (DeepStack);
        `per_layer` [L, B, T, P]: each layer's per-layer input (`models.per_layer`)."""
        if local is not None:
            assert per_layer is None and not self.kv_sources, "a vision tower's windows"
            return self._windowed(x_btd, pack, positions, local)
        fns = {k: self._block_fn(k, positions)[0] for k in self.kinds}
        step = lambda kind, state, x, _, j: fns[kind](x, state, j, pack, per_layer)

        def reuse(inputs):  # (the layers reading another's keys and values)
            kv = self.shared_kv(inputs, positions)
            return lambda kind, state, x, _, j: fns[kind](x, state, j, pack, per_layer, kv[kind])

        x_btd, ys = self.scan(step, x_btd, added=added, reuse=reuse)
        found = [(k, y) for k, y in ys.items() if y is not None]
        if not found:
            return x_btd, None
        # (each kind's in its layers' order; several kinds with statistics: back in layer order)
        stats = jax.tree.map(lambda *a: jnp.concatenate(a), *(y for _, y in found))
        kinds = [k for k, _ in found]
        layers = [i for k in kinds for i, kind in enumerate(self.pattern) if kind == k]
        if layers != sorted(layers):
            stats = jax.tree.map(lambda a: a[jnp.asarray(np.argsort(layers))], stats)
        return x_btd, stats

    def tapped(
        self, x_btd: jax.Array, pack: Packing, positions: jax.Array, taps: Sequence[int]
    ) -> tuple[jax.Array, jax.Array]:
        """The blocks without the final norm, and x after each of the layers `taps` (0-based,
        DeepStack's) stacked [len(taps), B, T, width] in their order. The layers are scanned in
        pieces that end at the taps: no other layer's activations are kept."""
        assert not self.kv_sources, "a vision tower's layers compute their keys and values"
        fns = {k: self._block_fn(k, positions)[0] for k in self.kinds}
        step = lambda kind, state, x, _, j: fns[kind](x, state, j, pack)
        x_btd, _, kept = self._scan(step, x_btd, {}, None, tuple(taps))
        return x_btd, jnp.stack([kept[t] for t in taps])

    def scan(
        self,
        step: Callable,
        x_btd: jax.Array,
        extra: dict | None = None,
        added: jax.Array | None = None,
        reuse: Callable | None = None,
    ) -> tuple:
        """Every layer in order: `step(kind, block_state, x, extra_j, j) -> (x, y)` for layer j
        (`block_state`: its parameters; `extra_j`: its slice of `extra[kind]`, arrays stacked
        like the kind's layers, e.g. a KV cache), then `added[j]` added to x for the first K
        layers (`added` [K, ...]: DeepStack). Returns (x, {kind: ys stacked like its layers});
        one scan per segment (`segments`). With `kv_sources`, `reuse(inputs)` is the step of
        the layers reading another's keys and values, given {source layer: its input x}."""
        x_btd, ys, _ = self._scan(step, x_btd, extra or {}, added, (), reuse)
        return x_btd, ys

    def _scan(self, step, x_btd, extra: dict, added, cuts: tuple[int, ...], reuse=None) -> tuple:
        """`scan`, and x after each layer of `cuts` ({layer: x}: the layers are scanned in
        pieces that end there). `added` rides along as a constant of the one scan: a piece of
        its own for the first K layers would be a second while loop whose temporaries XLA does
        not share with the first's (an MoE layer's exchange buffers twice: +23 GiB a GPU of
        configs/gpu/qwen3_vl_30b_a3b.yaml, bench.memory), where the constant costs an add a
        layer and, backward, its gradient's [K, ...] accumulator. With `kv_sources` a piece
        starts at each source layer, whose input is kept, and at the first layer reusing keys
        and values, whose step from there on is `reuse(inputs)`."""
        assert reuse is not None or not self.kv_sources, "layers reuse keys: give `reuse`"
        adding = (lambda s: _adding(s, added)) if added is not None else (lambda s: s)
        step = adding(step)
        sources = set(self.kv_sources.values())
        states = {k: nnx.split(self.stack(k))[1] for k in self.kinds}
        if len(self.kinds) == 1 and not cuts:
            (kind,) = self.kinds
            depth = jax.tree.leaves(states[kind])[0].shape[0]  # (a pipeline stage's slab)
            body = lambda x, xs: step(kind, xs[0], x, xs[1], xs[2])
            x_btd, ys = jax.lax.scan(
                body, x_btd, (states[kind], extra.get(kind), jnp.arange(depth))
            )
            return x_btd, {kind: ys}, {}
        found: dict[str, list] = {k: [] for k in self.kinds}
        offsets = dict.fromkeys(self.kinds, 0)
        kept, inputs = {}, {}
        bounds = {c + 1 for c in cuts} | sources | {self.first_reusing}
        for seg in pieces(self.pattern, tuple(bounds)):
            if seg.start in sources:  # (a source layer's input: the keys it gives are of it)
                inputs[seg.start] = x_btd
            if seg.start == self.first_reusing:
                step = adding(reuse(inputs))
            xs = {}
            for kind in dict.fromkeys(seg.unit):
                n, at, reps = seg.unit.count(kind), offsets[kind], seg.repeats
                cut = lambda a, at=at, n=n, reps=reps: a[at : at + n * reps].reshape(
                    reps, n, *a.shape[1:]
                )
                xs[kind] = jax.tree.map(cut, (states[kind], extra.get(kind)))
                offsets[kind] = at + n * reps

            def unit(x_btd, xs_r, seg=seg, step=step):
                xs, r = xs_r
                seen: dict[str, int] = {}
                ys: dict[str, list] = {k: [] for k in xs}
                for j, kind in enumerate(seg.unit):
                    o = seen.get(kind, 0)
                    seen[kind] = o + 1
                    state, extra_j = jax.tree.map(lambda a, o=o: a[o], xs[kind])
                    x_btd, y = step(kind, state, x_btd, extra_j, seg.start + r * len(seg.unit) + j)
                    ys[kind].append(y)
                # [unit's layers of a kind] per kind, stacked in their order
                return x_btd, {k: _stacked(v) for k, v in ys.items()}

            x_btd, ys = jax.lax.scan(unit, x_btd, (xs, jnp.arange(seg.repeats)))
            for kind, y in ys.items():  # [repeats, n, ...] -> the kind's layers in order
                found[kind].append(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), y))
            end = seg.start + len(seg.unit) * seg.repeats
            if end - 1 in cuts:
                kept[end - 1] = x_btd
        return x_btd, {k: _concatenated(v) for k, v in found.items()}, kept

    def _windowed(self, x_btd, pack, positions, local):
        """`run` with `local`: each layer by its own packing (whole documents or windows)."""
        assert len(self.kinds) == 1, "windowed layers are of one kind"
        block, _, stacked = self._block_fn(self.kinds[0], positions)
        depth = jax.tree.leaves(stacked)[0].shape[0]
        full = jnp.asarray([i in self.full_layers for i in range(depth)])

        def either(x_btd, step):
            block_state, is_full, j = step
            whole = lambda x: block(x, block_state, j, pack)
            windowed = lambda x: block(x, block_state, j, local)
            return jax.lax.cond(is_full, whole, windowed, x_btd)

        return jax.lax.scan(either, x_btd, (stacked, full, jnp.arange(depth)))


def _adding(step: Callable, added: jax.Array) -> Callable:
    """`step`, then `added[j]` added to its x for a layer j of the first K (`added` [K, ...];
    zero after them: one body for every layer)."""
    k = added.shape[0]

    def stepped(kind, state, x_btd, extra_j, j):
        x_btd, y = step(kind, state, x_btd, extra_j, j)
        add = jax.lax.dynamic_index_in_dim(added, jnp.minimum(j, k - 1), keepdims=False)
        return x_btd + jnp.where(j < k, add, jnp.zeros_like(add)).astype(x_btd.dtype), y

    return stepped


def _stacked(ys: list) -> Any:
    """One kind's outputs in a unit, stacked on a new leading axis (None when they are)."""
    if not ys or ys[0] is None:
        return None
    return jax.tree.map(lambda *a: jnp.stack(a), *ys)


def _concatenated(found: list) -> Any:
    """Segments' stacked outputs, one after another (None when there are none)."""
    if not found or found[0] is None:
        return None
    return jax.tree.map(lambda *a: jnp.concatenate(a), *found)


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
