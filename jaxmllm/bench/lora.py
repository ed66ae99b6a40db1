"""Step time of LoRA beside the full fine-tune, measured and as the cost model predicts it.

    python -m jaxmllm.bench.lora --config configs/tiny.yaml [--steps N] [--warmup W]
        [--rank R] [--planner P] [--json OUT] [--set key=value ...]

Three variants of the config train on the same stream (`bench.throughput`'s runs: one
planner, the same data, the variants taking turns step by step so machine noise hits them
alike):

- `full`: every module trained (the config with its freezes cleared);
- `lora`: rank-R adapters on every tower's matrices (`model.<tower>.lora`), the projectors
  trained whole;
- `lora_frozen`: LLaMA-Factory's recipe: adapters on the LLM alone, the encoders and the
  projectors frozen (the encoders then run forward only).

Reported per variant: trained parameters, the median step time, real LLM tokens/s, the
cost model's FLOPs of a step (`cost.model.CostModel.from_model`: the training multipliers, a
tower under adapters 2x its forward plus 3x its adapters') and its prediction of the step time:
seconds per FLOP fitted on `full`'s steps (the median time over the median FLOPs), applied to
each variant's FLOPs, beside what was measured.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import jax
import numpy as np

import sharding
from jaxmllm.bench.throughput import Run, setup
from jaxmllm.config import load_config
from jaxmllm.config.command import add_config_args
from jaxmllm.process.distributed import split_cpu

FREE = [
    "model.vision.freeze=false",
    "model.audio.freeze=false",
    "model.llm.freeze=false",
    "model.projector_freeze=false",
]


def variants(rank: int) -> dict[str, list[str]]:
    """Each variant's overrides (see the module docstring)."""
    towers = [f"model.{t}.lora.rank={rank}" for t in ("llm", "vision", "audio")]
    frozen = ["model.vision.freeze=true", "model.audio.freeze=true", "model.projector_freeze=true"]
    return {
        "full": FREE,
        "lora": [*FREE, *towers],
        "lora_frozen": [*FREE, f"model.llm.lora.rank={rank}", *frozen],
    }


def measure(config: str, sets: list[str], rank: int, planner: str, steps: int, warmup: int):
    """Rows per variant (see the module docstring)."""
    runs: list[Run] = []
    trained = {}
    for name, extra in variants(rank).items():
        cfg = load_config(config, [*sets, *extra])
        mesh = sharding.make_mesh(cfg.mesh)
        with jax.set_mesh(mesh):
            (run,) = setup(cfg, [planner or cfg.batch.planner], mesh, per_device=False)
        run.policy = name
        params = run.state["params"]
        trained[name] = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
        runs.append(run)
    with jax.set_mesh(mesh):
        for run in runs:
            for _ in range(warmup):
                run.run_step(mesh, measure=False)
        for i in range(steps):
            for run in runs:
                run.run_step(mesh, measure=True)
            print(f"\rmeasured {i + 1}/{steps} steps per variant", end="", file=sys.stderr)
        print(file=sys.stderr)
        for run in runs:
            run.data.close()
    return summarize(runs, trained)


def summarize(runs: list[Run], trained: dict[str, int]) -> list[dict]:
    """Measured and predicted step times; the rate fitted on the `full` variant's steps."""
    rows = []
    for run in runs:
        rows.append(
            {
                "variant": run.policy,
                "trained_params": trained[run.policy],
                "step_time_s": float(np.median(run.times)),
                "tokens_per_s": float(np.sum(run.tokens) / np.sum(run.times)),
                "model_flops_per_step": float(np.median(run.flops)),
            }
        )
    full = next(r for r in rows if r["variant"] == "full")
    rate = full["step_time_s"] / full["model_flops_per_step"]  # seconds per model FLOP
    for r in rows:
        r["predicted_s"] = rate * r["model_flops_per_step"]
        r["vs_full_measured"] = r["step_time_s"] / full["step_time_s"]
        r["vs_full_predicted"] = r["model_flops_per_step"] / full["model_flops_per_step"]
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table of the LoRA variants: parameters trained, step seconds and tokens/s
    measured, model GFLOP a step, and the predicted against the measured speed-up over full
    training."""
    cols = [
        "variant",
        "trained",
        "step s",
        "tok/s",
        "model GFLOP/step",
        "predicted s",
        "vs full (measured)",
        "vs full (predicted)",
    ]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        cells = [r["variant"], f"{r['trained_params'] / 1e6:.2f}M", f"{r['step_time_s']:.3f}"]
        cells += [f"{r['tokens_per_s']:.0f}", f"{r['model_flops_per_step'] / 1e9:.2f}"]
        cells += [f"{r['predicted_s']:.3f}", f"{r['vs_full_measured']:.2f}x"]
        cells.append(f"{r['vs_full_predicted']:.2f}x")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxmllm.bench.lora`: trains the config fully, with LoRA adapters of --rank on
    every tower, and with adapters on the LLM over frozen towers; times --steps steps of each
    after --warmup and prints the table (--json: the rows written there)."""
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.lora",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.add_argument("--steps", type=int, default=20, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per variant")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    p.add_argument("--planner", default="", help="batch.planner (default: the config's)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    split_cpu(load_config(args.config, args.set).mesh.cpu_devices)
    rows = measure(args.config, args.set, args.rank, args.planner, args.steps, args.warmup)
    kind = jax.devices()[0].device_kind
    print(
        f"{args.config}: {jax.device_count()} devices ({kind}), {args.steps} measured steps "
        f"per variant after {args.warmup} warm-up; median step times; predicted: the cost "
        "model's FLOPs at the full fine-tune's seconds per FLOP"
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": args.config,
                    "overrides": args.set,
                    "rank": args.rank,
                    "device_kind": kind,
                    "rows": rows,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    raise SystemExit(run(main))
