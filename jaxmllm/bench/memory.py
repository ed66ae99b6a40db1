"""Device memory of the train step per remat policy, compile-only: what fits a GPU, on any host.

    python -m jaxmllm.bench.memory --config configs/small.yaml [--policies none,full,...]
        [--device-gib 72] [--devices N] [--check] [--json OUT] [--set key=value ...]

For each policy (`model.remat`, every tower; and the config's own mix when its towers set
their own), the train step is built from abstract shapes (no data read, no parameter
allocated) on the config's mesh over `--devices` devices (forced host devices on a CPU), then
lowered and compiled, and reported per device:

- `temp_bytes`: XLA's temporaries (activations kept for the backward pass, gradients, the
  optimizer's workspace), and `peak_bytes`: arguments + outputs + temporaries, less what the
  outputs reuse of the donated train state;
- `recompute_flops`: the FLOPs the policy recomputes in a step (analytic: `recompute_flops`,
  from the blocks' shapes, the buckets' capacities and what the policy keeps,
  `jaxmllm/config/remat.py`), and `recompute_share` of the step's training FLOPs;
- `max_microbatch`: the most LLM rows per device and microbatch (`batch.llm_rows`, the encoder
  buckets grown in proportion) whose peak fits `--device-gib`, by compiling: at the config's
  rows and twice them, then where the line through the nearest compiled counts meets the
  budget, until the count that fits sits one below one that does not (a few compiles; 0 when
  not even the config's rows fit; `peaks` has every count compiled).

`--check` compiles the config as it is (its own policies and rows) once and exits 1 unless it
fits: what tests/test_recipes.py runs on every GPU recipe.

A preference run (`train.objective: dpo`, a loss with a reference) holds a frozen reference
policy in its train state (`jaxmllm.step.program.build_program`'s `reference`): with
`preference.reference: base`, a copy of the trained parameters (the frozen ones are the
policy's own), with a checkpoint a copy of every parameter, sharded like the policy, with no
gradient and no optimizer state; with LoRA and `base`, nothing (the adapters are switched off
for its pass), nor with `precomputed` (its log-probs come with the batch). The compiled step
takes it as an argument, so every peak counts it; the report shows it on a line of its own
(`reference_bytes` in all, `reference_device_bytes` a device, beside `state_device_bytes`:
each part of the train state a device holds). Its forward pass runs before the policy's in
each microbatch and keeps nothing for a backward: its activations sit in the temporaries only
while it runs, never beside the policy's, and it recomputes nothing; its FLOPs count in the
step's (`train_flops`: forward only).

Sizes the data would resolve (`-1`) take their bound without data (`resolve_bounds`: tiles of
the longest documents the config admits, a whole output per exchange pair), so what fits here
fits any data. On a CPU the figures are XLA:CPU's, an estimate of a GPU's: its fusions differ,
`auto` attention resolves to block_sparse (a GPU's cuDNN keeps no tiles of scores), and host
memory is device memory (an offload policy saves nothing here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

import jax

import sharding
from jaxmllm.bench.compile import measure
from jaxmllm.bench.table import cell
from jaxmllm.config import REMAT_POLICIES, Config, load_config
from jaxmllm.config.blocks import GATED_MLPS
from jaxmllm.config.command import add_config_args
from jaxmllm.config.phases import ENCODERS, LLM, PHASES, enabled, phase
from jaxmllm.config.remat import ATTENTION, QKV
from jaxmllm.cost import training
from jaxmllm.process.distributed import split_cpu
from jaxmllm.process.xla_flags import MEMORY_FRACTION
from jaxmllm.resolve.attention import resolve_attention
from jaxmllm.resolve.sizing import resolve_bounds
from jaxmllm.step.preference import compares_reference, uses_reference
from jaxmllm.step.program import build_program

GIB = 2**30
DEVICE_GIB = round(MEMORY_FRACTION * 80)  # of an 80 GB GPU (79.6 GiB), what a run takes: 72


def with_policy(cfg: Config, policy: str) -> Config:
    """`cfg` with every tower under `policy` (its own settings cleared)."""
    towers = {t: dataclasses.replace(getattr(cfg.model, t), remat="") for t in PHASES}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=policy, **towers))


# The sizes that grow with a device's buckets: at their bounds again for every row count.
GROW = ("route_pair_capacity", "llm_tiles", *(p.tiles for p in ENCODERS))


def with_rows(cfg: Config, rows: int, devices: int) -> Config:
    """`cfg` at `rows` LLM rows per device and microbatch, the encoder buckets in proportion
    (rounded up to what they must be multiples of), the sizes that grow with them (route
    capacity, tiles) at their bounds for these buckets, and every other `-1` size too
    (`resolve_bounds`; cuDNN's documents per row stay as set)."""
    b, m = cfg.batch, cfg.model
    block = b.attention_block if m.attention == "block_sparse" else 1
    grow = lambda n, unit: -(-n * rows // b.llm_rows // unit) * unit
    sized = {k: -1 for k in GROW if getattr(b, k) > 0}
    for p in ENCODERS:  # (whole LLM tokens, whole attention blocks of rows; BatchConfig's 4)
        unit = math.lcm(p.per_token(m), block * p.per_row(m), 4)
        sized[p.capacity] = grow(p.bucket(b), unit)
    batch = dataclasses.replace(b, **sized, llm_rows=rows)
    return resolve_bounds(dataclasses.replace(cfg, batch=batch), devices)


# ----------------------------------------------------------------------------- FLOPs


def layer_flops(cfg: Config, tower: str) -> dict[str, float]:
    """Forward FLOPs of one layer of `tower` over a device's bucket (one microbatch), by part:
    qkv, attention (the scores and the weighted sum: the pairs the kernel computes), out (the
    output projection), mlp_in (gate and up, or fc1), mlp_out."""
    b, m = cfg.batch, cfg.model
    t = getattr(m, tower)
    if tower == LLM:
        n, q, kv = b.llm_rows * b.llm_row_len, t.head_width * t.heads, t.head_width * t.kv_heads
        dense_pairs = b.llm_rows * b.llm_row_len**2
    else:  # (an encoder: one packed row of its bucket's rows, plain multi-head attention)
        p = phase(tower)
        n, q, kv = p.bucket(b) // p.per_row(m), t.width, t.width
        dense_pairs = n * n
    if m.attention == "block_sparse":
        pairs = getattr(b, f"{tower}_tiles") * b.attention_block**2
    else:  # (cuDNN skips what its documents do not span: at most this)
        pairs = dense_pairs // (2 if tower == LLM and m.attention == "cudnn" else 1)
    gated = 2 if t.mlp in GATED_MLPS else 1
    return {
        "qkv": 2.0 * n * t.width * (q + 2 * kv),
        "attention": 4.0 * pairs * q,
        "out": 2.0 * n * q * t.width,
        "mlp_in": 2.0 * n * t.width * t.mlp_dim * gated,
        "mlp_out": 2.0 * n * t.mlp_dim * t.width,
    }


def recomputed(parts: dict[str, float], policy: str, attention: str) -> float:
    """FLOPs of one layer's forward that `policy` runs again in the backward pass: the
    attention unless the policy keeps the kernel's output and statistics (`attention`; the
    dense reference kernel tags none, so it reruns), and each projection the backward reads
    whose output the policy does not keep (the last projection's output it never reads)."""
    keep = REMAT_POLICIES[policy]
    if not keep.remat:
        return 0.0
    kept = ATTENTION in keep.names and set(QKV) <= set(keep.names) and attention != "dense"
    again = 0.0 if kept else parts["attention"]
    again += parts["qkv"] if not set(QKV) <= set(keep.names) else 0.0
    again += parts["out"] if "attention_out" not in keep.names else 0.0
    return again + (parts["mlp_in"] if "mlp_in" not in keep.names else 0.0)


def backward_runs(cfg: Config) -> dict[str, int]:
    """Per enabled tower, its training multiplier (`cost.training.multiplier`): 1 when it runs
    forward only (frozen, nothing trainable below or inside), so nothing is recomputed."""
    how = training.modules(cfg.model)
    return {t: how[t].multiplier for t in (*(p.name for p in enabled(cfg.model)), LLM)}


def recompute_flops(cfg: Config) -> float:
    """FLOPs a device recomputes in a step under the config's remat policies (per tower)."""
    total = 0.0
    for tower, mult in backward_runs(cfg).items():
        if mult > 1:
            per_layer = recomputed(
                layer_flops(cfg, tower), cfg.model.remat_of(tower), cfg.model.attention
            )
            total += getattr(cfg.model, tower).depth * per_layer
    return total * cfg.batch.microbatches


def train_flops(cfg: Config) -> float:
    """A device's training FLOPs in a step without recomputation: its buckets' transformer
    layers (times 3 trained, 2 passing gradients, 1 forward only) and the LLM's output
    projection (analytic, capacities: padding is computed like the rest); a preference run's
    reference policy adds one forward pass of every tower over the same buckets."""
    b, lm = cfg.batch, cfg.model.llm
    runs = backward_runs(cfg)
    if uses_reference(cfg):  # (the reference's forward: x 1 more, nothing recomputed)
        runs = {t: mult + 1 for t, mult in runs.items()}
    total = sum(
        mult * getattr(cfg.model, t).depth * sum(layer_flops(cfg, t).values())
        for t, mult in runs.items()
    )
    total += runs[LLM] * 2.0 * b.llm_rows * b.llm_row_len * lm.width * lm.vocab_size
    return total * b.microbatches


# ----------------------------------------------------------------------------- the train state

STATE_PARTS = ("params", "frozen", "opt_state", "reference")


def state_columns(cfg: Config, mesh) -> dict:
    """The train state a device holds, per part (`STATE_PARTS`: bytes of its shards), and a
    preference run's reference policy: `reference_bytes` over all devices,
    `reference_device_bytes` a device, `reference_params` its parameter count and
    `reference` what it is (`preference.reference`; None without one). From abstract shapes
    (nothing allocated); the compiled step's arguments hold the same."""
    with jax.set_mesh(mesh):
        state = build_program(cfg, mesh).abstract_sharded()
    parts = {k: _device_bytes(state.get(k, {})) for k in STATE_PARTS}
    ref = state.get("reference", {})
    return {
        "state_device_bytes": parts,
        "reference": cfg.preference.reference if compares_reference(cfg) else None,
        "reference_params": sum(math.prod(x.shape) for x in jax.tree.leaves(ref)),
        "reference_bytes": int(
            sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(ref))
        ),
        "reference_device_bytes": parts["reference"],
    }


def _device_bytes(tree) -> int:
    """Bytes of one device's shards of `tree`'s sharded leaves (the largest shard each)."""
    return int(
        sum(
            math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in jax.tree.leaves(tree)
        )
    )


def _size(n: int) -> str:
    """Bytes in GiB, or MiB below a tenth of one."""
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.2f} MiB"


def reference_line(row: dict) -> str | None:
    """The report's line on a preference run's reference policy (None without one)."""
    what = row.get("reference")
    if what is None:
        return None
    forward = (
        "its forward pass keeps no activations for a backward (temporaries only while it "
        "runs, before the policy's)"
    )
    if what == "precomputed":
        return (
            "reference policy (preference.reference: precomputed): its log-probs come with the "
            "batch, no policy held or run (0 bytes)"
        )
    if not row["reference_params"]:
        return (
            f"reference policy (preference.reference: {what}): the LoRA adapters switched off, "
            f"no copy held (0 bytes); {forward}"
        )
    copy = "the trained parameters" if what == "base" else "every parameter"
    return (
        f"reference policy (preference.reference: {what}): a frozen copy of {copy}, "
        f"{row['reference_params'] / 1e6:.1f}M parameters, {_size(row['reference_device_bytes'])} "
        f"a device ({_size(row['reference_bytes'])} in all), sharded like the policy, "
        f"no gradient or optimizer state; counted in every peak; {forward}"
    )


# ----------------------------------------------------------------------------- the bench


def label(cfg: Config) -> str:
    """The policies a config runs: one name, or per tower when they differ."""
    own = {t: cfg.model.remat_of(t) for t in (*(p.name for p in enabled(cfg.model)), LLM)}
    if len(set(own.values())) == 1:
        return own[LLM]
    return " ".join(f"{t}:{p}" for t, p in own.items())


def flops_columns(cfg: Config, devices: int) -> dict:
    """A policy's analytic columns, of the sizes its row compiles at the config's rows (tiles
    and route capacity at their bounds: a -1 in `cfg` would count as -1 tiles)."""
    sized = with_rows(cfg, cfg.batch.llm_rows, devices)
    again = recompute_flops(sized)
    return {"recompute_flops": again, "recompute_share": again / train_flops(sized)}


def fit(cfg: Config, mesh, devices: int, device_bytes: int) -> dict:
    """One policy's row: compiled sizes at the config's rows, and the most rows that fit."""
    rows = cfg.batch.llm_rows
    base = measure(with_rows(cfg, rows, devices), mesh)
    peaks = {rows: base["peak_bytes"]}
    seconds = base["total_s"]
    if base["peak_bytes"] <= device_bytes:
        more = measure(with_rows(cfg, 2 * rows, devices), mesh)
        peaks[2 * rows], seconds = more["peak_bytes"], seconds + more["total_s"]
    for _ in range(MAX_SEARCH):
        guess = next_guess(peaks, device_bytes)
        if guess is None:
            break
        got = measure(with_rows(cfg, guess, devices), mesh)
        peaks[guess], seconds = got["peak_bytes"], seconds + got["total_s"]
    best = largest_fit(peaks, device_bytes)
    (low, p0), (high, p1) = sorted(peaks.items())[0], sorted(peaks.items())[-1]
    slope = (p1 - p0) / (high - low) if high > low else None
    return {
        "policy": label(cfg),
        **{k: base[k] for k in ("params", "param_bytes", "trained_params", "opt_bytes")},
        **state_columns(with_rows(cfg, rows, devices), mesh),
        "temp_bytes": base["temp_bytes"],
        "peak_bytes": base["peak_bytes"],
        "bytes_per_row": None if slope is None else int(slope),  # (between the rows compiled)
        **flops_columns(cfg, devices),
        "max_microbatch": best,
        "pinned": next_guess(peaks, device_bytes) is None,  # (else: fits, more may too)
        "max_tokens": best * cfg.batch.llm_row_len,
        "peaks": {str(k): v for k, v in sorted(peaks.items())},  # rows compiled: peak bytes
        "compile_s": seconds,
    }


MAX_SEARCH = 8  # compiles past the first two to pin the largest fit down


def largest_fit(peaks: dict[int, int], budget: int) -> int:
    """The most rows known to fit: below every row count known not to (0: none fits)."""
    over = min((r for r, p in peaks.items() if p > budget), default=None)
    fits = [r for r, p in peaks.items() if p <= budget and (over is None or r < over)]
    return max(fits, default=0)


def next_guess(peaks: dict[int, int], budget: int) -> int | None:
    """The row count to compile next, None once the largest fit is pinned down (one row below
    a count that does not fit). With no count over the budget yet: the line through the two
    largest counts, extended to the budget. Then, between the most rows known to fit and the
    fewest known not to: where the line between them meets the budget, kept a quarter of the
    way in from either end (so the bracket shrinks by a quarter at least; a peak linear in
    the rows is pinned by the first guess and the one after it)."""
    lo = largest_fit(peaks, budget)
    hi = min((r for r, p in peaks.items() if p > budget), default=None)
    if hi is None:
        (r0, p0), (r1, p1) = sorted(peaks.items())[-2:]
        slope = (p1 - p0) / (r1 - r0)
        return max(r1 + int((budget - p1) // slope), r1 + 1) if slope > 0 else 2 * r1
    width = hi - lo
    if width <= 1:
        return None
    p_lo = peaks.get(lo, 0)
    guess = lo + int((budget - p_lo) * width // (peaks[hi] - p_lo))
    margin = max(width // 4, 1)
    return min(max(guess, lo + margin), hi - margin)


def run(cfg: Config, policies: list[str], device_gib: float) -> list[dict]:
    """Rows per policy (and the config's own mix where its towers differ) on all devices."""
    cfg = resolve_attention(cfg)
    mesh = sharding.make_mesh(cfg.mesh)
    devices = sharding.data_parallel_size(mesh)
    configs = [with_policy(cfg, p) for p in policies]
    if label(cfg) not in policies:
        configs.append(cfg)
    rows = []
    for c in configs:
        rows.append(fit(c, mesh, devices, int(device_gib * GIB)))
        print(f"{rows[-1]['policy']}: compiled in {rows[-1]['compile_s']:.0f} s", flush=True)
    return rows


def check(cfg: Config, device_gib: float) -> dict:
    """The config as it is (its own policies and rows), compiled once: does it fit?"""
    cfg = resolve_attention(cfg)
    mesh = sharding.make_mesh(cfg.mesh)
    sized = with_rows(cfg, cfg.batch.llm_rows, sharding.data_parallel_size(mesh))
    got = measure(sized, mesh)
    fits = got["peak_bytes"] <= device_gib * GIB
    return {"policy": label(cfg), "fits": fits, **got, **state_columns(sized, mesh)}


def full_twin(cfg: Config) -> Config:
    """`cfg` with every module that trains LoRA adapters trained whole instead (its base in
    the param dtype): the full fine-tune a LoRA recipe stands beside."""
    m = cfg.model
    towers = {}
    for t in PHASES:
        tower = getattr(m, t)
        if tower.lora.enabled:
            off = dataclasses.replace(tower.lora, rank=0)
            towers[t] = dataclasses.replace(tower, lora=off, base_dtype="")
    projector = dataclasses.replace(m.projector_lora, rank=0)
    return dataclasses.replace(
        cfg, model=dataclasses.replace(m, projector_lora=projector, **towers)
    )


def compare_lora(cfg: Config, device_gib: float) -> list[dict]:
    """A LoRA recipe (its own policies; the most rows that fit, as `fit`) and its full
    fine-tune (`full_twin`) at the same rows, compiled once: parameters, trained parameters,
    their optimizer state's bytes, the peak."""
    cfg = resolve_attention(cfg)
    mesh = sharding.make_mesh(cfg.mesh)
    devices = sharding.data_parallel_size(mesh)
    lora = {"kind": "LoRA", **fit(cfg, mesh, devices, int(device_gib * GIB))}
    print(f"LoRA: compiled in {lora['compile_s']:.0f} s", flush=True)
    twin = with_rows(full_twin(cfg), cfg.batch.llm_rows, devices)
    got = measure(twin, mesh)
    full = {"kind": "full fine-tune", "policy": label(cfg), **got, "max_microbatch": None}
    full |= state_columns(twin, mesh)
    return [lora, full]


def lora_table(rows: list[dict], device_gib: float) -> str:
    """The markdown table of a LoRA run's memory per kind: parameters, those trained, parameter,
    optimizer and reference GiB, the peak against `device_gib`, and the most rows a microbatch
    fits ('+': more may)."""
    cols = ["kind", "params", "trained", "param GiB", "optimizer GiB", "reference GiB"]
    cols += ["peak GiB", "fits", "max rows"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        best = r["max_microbatch"]
        fits = "yes" if r["peak_bytes"] <= device_gib * GIB else "no"
        cells = [r["kind"], f"{r['params'] / 1e9:.2f}B", f"{r['trained_params'] / 1e6:.1f}M"]
        keys = ("param_bytes", "opt_bytes", "reference_bytes", "peak_bytes")
        cells += [f"{r.get(k, 0) / GIB:.2f}" for k in keys]
        cells += [fits, "-" if best is None else f"{best}{'' if r.get('pinned') else '+'}"]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def table(rows: list[dict], rows_per_mb: int, row_len: int) -> str:
    """The markdown table of the remat policies: temporary and peak GiB, GiB a row, the FLOPs
    recomputed and their share, and the most rows of `row_len` a microbatch fits, against the
    config's `rows_per_mb`."""
    cols = ["policy", "temp GiB", "peak GiB", "GiB/row", "recompute TFLOP", "recompute %"]
    cols += [f"max rows (x{row_len})", "vs now"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    gib = lambda b: cell(b, ".2f", unit=GIB)
    for r in rows:
        best = r["max_microbatch"]
        lines.append(
            " | ".join(
                [
                    r["policy"],
                    gib(r["temp_bytes"]),
                    gib(r["peak_bytes"]),
                    gib(r["bytes_per_row"]),
                    f"{r['recompute_flops'] / 1e12:.2f}",
                    f"{100 * r['recompute_share']:.1f}",
                    f"{best}{'' if r['pinned'] else '+'}",
                    f"{best / rows_per_mb:.2f}x",
                ]
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxmllm.bench.memory`: compiles the config's step under each remat policy
    (--policies), reads XLA's memory analysis, searches the most rows a microbatch fits in
    --device-gib, and prints the table (--json: the rows written there)."""
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.add_argument("--policies", default=",".join(REMAT_POLICIES), help="comma-separated")
    p.add_argument(
        "--device-gib",
        type=float,
        default=DEVICE_GIB,
        help="what JAX may take of a device: 72, the 0.9 of an 80 GB GPU a run takes "
        "(XLA_CLIENT_MEM_FRACTION=0.9, the recipes' and the GPU campaign's)",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=0,
        help="forced CPU devices (default: the "
        "config's mesh.cpu_devices, else the product of its mesh sizes)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="compile the config as it is once; exit 1 unless it fits --device-gib",
    )
    p.add_argument(
        "--lora",
        action="store_true",
        help="a config with LoRA adapters: it and its full fine-tune side by side (params, "
        "optimizer bytes, peak)",
    )
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    # Nothing runs: no code optimisation (XLA:CPU's LLVM passes, half the compile time; the
    # buffers are those of an optimised build), set before the backend starts.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    )
    split_cpu(args.devices or cfg.mesh.cpu_devices or mesh_devices(cfg))
    jax.config.update("jax_enable_compilation_cache", False)
    cfg = cpu_exchange(cfg)
    mesh = sharding.make_mesh(cfg.mesh)
    if args.check:
        got = check(cfg, args.device_gib)
        print(
            f"{args.config} ({got['policy']}) on {mesh.size} devices, mesh {dict(mesh.shape)}: "
            f"peak {got['peak_bytes'] / GIB:.2f} GiB (temporaries {got['temp_bytes'] / GIB:.2f})"
            f" {'fits' if got['fits'] else 'does NOT fit'} {args.device_gib:g} GiB; compiled "
            f"in {got['total_s']:.0f} s"
        )
        _print_reference(got)
        return 0 if got["fits"] else 1
    if args.lora:
        rows = compare_lora(cfg, args.device_gib)
        b = cfg.batch
        print(
            f"{args.config} on {mesh.size} device(s), mesh {dict(mesh.shape)}, {b.microbatches} "
            f"microbatches of {b.llm_rows} x {b.llm_row_len} tokens ({label(cfg)}); totals over "
            "the devices"
        )
        print(lora_table(rows, args.device_gib))
        for r in rows:
            line = reference_line(r)
            if line:
                print(f"{r['kind']}: {line}")
        _write(args, mesh, rows)
        return 0
    policies = [s for s in args.policies.split(",") if s]
    rows = run(cfg, policies, args.device_gib)
    print(
        f"{args.config}: train step per device on {mesh.size} {jax.devices()[0].platform} "
        f"device(s), mesh {dict(mesh.shape)}, {cfg.batch.microbatches} microbatches of "
        f"{cfg.batch.llm_rows} x {cfg.batch.llm_row_len} tokens; fits {args.device_gib:g} GiB"
    )
    _print_reference(rows[0])
    print(table(rows, cfg.batch.llm_rows, cfg.batch.llm_row_len))
    _write(args, mesh, rows)
    return 0


def _print_reference(row: dict) -> None:
    """Prints the line comparing a row with its recorded reference figure, when there is one."""
    line = reference_line(row)
    if line:
        print(line)


def _write(args, mesh, rows: list[dict]) -> None:
    """Writes the rows to --json (when given), with the config, its overrides, the device budget,
    the mesh size, backend and jax version they were taken with."""
    if args.json:
        with open(args.json, "w") as f:
            run = {"config": args.config, "overrides": args.set, "device_gib": args.device_gib}
            run |= {"devices": mesh.size, "backend": jax.devices()[0].platform}
            json.dump({**run, "jax": jax.__version__, "rows": rows}, f, indent=2)


def mesh_devices(cfg: Config) -> int:
    """The devices a mesh with no -1 names (a -1 takes what there is: 1 then)."""
    m = cfg.mesh
    sizes = [m.data, m.stage, m.expert, m.fsdp, m.context, m.tensor]
    return math.prod(s for s in sizes if s > 0)


def cpu_exchange(cfg: Config) -> Config:
    """`cfg` with a mixture of experts' ragged token exchange measured as the dense one off a
    GPU (XLA:CPU has no ragged all-to-all): both hold the worst case's receive buffer, the
    dense one a send buffer of it too, so what fits this way fits the ragged way."""
    moe = cfg.model.llm.moe
    if jax.devices()[0].platform == "gpu" or moe.exchange != "ragged":
        return cfg
    print("note: model.llm.moe.exchange ragged measured as dense (no ragged all-to-all here)")
    llm = dataclasses.replace(cfg.model.llm, moe=dataclasses.replace(moe, exchange="dense"))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, llm=llm))


if __name__ == "__main__":
    from jaxmllm.config import command  # (its `run`, not this module's: imported as a module)

    raise SystemExit(command.run(main))
