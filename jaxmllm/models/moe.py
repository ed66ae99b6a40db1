"""Mixture-of-experts MLPs: a router over stacked experts, dropless, the experts split over the
mesh's `expert` axis (`config.decoder.MoEConfig` configures it).

An MoE layer's MLP sends each token to `top_k` of E gated MLPs ("experts", their weights
stacked [E, ...]) and sums their outputs weighted by the router's probabilities (softmax over
the experts, top-k, renormalised with `norm_topk_prob`), as Qwen3-MoE and Qwen2-MoE do; an
optional shared expert sees every token, scaled by a sigmoid gate (Qwen2-MoE, Qwen3.5-MoE) or
not (Gemma 4's MLP beside its experts). The experts' gate activation is the decoder MLP's
(SiLU; Gemma 4's tanh GELU). Gemma 4's router, as options: it reads the layer's residual
stream through an RMSNorm without a weight, times a learned scale per channel and
width^-0.5 (`router_norm`), and each expert's weight is multiplied by a learned scale of its
own after the renormalisation (`expert_scale`). Its branches' own norms are the block's
(`transformer.Block`): `branches` returns the routed and the shared outputs apart.

**Dropless, computing only the active experts.** A device's N tokens make N x k assignments
(padding tokens none). They are sorted by expert, so each expert's rows are one contiguous
group, and a grouped matmul (`jaxmllm.models.grouped`) computes each group against its expert
only, tile by tile: the rows' work plus at most one tile of padding an expert (the tile is
chosen so that this is about an eighth of the rows).

**Expert parallelism.** With `mesh.expert` = P > 1 each device holds E / P experts and its own
data-parallel buckets (the batch is split over the `expert` axis as over `data`). Inside one
`shard_map`, a device's sorted assignments are sent to the devices holding their experts and
the results sent back by all-to-all over `expert` (`dense`: lax.all_to_all of a buffer of the
worst case, every backend; `ragged`: lax.ragged_all_to_all moving only the routed rows, GPU),
and the receiver groups what it got by its local experts. Dropless buffers hold the worst case
(every assignment of every sender to one device); `capacity_factor` bounds them, and what does
not fit is dropped and counted (`dropped`), never silently. Tensor parallelism splits each
expert's inner width (a partial sum over `tensor` at the end); FSDP gathers the experts' width
before the `shard_map` as it does every weight. The router, the statistics and the shared
expert are computed outside it, under XLA's sharding.

**Statistics for the losses** (`RouterStats`): per layer, the assignments and the router's
summed probabilities per expert, the tokens, the summed squared log-sum-exp (z-loss), over the
valid tokens of every device: sums, so the load-balancing loss built from them
(`balance_loss`) is the global batch's, not a mean of per-device ones.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxmllm.models import lora as lora_
from jaxmllm.models.grouped import local_experts, take_rows, untake_rows
from jaxmllm.models.layers import GATED, NORM_EPS, Dense, GatedMLP, normal_param
from sharding import DATA_AXES, EXPERT_AXIS, STAGE_AXIS

MAX_TILE = 128  # rows per tile at most (a tile is one expert's matmul of tile x width)
MIN_TILE = 8


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """What an MoE layer is made of (static: from `config.decoder.MoEConfig`)."""

    experts: int
    top_k: int
    mlp_dim: int
    norm_topk_prob: bool = True
    shared_mlp_dim: int = 0
    shared_gate: bool = True
    capacity_factor: float = 0.0
    exchange: str = "dense"
    tile: int = 0
    activation: str = "silu"  # the experts' and shared expert's gate (layers.ACTIVATIONS)
    router_norm: bool = False  # the router reads the residual, normed and scaled (Gemma 4)
    expert_scale: bool = False  # each expert's weight times a learned scale (Gemma 4)
    branch_norms: bool = False  # the shared and routed outputs normed apart (transformer.Block)

    @classmethod
    def of(cls, moe, mlp: str = "gated_silu") -> MoESpec:
        """The model's view of the config's `MoEConfig`: its sizes and routing options, the
        experts gated by the activation of the decoder's `mlp` (`layers.GATED`)."""
        return cls(
            moe.experts,
            moe.top_k,
            moe.mlp_dim,
            moe.norm_topk_prob,
            moe.shared_mlp_dim,
            moe.shared_gate,
            moe.capacity_factor,
            moe.exchange,
            moe.tile,
            GATED[mlp],
            moe.router_norm,
            moe.expert_scale,
            moe.branch_norms,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterStats:
    """One MoE layer's routing over a batch (sums over its valid tokens on every device)."""

    counts: jax.Array  # [E] assignments per expert
    probs: jax.Array  # [E] the router's probabilities summed over the tokens
    tokens: jax.Array  # [] valid tokens
    z: jax.Array  # [] sum of logsumexp(logits)^2 (the z-loss)
    dropped: jax.Array  # [] assignments dropped by a capacity (0 when dropless)
    recv_max: jax.Array  # [] the most rows a device received for its experts
    recv_mean: jax.Array  # [] the mean rows a device received
    sent_remote: jax.Array  # [] assignments sent to another device's experts


def balance_loss(stats: RouterStats) -> jax.Array:
    """The load-balancing loss over stacked layers' statistics (leading axis: MoE layers), as
    transformers' `load_balancing_loss_func` computes it over every layer's router logits
    concatenated: E x sum_e (assignments_e / rows) x (probability_e / rows), rows = tokens x
    layers. top_k when the experts' loads and mean probabilities are all equal."""
    experts = stats.counts.shape[-1]
    rows = jnp.maximum(stats.tokens.sum(), 1.0)
    counts, probs = stats.counts.reshape(-1, experts), stats.probs.reshape(-1, experts)
    return experts * jnp.sum(counts.sum(0) / rows * (probs.sum(0) / rows))


def z_loss(stats: RouterStats) -> jax.Array:
    """The router z-loss: the mean over tokens (and layers) of logsumexp(logits)^2."""
    return stats.z.sum() / jnp.maximum(stats.tokens.sum(), 1.0)


class Experts(nnx.Module):
    """E gated MLPs' weights, stacked: gate and up [E, width, f], down [E, f, width].

    With adapters (`lora`: targets gate, up, down), each expert has its own low-rank update,
    as PEFT puts LoRA on transformers' stacked experts (`target_parameters`): one on gate and
    up together, as transformers fuses them (`gate_up`: A [E, width, 2r], B [E, 2r, 2f], gate
    the first f columns; PEFT's rank and alpha for it are twice the others'), one on down
    (A [E, f, r], B [E, r, width]). No dropout: the update is merged into the weights
    (`weights`), which no dropout of the inputs could reach (PEFT refuses it too).
    """

    def __init__(
        self,
        experts: int,
        width: int,
        mlp_dim: int,
        *,
        param_dtype,
        dtype=jnp.float32,
        lora: dict[str, lora_.Adapter] | None = None,
        rngs: nnx.Rngs,
    ):
        """`dtype`: the compute dtype the adapters' updates are multiplied in (fp32 sums)."""
        w_in, w_out = 1.0 / math.sqrt(width), 1.0 / math.sqrt(mlp_dim)
        into, out = ("expert", "expert_embed", "mlp"), ("expert", "mlp", "expert_embed")
        self.gate = normal_param(rngs, (experts, width, mlp_dim), w_in, into, param_dtype)
        self.up = normal_param(rngs, (experts, width, mlp_dim), w_in, into, param_dtype)
        self.down = normal_param(rngs, (experts, mlp_dim, width), w_out, out, param_dtype)
        lora = lora or {}
        fused = lora.get("gate")  # (gate and up are adapted together: config checks it)
        kw = dict(dtype=dtype, rngs=rngs)
        self.gate_up_adapter = (
            ExpertsAdapter(experts, width, 2 * mlp_dim, double(fused), into[1:], **kw)
            if fused
            else None
        )
        down = lora.get("down")
        self.down_adapter = (
            ExpertsAdapter(experts, mlp_dim, width, down, out[1:], **kw) if down else None
        )

    def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """gate, up and down with each expert's adapter update added (float32 sums)."""
        gate, up, down = self.gate[...], self.up[...], self.down[...]
        f = gate.shape[-1]
        if self.gate_up_adapter is not None:
            delta = self.gate_up_adapter.delta()
            gate = (gate.astype(jnp.float32) + delta[..., :f]).astype(gate.dtype)
            up = (up.astype(jnp.float32) + delta[..., f:]).astype(up.dtype)
        if self.down_adapter is not None:
            down = (down.astype(jnp.float32) + self.down_adapter.delta()).astype(down.dtype)
        return gate, up, down


def double(adapter: lora_.Adapter) -> lora_.Adapter:
    """The fused gate_up adapter of a tower's `adapter`: rank and alpha doubled (PEFT's)."""
    return lora_.Adapter(2 * adapter.rank, 2 * adapter.alpha, adapter.dropout)


class ExpertsAdapter(nnx.Module):
    """Every expert's LoRA update of one stacked matrix: lora_a [E, in, r], lora_b [E, r, out]
    (fp32; A at PEFT's init, B zero), the update scale * A_e B_e."""

    def __init__(
        self, experts, n_in, n_out, adapter: lora_.Adapter, axes, *, dtype, rngs: nnx.Rngs
    ):
        """LoRA A [experts, n_in, rank] (PEFT's uniform init) and B [experts, rank, n_out] (zeros)
        per expert of one stacked matrix, drawn from a key folded off the base weights' stream so
        that adding adapters leaves the base's draws as they were."""
        # (folded from the last weight's key, salted by the matrix: the base's draws stay)
        stream = rngs.params
        key = jax.random.fold_in(stream.key[...], stream.count[...] - 1)
        key = jax.random.fold_in(jax.random.fold_in(key, lora_.SALT), n_in * 7919 + n_out)
        bound = 1.0 / math.sqrt(n_in)  # (PEFT's init of A)
        a = jax.random.uniform(key, (experts, n_in, adapter.rank), jnp.float32, -bound, bound)
        self.lora_a = nnx.Param(a, axes=("expert", axes[0], None))
        b = jnp.zeros((experts, adapter.rank, n_out), jnp.float32)
        self.lora_b = nnx.Param(b, axes=("expert", None, axes[1]))
        self.scale = adapter.scale
        self.dtype = dtype

    def delta(self) -> jax.Array:
        """[E, in, out]: scale * A_e B_e in the compute dtype (float32 sums; the backward's
        matmuls then take it too)."""
        a, b = (p[...].astype(self.dtype) for p in (self.lora_a, self.lora_b))
        return self.scale * jnp.einsum("eir,ero->eio", a, b, preferred_element_type=self.dtype)


class MoE(nnx.Module):
    """An MoE layer's MLP: router, stacked experts, optional shared expert (module docstring)."""

    def __init__(
        self,
        width: int,
        spec: MoESpec,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        lora: dict[str, lora_.Adapter] | None = None,
        norm_eps: float = NORM_EPS,
        rngs: nnx.Rngs,
    ):
        """`norm_eps`: the router's norm's (`router_norm`).

        `lora`: adapters of gate, up and down where PEFT puts them on transformers' MoE
        models: on the shared expert's Linears when there is one (Qwen2-MoE, Qwen3.5-MoE:
        gate_proj, up_proj and down_proj match them, the stacked experts are no Linear), else
        on the routed experts' stacked weights (`Experts`; Qwen3-MoE, where PEFT moves those
        targets onto them); the router takes none."""
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # (logits in the compute dtype, as transformers computes them, then float32: a float32
        # output would make the backward's matmul float32 x float32)
        self.router = Dense(width, spec.experts, ("embed", None), **kw)
        # (Gemma 4's router.scale and per_expert_scale: ones until a checkpoint sets them)
        ones = lambda n, axis: nnx.Param(jnp.ones((n,), param_dtype), axes=(axis,))
        self.router_scale = ones(width, "embed") if spec.router_norm else None
        self.expert_scale = ones(spec.experts, None) if spec.expert_scale else None
        self.norm_eps = norm_eps
        self.experts = Experts(
            spec.experts,
            width,
            spec.mlp_dim,
            param_dtype=param_dtype,
            dtype=dtype,
            lora=None if spec.shared_mlp_dim else lora,
            rngs=rngs,
        )
        shared = spec.shared_mlp_dim > 0
        self.shared = (
            GatedMLP(
                width,
                spec.shared_mlp_dim,
                use_bias=False,
                activation=spec.activation,
                lora=lora,
                **kw,
            )
            if shared
            else None
        )
        gate = shared and spec.shared_gate
        self.shared_gate = Dense(width, 1, ("embed", None), **kw) if gate else None
        self.spec = spec
        self.dtype = dtype

    def __call__(self, x_btd: jax.Array, valid_bt: jax.Array | None = None) -> jax.Array:
        """The layer's output [B, T, width] (`routed` without the statistics)."""
        return self.routed(x_btd, valid_bt)[0]

    def routed(
        self,
        x_btd: jax.Array,
        valid_bt: jax.Array | None = None,
        residual: jax.Array | None = None,
    ) -> tuple[jax.Array, RouterStats]:
        """Every token through its top-k experts (and the shared expert), summed.

        Args:
          x_btd: inputs [B, T, width] in the compute dtype.
          valid_bt: the tokens that count (padding: False): they reach no expert and no
            statistic; None: all.
          residual: the layer's residual stream before the MLP's norm, which the router reads
            with `router_norm` (None: x); without it the router reads x.

        Returns:
          (output [B, T, width] in the compute dtype, this layer's `RouterStats`).
        """
        y, shared, stats = self.branches(x_btd, valid_bt, residual)
        return (y if shared is None else y + shared), stats

    def branches(
        self,
        x_btd: jax.Array,
        valid_bt: jax.Array | None = None,
        residual: jax.Array | None = None,
        shared_x: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array | None, RouterStats]:
        """`routed`'s two branches apart: (the routed experts' output, the shared expert's, gated
        where it has a gate; None without one, the statistics), each in the compute dtype.
        `shared_x`: the shared expert's own input (Gemma 4's MLP, normed apart; None: x)."""
        spec = self.spec
        if valid_bt is None:
            valid_bt = jnp.ones(x_btd.shape[:2], bool)
        logits = self.router(self.router_input(x_btd, residual)).astype(jnp.float32)  # [B, T, E]
        probs = jax.nn.softmax(logits, axis=-1)
        top_p, top_e = jax.lax.top_k(probs, spec.top_k)
        if spec.norm_topk_prob:
            top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
        if self.expert_scale is not None:
            top_p = top_p * self.expert_scale[...].astype(jnp.float32)[top_e]
        weights = top_p.astype(x_btd.dtype)
        gate, up, down = self.experts.weights()  # (with their adapters' updates)
        y, moved = dispatch(x_btd, top_e, weights, valid_bt, gate, up, down, spec)
        shared = None
        if self.shared is not None:
            inputs = x_btd if shared_x is None else shared_x
            shared = self.shared(inputs)
            if self.shared_gate is not None:
                shared = jax.nn.sigmoid(self.shared_gate(inputs)) * shared
            shared = shared.astype(self.dtype)
        valid = valid_bt.astype(jnp.float32)
        counts = (
            jnp.zeros((spec.experts,), jnp.float32)
            .at[top_e]
            .add(jnp.broadcast_to(valid[..., None], top_e.shape))
        )
        lse = jax.nn.logsumexp(logits, axis=-1)
        stats = RouterStats(
            counts=counts,
            probs=jnp.sum(probs * valid[..., None], axis=(0, 1)),  # (a sum, not an f32 dot)
            tokens=valid.sum(),
            z=jnp.sum(lse * lse * valid),
            **moved,
        )
        return y.astype(self.dtype), shared, stats

    def router_input(self, x_btd: jax.Array, residual: jax.Array | None) -> jax.Array:
        """What the router's projection reads: the experts' input x, or with `router_norm`
        (Gemma 4's) the residual (x where None) over its root mean square (no weight), times
        the learned scale and width^-0.5 (float32, then the compute dtype)."""
        if self.router_scale is None:
            return x_btd
        x_btd = x_btd if residual is None else residual
        x32 = x_btd.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.norm_eps)
        scale = self.router_scale[...].astype(jnp.float32) * x_btd.shape[-1] ** -0.5
        return (x32 * scale).astype(self.dtype)


# ----------------------------------------------------------------------------- dispatch


def dispatch(x_btd, top_e, weights, valid_bt, gate, up, down, spec: MoESpec):
    """sum_k weights[k] * expert_{top_e[k]}(x) for every valid token ([B, T, width]), and the
    exchange's figures ({dropped, recv_max, recv_mean, sent_remote}).

    Under a mesh (`jax.set_mesh`) with data-parallel axes: one `shard_map` in which each
    device routes its own buckets' tokens, to its own experts or (mesh.expert > 1) by
    all-to-all to the devices holding them. Without one (a single device, `hf check`), inside
    a pipeline stage's manual axes, or for rows that are not whole buckets of the devices
    (generation's prompts): every token of the batch here, XLA placing the work.
    """
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else tuple(a for a in DATA_AXES if a in mesh.axis_names)
    shards = math.prod(mesh.shape[a] for a in axes)
    cast = lambda w: w.astype(x_btd.dtype)
    gate, up, down = cast(gate), cast(up), cast(down)
    # (rows not one bucket a data-parallel device, e.g. generation's prompts under the
    # training mesh: every token here, the experts gathered by XLA)
    if not axes or STAGE_AXIS in mesh.manual_axes or x_btd.shape[0] % shards:
        route = Route(spec, experts_here=spec.experts, ep=1, tensor=False, axes=())
        return route(x_btd, top_e, weights, valid_bt, gate, up, down)
    ep = mesh.shape.get(EXPERT_AXIS, 1)
    tensor = mesh.shape.get("tensor", 1) > 1 and spec.mlp_dim % mesh.shape["tensor"] == 0
    tn = "tensor" if tensor else None
    ex = EXPERT_AXIS if ep > 1 else None
    route = Route(spec, experts_here=spec.experts // ep, ep=ep, tensor=tensor, axes=axes)
    batch = P(axes)
    figures = {k: P() for k in ("dropped", "recv_max", "recv_mean", "sent_remote")}
    # (check_vma off: the grouped matmul's scans start from constants, the same everywhere)
    return jax.shard_map(
        route,
        mesh=mesh,
        in_specs=(batch, batch, batch, batch, P(ex, None, tn), P(ex, None, tn), P(ex, tn, None)),
        out_specs=(batch, figures),
        check_vma=False,
    )(x_btd, top_e, weights, valid_bt, gate, up, down)


@dataclasses.dataclass(frozen=True)
class Route:
    """One device's routing (the body of `dispatch`'s shard_map, or the whole batch)."""

    spec: MoESpec
    experts_here: int  # experts this device holds
    ep: int  # devices the experts are split over
    tensor: bool  # each expert's inner width split over `tensor` (outputs partial)
    axes: tuple[str, ...]  # the data-parallel mesh axes (empty: no mesh)

    def __call__(self, x_btd, top_e, weights, valid_bt, gate, up, down):
        """The routed experts' output [B, T, d] for tokens x_btd and their top_e experts with their
        weights: each token's k assignments run on their experts (here, or exchanged with the
        devices that hold them) and are summed back by weight; also the exchange's figures
        (rows dropped, received, sent to other devices)."""
        b, t, d = x_btd.shape
        k = self.spec.top_k
        x_nd = x_btd.reshape(b * t, d)
        expert_a = jnp.where(valid_bt.reshape(-1, 1), top_e.reshape(-1, k), self.spec.experts)
        expert_a = expert_a.reshape(-1)  # [N x k] assignments, token-major; E: none (padding)
        rows_ad = jnp.repeat(x_nd, k, axis=0)
        if self.ep == 1:
            act, tile = self.spec.activation, self.tile(len(expert_a))
            y_ad = local_experts(rows_ad, expert_a, gate, up, down, tile, act)
            zero = jnp.zeros((), jnp.float32)
            moved = expert_a < self.spec.experts
            received = moved.sum().astype(jnp.float32)
            figures = dict(dropped=zero, recv_max=received, recv_mean=received, sent_remote=zero)
        else:
            y_ad, figures = self.exchanged(rows_ad, expert_a, gate, up, down)
        y_nd = jnp.einsum("nkd,nk->nd", y_ad.reshape(-1, k, d), weights.reshape(-1, k))
        if self.tensor:  # (each tensor rank summed its part of the experts' inner width)
            y_nd = jax.lax.psum(y_nd, "tensor")
        if self.axes:
            figures = self._global(figures)
        return y_nd.reshape(b, t, d), figures

    def tile(self, rows: int) -> int:
        """Rows per tile of the grouped matmul: `spec.tile`, else a power of two that keeps the
        padding (at most one tile per expert) near an eighth of `rows`, in [8, 128]."""
        if self.spec.tile:
            return self.spec.tile
        fair = rows // (8 * self.experts_here)
        return max(MIN_TILE, min(MAX_TILE, 1 << max(fair, 1).bit_length() - 1))

    def _global(self, figures: dict) -> dict:
        """The figures over every device: sums, and the most any device received."""
        out = {k: jax.lax.psum(v, self.axes) for k, v in figures.items() if k != "recv_max"}
        out["recv_mean"] = out["recv_mean"] / jax.lax.psum(1, self.axes)
        out["recv_max"] = jax.lax.pmax(figures["recv_max"], self.axes)
        return out

    def exchanged(self, rows_ad, expert_a, gate, up, down):
        """Assignments to the devices holding their experts and back (mesh.expert > 1)."""
        a, d = rows_ad.shape
        ep, here = self.ep, self.experts_here
        order = jnp.argsort(expert_a, stable=True)
        expert_s = expert_a[order]  # sorted by expert, so grouped by destination
        dest_s = expert_s // here  # ep: none (padding)
        sent = jnp.zeros((ep + 1,), jnp.int32).at[dest_s].add(1)[:ep]  # [ep] rows per device
        start = jnp.cumsum(sent) - sent
        rows_sd = take_rows(rows_ad, order)
        me = jax.lax.axis_index(EXPERT_AXIS)
        exchange = RaggedExchange if self.spec.exchange == "ragged" else DenseExchange
        ex = exchange(self.buffer(a), ep, sent, start, me)
        received, local_e, received_rows = ex.send(rows_sd, expert_s - dest_s * here, here)
        y_rd = local_experts(received, local_e, gate, up, down, self.tile(a), self.spec.activation)
        y_sd = ex.back(y_rd)
        y_ad = untake_rows(y_sd, order)
        figures = dict(
            dropped=ex.dropped(),
            recv_max=received_rows,
            recv_mean=received_rows,
            sent_remote=(sent.sum() - sent[me]).astype(jnp.float32),
        )
        return y_ad, figures

    def buffer(self, assignments: int) -> int:
        """Rows a device may receive: the most its experts can be sent (dropless), else
        capacity_factor x the mean. A token's k assignments go to k distinct experts, so a
        sender sends a device at most min(k, experts there) of each token's: every sender's
        assignments when a device holds k experts or more, fewer when it holds fewer (64
        experts, top-8, over 16 devices: 4 a device, half)."""
        c, k = self.spec.capacity_factor, self.spec.top_k
        worst = self.ep * (assignments // k) * min(k, self.experts_here)
        return worst if c == 0 else min(worst, math.ceil(c * assignments))


class DenseExchange:
    """The all-to-alls as lax.all_to_all of [ep, slots, ...] buffers: `slots` rows from each
    sender to each device (a sender's every assignment, dropless), the unused ones zeros."""

    def __init__(self, buffer: int, ep: int, sent, start, me):
        """The slots of each device's buffer: `sent` rows per device from its `start` in the
        sorted rows, at most ceil(buffer / ep) of them (the rest dropped)."""
        self.ep, self.slots = ep, -(-buffer // ep)
        self.fits = jnp.minimum(sent, self.slots)  # [ep] rows sent to each device
        s = jnp.arange(self.slots)
        ok = s[None, :] < self.fits[:, None]
        self.index = jnp.where(ok, start[:, None] + s[None, :], -1)  # the sorted row of a slot
        self.sent = sent

    def send(self, rows_sd, local_s, here: int):
        """(received rows [ep x slots, d], their local experts (`here`: none), how many)."""
        a, d = rows_sd.shape
        self.rows = a
        idx = jnp.where(self.index >= 0, self.index, a)  # (past the rows: zeros, no gradient)
        buf = jnp.take(rows_sd, idx, axis=0, mode="fill", fill_value=0)  # [ep, slots, d]
        ids = jnp.take(local_s, idx, axis=0, mode="fill", fill_value=here)
        got = jax.lax.all_to_all(buf, EXPERT_AXIS, 0, 0, tiled=True)
        got_ids = jax.lax.all_to_all(ids, EXPERT_AXIS, 0, 0, tiled=True)
        received = (got_ids < here).sum().astype(jnp.float32)
        return got.reshape(-1, d), got_ids.reshape(-1), received

    def back(self, y_rd):
        """The results, back to their senders in the sorted order (dropped rows 0)."""
        d = y_rd.shape[-1]
        back = jax.lax.all_to_all(
            y_rd.reshape(self.ep, self.slots, d), EXPERT_AXIS, 0, 0, tiled=True
        )
        slot_of = jnp.full((self.rows,), self.ep * self.slots, jnp.int32)  # sorted row's slot
        idx = jnp.where(self.index >= 0, self.index, self.rows).reshape(-1)
        slot_of = slot_of.at[idx].set(jnp.arange(idx.size, dtype=jnp.int32), mode="drop")
        return jnp.take(back.reshape(-1, d), slot_of, axis=0, mode="fill", fill_value=0)

    def dropped(self):
        """Rows this device could not send, past the slots (0 dropless)."""
        return jnp.sum(self.sent - self.fits).astype(jnp.float32)


class RaggedExchange:
    """The all-to-alls as lax.ragged_all_to_all: only the routed rows move (backends that
    implement it: GPU; XLA:CPU does not). A receiver holds its senders' rows one after another
    in sender order in a buffer of `buffer` rows; with a capacity, each device's rows are
    taken in sender order until it is full (every sender knows every count: a tiny
    all-gather), the rest dropped."""

    def __init__(self, buffer: int, ep: int, sent, start, me):
        """Where each sender's rows land in each receiver's buffer: all devices' counts gathered,
        each receiver filled in sender order up to `buffer` rows."""
        self.buffer, self.ep, self.me = buffer, ep, me
        counts = jax.lax.all_gather(sent, EXPERT_AXIS)  # [ep senders, ep receivers]
        before = jnp.cumsum(counts, axis=0) - counts  # rows of earlier senders, per receiver
        self.fits = jnp.clip(buffer - before, 0, counts).astype(jnp.int32)  # [sender, receiver]
        self.at = (jnp.cumsum(self.fits, axis=0) - self.fits).astype(jnp.int32)
        self.start_of = (jnp.cumsum(counts, axis=1) - counts).astype(jnp.int32)  # sender's own
        self.sent = sent

    def _a2a(self, operand, output, in_off, sizes, out_off, recv):
        """One ragged all-to-all over the expert axis (offsets and sizes per device)."""
        return jax.lax.ragged_all_to_all(
            operand, output, in_off, sizes, out_off, recv, axis_name=EXPERT_AXIS
        )

    def send(self, rows_sd, local_s, here: int):
        """Sends each device the rows routed to its experts (`rows_sd`, and each row's expert there,
        `local_s`); returns the rows received, their experts (`here`: padding) and their count."""
        me, fits, at = self.me, self.fits, self.at
        a, d = rows_sd.shape
        self.rows = a
        args = (self.start_of[me], fits[me], at[me], fits[:, me])
        got = self._a2a(rows_sd, jnp.zeros((self.buffer, d), rows_sd.dtype), *args)
        ids = self._a2a(
            local_s.astype(jnp.int32)[:, None],
            jnp.full((self.buffer, 1), here, jnp.int32),
            *args,
        )
        return got, ids[:, 0], fits[:, me].sum().astype(jnp.float32)

    def back(self, y_rd):
        """The experts' outputs for the received rows, returned to their senders as sent."""
        me, fits, at = self.me, self.fits, self.at
        d = y_rd.shape[-1]
        out = jnp.zeros((self.rows, d), y_rd.dtype)
        return self._a2a(y_rd, out, at[:, me], fits[:, me], self.start_of[:, me], fits[me])

    def dropped(self):
        """Rows of this device's that found no room in their receivers' buffers."""
        return jnp.sum(self.sent - self.fits[self.me]).astype(jnp.float32)
