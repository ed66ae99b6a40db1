"""End-to-end throughput of the planners: the same model, the same data stream, one run.

    python -m jaxmllm.bench.throughput --config configs/tiny.yaml [--policies a,b] [--steps N]
        [--warmup W] [--json OUT] [--set key=value ...]

Each policy gets its own copy of the same initial train state and its own planner over the same
epoch-shuffled sample stream; after compiling and `--warmup` steps each, the policies take turns
step by step (so machine noise hits them alike). Reported per policy: real (non-padding) LLM
tokens/s, step time, padding per phase, model FLOPs per real token (the analytic count of the
real items' work that the trainer's TFLOP/s reports; XLA's own cost analysis counts a scanned
block once whatever the depth, so it no longer says what a step computes), bytes the
encoder-row exchange moves per step, and ratios to `grain`.

`--remat none,full,...` runs each policy under each remat policy (rows `policy/remat`, beside
the share of the step's FLOPs it recomputes, analytic); `--phases` also times each phase's own
program on every device's buckets (vision, audio, LLM, the exchange, the optimizer:
`jaxmllm.bench.phases`), so a slow phase shows.

A policy is a planner name, or `planner:attention` to override `model.attention`
(`orchestrated:dense` beside `orchestrated` compares block-sparse attention with dense).
With block-sparse attention each policy gets its own tile capacity (`resolve_batch`: the
data's mean need for orchestrated, a dry run of its own packs for the others), reported as
`tiles` (per device bucket, all phases), `tile fill` (mean need / capacity) and `tile
max/mean` (over devices, per microbatch).

The max-device measure: the forced CPU devices share the machine's cores, so wall time shows
the total work of all devices, not the slowest device a cluster waits for. So each step, after
the SPMD step, every device's bucket is also run alone on a one-device program of the same
shapes, one device at a time, and the step is reported as the slowest of them
(`tokens_per_s_max_device`, `step_time_max_device_s`, and `device_time_max_mean`: slowest /
mean). Under fixed shapes every device computes its whole bucket, so these differ between
policies through the capacities (tokens, patches, tiles) rather than between devices. The
encoder-row exchange is not in it (see `xchg MB`). `--no-per-device` skips it, and so does
`mesh.context` > 1 (a device's part of a split row needs its group's keys: `jaxmllm.bench.context`
times the ranks' attention alone instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import sharding
from jaxmllm.batch.bucketize import batch_shapes
from jaxmllm.bench.memory import recompute_flops, train_flops, with_policy
from jaxmllm.bench.phases import PHASES, PhaseTimer
from jaxmllm.config import Config, MeshConfig, load_config
from jaxmllm.config.command import add_config_args
from jaxmllm.config.phases import PHASES as TOWERS
from jaxmllm.data.source import make_source
from jaxmllm.feed.iterator import make_pipeline
from jaxmllm.loop.metrics import peak_tflops
from jaxmllm.process.distributed import split_cpu
from jaxmllm.resolve.run import Run as Resolved
from jaxmllm.resolve.run import resolve_run
from jaxmllm.step.program import build_program

POLICIES = ("naive", "grain", "balanced", "orchestrated")


def policy_run(cfg: Config, policy: str, data: tuple, devices: int) -> Resolved:
    """`cfg` with `policy` as planner (`name` or `name:attention`, e.g. `orchestrated:dense`,
    and `/remat` after it for every tower's remat policy, e.g. `orchestrated/save_dots`),
    resolved over `data` (source, index); token and patch capacities shared by all policies,
    tile capacities each policy's own (what its packs need: see `resolve_batch`)."""
    policy, _, remat = policy.partition("/")
    cfg = with_policy(cfg, remat) if remat else cfg
    planner, _, attention = policy.partition(":")
    # An explicit exchange size applies to the routing policy; the others never route.
    routed = planner == "orchestrated" and cfg.batch.route_pair_capacity > 0
    rpc = cfg.batch.route_pair_capacity if routed else -1
    batch = dataclasses.replace(cfg.batch, planner=planner, route_pair_capacity=rpc)
    model = dataclasses.replace(cfg.model, attention=attention or cfg.model.attention)
    return resolve_run(dataclasses.replace(cfg, batch=batch, model=model), devices, data=data)


def device_batch(host: dict[str, np.ndarray], d: int, shapes: dict) -> dict[str, np.ndarray]:
    """Device `d`'s bucket of a host batch [M, D, ...], shaped for a one-device program: the
    exchange tables keep what `d` sends itself (under fixed shapes the values change no cost;
    the exchange's own cost is `exchange_bytes`)."""
    out = {}
    for key, (shape, dtype) in shapes.items():
        a = host[key][:, d : d + 1]
        if key.endswith(("_send", "_send_count")):
            a = a[:, :, d : d + 1]
        a = a[tuple(slice(0, n) for n in shape)]
        out[key] = np.ascontiguousarray(a, dtype)
    return out


def exchange_bytes(cfg: Config, devices: int) -> int:
    """Bytes the dense all-to-all moves per step (forward + backward, all phases, all microbatches).

    Every device sends C rows to each of the B-1 other LLM buckets whatever their fill (B = D,
    or D / mesh.context groups: a group's rows go to one of its devices, `exchange_rows`): the
    price of fixed shapes that `ragged_all_to_all` avoids on backends that have it.
    """
    c = cfg.batch.route_pair_capacity
    if not c:
        return 0
    width = cfg.model.llm.width
    itemsize = np.dtype(cfg.model.compute_dtype).itemsize
    phases = sum(p.enabled for p in (cfg.model.vision, cfg.model.audio))
    per_exchange = devices * (devices // cfg.mesh.context - 1) * c * width * itemsize
    return 2 * phases * cfg.batch.microbatches * per_exchange


@dataclasses.dataclass
class Run:
    """One policy's pipeline, program, state and measurements."""

    policy: str
    cfg: Config
    data: object
    step: object
    state: dict
    alone: object = None  # (one-device step, its state, its batch shapes, its mesh)
    phases: PhaseTimer | None = None  # each phase's own program (--phases)
    phase_times: list = dataclasses.field(default_factory=list)  # per step, seconds per phase
    times: list = dataclasses.field(default_factory=list)
    tokens: list = dataclasses.field(default_factory=list)
    flops: list = dataclasses.field(default_factory=list)
    padding: list = dataclasses.field(default_factory=list)
    device_times: list = dataclasses.field(default_factory=list)  # per step, per device
    tiles: list = dataclasses.field(default_factory=list)  # per step, [M, D] tiles needed

    def run_step(self, mesh, measure: bool) -> None:
        host = next(self.data)
        batch = sharding.make_global_batch(host["batch"], mesh)
        start = time.perf_counter()
        self.state, metrics = self.step(self.state, batch)
        jax.block_until_ready(metrics)
        if measure:
            self.times.append(time.perf_counter() - start)
            self.tokens.append(host["info"].tokens)
            self.flops.append(host["info"].flops)
            self.padding.append({k: 1.0 - v for k, v in host["info"].fill.items()})
            lists = [a for k, a in host["batch"].items() if k.endswith("_tiles")]
            if lists:
                self.tiles.append(sum((a[..., 0] >= 0).sum(-1) for a in lists))
        if self.alone is not None:
            self.time_devices(host["batch"], measure)
        if self.phases is not None:
            shapes = self.alone[2]
            times = self.phases.time(host["batch"], lambda h, d: device_batch(h, d, shapes))
            if measure:
                self.phase_times.append(times)

    def time_devices(self, host: dict[str, np.ndarray], measure: bool) -> None:
        """Each device's bucket of this step alone, one device at a time, on one device."""
        step, state, shapes, mesh1 = self.alone
        times = []
        with jax.set_mesh(mesh1):
            for d in range(next(iter(host.values())).shape[1]):
                batch = sharding.make_global_batch(device_batch(host, d, shapes), mesh1)
                start = time.perf_counter()
                state, metrics = step(state, batch)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
        self.alone = (step, state, shapes, mesh1)
        if measure:
            self.device_times.append(times)


def setup(
    cfg: Config,
    policies: list[str],
    mesh,
    per_device: bool = True,
    phases: bool = False,
    data: tuple | None = None,
) -> list[Run]:
    """Each policy's run; `data`: (a grain source, its lengths index) instead of the config's
    (opened once: every policy plans the same data)."""
    opened = data or make_source(cfg)
    devices = sharding.data_parallel_size(mesh)
    mesh1 = sharding.make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    runs, init = [], None
    for policy in policies:
        resolved = policy_run(cfg, policy, opened, devices)
        pcfg = resolved.cfg
        prog = build_program(pcfg, mesh)
        if init is None:
            init = jax.device_get(prog.init())  # every policy starts from the same state
        state = jax.device_put(init, prog.shardings)
        data = make_pipeline(resolved)
        run = Run(policy, pcfg, data, prog.step, state)
        if per_device:
            with jax.set_mesh(mesh1):
                one = build_program(pcfg, mesh1)
                state1 = jax.device_put(init, one.shardings)
                run.alone = (one.step, state1, batch_shapes(pcfg, 1), mesh1)
                if phases:  # (the state is copied: the one-device step donates its own)
                    copy = jax.tree.map(jnp.copy, state1)
                    run.phases = PhaseTimer(pcfg, one, copy, mesh, mesh1)
        runs.append(run)
    return runs


def summarize(run: Run, devices: int) -> dict:
    total_time, total_tokens = float(np.sum(run.times)), float(np.sum(run.tokens))
    phases = sorted({k for p in run.padding for k in p})
    return {
        "policy": run.policy,
        "steps": len(run.times),
        "tokens_per_s": total_tokens / total_time,
        "step_time_s": float(np.mean(run.times)),
        **per_device(run, total_tokens),
        **tile_stats(run),
        "real_tokens_per_step": total_tokens / len(run.times),
        **{f"padding/{k}": float(np.mean([p[k] for p in run.padding])) for k in phases},
        "model_flops_per_real_token": float(np.sum(run.flops)) / total_tokens,
        "tflops_per_device": float(np.sum(run.flops)) / total_time / devices / 1e12,
        "exchange_bytes_per_step": exchange_bytes(run.cfg, devices),
        "remat": {t: run.cfg.model.remat_of(t) for t in TOWERS},
        "recompute_share": recompute_flops(run.cfg) / train_flops(run.cfg),
        **phase_stats(run),
    }


def phase_stats(run: Run) -> dict:
    """Per phase, the mean over steps of its slowest device's seconds (`bench.phases`)."""
    if not run.phase_times:
        return {}
    return {
        f"phase/{p}_s": float(np.mean([t.get(p, 0.0) for t in run.phase_times])) for p in PHASES
    }


def per_device(run: Run, total_tokens: float) -> dict:
    """The SPMD step as its slowest device: per step, the most any device's bucket took alone."""
    if not run.device_times:
        return {}
    t = np.asarray(run.device_times)  # [steps, devices]
    slowest = t.max(1)
    return {
        "tokens_per_s_max_device": total_tokens / float(slowest.sum()),
        "step_time_max_device_s": float(slowest.mean()),
        "device_time_max_mean": float(np.mean(slowest / t.mean(1))),
    }


def tile_stats(run: Run) -> dict:
    """Block-sparse attention: the tile capacity of a device's bucket (all phases), the mean
    need over it (tile fill), and max / mean over devices per microbatch."""
    if not run.tiles:
        return {}
    b = run.cfg.batch
    caps = {"llm": b.llm_tiles, "vision": b.vision_tiles, "audio": b.audio_tiles}
    phases = [p for p in caps if f"{p}_tiles" in batch_shapes(run.cfg, 1)]
    cap = sum(caps[p] for p in phases)
    need = np.asarray(run.tiles, np.float64)  # [steps, M, D]
    mean = need.mean(-1)
    return {
        "tile_capacity": int(cap),
        "tile_capacity_by_phase": {p: caps[p] for p in phases},
        "tile_mean": float(need.mean()),
        "tile_fill": float(need.mean() / cap),
        "tile_max_mean": float(np.mean(need.max(-1)[mean > 0] / mean[mean > 0])),
    }


def table(rows: list[dict], peak: float | None = None) -> str:
    cols = [
        "policy",
        "tok/s",
        "step s",
        "max-dev tok/s",
        "max-dev step s",
        "pad llm",
        "pad vis",
        "pad aud",
        "tiles",
        "tile fill",
        "tile max/mean",
        "FLOP/tok",
        "TFLOP/s/dev",
        "MFU",
        "xchg MB",
        "vs grain",
        "vs grain (max-dev)",
    ]
    grain = next((r for r in rows if r["policy"] == "grain"), None)
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:

        def vs(key, r=r):
            ok = grain is not None and key in r and key in grain
            return f"{r[key] / grain[key]:.2f}x" if ok else "-"

        f = lambda key, fmt, r=r: format(r[key], fmt) if key in r else "-"
        lines.append(
            " | ".join(
                [
                    r["policy"],
                    f("tokens_per_s", ".0f"),
                    f("step_time_s", ".3f"),
                    f("tokens_per_s_max_device", ".0f"),
                    f("step_time_max_device_s", ".3f"),
                    *(f"{r.get(f'padding/{p}', 0.0):.2f}" for p in ("llm", "vision", "audio")),
                    f("tile_capacity", "d"),
                    f("tile_fill", ".3f"),
                    f("tile_max_mean", ".3f"),
                    f("model_flops_per_real_token", ".3g"),
                    f("tflops_per_device", ".1f"),
                    f"{r['tflops_per_device'] / peak:.1%}" if peak else "-",
                    f"{r['exchange_bytes_per_step'] / 1e6:.2f}",
                    vs("tokens_per_s"),
                    vs("tokens_per_s_max_device"),
                ]
            )
        )
    return "\n".join(lines)


def phase_table(rows: list[dict]) -> str:
    """Step time per remat policy beside its analytic recompute, and where it goes per phase
    (`rest`: the max-device step less its phases' programs; the exchange, which the
    max-device measure leaves out, is timed on the whole mesh)."""
    phased = any("phase/llm_s" in r for r in rows)
    cols = ["policy", "recompute %", "max-dev step s"]
    cols += [f"{p} s" for p in PHASES] + ["rest s"] if phased else []
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        step = r.get("step_time_max_device_s")
        cells = [
            r["policy"],
            f"{100 * r['recompute_share']:.1f}",
            "-" if step is None else f"{step:.3f}",
        ]
        if phased:
            times = {p: r[f"phase/{p}_s"] for p in PHASES}
            cells += [f"{t:.3f}" for t in times.values()]
            alone = sum(times.values()) - times["exchange"]  # (what the max-device step holds)
            cells.append("-" if step is None else f"{step - alone:.3f}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--steps", type=int, default=30, help="measured steps per policy")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per policy")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--no-per-device", action="store_true", help="skip the max-device measure")
    p.add_argument(
        "--remat",
        default="",
        help="remat policies (every tower's) to run each "
        "policy under, comma-separated: rows policy/remat (default: the config's)",
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="time each phase's own program too "
        "(jaxmllm.bench.phases), on the max-device measure's devices",
    )
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    split_cpu(cfg.mesh.cpu_devices)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    remats = [x.strip() for x in args.remat.split(",") if x.strip()]
    policies = [f"{p}/{r}" for p in policies for r in remats] if remats else policies
    mesh = sharding.make_mesh(cfg.mesh)
    devices = sharding.data_parallel_size(mesh)
    with jax.set_mesh(mesh):
        alone = not args.no_per_device and cfg.mesh.context == 1  # (see the module doc)
        runs = setup(cfg, policies, mesh, per_device=alone, phases=alone and args.phases)
        for run in runs:
            for _ in range(args.warmup):
                run.run_step(mesh, measure=False)
        for i in range(args.steps):
            for run in runs:
                run.run_step(mesh, measure=True)
            print(f"\rmeasured {i + 1}/{args.steps} steps per policy", end="", file=sys.stderr)
        print(file=sys.stderr)
        for run in runs:
            run.data.close()
    rows = [summarize(r, devices) for r in runs]
    kind = jax.devices()[0].device_kind
    peak = peak_tflops(kind)
    print(
        f"{args.config}: {devices} devices ({kind}), {args.steps} measured steps per policy "
        f"after {args.warmup} warm-up; MFU: model TFLOP/s of the real tokens over "
        + (f"{peak} TFLOP/s (dense bf16 peak)" if peak else "- (no peak known for this device)")
    )
    print(table(rows, peak))
    if remats or args.phases:
        print(phase_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            out = {
                "config": args.config,
                "devices": devices,
                "device_kind": kind,
                "peak_tflops": peak,
                "rows": rows,
            }
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
