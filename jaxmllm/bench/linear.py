"""A linear-attention layer's training step against a full-attention layer's, by row length.

    python -m jaxmllm.bench.linear [--rows 4096,16384,65536] [--width 1024] [--full-max 16384]
        [--dtype float32] [--json OUT]

One row of T tokens holding one document (the long-context case, where attention's cost is all
quadratic), through one token mixer of a Qwen3.5-shaped hybrid: forward and backward (the
gradients of a weighted sum of its outputs with respect to its input and its parameters), after
compiling. The mixers, at the same width:

- `linear`: Gated DeltaNet (`jaxmllm.models.deltanet`): its projections, convolution and the
  chunked delta rule (chunks of 64, the state carried by a scan), its memory linear in T;
- `full`: Qwen3.5's full attention (QK-norm, the output gate, partial rotary) by block-sparse
  attention over the document's causal tiles (`jaxmllm.models.blocksparse`, flash-style),
  quadratic in T; above `--full-max` tokens it is compiled (for its memory) but not run, its
  time extrapolated from the longest measured row as T^2 (`full_measured: false`).

Per row length and mixer: seconds of the step (median), tokens/s, microseconds per token, and
the compiled step's memory (XLA's memory analysis: arguments, outputs and temporaries) in all
and per token. The linear layer's time per token stays flat in T and its memory grows linearly;
the full layer's time per token grows with T.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmllm.bench.attention import _peak_bytes, median_time
from jaxmllm.models.attention import Attention, packing
from jaxmllm.models.deltanet import GatedDeltaNet, LinearSpec
from jaxmllm.plan import tiles as T

BLOCK = 128  # block-sparse attention's tile side


def mixer(kind: str, args, rngs: nnx.Rngs) -> nnx.Module:
    """The token mixer `kind` (linear | full) of a Qwen3.5-shaped layer of `args.width`."""
    dtype = jnp.dtype(args.dtype)
    if kind == "linear":
        spec = LinearSpec(args.key_heads, args.value_heads, args.head_dim, args.head_dim)
        return GatedDeltaNet(args.width, spec, dtype=dtype, rngs=rngs)
    return Attention(
        args.width,
        args.heads,
        args.kv_heads,
        head_dim=args.head_dim,
        qk_norm=True,
        norm_offset=True,
        rotary_dim=args.head_dim // 4,
        gate=True,
        dtype=dtype,
        rngs=rngs,
    )


def step_fn(module: nnx.Module):
    """(jitted forward + backward of a weighted sum of the mixer's outputs, its params)."""
    graphdef, params = nnx.split(module)

    def loss(params, x, w, pack, positions):
        """The scalar whose gradient is the layer's backward: its output weighted by the
        cotangent `w`, in fp32."""
        out = nnx.merge(graphdef, params)(x, pack, positions)
        return jnp.sum(out.astype(jnp.float32) * w)

    return jax.jit(jax.grad(loss, argnums=(0, 1))), params


def inputs(row_len: int, args) -> tuple:
    """A row of one document: inputs, output weights, its packing (block-sparse tiles) and
    positions."""
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (1, row_len, args.width), dtype)
    w = jax.random.normal(keys[1], (1, row_len, args.width), jnp.float32)
    seg = jnp.ones((1, row_len), jnp.int32)
    tl = T.tile_list(
        np.zeros(1, np.int64),
        np.array([row_len]),
        np.zeros(1, np.int64),
        row_len // BLOCK,
        BLOCK,
        True,
    )
    tiles = jnp.asarray(tl, jnp.int32)[None]
    pack = packing(seg, causal=True, kind="block_sparse", tiles_bk2=tiles, block=BLOCK)
    return x, w, pack, jnp.arange(row_len)[None]


def measure(row_len: int, kind: str, args) -> dict:
    """One mixer's step on one row: time (unless past --full-max), memory."""
    module = mixer(kind, args, nnx.Rngs(0))
    grad, params = step_fn(module)
    x, w, pack, positions = inputs(row_len, args)
    call = (params, x, w, pack, positions)
    compiled = grad.lower(*call).compile()
    runs = kind == "linear" or row_len <= args.full_max
    seconds = median_time(compiled, call, args.repeat) if runs else None
    peak = _peak_bytes(compiled)
    return {
        "mixer": kind,
        "row_len": row_len,
        "measured": runs,
        "seconds": seconds,
        "bytes": peak,
        "bytes_per_token": None if peak is None else peak / row_len,
    }


def extrapolate(rows: list[dict]) -> None:
    """A full layer's unmeasured rows from its longest measured one, as T^2; then rates."""
    measured = [r for r in rows if r["mixer"] == "full" and r["measured"]]
    for r in rows:
        if r["seconds"] is None and measured:
            ref = max(measured, key=lambda m: m["row_len"])
            r["seconds"] = ref["seconds"] * (r["row_len"] / ref["row_len"]) ** 2
        if r["seconds"] is not None:
            r["tokens_per_s"] = r["row_len"] / r["seconds"]
            r["us_per_token"] = 1e6 * r["seconds"] / r["row_len"]


def table(rows: list[dict]) -> str:
    """The markdown table of the hybrid decoder's two layer kinds by row length: step seconds
    (full attention's extrapolated as T^2 past --full-max), tokens/s, microseconds and KiB a
    token, memory."""
    cols = ["mixer", "row", "step s", "tokens/s", "us/token", "MiB", "KiB/token"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        est = "" if r["measured"] else " (T^2 est.)"
        mem = r["bytes"] or 0
        lines.append(
            " | ".join(
                [
                    r["mixer"],
                    str(r["row_len"]),
                    f"{r['seconds']:.4g}{est}" if r.get("seconds") else "-",
                    f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-",
                    f"{r['us_per_token']:.1f}" if r.get("us_per_token") else "-",
                    f"{mem / 2**20:.0f}",
                    f"{mem / r['row_len'] / 2**10:.1f}",
                ]
            )
        )
    return "\n".join(lines)


def flatness(rows: list[dict]) -> float:
    """The linear layer's longest row's time per token over its shortest's."""
    linear = sorted((r for r in rows if r["mixer"] == "linear"), key=lambda r: r["row_len"])
    return linear[-1]["us_per_token"] / linear[0]["us_per_token"]


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m jaxmllm.bench.linear`: row lengths, layer widths and head
    counts of both layer kinds, how long full attention runs, repeats, dtype."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="4096,16384,65536", help="row lengths, comma-separated")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8, help="full attention's query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="full attention's key/value heads")
    p.add_argument("--key-heads", type=int, default=4, help="linear attention's key heads")
    p.add_argument("--value-heads", type=int, default=8, help="linear attention's value heads")
    p.add_argument("--head-dim", type=int, default=128, help="every head's width")
    p.add_argument(
        "--full-max", type=int, default=16384, help="longest row full attention is run at"
    )
    p.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (median)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", help="write the rows here")
    return p


def main(argv: list[str] | None = None) -> None:
    """`python -m jaxmllm.bench.linear`: times a Gated DeltaNet (linear attention) layer and a
    full-attention layer forward and backward at each row length, and prints the table (--json:
    the rows written there)."""
    args = parser().parse_args(argv)
    lengths = [int(x) for x in args.rows.split(",")]
    for n in lengths:
        if n % BLOCK:
            parser().error(f"--rows: {n} is not a multiple of {BLOCK}")
    rows = []
    for kind in ("linear", "full"):
        for n in lengths:
            rows.append(measure(n, kind, args))
            print(f"{kind} {n}: done", flush=True)
    extrapolate(rows)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}, width {args.width}; linear: "
        f"{args.key_heads} key / {args.value_heads} value heads of {args.head_dim}, chunks of "
        f"64; full: {args.heads} / {args.kv_heads} heads of {args.head_dim}, block-sparse "
        f"{BLOCK}; {args.dtype}, forward + backward of one row of one document"
    )
    print(table(rows))
    print(f"linear: time per token at {lengths[-1]} over {lengths[0]}: {flatness(rows):.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
