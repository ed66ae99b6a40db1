"""End-to-end throughput of the planners: the same model, the same data stream, one run.

    python -m jaxmllm.bench.throughput --config configs/tiny.yaml [--policies a,b] [--steps N]
        [--warmup W] [--json OUT] [--set key=value ...]

Each policy gets its own copy of the same initial train state and its own planner over the same
epoch-shuffled sample stream; after compiling and `--warmup` steps each, the policies take turns
step by step (so machine noise hits them alike). Reported per policy: real (non-padding) LLM
tokens/s, step time, padding per phase, model FLOPs per real token (the analytic count of the
real items' work that the trainer's TFLOP/s reports; XLA's own cost analysis counts a scanned
block once whatever the depth, so it no longer says what a step computes), bytes the
encoder-row exchange moves per step, and ratios to `naive` and `grain`.
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
from jaxmllm.config import Config, load_config
from jaxmllm.data.pipeline import make_pipeline, make_source, resolve_batch
from jaxmllm.distributed import split_cpu
from jaxmllm.step import build_program

POLICIES = ("naive", "grain", "balanced", "orchestrated")


def policy_config(cfg: Config, policy: str, index) -> Config:
    """`cfg` with `policy` as planner, auto values resolved; capacities shared by all policies."""
    # An explicit exchange size applies to the routing policy; the others never route.
    routed = policy == "orchestrated" and cfg.batch.route_pair_capacity > 0
    rpc = cfg.batch.route_pair_capacity if routed else -1
    batch = dataclasses.replace(cfg.batch, planner=policy, route_pair_capacity=rpc)
    return resolve_batch(dataclasses.replace(cfg, batch=batch), index)


def exchange_bytes(cfg: Config, devices: int) -> int:
    """Bytes the dense all-to-all moves per step (forward + backward, all phases, all microbatches).

    Every device sends C rows to each of the D-1 others whatever their fill: the price of fixed
    shapes that `ragged_all_to_all` avoids on backends that have it.
    """
    c = cfg.batch.route_pair_capacity
    if not c:
        return 0
    width = cfg.model.llm.width
    itemsize = np.dtype(cfg.model.compute_dtype).itemsize
    phases = sum(p.enabled for p in (cfg.model.vision, cfg.model.audio))
    per_exchange = devices * (devices - 1) * c * width * itemsize
    return 2 * phases * cfg.batch.microbatches * per_exchange


@dataclasses.dataclass
class Run:
    """One policy's pipeline, program, state and measurements."""

    policy: str
    cfg: Config
    data: object
    step: object
    state: dict
    times: list = dataclasses.field(default_factory=list)
    tokens: list = dataclasses.field(default_factory=list)
    flops: list = dataclasses.field(default_factory=list)
    padding: list = dataclasses.field(default_factory=list)

    def run_step(self, mesh, measure: bool) -> None:
        host = next(self.data)
        batch = sharding.make_global_batch(host["batch"], mesh)
        start = time.perf_counter()
        self.state, metrics = self.step(self.state, batch)
        jax.block_until_ready(metrics)
        if measure:
            self.times.append(time.perf_counter() - start)
            self.tokens.append(host["info"]["tokens"])
            self.flops.append(host["info"]["flops"])
            self.padding.append({k: 1.0 - v for k, v in host["info"]["fill"].items()})


def setup(cfg: Config, policies: list[str], mesh) -> list[Run]:
    source, index = make_source(cfg)
    devices = sharding.data_parallel_size(mesh)
    runs, init = [], None
    for policy in policies:
        pcfg = policy_config(cfg, policy, index)
        prog = build_program(pcfg, mesh)
        if init is None:
            init = jax.device_get(prog.init())  # every policy starts from the same state
        state = jax.device_put(init, prog.shardings)
        data = make_pipeline(pcfg, devices, source=source, index=index)
        runs.append(Run(policy, pcfg, data, prog.step, state))
    return runs


def summarize(run: Run, devices: int) -> dict:
    total_time, total_tokens = float(np.sum(run.times)), float(np.sum(run.tokens))
    phases = sorted({k for p in run.padding for k in p})
    return {
        "policy": run.policy,
        "steps": len(run.times),
        "tokens_per_s": total_tokens / total_time,
        "step_time_s": float(np.mean(run.times)),
        "real_tokens_per_step": total_tokens / len(run.times),
        **{f"padding/{k}": float(np.mean([p[k] for p in run.padding])) for k in phases},
        "model_flops_per_real_token": float(np.sum(run.flops)) / total_tokens,
        "exchange_bytes_per_step": exchange_bytes(run.cfg, devices),
    }


def table(rows: list[dict]) -> str:
    base = {r["policy"]: r["tokens_per_s"] for r in rows}
    cols = [
        "policy",
        "tok/s",
        "step s",
        "pad llm",
        "pad vis",
        "pad aud",
        "FLOP/tok",
        "xchg MB",
        "vs naive",
        "vs grain",
    ]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        ratio = lambda b, r=r: f"{r['tokens_per_s'] / base[b]:.2f}x" if b in base else "-"
        lines.append(
            " | ".join(
                [
                    r["policy"],
                    f"{r['tokens_per_s']:.0f}",
                    f"{r['step_time_s']:.3f}",
                    *(f"{r.get(f'padding/{p}', 0.0):.2f}" for p in ("llm", "vision", "audio")),
                    f"{r['model_flops_per_real_token']:.3g}",
                    f"{r['exchange_bytes_per_step'] / 1e6:.2f}",
                    ratio("naive"),
                    ratio("grain"),
                ]
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--steps", type=int, default=30, help="measured steps per policy")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per policy")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    split_cpu(cfg.mesh.cpu_devices)
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    mesh = sharding.make_mesh(cfg.mesh)
    devices = sharding.data_parallel_size(mesh)
    with jax.set_mesh(mesh):
        runs = setup(cfg, policies, mesh)
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
    print(
        f"{args.config}: {devices} devices ({jax.devices()[0].platform}), "
        f"{args.steps} measured steps per policy after {args.warmup} warm-up"
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "devices": devices, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
