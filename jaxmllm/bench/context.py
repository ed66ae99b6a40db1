"""Context parallelism's benchmarks: how evenly a split spreads a group's attention tiles over
its ranks, and what a rank's share of a step costs.

    python -m jaxmllm.bench.balance --context 2,4,8 [--mix ai2d,chartqa] [--json OUT]
    python -m jaxmllm.bench.context [--tokens 16384] [--context 4] [--json OUT]

`balance --context` (`balance_rows`, `balance_table`): per context size C, per-rank tiles
max/mean (the slowest rank's tiles over the group's mean: what a step waits for) under three
splits of each group's rows (`jaxmllm.plan.context`): `uniform` (each row in C contiguous
chunks), `zigzag` (MaxText: each row in 2C chunks, rank c taking c and 2C-1-c) and `ours`
(tiles dealt, equal blocks). Workloads: the rows `orchestrated` packs for groups of C devices
from the length tables (`--tokens` a device, capacities as the trainer sizes them), and long
single documents alone in a group's row (a half, 90% and all of it).

`python -m jaxmllm.bench.context` (`main`): the per-device measure of one decoder layer
(projections, attention over the gathered group's keys and values, MLP; forward and backward,
fp32) on one CPU device: the whole row unsplit (W), then each rank's share alone under each
split, the gathered keys and values given (the all-gather is not timed). Reported: the slowest
rank over W / C (1.0 = a perfect split of the work), and its tiles over the mean. Every rank
computes its tile capacity (the split's most), padding included, as under XLA's fixed shapes.
Times are this process's CPU seconds (the median of `--repeat` runs), steadier than wall time
on a shared machine.

`python -m jaxmllm.bench.context --bytes` (`strategy_rows`): per context size and
`mesh.context_strategy`, the bytes a rank sends (or receives: the same for these collectives)
over the context axis per attention layer and microbatch, forward and backward, from the shapes
(`jaxmllm.cost.exchange`), and where the process has C devices (`XLA_FLAGS=
--xla_force_host_platform_device_count=8` on a CPU) from the collectives of XLA's compiled
program of one attention's forward and backward (`compiled_bytes`); and the extra memory a rank
holds for it (the gathered keys and values; ulysses' repeated KV heads). A Gated DeltaNet
layer's row (ulysses only: gather cannot run it) counts its all-to-alls the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxmllm.bench.attention import documents, median_time
from jaxmllm.cost.exchange import attention_bytes, linear_bytes
from jaxmllm.models.blocksparse import kernel
from jaxmllm.plan import context as split
from jaxmllm.plan.contract import Capacities
from jaxmllm.plan.registry import make_planner
from jaxmllm.plan.tiles import tile_list
from jaxmllm.resolve.capacity import encoder_capacities, route_capacity
from jaxmllm.resolve.tilesize import held_tiles

LONG_SHARES = (0.5, 0.9, 1.0)  # long single documents: these shares of a group's row


# ----------------------------------------------------------------------------- tile balance


def spreads(weights: dict, rows: int, ranks: int) -> dict[str, list[float]]:
    """Per split, each group's per-rank tiles max/mean (groups with tiles)."""
    out = {name: [] for name in split.SPLITS}
    for w in weights.values():
        if not w.sum():
            continue
        for name in split.SPLITS:
            loads = split.rank_loads(w, split.split(name, w, rows, ranks), ranks)
            out[name].append(float(loads.max() / loads.mean()))
    return out


def packed_rows(index, ranks: int, tokens: int, groups: int, steps: int, seed: int = 0):
    """The block weights of every group of `steps` plans of orchestrated for `groups` groups of
    `ranks` devices (`tokens` LLM tokens a device, capacities as the trainer sizes them)."""
    per_token, per_row = {"vision": 4, "audio": 4}, {"vision": 1, "audio": 4}
    enc = encoder_capacities(index, tokens, per_token, per_row=per_row, block=128)
    caps = Capacities(
        microbatches=1,
        devices=groups * ranks,
        llm_rows=1,
        llm_row_len=tokens,
        units=enc.units,
        per_token=per_token,
        per_row=per_row,
        route_pair_capacity=max(enc.units.values()) // 4,
        attention_block=128,
        context=ranks,
    )
    make = lambda c: make_planner("orchestrated", index, c, seed)
    # (sized as the trainer sizes them: `pipeline.resolve_route`, `resolve_tiles`)
    route = route_capacity(make(caps), index, caps, steps, steps)
    caps = dataclasses.replace(caps, route_pair_capacity=route)
    tiles = held_tiles(make(caps), index, caps, steps)
    caps = dataclasses.replace(caps, tiles=tiles)
    planner = make(caps)
    weights = {}
    for step in range(steps):
        for key, w in split.group_weights(planner.plan(), index, caps).items():
            weights[(step, *key)] = w
    return weights, caps


def long_document(ranks: int, row_len: int, share: float, block: int = 128) -> dict:
    """The block weights of one document of `share` of a group's row (`ranks` x `row_len`)."""
    blocks = ranks * row_len // block
    n = int(share * ranks * row_len)
    t = tile_list(np.array([0]), np.array([n]), np.array([0]), blocks, block, True)
    return {0: split.block_weights(t, blocks)}


def balance_rows(mixes: dict, contexts: list[int], tokens: int, groups: int, steps: int) -> list:
    """The rows of `bench.balance --context`: per workload and context size, per split the mean
    and worst per-rank tiles max/mean over the groups."""
    rows = []
    for ranks in contexts:
        for name, index in mixes.items():
            t0 = time.process_time()
            weights, caps = packed_rows(index, ranks, tokens, groups, steps)
            rows.append(
                _row(
                    f"{name} packed",
                    ranks,
                    weights,
                    caps.llm_rows,
                    time.process_time() - t0,
                    tokens=tokens,
                    groups=groups,
                    steps=steps,
                )
            )
        for share in LONG_SHARES:
            weights = long_document(ranks, tokens, share)
            label = f"long {share:.0%} of {ranks * tokens // 1024}k"
            rows.append(_row(label, ranks, weights, 1, 0.0, tokens=tokens))
    return rows


def _row(workload: str, ranks: int, weights: dict, rows: int, seconds: float, **extra) -> dict:
    got = spreads(weights, rows, ranks)
    out = {"workload": workload, "context": ranks, "groups": len(got["ours"]), **extra}
    for name, values in got.items():
        out[name] = {"mean": float(np.mean(values)), "worst": float(np.max(values))}
    out["seconds"] = seconds
    return out


def balance_table(rows: list[dict]) -> str:
    cols = ["workload", "C", "groups"] + [f"{n} max/mean (worst)" for n in split.SPLITS]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        cells = [r["workload"], str(r["context"]), str(r["groups"])]
        cells += [f"{r[n]['mean']:.3f} ({r[n]['worst']:.3f})" for n in split.SPLITS]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def from_balance(args) -> int:
    """`bench.balance --context`: --mix (default ai2d,chartqa) or --lengths, --tokens a rank
    (8192 unless given), --groups, --max-steps (at most 8), --json."""
    from jaxmllm.bench.mixes import load_lengths, load_mix

    if args.lengths:
        mixes = {Path(args.lengths).name: load_lengths(args.lengths)}
    else:
        mixes = {n: load_mix(n) for n in (args.mix or "ai2d,chartqa").split(",")}
    tokens = args.tokens if args.tokens != 32768 else 8192  # (the balance bench's default)
    contexts = [int(c) for c in args.context.split(",")]
    rows = balance_rows(mixes, contexts, tokens, args.groups, min(args.max_steps, 8))
    print(
        f"per-rank attention tiles max/mean (block 128, {tokens} tokens a rank; the mean over "
        "groups, the worst in brackets)"
    )
    print(balance_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


# ----------------------------------------------------------------------------- strategy bytes

BYTES = {"bfloat16": 2, "float32": 4}
COLLECTIVES = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")


def hlo_collective_bytes(hlo: str, ranks: int) -> int:
    """Bytes a rank sends over its collectives in compiled HLO text (each op's result shape,
    as the op moves it over its replica group of c devices: an all-gather's or all-to-all's
    (c - 1) / c, a reduce-scatter's c - 1 times its result, an all-reduce's 2 (c - 1) / c; a
    group of one moves nothing). XLA:CPU runs a bf16 collective in f32: its bytes double."""
    import re

    total = 0
    op = re.compile(r"= (.+?) (" + "|".join(COLLECTIVES) + r")(-start)?\(")
    shape = re.compile(r"(bf16|f16|f32|s32|u32|s8|u8|pred)\[([\d,]*)\]")
    size = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
    groups = re.compile(r"replica_groups=\{\{([\d,]*)\}")
    for line in hlo.splitlines():
        m = op.search(line)
        if not m:
            continue
        g = groups.search(line)
        c = len(g.group(1).split(",")) if g else ranks  # (a group of 1 moves nothing)
        share = {"all-gather": (c - 1) / c, "all-to-all": (c - 1) / c}
        share |= {"reduce-scatter": c - 1, "all-reduce": 2 * (c - 1) / c}
        share |= {"collective-permute": 1}
        shapes = shape.findall(m.group(1))
        if m.group(3):  # (an async start's tuple holds its operand and result: the result)
            shapes = shapes[len(shapes) // 2 :]
        n = sum(size[d] * math.prod(int(x) for x in dims.split(",") if x) for d, dims in shapes)
        total += int(n * share[m.group(2)])
    return total


def compiled_bytes(strategy: str, tokens: int, ranks: int, args, tiles) -> int | None:
    """Bytes a rank sends in XLA's compiled forward and backward of one attention layer by
    `strategy` (`hlo_collective_bytes`) on a mesh of `ranks` devices (None: fewer devices);
    compiled only, never run."""
    import sharding
    from jaxmllm.models import context as ctx

    if len(jax.devices()) < ranks:
        return None
    mesh = sharding.make_mesh(
        {"data": 1, "context": ranks, "fsdp": 1, "tensor": 1}, jax.devices()[:ranks]
    )
    attend = ctx.ulysses_attend if strategy == "ulysses" else ctx.attend
    e, dtype = args.width // args.heads, jnp.dtype(args.dtype)
    qs = jax.ShapeDtypeStruct((ranks, tokens, args.heads, e), dtype)
    kvs = jax.ShapeDtypeStruct((ranks, tokens, args.kv_heads, e), dtype)
    ints = jax.ShapeDtypeStruct((ranks, tokens), jnp.int32)
    lists = jax.ShapeDtypeStruct((ranks, tiles, 2), jnp.int32)

    def loss(q, k, v, seg, pos, t):
        out = attend(q, k, v, seg, pos, t, block=args.block, causal=True)
        return jnp.sum(jnp.square(out.astype(jnp.float32)))

    # (value and gradients: the forward's output all-to-all is kept, as a step's loss keeps it)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    with jax.set_mesh(mesh):
        hlo = step.lower(qs, kvs, kvs, ints, ints, lists).compile().as_text()
    return hlo_collective_bytes(hlo, ranks)


def strategy_rows(args) -> list[dict]:
    """The rows of `--bytes`: per context size, per strategy its bytes a rank per attention
    layer (analytic and XLA's) and the extra memory held; and the Gated DeltaNet row."""
    from jaxmllm.config.decoder import LinearConfig

    itemsize, e = BYTES[args.dtype], args.width // args.heads
    linear = LinearConfig()  # (Qwen3.5's: 16 key heads, 32 value heads, 128)
    rows = []
    for ranks in (int(c) for c in args.context.split(",")):
        tiles = ranks * (args.tokens // args.block) ** 2 // 2  # (a long document's, a rank's)
        sizes = attention_bytes(args.tokens, ranks, args.heads, args.kv_heads, e, itemsize, tiles)
        for name, got in sizes.items():
            xla = compiled_bytes(name, args.tokens, ranks, args, tiles)
            rows.append(
                {"context": ranks, "strategy": name, "layer": "attention", **got, "xla": xla}
            )
        rows.append(
            {
                "context": ranks,
                "strategy": "ulysses",
                "layer": "gated deltanet",
                "forward": linear_bytes(args.tokens, ranks, linear, itemsize) // 2,
                "backward": linear_bytes(args.tokens, ranks, linear, itemsize) // 2,
                "held": 0,
                "xla": None,
            }
        )
    return rows


def bytes_table(rows: list[dict]) -> str:
    mib = lambda n: "-" if n is None else f"{n / 2**20:.1f}"
    cols = ["C", "layer", "strategy", "fwd MiB", "bwd MiB", "total MiB", "XLA MiB", "held MiB"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        cells = [str(r["context"]), r["layer"], r["strategy"], mib(r["forward"])]
        cells += [mib(r["backward"]), mib(r["forward"] + r["backward"]), mib(r["xla"])]
        lines.append(" | ".join(cells + [mib(r["held"])]))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- rank times


def _layer_grad(width: int, heads: int, kv: int, mlp: int, block: int):
    """fwd + bwd of one decoder layer over a rank's tokens, the group's keys and values given."""
    e = width // heads

    def loss(params, x, k_all, v_all, seg, seg_all, pos, pos_all, tiles, weights):
        wq, wk, wv, wo, w1, w2 = params
        t = x.shape[0]
        q = (x @ wq).reshape(t, heads, e)
        own = (x @ wk).sum() + (x @ wv).sum()  # (the rank's own keys and values: its share)
        # (no bidirectional spans: None for the queries' and the keys')
        a = kernel(q, k_all, v_all, seg, seg_all, pos, pos_all, None, None, tiles, block, True, 0)
        h = x + a.reshape(t, width) @ wo
        out = h + jax.nn.silu(h @ w1) @ w2
        return jnp.sum(out * weights) + 1e-6 * own

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def rank_times(sizes: np.ndarray, ranks: int, args) -> dict:
    """W (the whole row on one device) and, per split, each rank's time alone."""
    b, width = args.block, args.width
    row_len = ranks * args.tokens
    blocks = row_len // b
    offsets = np.cumsum(sizes) - sizes
    group = tile_list(offsets, sizes, np.zeros(len(sizes), np.int64), blocks, b, True)
    weights = split.block_weights(group, blocks)
    seg = np.zeros(row_len, np.int32)
    seg[: sizes.sum()] = np.repeat(np.arange(1, len(sizes) + 1), sizes)
    pos = np.concatenate([np.arange(n) for n in sizes] + [np.zeros(row_len - sizes.sum())])
    pos = pos.astype(np.int32)
    rng = np.random.default_rng(0)
    kv_w = args.kv_heads * (width // args.heads)
    shapes = [
        (width, width),
        (width, kv_w),
        (width, kv_w),
        (width, width),
        (width, args.mlp),
        (args.mlp, width),
    ]
    params = [jnp.asarray(rng.normal(0, 0.02, s), jnp.float32) for s in shapes]
    x = jnp.asarray(rng.normal(size=(row_len, width)), jnp.float32)
    kv = lambda: jnp.asarray(
        rng.normal(size=(row_len, args.kv_heads, width // args.heads)), jnp.float32
    )
    k_all, v_all = kv(), kv()
    grad = _layer_grad(width, args.heads, args.kv_heads, args.mlp, b)

    def run(tokens, k, v, seg_k, pos_k, tiles):
        w = jnp.ones((len(tokens), width), jnp.float32)
        a = (params, x[tokens], k, v, seg[tokens], seg_k, pos[tokens], pos_k, tiles, w)
        # (CPU seconds of this process: on a shared box wall time counts the others' load)
        return median_time(grad, a, args.repeat, clock=time.process_time)

    whole = run(np.arange(row_len), k_all, v_all, seg, pos, jnp.asarray(group, jnp.int32))
    out = {"whole_s": whole, "tiles": int(len(group)), "splits": {}}
    for name in split.SPLITS:
        owner = split.split(name, weights, 1, ranks)
        cap = int(split.rank_loads(weights, owner, ranks).max())
        lists = split.rank_tiles(group, owner, ranks, cap)
        lay = split.layout(owner, ranks)
        order = (lay[..., None] * b + np.arange(b)).reshape(ranks, -1)  # rank -> tokens
        every = order.ravel()
        times = [
            run(order[r], k_all[every], v_all[every], seg[every], pos[every], lists[r])
            for r in range(ranks)
        ]
        loads = split.rank_loads(weights, owner, ranks)
        out["splits"][name] = {
            "rank_s": times,
            "slowest_over_share": max(times) / (whole / ranks),
            "tiles_max_mean": float(loads.max() / loads.mean()),
        }
    return out


def time_table(results: list[dict]) -> str:
    cols = ["workload", "C", "tiles", "whole s", "W/C s"]
    cols += [f"{n} slowest s (/ W/C, tiles max/mean)" for n in split.SPLITS]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in results:
        cells = [
            r["workload"],
            str(r["context"]),
            str(r["tiles"]),
            f"{r['whole_s']:.3f}",
            f"{r['whole_s'] / r['context']:.3f}",
        ]
        for n in split.SPLITS:
            s = r["splits"][n]
            cells.append(
                f"{max(s['rank_s']):.3f} ({s['slowest_over_share']:.2f}x, "
                f"{s['tiles_max_mean']:.3f})"
            )
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.context",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", type=int, default=4096, help="LLM tokens a rank (a device)")
    p.add_argument("--context", default="4", help="context sizes, comma-separated")
    p.add_argument("--mix", default="chartqa", help="length table of the packed row")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--mlp", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3, help="timed runs a measurement (median)")
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--bytes",
        action="store_true",
        help="bytes per layer of each mesh.context_strategy instead of the rank times",
    )
    p.add_argument("--dtype", default="bfloat16", choices=sorted(BYTES), help="(--bytes)")
    args = p.parse_args(argv)
    if args.bytes:
        rows = strategy_rows(args)
        print(
            f"jax {jax.__version__}: bytes a rank sends per layer and microbatch over the "
            f"context axis, {args.dtype}, {args.heads} heads / {args.kv_heads} kv heads of "
            f"{args.width // args.heads}, {args.tokens} tokens a rank (XLA: its compiled "
            "attention, forward + backward)"
        )
        print(bytes_table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}) + "\n")
        return 0
    results = []
    for ranks in (int(c) for c in args.context.split(",")):
        row_len = ranks * args.tokens
        for workload, sizes in (
            ("long 100%", np.array([row_len])),
            (f"{args.mix} packed", documents(args.mix, row_len)),
        ):
            r = rank_times(sizes, ranks, args)
            results.append({"workload": workload, "context": ranks, **r})
            print(f"{workload}, context {ranks}: done", file=sys.stderr, flush=True)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}: one decoder layer, "
        f"forward + backward, fp32, width {args.width}, {args.heads} heads / {args.kv_heads} "
        f"kv heads, block {args.block}, {args.tokens} tokens a rank"
    )
    print(time_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
