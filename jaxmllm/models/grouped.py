"""The grouped matmul of a mixture of experts: each row through its expert's gated MLP, computing
only the active experts (`jaxmllm.models.moe` routes to it).

The rows are laid out by expert with each expert's group padded to whole tiles (`Layout`), so
every tile belongs to one expert: a scan over the tiles, a chunk of them a step, multiplies each
tile by its expert's weights. The work is the rows' plus at most one tile of padding an expert
(less than a tile: `tile - 1` rows), whatever the experts' loads; tiles past the last group are
skipped at run time. Rows go into the layout and back by gathers both ways (`gather_rows`), so
neither pass scatters: a scatter-add into the rows' buffer (each tile's rows summed over the
groups that share it, as a tile shared by groups needs) was serialised by atomics on a GPU and
held in float32 by XLA:CPU, four such buffers of the worst case's rows in a dropless step.
`jax.lax.ragged_dot` computes the same, but XLA lowers it on CPU and on NVIDIA GPUs (jaxlib
0.10-0.11) to a dense matmul against every expert, masked: E times the work and an
[rows, E x width] intermediate; the tiles here are batched matmuls every backend runs at its
matmul speed. The backward pass is written out (`jax.custom_vjp`): it keeps the gate and up
activations, never a gathered copy of the experts' weights.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmllm.models.layers import ACTIVATIONS

CHUNK_ROWS = 1024  # rows a scan step of the grouped matmul computes (tiles x tile)
_UNROLLED = contextvars.ContextVar("grouped_unrolled", default=False)


@contextlib.contextmanager
def unrolled() -> Iterator[None]:
    """Grouped matmuls traced inside this block unroll their scans: XLA's cost analysis
    counts a loop's body once, so `bench.moe` counts every tile this way (a larger program,
    the same computation)."""
    token = _UNROLLED.set(True)
    try:
        yield
    finally:
        _UNROLLED.reset(token)


# ----------------------------------------------------------------------------- permutations


@jax.custom_vjp
def take_rows(x_rd: jax.Array, order_r: jax.Array) -> jax.Array:
    """`x[order]` for a permutation `order`: its backward gathers by the inverse permutation
    (a gather, where `x[order]`'s own backward is a scatter-add XLA cannot know collides
    nowhere)."""
    return x_rd[order_r]


def _take_fwd(x_rd, order_r):
    return x_rd[order_r], order_r


def _take_bwd(order_r, g_rd):
    return untake_rows(g_rd, order_r), None


take_rows.defvjp(_take_fwd, _take_bwd)


@jax.custom_vjp
def untake_rows(y_rd: jax.Array, order_r: jax.Array) -> jax.Array:
    """The inverse of `take_rows`: `out[order] = y`."""
    return y_rd[_inverse(order_r)]


def _untake_fwd(y_rd, order_r):
    return untake_rows(y_rd, order_r), order_r


def _untake_bwd(order_r, g_rd):
    return g_rd[order_r], None


untake_rows.defvjp(_untake_fwd, _untake_bwd)


def _inverse(order_r: jax.Array) -> jax.Array:
    n = order_r.shape[0]
    return jnp.zeros((n,), order_r.dtype).at[order_r].set(jnp.arange(n, dtype=order_r.dtype))


@jax.custom_vjp
def gather_rows(x_rd: jax.Array, src_s: jax.Array, dst_r: jax.Array) -> jax.Array:
    """`out[s] = x[src[s]]` (0 where `src[s]` is past x's rows), for a one-to-one `src` whose
    inverse is `dst` (`dst[r]`: the row of the output x's row r went to; past the output's rows
    where it went nowhere). The backward is the gather by `dst`, no scatter."""
    return jnp.take(x_rd, src_s, axis=0, mode="fill", fill_value=0)


def _gather_fwd(x_rd, src_s, dst_r):
    return gather_rows(x_rd, src_s, dst_r), (src_s, dst_r)


def _gather_bwd(res, g_sd):
    src_s, dst_r = res
    return gather_rows(g_sd, dst_r, src_s), None, None


gather_rows.defvjp(_gather_fwd, _gather_bwd)


# ----------------------------------------------------------------------------- the layout


@dataclasses.dataclass(frozen=True)
class Layout:
    """Rows laid out by expert, each expert's group padded to whole tiles.

    `slot[r]`: where row r goes (past the layout's end for a row of no expert); `row[s]`: the
    row in slot s (past the rows for padding); `expert[t]`: tile t's expert; `used`: the
    tiles the groups take (those after are empty)."""

    slot: jax.Array  # [rows]
    row: jax.Array  # [tiles x tile]
    expert: jax.Array  # [tiles]
    used: jax.Array  # []
    tile: int

    @classmethod
    def of(cls, expert_r: jax.Array, experts: int, tile: int, chunk: int) -> Layout:
        """The layout of rows whose experts are `expert_r` (in [0, experts); `experts`: none),
        with room for any loads: the rows plus `experts - 1` tiles, in whole chunks of tiles."""
        rows = expert_r.shape[0]
        tiles = -(-rows // tile) + experts - 1
        tiles += -tiles % chunk
        sizes = jnp.zeros((experts + 1,), jnp.int32).at[expert_r].add(1)[:experts]
        spans = -(-sizes // tile)  # tiles per expert
        tile_end = jnp.cumsum(spans)
        first_slot = (tile_end - spans) * tile  # an expert's first slot
        order = jnp.argsort(expert_r, stable=True)
        expert_s = expert_r[order]
        group_start = jnp.cumsum(sizes) - sizes
        e = jnp.minimum(expert_s, experts - 1)
        rank = jnp.arange(rows) - group_start[e]
        slots = tiles * tile
        slot_s = jnp.where(expert_s < experts, first_slot[e] + rank, slots)
        slot = jnp.zeros((rows,), jnp.int32).at[order].set(slot_s.astype(jnp.int32))
        row = jnp.full((slots,), rows, jnp.int32)
        row = row.at[slot].set(jnp.arange(rows, dtype=jnp.int32), mode="drop")
        expert = jnp.searchsorted(tile_end, jnp.arange(tiles), side="right")
        expert = jnp.minimum(expert, experts - 1).astype(jnp.int32)
        return cls(slot, row, expert, tile_end[-1], tile)


def local_experts(rows_rd, expert_r, gate, up, down, tile: int, activation: str = "silu"):
    """Each row through its expert of this device's (`expert_r` in [0, E_here); E_here: none,
    output 0): into the layout, the grouped matmul, back in the rows' order."""
    chunk = max(1, CHUNK_ROWS // tile)
    layout = Layout.of(expert_r, gate.shape[0], tile, chunk)
    x_sd = gather_rows(rows_rd, layout.row, layout.slot)
    y_sd = grouped_mlp(x_sd, layout, gate, up, down, chunk, activation)
    return gather_rows(y_sd, layout.slot, layout.row)


def grouped_mlp(
    x_sd, layout: Layout, gate_edf, up_edf, down_efd, chunk: int, activation: str = "silu"
):
    """`down_e(act(x gate_e) * (x up_e))` for each tile of the layout's rows with its expert
    e's weights (tiles past `layout.used` give 0; `activation`: the gate's, a name of
    `layers.ACTIVATIONS`: silu, Gemma 4's gelu_tanh); matmuls in x's dtype with float32
    accumulation."""
    tables = (layout.expert.reshape(-1, chunk), jnp.arange(layout.expert.shape[0]) < layout.used)
    tables = (tables[0], tables[1].reshape(-1, chunk))
    return _grouped(x_sd, gate_edf, up_edf, down_efd, tables, layout.tile, activation)


def _gate_and_slope(activation: str, g32):
    """(act(g), act'(g)) of the gate's float32 pre-activations, for the written-out backward:
    SiLU's slope written out, another's by a forward-mode derivative (elementwise: one jvp
    with ones gives every element's)."""
    if activation == "silu":
        sig = jax.nn.sigmoid(g32)
        return g32 * sig, sig * (1.0 + g32 * (1.0 - sig))
    return jax.jvp(ACTIVATIONS[activation], (g32,), (jnp.ones_like(g32),))


def _mm(spec: str, a, b, dtype):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(dtype)


def _chunks(x_sd, tile: int, chunk: int):
    """[slots, d] as [steps, chunk tiles, tile, d] (the scan's steps)."""
    return x_sd.reshape(-1, chunk, tile, x_sd.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _grouped(x_sd, gate, up, down, tables, tile: int, activation: str):
    return _grouped_fwd(x_sd, gate, up, down, tables, tile, activation)[0]


def _grouped_fwd(x_sd, gate, up, down, tables, tile: int, activation: str):
    s, d = x_sd.shape
    dtype = x_sd.dtype
    f = gate.shape[-1]
    chunk = tables[0].shape[1]

    def step(_, xs):
        xt, e, live = xs  # [c, tile, d], [c], [c]

        def run():
            g, u = _mm("cmd,cdf->cmf", xt, gate[e], dtype), _mm("cmd,cdf->cmf", xt, up[e], dtype)
            act = ACTIVATIONS[activation](g.astype(jnp.float32))
            h = (act * u.astype(jnp.float32)).astype(dtype)
            return _mm("cmf,cfd->cmd", h, down[e], dtype), g, u

        empty = lambda: (
            jnp.zeros((chunk, tile, d), dtype),
            jnp.zeros((chunk, tile, f), dtype),
            jnp.zeros((chunk, tile, f), dtype),
        )
        return None, jax.lax.cond(jnp.any(live), run, empty)

    xs = (_chunks(x_sd, tile, chunk), *tables)
    _, (y, g, u) = jax.lax.scan(step, None, xs, unroll=_UNROLLED.get())
    # (named as the MLP's input projections are: remat policies keep them or recompute them)
    g, u = checkpoint_name(g, "mlp_in"), checkpoint_name(u, "mlp_in")
    return y.reshape(s, d), (x_sd, gate, up, down, tables, g, u)


def _grouped_bwd(tile: int, activation: str, res, dy_sd):
    x_sd, gate, up, down, tables, g_all, u_all = res
    s, d = x_sd.shape
    dtype = x_sd.dtype
    chunk = tables[0].shape[1]

    def step(acc, xs):
        xt, dy, e, live, g, u = xs

        def run(acc):
            d_gate, d_up, d_down = acc
            g32, u32 = g.astype(jnp.float32), u.astype(jnp.float32)
            act, slope = _gate_and_slope(activation, g32)
            h = (act * u32).astype(dtype)
            f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
            d_down = d_down.at[e].add(f32("cmf,cmd->cfd", h, dy))
            dh = f32("cmd,cfd->cmf", dy, down[e])
            dg = (dh * u32 * slope).astype(dtype)
            du = (dh * act).astype(dtype)
            d_gate = d_gate.at[e].add(f32("cmd,cmf->cdf", xt, dg))
            d_up = d_up.at[e].add(f32("cmd,cmf->cdf", xt, du))
            dx = f32("cmf,cdf->cmd", dg, gate[e]) + f32("cmf,cdf->cmd", du, up[e])
            return (d_gate, d_up, d_down), dx.astype(dtype)

        skip = lambda acc: (acc, jnp.zeros((chunk, tile, d), dtype))
        return jax.lax.cond(jnp.any(live), run, skip, acc)

    zeros = tuple(jnp.zeros(w.shape, jnp.float32) for w in (gate, up, down))
    dy = _chunks(dy_sd.astype(dtype), tile, chunk)
    xs = (_chunks(x_sd, tile, chunk), dy, *tables, g_all, u_all)
    (d_gate, d_up, d_down), dx = jax.lax.scan(step, zeros, xs, unroll=_UNROLLED.get())
    grads = (d_gate.astype(gate.dtype), d_up.astype(up.dtype), d_down.astype(down.dtype))
    return (dx.reshape(s, d), *grads, None)


_grouped.defvjp(_grouped_fwd, _grouped_bwd)
