"""Pipeline stages: how good the frozen-aware partition is, and whether its bubble is real.

    python -m jaxmllm.bench.stages [--config configs/small.yaml] [--stages 2,4,8]
        [--microbatches 4,16] [--schedules gpipe] [--measure configs/pipeline.yaml]
        [--measure-stages 2,4] [--json OUT] [--set key=value ...]

Partition quality (predicted, from the cost model; pure Python, instant): for the config's
model with its vision encoder frozen and with everything trainable, at each stage count and
microbatch count, the predicted step time and bottleneck tick of

- uniform: every encoder in the pipeline and the layers dealt out in equal counts (a stage may
  hold the end of one module and the start of the next), the better of the schedules;
- frozen-blind: the partitioner as if every module were trainable, its plan priced with the
  true costs (what knowing the model's shapes but not what is frozen gives);
- frozen-aware: the partitioner with the true costs (`jaxmllm.pipeline.partition`).

Measured bubble (`--measure`, on this machine's CPU): the plans of a small pipelined config
(configs/pipeline.yaml by default) at each `--measure-stages`; each stage's forward and backward
of one microbatch bucket are timed on one device, the stages in turn for `--repeats` rounds,
medians (jaxmllm.bench.stage_timing: the forced CPU devices share the cores, so the SPMD step's
wall time shows the total work, not the ticks), then replayed through the schedule table:
measured bubble against the cost model's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jaxmllm.config import Config, load_config
from jaxmllm.config.command import add_config_args
from jaxmllm.pipeline.choose import SCHEDULES_RUN
from jaxmllm.pipeline.costs import model_costs
from jaxmllm.pipeline.partition import Plan, partition, reprice, uniform
from jaxmllm.resolve.attention import resolve_attention


def _frozen_vision(cfg: Config, frozen: bool) -> Config:
    vision = dataclasses.replace(cfg.model.vision, freeze=frozen)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vision=vision))


def _all_trainable(cfg: Config) -> Config:
    m = cfg.model
    model = dataclasses.replace(
        m,
        vision=dataclasses.replace(m.vision, freeze=False),
        audio=dataclasses.replace(m.audio, freeze=False),
        llm=dataclasses.replace(m.llm, freeze=False),
        projector_freeze=False,
    )
    return dataclasses.replace(cfg, model=model)


def quality_row(
    cfg: Config, stages: int, microbatches: int, schedules: list[str], as_stages: bool = False
) -> dict:
    """Uniform, frozen-blind and frozen-aware plans of one model at one stage count; with
    `as_stages` the encoders run as pipeline stages (audio data-parallel below 3 stages)."""
    batch = dataclasses.replace(cfg.batch, microbatches=microbatches)
    costs = model_costs(cfg.model, batch)
    blind_costs = model_costs(_all_trainable(cfg).model, batch)
    where = {"vision": "stages", "audio": "stages" if stages >= 3 else "data"} if as_stages else {}
    plan = lambda c, k: partition(c, stages, schedule=k, placement=where)
    best = lambda plans: min(plans, key=lambda p: p.step_time)
    plans = {
        "uniform": best(uniform(costs, stages, k) for k in schedules),
        "blind": best(reprice(plan(blind_costs, k), costs) for k in schedules),
        "aware": best(plan(costs, k) for k in schedules),
    }
    row = {"stages": stages, "microbatches": microbatches}
    for name, plan in plans.items():
        row[name] = _summary(plan)
    aware = plans["aware"]
    row["uniform_over_aware"] = plans["uniform"].step_time / aware.step_time
    row["blind_over_aware"] = plans["blind"].step_time / aware.step_time
    row["bottleneck_uniform_over_aware"] = plans["uniform"].bottleneck / aware.bottleneck
    return row


def _summary(plan: Plan) -> dict:
    return {
        "schedule": plan.schedule,
        "step_tflop": plan.step_time / 1e12,
        "bottleneck_tflop": plan.bottleneck / 1e12,
        "bubble": plan.bubble,
        "stages": [f"{s.segment}:{s.layers}" for s in plan.stages],
        "data_parallel": list(plan.data_parallel),
    }


def quality_table(rows: list[dict]) -> str:
    cols = [
        "model",
        "S",
        "M",
        "uniform step",
        "blind step",
        "aware step",
        "uniform/aware",
        "blind/aware",
        "bottleneck u/a",
        "aware plan",
    ]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        a = r["aware"]
        plan = " ".join(a["stages"]) + (
            f" (dp: {','.join(a['data_parallel'])})" if a["data_parallel"] else ""
        )
        lines.append(
            " | ".join(
                [
                    r["model"],
                    str(r["stages"]),
                    str(r["microbatches"]),
                    f"{r['uniform']['step_tflop']:.1f}",
                    f"{r['blind']['step_tflop']:.1f}",
                    f"{a['step_tflop']:.1f} {a['schedule']}",
                    f"{r['uniform_over_aware']:.2f}x",
                    f"{r['blind_over_aware']:.2f}x",
                    f"{r['bottleneck_uniform_over_aware']:.2f}x",
                    plan,
                ]
            )
        )
    return "\n".join(lines)


def measure_table(rows: list[dict]) -> str:
    cols = [
        "S",
        "M",
        "plan",
        "predicted bubble",
        "measured bubble",
        "rel. diff",
        "measured pipeline s",
        "stage fwd ms",
        "stage bwd ms",
    ]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        lines.append(
            " | ".join(
                [
                    str(r["stages"]),
                    str(r["microbatches"]),
                    " ".join(r["plan"]),
                    f"{r['predicted_bubble']:.3f}",
                    f"{r['measured_bubble']:.3f}",
                    f"{r['bubble_rel_diff']:+.1%}",
                    f"{r['measured_pipeline_s']:.3f}",
                    " ".join(f"{t * 1e3:.1f}" for t in r["fwd_s"]),
                    " ".join(f"{t * 1e3:.1f}" for t in r["bwd_s"]),
                ]
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.stages",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(
        p,
        required=False,
        default="configs/small.yaml",
        config_help="the model partitioned",
        set_help="overrides for the --measure config",
    )
    p.add_argument("--stages", default="2,4,8")
    p.add_argument("--microbatches", default="4,16")
    p.add_argument("--schedules", default=",".join(SCHEDULES_RUN), help="gpipe,1f1b: both")
    p.add_argument("--measure", default="configs/pipeline.yaml", help="'' skips the measure")
    p.add_argument("--measure-stages", default="2,4")
    p.add_argument(
        "--repeats",
        type=int,
        default=100,
        help="rounds of timing every stage's programs in turn (median)",
    )
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    ints = lambda text: [int(x) for x in text.split(",") if x]
    schedules = [s for s in args.schedules.split(",") if s]
    cfg = resolve_attention(load_config(args.config))  # (auto: this machine's kernel)
    rows = []
    for as_stages in (False, True):
        part = []
        for name, model in (
            ("frozen vision", _frozen_vision(cfg, True)),
            ("all trainable", _all_trainable(cfg)),
        ):
            for m in ints(args.microbatches):
                for s in ints(args.stages):
                    row = quality_row(model, s, m, schedules, as_stages)
                    part.append(
                        {"model": name, "encoders": "stages" if as_stages else "free", **row}
                    )
        where = "encoders as stages" if as_stages else "encoders placed by the partitioner"
        print(
            f"\npartition quality, {args.config} shapes, {where} (predicted TFLOP per step "
            f"and device; schedules: {', '.join(schedules)})"
        )
        print(quality_table(part))
        rows += part
    measured = []
    if args.measure:
        from jaxmllm.bench.stage_timing import measure_bubbles

        measured = measure_bubbles(args.measure, args.set, ints(args.measure_stages), args.repeats)
        print(f"\nmeasured vs predicted bubble, {args.measure} on this CPU (per-device measure)")
        print(measure_table(measured))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "quality": rows, "measured": measured}, f, indent=2)
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
