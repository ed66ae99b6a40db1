"""The grouped matmul of a mixture of experts: rows sorted by expert, each expert's group
through its own gated MLP, computing only the active experts (`jaxmllm.models.moe` routes to it).

The rows (a multiple of `tile`) are cut into tiles, and every (tile, expert) pair whose group
touches the tile is visited once, a chunk of visits per step of a scan: at most tiles + E - 1
visits, so the work is the rows' plus at most E - 1 tiles of padding whatever the experts'
loads. Visits past the last group are skipped at run time. `jax.lax.ragged_dot` computes the
same, but XLA lowers it on CPU and on NVIDIA GPUs (jaxlib 0.10-0.11) to a dense matmul against
every expert, masked: E times the work and an [rows, E x width] intermediate; the tiles here are
batched matmuls every backend runs at its matmul speed. The backward pass is written out
(`jax.custom_vjp`): it keeps the gate and up activations and the visit tables, never a gathered
copy of the experts' weights. Permutations (`take_rows`) are gathered both ways.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

CHUNK_ROWS = 1024  # rows a scan step of the grouped matmul computes (visits x tile)
_UNROLLED = contextvars.ContextVar("grouped_unrolled", default=False)


@contextlib.contextmanager
def unrolled() -> Iterator[None]:
    """Grouped matmuls traced inside this block unroll their scans: XLA's cost analysis
    counts a loop's body once, so `bench.moe` counts every visit this way (a larger program,
    the same computation)."""
    token = _UNROLLED.set(True)
    try:
        yield
    finally:
        _UNROLLED.reset(token)


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


def local_experts(rows_rd, expert_r, gate, up, down, tile: int):
    """Each row through its expert of this device's (`expert_r` in [0, E_here); E_here: none,
    output 0): rows sorted by expert, the grouped matmul, back in their order."""
    r = rows_rd.shape[0]
    here = gate.shape[0]
    order = jnp.argsort(expert_r, stable=True)
    sizes = jnp.zeros((here + 1,), jnp.int32).at[expert_r].add(1)[:here]
    pad = -r % tile
    sorted_rd = jnp.pad(take_rows(rows_rd, order), ((0, pad), (0, 0)))
    y_rd = grouped_mlp(sorted_rd, sizes, gate, up, down, tile)[:r]
    return untake_rows(y_rd, order)


def grouped_mlp(x_rd, sizes_e, gate_edf, up_edf, down_efd, tile: int):
    """`down_e(silu(x gate_e) * (x up_e))` for the rows of each expert e's group: rows sorted by
    expert, group e the `sizes_e[e]` rows after the groups before it; rows past the last group
    give 0. The rows (a multiple of `tile`) are visited tile by tile per expert (module
    docstring); matmuls in x's dtype with float32 accumulation."""
    r = x_rd.shape[0]
    if r % tile:
        raise ValueError(f"{r} rows are not a whole number of tiles of {tile}")
    chunk = max(1, CHUNK_ROWS // tile)
    tables = visits(sizes_e, r // tile, tile, chunk)
    return _grouped(x_rd, gate_edf, up_edf, down_efd, tables, tile)


def visits(sizes_e, tiles: int, tile: int, chunk: int) -> tuple[jax.Array, ...]:
    """The (tile, expert, first row, end row) of every visit, in chunks [n, chunk]: each
    expert's group visits the tiles it touches, rows [lo, hi) of the tile its own; visits past
    the last group are empty (lo = hi = 0)."""
    experts = sizes_e.shape[0]
    count = tiles + experts - 1
    count += -count % chunk
    ends = jnp.cumsum(sizes_e)
    starts = ends - sizes_e
    first = starts // tile
    spans = jnp.where(sizes_e > 0, (ends - 1) // tile - first + 1, 0)
    v_end = jnp.cumsum(spans)
    v = jnp.arange(count)
    e = jnp.searchsorted(v_end, v, side="right")
    active = e < experts
    e = jnp.minimum(e, experts - 1)
    t = first[e] + v - (v_end[e] - spans[e])
    lo = jnp.clip(starts[e] - t * tile, 0, tile)
    hi = jnp.clip(ends[e] - t * tile, 0, tile)
    t, lo, hi = (jnp.where(active, x, 0) for x in (t, lo, hi))
    return tuple(x.astype(jnp.int32).reshape(-1, chunk) for x in (t, e, lo, hi))


def _mask(lo, hi, tile: int) -> jax.Array:
    rows = jnp.arange(tile)
    return (rows[None, :] >= lo[:, None]) & (rows[None, :] < hi[:, None])  # [c, tile]


def _mm(spec: str, a, b, dtype):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _grouped(x_rd, gate, up, down, tables, tile: int):
    return _grouped_fwd(x_rd, gate, up, down, tables, tile)[0]


def _grouped_fwd(x_rd, gate, up, down, tables, tile: int):
    r, d = x_rd.shape
    dtype = x_rd.dtype
    x_tmd = x_rd.reshape(r // tile, tile, d)
    f = gate.shape[-1]

    def step(_, tab):
        t, e, lo, hi = tab

        def run():
            xt = x_tmd[t]  # [c, tile, d]
            g, u = _mm("cmd,cdf->cmf", xt, gate[e], dtype), _mm("cmd,cdf->cmf", xt, up[e], dtype)
            h = _hidden(g, u, _mask(lo, hi, tile), dtype)
            return _mm("cmf,cfd->cmd", h, down[e], dtype), g, u

        c = t.shape[0]
        empty = lambda: (
            jnp.zeros((c, tile, d), dtype),
            jnp.zeros((c, tile, f), dtype),
            jnp.zeros((c, tile, f), dtype),
        )
        return None, jax.lax.cond(jnp.any(hi > lo), run, empty)

    _, (y, g, u) = jax.lax.scan(step, None, tables, unroll=_UNROLLED.get())
    # (named as the MLP's input projections are: remat policies keep them or recompute them)
    g, u = checkpoint_name(g, "mlp_in"), checkpoint_name(u, "mlp_in")
    out = jnp.zeros_like(x_tmd).at[tables[0].reshape(-1)].add(y.reshape(-1, tile, d))
    return out.reshape(r, d), (x_rd, gate, up, down, tables, g, u)


def _hidden(g, u, mask, dtype):
    """silu(g) * u on the rows of the visit's expert (float32, then the compute dtype)."""
    h = jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)
    return jnp.where(mask[..., None], h, 0.0).astype(dtype)


def _grouped_bwd(tile: int, res, dy_rd):
    x_rd, gate, up, down, tables, g_all, u_all = res
    r, d = x_rd.shape
    dtype = x_rd.dtype
    x_tmd = x_rd.reshape(r // tile, tile, d)
    dy_tmd = dy_rd.astype(dtype).reshape(r // tile, tile, d)

    def step(acc, xs):
        (t, e, lo, hi), g, u = xs

        def run(acc):
            d_gate, d_up, d_down = acc
            xt, dy = x_tmd[t], dy_tmd[t]
            mask = _mask(lo, hi, tile)[..., None]
            g32, u32 = g.astype(jnp.float32), u.astype(jnp.float32)
            sig = jax.nn.sigmoid(g32)
            silu = g32 * sig
            h = jnp.where(mask, silu * u32, 0.0).astype(dtype)
            d_down = d_down.at[e].add(
                jnp.einsum("cmf,cmd->cfd", h, dy, preferred_element_type=jnp.float32)
            )
            dh = jnp.einsum("cmd,cfd->cmf", dy, down[e], preferred_element_type=jnp.float32)
            dh = jnp.where(mask, dh, 0.0)
            dg = (dh * u32 * sig * (1.0 + g32 * (1.0 - sig))).astype(dtype)
            du = (dh * silu).astype(dtype)
            f32 = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
            d_gate = d_gate.at[e].add(f32("cmd,cmf->cdf", xt, dg))
            d_up = d_up.at[e].add(f32("cmd,cmf->cdf", xt, du))
            dx = f32("cmf,cdf->cmd", dg, gate[e]) + f32("cmf,cdf->cmd", du, up[e])
            return (d_gate, d_up, d_down), dx.astype(dtype)

        skip = lambda acc: (acc, jnp.zeros((t.shape[0], tile, d), dtype))
        return jax.lax.cond(jnp.any(hi > lo), run, skip, acc)

    zeros = tuple(jnp.zeros(w.shape, jnp.float32) for w in (gate, up, down))
    (d_gate, d_up, d_down), dx = jax.lax.scan(
        step, zeros, (tables, g_all, u_all), unroll=_UNROLLED.get()
    )
    dx_tmd = jnp.zeros_like(x_tmd).at[tables[0].reshape(-1)].add(dx.reshape(-1, tile, d))
    grads = (d_gate.astype(gate.dtype), d_up.astype(up.dtype), d_down.astype(down.dtype))
    return (dx_tmd.reshape(r, d), *grads, None)


_grouped.defvjp(_grouped_fwd, _grouped_bwd)
