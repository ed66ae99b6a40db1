"""A recipe's real training step on every device of this machine: the table a node is budgeted by.

    python -m jaxmllm.bench.node --config configs/gpu/qwen2vl_7b.yaml [--steps 20] [--warmup 3]
        [--json OUT] [--set key=value ...]

It builds what `python -m jaxmllm.train` builds from the config (`resolve_run`: the mesh over
all of this machine's devices, the kernel, the batch sizes from the data; the compiled step,
pipelined where `mesh.stage` says; the data feed with its planner, workers, prefetching and the
copy to the devices overlapping the step) and runs `--warmup` steps, then `--steps` measured
ones, from a random initial state (no checkpoint is read or written: `model.init_from` is left
out, the weights' values change no time). The config's data are read as training reads them, so
point it at your own (`--set data.path=...`): fill and the host's share are properties of the mix.

The report, one row per measured quantity (and `--json OUT`, with every step's figures):
- the first step's time (compiling it included) and the steady step: median, 10th and 90th
  percentile of the measured steps' seconds;
- real LLM tokens a second, and samples a second, for the whole machine;
- TFLOP/s a device and MFU, from the analytic FLOPs of the real items (what the trainer's
  `mfu` reports), counted two ways: every phase's (the towers included), and the LLM's alone
  (what a text-only trainer would call its MFU); MFU needs the device's dense bf16 peak
  (`train.peak_tflops`, else the device kind's datasheet figure; none on a CPU);
- each phase's fill (real units over its bucket, the share of the computed work that is not
  padding);
- the host against the step: the seconds the loop waited for the next batch (its share of the
  step: over a few percent, the devices idle on the data), and the feed's own stages per step
  (planning, loading, bucketing, counting, the copy to the devices), which run ahead of the
  step on their own threads and processes.

One process drives the machine's devices (as `python -m jaxmllm.train` does on one node). On a
CPU (`mesh.cpu_devices: 8`, as configs/tiny.yaml sets, or
XLA_FLAGS=--xla_force_host_platform_device_count=8) it runs the same code over forced host
devices: a smoke of the path, not a measure of a node.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import numpy as np

import sharding
from jaxmllm.config import Config, ConfigError, InitFrom, load_config
from jaxmllm.config.command import add_config_args
from jaxmllm.feed.iterator import make_pipeline
from jaxmllm.feed.times import HostTimes
from jaxmllm.init_from import start_reference
from jaxmllm.loop.metrics import device_peak
from jaxmllm.process.distributed import split_cpu
from jaxmllm.resolve.run import resolve_run
from jaxmllm.step.stages.program import build_program

STAGES = ("plan_s", "load_s", "bucketize_s", "count_s", "transfer_s")


@dataclasses.dataclass
class Step:
    """One step's measurements."""

    seconds: float  # the step on the devices (dispatch to its results ready)
    wait_s: float  # the loop waiting for the feed's next batch before it
    tokens: float  # real LLM tokens
    samples: int
    flops: float  # analytic FLOPs of the real items, every phase
    llm_flops: float  # ... of the LLM phase alone
    fill: dict[str, float]  # per phase, real units over the bucket
    host: dict[str, float]  # the feed's stages' seconds (HostTimes)


def bench_config(cfg: Config, steps: int) -> Config:
    """The config as the bench runs it: no weights read (`model.init_from` left out: a random
    state times the same), no evaluation, no checkpoint or output folder of its own."""
    if cfg.train.objective != "sft" and cfg.preference.reference == "precomputed":
        raise ConfigError(
            "preference.reference: precomputed needs a pass over the pairs before training; "
            "benchmark the step with preference.reference: base (the same step and shapes)"
        )
    train = dataclasses.replace(cfg.train, steps=steps, ledger=False, record_timings=False)
    data = dataclasses.replace(cfg.data, eval=dataclasses.replace(cfg.data.eval, source="none"))
    model = dataclasses.replace(cfg.model, init_from=InitFrom())
    return dataclasses.replace(cfg, train=train, data=data, model=model)


def measure(cfg: Config, warmup: int, steps: int) -> dict:
    """Runs the config's step `warmup` + `steps` times on every device; the report's figures."""
    started = time.perf_counter()
    run = resolve_run(cfg)
    mesh = run.mesh
    with jax.set_mesh(mesh):
        cfg = run.cfg
        prog = build_program(cfg, mesh)
        state = start_reference(cfg, prog, prog.init())
        to_device = lambda host: sharding.make_global_batch(host, mesh)
        data = make_pipeline(run, to_device=to_device)
        ready = time.perf_counter() - started
        first, measured = 0.0, []
        try:
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                item = next(data)
                t1 = time.perf_counter()
                state, metrics = prog.step(state, item["batch"])
                jax.block_until_ready(metrics)
                t2 = time.perf_counter()
                if i == 0:
                    first = t2 - t0
                if i >= warmup:
                    measured.append(_step(item["info"], t2 - t1, t1 - t0))
                print(f"\rstep {i + 1}/{warmup + steps}", end="", file=sys.stderr)
            print(file=sys.stderr)
        finally:
            data.close()
    return summary(cfg, measured, first, ready, mesh)


def _step(info, seconds: float, wait_s: float) -> Step:
    """A measured step from the feed's StepInfo (its counts made on the host, ahead of it)."""
    host = info.host or HostTimes()
    return Step(
        seconds=seconds,
        wait_s=wait_s,
        tokens=info.tokens,
        samples=len(info.samples),
        flops=info.flops,
        llm_flops=info.llm_flops,
        fill=dict(info.fill),
        host={k: getattr(host, k) for k in STAGES},
    )


def summary(cfg: Config, steps: list[Step], first: float, ready: float, mesh) -> dict:
    """The report's figures from the measured steps."""
    devices = mesh.size
    kind = jax.devices()[0].device_kind
    peak = device_peak(cfg.train.peak_tflops, kind)
    seconds = np.array([s.seconds for s in steps])
    total = float(seconds.sum())
    flops, llm_flops = sum(s.flops for s in steps), sum(s.llm_flops for s in steps)
    tflops = flops / total / devices / 1e12
    llm_tflops = llm_flops / total / devices / 1e12
    wait = float(np.sum([s.wait_s for s in steps]))
    phases = sorted({p for s in steps for p in s.fill})
    return {
        "devices": devices,
        "device_kind": kind,
        "platform": jax.devices()[0].platform,
        "mesh": dict(mesh.shape),
        "attention": cfg.model.attention,
        "planner": cfg.batch.planner,
        "steps": len(steps),
        "setup_s": ready,
        "first_step_s": first,
        "step_time_s": float(np.median(seconds)),
        "step_time_p10_s": float(np.percentile(seconds, 10)),
        "step_time_p90_s": float(np.percentile(seconds, 90)),
        "tokens_per_s": sum(s.tokens for s in steps) / total,
        "samples_per_s": sum(s.samples for s in steps) / total,
        "tflops_per_device": tflops,
        "llm_tflops_per_device": llm_tflops,
        "peak_tflops": peak,
        "mfu": tflops / peak if peak else None,
        "mfu_llm": llm_tflops / peak if peak else None,
        **{f"fill/{p}": float(np.mean([s.fill[p] for s in steps])) for p in phases},
        "host/wait_s": wait / len(steps),
        "host/wait_share": wait / (wait + total),
        **{f"host/{k}": float(np.mean([s.host[k] for s in steps])) for k in STAGES},
        "per_step": [dataclasses.asdict(s) for s in steps],
    }


def table(r: dict) -> str:
    """The report as a two-column markdown table."""
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"
    rows = [
        ("devices", f"{r['devices']} x {r['device_kind']} ({r['platform']}), mesh {r['mesh']}"),
        ("attention, planner", f"{r['attention']}, {r['planner']}"),
        ("set-up (resolve, compile not included)", f"{r['setup_s']:.1f} s"),
        ("first step (its compile included)", f"{r['first_step_s']:.1f} s"),
        (
            f"step time, median of {r['steps']} (p10-p90)",
            f"{r['step_time_s']:.3f} s ({r['step_time_p10_s']:.3f}-{r['step_time_p90_s']:.3f})",
        ),
        ("real LLM tokens/s (all devices)", f"{r['tokens_per_s']:,.0f}"),
        ("samples/s", f"{r['samples_per_s']:,.1f}"),
        ("TFLOP/s a device, all phases", f"{r['tflops_per_device']:.3g}"),
        ("TFLOP/s a device, the LLM alone", f"{r['llm_tflops_per_device']:.3g}"),
        (
            "MFU, all phases / the LLM alone",
            f"{pct(r['mfu'])} / {pct(r['mfu_llm'])}"
            + ("" if r["peak_tflops"] else " (no peak known: set train.peak_tflops)"),
        ),
    ]
    rows += [(f"fill, {k[5:]}", pct(v)) for k, v in r.items() if k.startswith("fill/")]
    rows += [
        (
            "host: waited for the next batch",
            f"{r['host/wait_s']:.4f} s a step ({pct(r['host/wait_share'])} of the time)",
        ),
        (
            "host: feed stages a step (ahead of the step)",
            ", ".join(f"{k[:-2]} {r[f'host/{k}']:.4f} s" for k in STAGES),
        ),
    ]
    lines = ["quantity | value", "--- | ---"]
    return "\n".join(lines + [f"{a} | {b}" for a, b in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.node",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.add_argument("--steps", type=int, default=20, help="measured steps")
    p.add_argument("--warmup", type=int, default=3, help="steps before them (the first compiles)")
    p.add_argument("--json", help="write the report here, every step's figures included")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        raise ConfigError("--steps and --warmup: at least 1 each (the first step compiles)")
    cfg = bench_config(load_config(args.config, args.set), args.warmup + args.steps)
    split_cpu(cfg.mesh.cpu_devices)
    report = measure(cfg, args.warmup, args.steps)
    print(f"{args.config}: {args.steps} steps measured after {args.warmup}")
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, **report}, f, indent=2)
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
