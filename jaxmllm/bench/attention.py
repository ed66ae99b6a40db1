"""Dense vs block-sparse attention on one packed row: time, memory and tiles.

    python -m jaxmllm.bench.attention [--rows 2048,8192,32768] [--mix chartqa | --lengths FILE]
        [--block 128] [--window W] [--json OUT]

A row of `row_len` tokens is packed with documents drawn from a length table (a built-in mix, or
a lengths file or index folder of your own data: `--lengths`; the LLM tokens of each sample:
text plus merged image tokens, a sample longer than the row skipped), in the table's order,
until the next one does not fit; the rest is padding. Attention over it (one
row, grouped-query heads, fp32) runs forward and backward (the gradient of a weighted sum of
the outputs with respect to q, k and v) with the dense masked reference and with block-sparse
attention over the row's tile list (`jaxmllm.plan.tiles`). Reported per row length:

- `dense_s`, `sparse_s`: median seconds of forward + backward after compiling;
  above `--dense-max` tokens dense is compiled (for its memory) but not run, and its time is
  extrapolated from the longest measured row as T^2 (`dense_measured: false`);
- `dense_bytes`, `sparse_bytes`: peak memory of the compiled program from XLA's memory
  analysis (arguments + outputs + temporaries);
- on a GPU also `cudnn_s`, `cudnn_bytes`: cuDNN's fused attention over the same documents
  (`model.attention: cudnn`, bf16 operands), and `cudnn_err`: its output's relative error
  (L2 over the real positions) against block-sparse at `--dtype`;
- `tiles`: tiles computed (the row's tile list); `doc_tiles`: the documents' own tiles, each
  document alone from a block boundary (its causal triangle over ceil(n / block) blocks), the
  least any schedule of these documents computes; `tiles / doc_tiles` is the packing overhead;
- with `--window W` (a sliding-window layer, Gemma's local ones; llm only): `window_tiles`, the
  tiles some window of W tokens reaches (the windowed layers' own list), `window_s` block-sparse
  over that list and `masked_s` over the row's causal list masked to the window (what a
  windowed layer computes without skipping), `window_err` the first's relative error against
  the second (L2 over the real positions).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmllm.bench.mixes import lengths_of, load_mix
from jaxmllm.bench.table import cell, markdown, ratio
from jaxmllm.config.checks import UserError
from jaxmllm.models import blocksparse, cudnn
from jaxmllm.models.attention import attention_mask, dense_attention
from jaxmllm.plan import tiles as T


def documents(
    mix: str,
    row_len: int,
    kind: str = "llm",
    merge_area: int = 4,
    subsample: int = 4,
    lengths: str | None = None,
) -> np.ndarray:
    """Lengths of the documents packed into one row of `row_len` tokens (see the module doc):
    the samples' LLM tokens, or (`kind` vision) their images' patches; of the mix, or of the
    lengths file or index folder `lengths` where given."""
    index = lengths_of(lengths) if lengths else load_mix(mix)
    if kind == "vision":
        lengths = index.items["vision"].sizes
    else:
        lengths = index.llm_tokens({"vision": merge_area, "audio": subsample})
    out, used = [], 0
    for n in lengths:
        if n < 1 or n > row_len:
            continue
        if used + n > row_len:
            break
        out.append(int(n))
        used += int(n)
    return np.array(out, np.int64)


def segments(sizes: np.ndarray, row_len: int) -> np.ndarray:
    """A row's segment ids: documents of these sizes packed from its start (ids 1, 2, ...),
    padding (0) after."""
    seg = np.zeros(row_len, np.int32)
    seg[: sizes.sum()] = np.repeat(np.arange(1, len(sizes) + 1), sizes)
    return seg


def _inputs(row_len: int, heads: int, kv_heads: int, head_dim: int, dtype, seed: int = 0):
    """Random q, k, v [1, row_len, heads, head_dim] (k and v at kv_heads) and a random cotangent
    `w` like q, in `dtype`, from `seed`."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (1, row_len, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (1, row_len, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (1, row_len, kv_heads, head_dim), dtype)
    w = jax.random.normal(keys[3], (1, row_len, heads, head_dim), dtype)
    return q, k, v, w


def _grad_fn(attend):
    """The jitted gradient of `attend` with respect to q, k and v, through the scalar
    sum(attend(...) * w): a training step's backward of one attention."""

    def loss(q, k, v, w, *rest):
        """The scalar whose gradient is attention's backward: the output weighted by the
        cotangent `w`."""
        return jnp.sum(attend(q, k, v, *rest) * w)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _rel_err(got, want, real) -> float:
    """The relative L2 error of `got` against `want` over the real (non-padding) positions, in
    float64."""
    got, want = (np.asarray(x, np.float64)[:, real] for x in (got, want))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _peak_bytes(compiled) -> int | None:
    """A compiled program's memory as XLA reports it (arguments, outputs and temporaries, in
    bytes), None where the backend reports none."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes)


def median_time(compiled, args, repeat: int, clock=time.perf_counter) -> float:
    """Median of `repeat` runs after one to warm up, by `clock` (wall time by default)."""
    jax.block_until_ready(compiled(*args))  # warm
    times = []
    for _ in range(repeat):
        t0 = clock()
        jax.block_until_ready(compiled(*args))
        times.append(clock() - t0)
    return statistics.median(times)


def measure(row_len: int, args) -> dict:
    """One row's forward + backward by every kernel; `args`: the command line's (`kind`: llm,
    causal over samples' tokens, or vision, over images' patches)."""
    kind = getattr(args, "kind", "llm")
    causal = kind == "llm"
    lengths = getattr(args, "lengths", None)
    sizes = documents(args.mix, row_len, kind, lengths=lengths)
    if not len(sizes):  # (a row of nothing measures nothing: a speed-up of padding)
        source = f"--lengths {lengths}" if lengths else f"mix {args.mix}"
        raise UserError(
            f"--rows {row_len}: no {kind} document of {source} fits a row of {row_len} "
            "tokens; use longer rows or other lengths"
        )
    seg_np = segments(sizes, row_len)
    offsets = np.cumsum(sizes) - sizes
    rows = np.zeros(len(sizes), np.int64)
    tl = T.tile_list(offsets, sizes, rows, row_len // args.block, args.block, causal)
    doc_tiles = int(T.own_tiles(-(-sizes // args.block), causal).sum())
    dtype = jnp.dtype(args.dtype)
    q, k, v, w = _inputs(row_len, args.heads, args.kv_heads, args.head_dim, dtype)
    seg = jnp.asarray(seg_np)[None]

    sparse_fwd = lambda q, k, v, s, t: blocksparse.attend(
        q, k, v, s, t, block=args.block, causal=causal
    )
    sparse = _grad_fn(sparse_fwd)
    sparse_args = (q, k, v, w, seg, jnp.asarray(tl, jnp.int32)[None])
    sparse_c = sparse.lower(*sparse_args).compile()
    dense = _grad_fn(
        lambda q, k, v, s: dense_attention(q, k, v, attention_mask(s, causal=causal), dtype)
    )
    dense_args = (q, k, v, w, seg)
    try:
        dense_c = dense.lower(*dense_args).compile()
    except jax.errors.JaxRuntimeError:  # a GPU's autotuner runs what it compiles: out of memory
        if row_len <= args.dense_max:
            raise
        dense_c = None
    row = {
        "row_len": row_len,
        "docs": len(sizes),
        "doc_mean": float(sizes.mean()),
        "fill": float(sizes.sum() / row_len),
        "tiles": len(tl),
        "doc_tiles": doc_tiles,
        "dense_tiles": int(T.own_tiles(row_len // args.block, causal)),
        "sparse_s": median_time(sparse_c, sparse_args, args.repeat),
        "sparse_bytes": _peak_bytes(sparse_c),
        "dense_bytes": _peak_bytes(dense_c) if dense_c is not None else None,
        "dense_measured": row_len <= args.dense_max,
    }
    row["dense_s"] = (
        median_time(dense_c, dense_args, args.repeat) if row["dense_measured"] else None
    )
    if getattr(args, "window", 0):
        row.update(_windowed(args, offsets, sizes, row_len, (q, k, v, w, seg), seg_np > 0))
    if jax.default_backend() == "gpu":
        packed = cudnn.segments(seg, len(sizes))
        fused_fwd = lambda q, k, v, s: cudnn.attend(q, k, v, s, *packed, causal=causal)
        fused_c = _grad_fn(fused_fwd).lower(*dense_args).compile()
        row["cudnn_s"] = median_time(fused_c, dense_args, args.repeat)
        row["cudnn_bytes"] = _peak_bytes(fused_c)
        want = jax.jit(sparse_fwd)(q, k, v, seg, sparse_args[-1])
        got = jax.jit(fused_fwd)(q, k, v, seg)
        row["cudnn_err"] = _rel_err(got, want, seg_np > 0)
    return row


def _windowed(args, offsets, sizes, row_len: int, inputs, real) -> dict:
    """A sliding-window layer over the row: its own tile list (`plan.tiles.window_reach`) and the
    causal one masked to the window, timed forward + backward, and the error between them."""
    reach = T.window_reach(args.window, args.block)
    rows = np.zeros(len(sizes), np.int64)
    lists = {
        name: jnp.asarray(
            T.tile_list(offsets, sizes, rows, row_len // args.block, args.block, True, r), jnp.int32
        )[None]
        for name, r in (("window", reach), ("masked", None))
    }
    fwd = lambda q, k, v, s, t: blocksparse.attend(
        q, k, v, s, t, block=args.block, causal=True, window=args.window
    )
    out = {"window": args.window, "window_tiles": int(lists["window"].shape[1])}
    for name, tl in lists.items():
        call = (*inputs, tl)
        out[f"{name}_s"] = median_time(_grad_fn(fwd).lower(*call).compile(), call, args.repeat)
    q, k, v, _, seg = inputs
    got, want = (jax.jit(fwd)(q, k, v, seg, lists[n]) for n in ("window", "masked"))
    out["window_err"] = _rel_err(got, want, real)
    return out


def extrapolate(rows: list[dict]) -> None:
    """Dense time of unmeasured rows from the longest measured one, as T^2."""
    measured = [r for r in rows if r["dense_measured"]]
    if not measured:
        return
    ref = max(measured, key=lambda r: r["row_len"])
    for r in rows:
        if not r["dense_measured"]:
            r["dense_s"] = ref["dense_s"] * (r["row_len"] / ref["row_len"]) ** 2


def table(rows: list[dict]) -> str:
    """The markdown table of the rows: per row length the documents and tiles, dense and
    block-sparse seconds (dense as T^2 past its measured rows), the speed-up and memory, and
    cuDNN's columns when measured."""
    cols = ["row", "docs", "doc mean", "tiles", "doc tiles", "tiles/doc", "dense s", "sparse s"]
    cols += ["speed-up", "dense MiB", "sparse MiB"]
    fused = any("cudnn_s" in r for r in rows)
    if fused:
        cols += ["cudnn s", "cudnn MiB", "cudnn err"]
    windowed = any("window_s" in r for r in rows)
    if windowed:
        cols += ["window tiles", "masked s", "window s", "skip speed-up", "window err"]
    mib = lambda b: cell(b, ".0f", unit=2**20)
    lines = []
    for r in rows:
        dense_s = r.get("dense_s")  # (None: not measured, no measured row to extrapolate from)
        estimated = "" if r["dense_measured"] or dense_s is None else " (T^2 est.)"
        cells = [
            str(r["row_len"]),
            str(r["docs"]),
            f"{r['doc_mean']:.0f}",
            str(r["tiles"]),
            str(r["doc_tiles"]),
            f"{r['tiles'] / max(r['doc_tiles'], 1):.3f}",
            cell(dense_s, ".4g", estimated),
            cell(r["sparse_s"], ".4g"),
            cell(ratio(dense_s, r["sparse_s"]), ".1f", "x"),
            mib(r["dense_bytes"]),
            mib(r["sparse_bytes"]),
        ]
        if fused:
            cells += [cell(r.get("cudnn_s"), ".4f"), mib(r.get("cudnn_bytes"))]
            cells.append(cell(r.get("cudnn_err"), ".1e"))
        if windowed:
            cells += [
                str(r["window_tiles"]),
                cell(r["masked_s"], ".4g"),
                cell(r["window_s"], ".4g"),
            ]
            cells += [cell(ratio(r["masked_s"], r["window_s"]), ".1f", "x")]
            cells.append(cell(r["window_err"], ".1e"))
        lines.append(cells)
    return markdown(cols, lines)


def main(argv: list[str] | None = None) -> None:
    """`python -m jaxmllm.bench.attention`: times dense, block-sparse (and on a GPU cuDNN)
    attention forward and backward on rows packed with documents of a length mix's sizes, checks
    their errors against dense, and prints the table (--json FILE: the rows written there)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="2048,8192,32768", help="row lengths, comma-separated")
    p.add_argument("--mix", default="chartqa", help="length table the documents come from")
    p.add_argument(
        "--lengths",
        help="your lengths instead of --mix: a JSONL file, an InternVL table or an index folder",
    )
    p.add_argument("--block", type=int, default=128, help="tokens per attention block")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument(
        "--kind",
        default="llm",
        choices=["llm", "vision"],
        help="llm: causal, over the samples' LLM tokens; vision: over their images' patches",
    )
    p.add_argument(
        "--window",
        type=int,
        default=0,
        help="also a sliding-window layer of this many tokens (llm): its own tile list against "
        "the causal one masked to the window (0: none)",
    )
    p.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (median)")
    p.add_argument(
        "--dense-max",
        type=int,
        default=8192,
        help="longest row dense attention is run at (longer: memory only)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="q, k, v and the computation (cuDNN's column is bf16 whatever this is)",
    )
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.window < 0 or (args.window and args.kind != "llm"):
        p.error(f"--window {args.window}: a window is a decoder's (--kind llm), of >= 1 tokens")
    rows = []
    for part in args.rows.split(","):
        row_len = int(part)
        if row_len % args.block:
            p.error(f"--rows: {row_len} is not a multiple of --block {args.block}")
        rows.append(measure(row_len, args))
        print(f"row {row_len}: done", flush=True)
    extrapolate(rows)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}, "
        f"{args.lengths or 'mix ' + args.mix} ({args.kind}), "
        f"block {args.block}, {args.heads} heads / {args.kv_heads} kv heads of {args.head_dim}, "
        f"{args.dtype}, forward + backward of one row"
        + (f", window {args.window}" if args.window else "")
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
