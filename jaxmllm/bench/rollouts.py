"""GRPO rollouts on the planner: one rollout's completions packed by orchestrated and by grain's
packer, how many steps it takes, the goodput of those steps and the host's planning time.

    python -m jaxmllm.bench.rollouts [--mix ai2d,chartqa | --lengths FILE.jsonl] \\
        [--devices 8,64] [--policies orchestrated,grain] [--prompts 128] [--group 8] \\
        [--completion-median 256] [--completion-sigma 1.0] [--max-new 4096] [--tokens 32768] \\
        [--micro 2] [--block 128] [--config configs/gpu/qwen3_vl_8b.yaml] [--seed 0] \\
        [--per-completion] [--json OUT.json]

The rollout mix: `--prompts` samples of a real length table (`--mix`: the InternVL tables of
`jaxmllm.bench.mixes`, their images in the config's patches; drawn without replacement, seeded
by `--seed`) are the prompts: each one's text tokens (the table's short answer counted as
prompt) and its images. Each prompt gets `--group` (G) completions drawn lognormal, iid (median
`--completion-median`, spread `--completion-sigma`; clipped to 4..`--max-new` tokens): one
prompt's completions range from a few tokens to thousands. A prompt's group is one sample of G
documents (the prompt and each completion), its media once, as `jaxmllm.loop.rollouts` trains
them (`group_samples`: a group that overruns a bucket's row or LLM tiles makes as few samples
as hold it, `fits_bucket`); `--per-completion`: each completion a sample of its own with its
own copy of the prompt's media (a prompt's images encoded G times, as the trainer did before).
Both layouts plan at the capacities sized for the completions a sample each (what the trainer
has: sized from the data's samples, not from groups).

One rollout is planned per mix, policy and device count, as `RolloutIterator.plan` plans it:
a planner over the rollout's index alone, steps until every sample has been planned; a
sample planned again (a rollout smaller than what the steps hold: the planner reads the
rollout's samples epoch after epoch) counts once, as `jaxmllm.loop.evaluate.count_once` counts
it (the repeat's loss mask zeroed: computed, not useful). Capacities: `bench.sizes.make_caps`
for `--tokens` LLM tokens a device and microbatch, matched to the rollout's modality ratio,
then `sized_caps` (dry runs of the policy over the same rollout) as in `bench.pairs`; both
policies at the same capacities. Per row:

  steps       steps the rollout needed
  fill        planned units / capacity per phase over those steps (LLM tokens, vision
              patches; repeats included: what the packer filled)
  repeats     samples planned again after their first time (padding in effect)
  new a step  samples planned for the first time, each step (a long tail of steps with
              few: samples the planner deferred, the steps meanwhile filled with repeats)
  goodput     useful FLOPs over computed (as `bench.pairs`: units and attention tiles of
              `--block`, weighted by the config's cost model; computed = every bucket's
              capacity), each completion counted once; `packed`: the same with the repeats
              counted as useful (the packing alone)
  ms/step     host planning time a step, median over the rollout's steps (process CPU time;
              grain: per host of `--devices-per-host`)
  ms/rollout  the planner's construction (a new one each rollout, as the trainer builds it)
              and all the rollout's steps; the capacities' dry runs are not counted (the
              trainer sizes them once, at start-up)

Planner simulations on the host: no device runs, no timing claim beyond the host's planning.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from jaxmllm.bench.mixes import MIXES, bench_config, length_tables, units_per_token
from jaxmllm.bench.sizes import make_caps, sized_caps
from jaxmllm.config.command import fail, run
from jaxmllm.config.phases import LLM, NAMES, PHASES
from jaxmllm.cost.model import CostModel
from jaxmllm.data.lengths import LengthsIndex, cuts_matrix, document_counts
from jaxmllm.loop.rollouts import drain, fits_bucket
from jaxmllm.plan.contract import Capacities, check_plan, phase_docs, span_extras, step_tiles
from jaxmllm.plan.registry import HOLDS_TILES, make_planner
from jaxmllm.plan.tiles import bin_tiles, window_reach
from jaxmllm.resolve.tilesize import flop_share, step_window_tiles, window_cap

CONFIG = "configs/gpu/qwen3_vl_8b.yaml"  # the default model: Qwen3-VL-8B's shapes, trained whole
SHORTEST = 4  # completion tokens (the lognormal's lower clip; the upper is --max-new)
SIZING_STEPS = 8  # the capacities' dry runs (as bench.pairs' default --steps)


def completion_lengths(
    n: int, seed: int, median: float = 256, sigma: float = 1.0, longest: int = 4096
) -> np.ndarray:
    """Tokens of `n` completions: lognormal around `median` with spread `sigma`, iid, clipped
    to SHORTEST..`longest`."""
    rng = np.random.default_rng([seed, 61])
    return np.clip(np.exp(rng.normal(np.log(median), sigma, n)), SHORTEST, longest).astype(np.int64)


def rollout_layout(
    table: LengthsIndex, prompts: int, group: int, completions: np.ndarray, seed: int
) -> LengthsIndex:
    """The rollout's index: `prompts` x `group` samples, a prompt's G completions one after
    another, each with its own copy of the prompt's media."""
    rng = np.random.default_rng([seed, 62])
    chosen = rng.choice(len(table), prompts, replace=len(table) < prompts)
    order = np.repeat(chosen, group)
    return LengthsIndex(
        text=(table.text[order] + completions).astype(np.int64),
        items={p: items.take(order) for p, items in table.items.items()},
    )


def grouped_layout(index: LengthsIndex, group: int, caps: Capacities) -> LengthsIndex:
    """The rollout `index` (a completion a sample, a prompt's G in a row: `rollout_layout`)
    as the trainer lays it out: a prompt's completions one sample of a document each, its
    media once, as few samples as `caps` hold (`loop.rollouts.fits_bucket`)."""
    docs = index.llm_tokens(caps.per_token)
    rows = docs - index.text  # (a document's placeholders: one copy in its sample's text)
    spans = span_extras(index, np.arange(len(index)), caps)
    owner, cuts, text = [], [], []
    for k in range(len(index)):  # (a new sample: a new prompt, or the bucket full)
        extra = 0 if spans is None else int(spans[k])
        if k % group == 0 or not fits_bucket([*cuts[-1], int(docs[k])], caps, extra):
            owner.append(k)
            cuts.append([])
            text.append(-int(rows[k]))
        cuts[-1].append(int(docs[k]))
        text[-1] += int(docs[k])
    return LengthsIndex(
        text=np.asarray(text, np.int64),
        items={p: items.take(np.asarray(owner)) for p, items in index.items.items()},
        split=cuts_matrix([c[:-1] for c in cuts]),
    )


def _by_document(first: np.ndarray, plan, index: LengthsIndex) -> np.ndarray:
    """`first` (a plan's samples) for each of their LLM documents (`phase_docs`' order: a
    group's documents one after the other)."""
    return np.repeat(first, document_counts(index.split_of(plan.samples)))


def useful_tiles(plan, index: LengthsIndex, caps: Capacities, first: np.ndarray) -> dict:
    """Per phase, the attention tiles of the documents of the plan's samples marked `first`
    (their first time planned) where they were placed."""
    out = {}
    for p in PHASES:
        micro, dev, row, off, size = phase_docs(plan, index, caps, p)
        keep = _by_document(first, plan, index) if p == LLM else first[plan.items[p].owner]
        rows = caps.llm_rows if p == LLM else 1
        d_n = caps.llm_buckets if p == LLM else caps.devices
        bins = ((micro * d_n + dev) * rows + row)[keep]
        nbins = caps.microbatches * d_n * rows
        tiles = bin_tiles(bins, off[keep], size[keep], nbins, caps.attention_block, p == LLM)
        out[p] = float(tiles.sum())
    return out


def useful_window_tiles(
    plan, index: LengthsIndex, caps: Capacities, first: np.ndarray, window: int
) -> float:
    """The tiles a sliding window of `window` tokens reaches (the windowed layers' own list)
    in the LLM documents of the plan's samples marked `first`, where they were placed."""
    micro, dev, row, off, size = phase_docs(plan, index, caps, LLM)
    first = _by_document(first, plan, index)
    bins = ((micro * caps.llm_buckets + dev) * caps.llm_rows + row)[first]
    nbins = caps.microbatches * caps.llm_buckets * caps.llm_rows
    reach = window_reach(window, caps.attention_block)
    return float(
        bin_tiles(bins, off[first], size[first], nbins, caps.attention_block, True, reach).sum()
    )


def plan_rollout(
    index: LengthsIndex,
    policy: str,
    devices: int,
    tokens: int,
    micro: int,
    cost: CostModel,
    block: int = 128,
    per_host: int = 8,
    per_token: dict[str, int] | None = None,
    seed: int = 0,
    group: int = 0,
) -> dict:
    """One row: `policy` planning the rollout `index` on `devices` devices until every
    sample has been planned (repeats counted once); `per_token`: units an LLM token of
    each encoder phase (vision: the merge area, audio: the subsampling); `group` > 0: a
    prompt's completions as one sample (`grouped_layout`), at `index`'s capacities."""
    if block <= 0:
        raise ValueError("--block must be > 0 (the goodput counts attention tiles)")
    pt = per_token or {"vision": 4, "audio": 4}
    caps = make_caps(
        index, devices, tokens, micro, policy, pt["vision"], pt["audio"], block, per_host
    )
    caps = sized_caps(index, caps, policy, SIZING_STEPS, cost, seed)
    if group:
        index = grouped_layout(index, group, caps)
    make_planner(policy, index, caps, seed + 1).plan()  # (warm: imports, first-call paths)
    start = time.process_time()
    planner = make_planner(policy, index, caps, seed)
    drain(planner)  # (as the rollout feed plans a rollout)
    build = time.process_time() - start
    n, work = len(index), index.work(caps.per_token)
    seen = np.zeros(n, bool)
    useful, planned = np.zeros(len(PHASES)), np.zeros(len(PHASES))
    tiles_useful = dict.fromkeys(PHASES, 0.0)
    tiles_planned = dict.fromkeys(PHASES, 0.0)
    weights = cost.tile_weights(block, caps.per_row, caps.context)
    window = weights[LLM].window  # (windowed layers with a list of their own: its tiles)
    window_useful = window_planned = 0.0
    most = dict.fromkeys(PHASES, 0)  # the most tiles a bucket needed (a policy not holding)
    times, variants, new, repeats = [], [], [], 0
    while not seen.all():
        if len(times) > 4 * n + 8:  # (as RolloutIterator.plan gives up)
            raise ValueError(f"{policy}: {int((~seen).sum())} completions were never planned")
        t = time.process_time()
        plan = planner.plan()
        times.append(time.process_time() - t)
        check_plan(plan, index, caps)
        variants.append(plan.variant)
        s = plan.samples
        first = np.zeros(len(s), bool)
        distinct, at = np.unique(s, return_index=True)
        first[at] = ~seen[distinct]  # (a sample twice in one step: its first copy counts)
        seen[s] = True
        repeats += int((~first).sum())
        new.append(int(first.sum()))
        useful += work[s[first]].sum(0)
        planned += work[s].sum(0)
        for p, need in step_tiles(plan, index, caps).items():
            most[p] = max(most[p], int(need.max(initial=0)))
            tiles_planned[p] += float(need.sum())
        for p, v in useful_tiles(plan, index, caps, first).items():
            tiles_useful[p] += v
        if window:
            window_useful += useful_window_tiles(plan, index, caps, first, window)
            window_planned += float(step_window_tiles(plan, index, caps, window).sum())
    steps = len(times)
    by_step = [caps.tile_caps(v) if policy in HOLDS_TILES else most for v in variants]
    computed = {p: float(np.mean([c[p] for c in by_step])) for p in PHASES}
    cap_window = float(np.mean([window_cap(caps, c[LLM], weights[LLM]) for c in by_step]))
    buckets = steps * devices * micro
    cap_units = np.array(
        [caps.llm_rows * caps.llm_row_len, *(caps.units[p] for p in NAMES)], np.float64
    )
    capacity = buckets * cap_units
    fill = np.divide(planned, capacity, out=np.zeros(len(PHASES)), where=capacity > 0)
    hosts = len(planner.host_devices) if policy == "grain" else 1
    times = np.array(times) / hosts
    return {
        "policy": policy,
        "devices": devices,
        "samples": n,
        "planned_once": int(seen.sum()),
        "steps": steps,
        "fill": dict(zip(PHASES, fill.round(4).tolist(), strict=True)),
        "repeats": repeats,
        "new_per_step": new,
        "goodput": flop_share(
            useful, tiles_useful, caps, computed, buckets, weights, window_useful, cap_window
        ),
        "goodput_packed": flop_share(
            planned, tiles_planned, caps, computed, buckets, weights, window_planned, cap_window
        ),
        "useful_units": dict(zip(PHASES, useful.tolist(), strict=True)),
        "rollout_units": dict(zip(PHASES, work.sum(0).tolist(), strict=True)),  # (each once)
        "ms_per_step": 1000 * float(np.median(times)),
        "ms_per_rollout": 1000 * float(build / hosts + times.sum()),
        "tile_capacity": {p: round(v, 1) for p, v in computed.items()},
        "caps": {
            "llm_rows": caps.llm_rows,
            "llm_row_len": caps.llm_row_len,
            **{f"{p}_units": caps.units[p] for p in NAMES},
            "microbatches": micro,
        },
    }


HEADER = (
    f"{'policy':<13}{'D':>5}{'steps':>6}  fill llm vision  {'repeats':>7}  goodput  packed"
    f"  {'ms/step':>8}  {'ms/rollout':>10}  new a step"
)


def _fmt_row(r: dict) -> str:
    """A row of the table."""
    return (
        f"{r['policy']:<13}{r['devices']:>5}{r['steps']:>6}  {r['fill'][LLM]:.3f}  "
        f"{r['fill']['vision']:.3f}  {r['repeats']:>7}  {r['goodput']:7.3f}  "
        f"{r['goodput_packed']:6.3f}  {r['ms_per_step']:8.1f}  {r['ms_per_rollout']:10.1f}  "
        f"{','.join(map(str, r['new_per_step']))}"
    )


def main(argv: list[str] | None = None) -> int:
    """The command: the table on stdout, the rows in `--json`."""
    ap = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.rollouts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--mix", default="ai2d,chartqa", help=f"prompts: {', '.join(MIXES)}")
    src.add_argument("--lengths", help="prompts from a lengths JSONL file (DESIGN.md format)")
    ap.add_argument("--devices", default="8,64", help="device counts, comma-separated")
    ap.add_argument("--policies", default="orchestrated,grain")
    ap.add_argument("--prompts", type=int, default=128, help="prompts a rollout (P)")
    ap.add_argument("--group", type=int, default=8, help="completions a prompt (G)")
    ap.add_argument("--completion-median", type=float, default=256.0)
    ap.add_argument("--completion-sigma", type=float, default=1.0)
    ap.add_argument("--max-new", type=int, default=4096, help="longest completion (tokens)")
    ap.add_argument("--tokens", type=int, default=32768, help="LLM tokens per device and micro")
    ap.add_argument("--micro", type=int, default=2, help="microbatches per step")
    ap.add_argument("--block", type=int, default=128, help="attention block for the tiles")
    ap.add_argument("--devices-per-host", type=int, default=8)
    ap.add_argument("--config", default=CONFIG, help="the model the FLOPs are weighted by")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--per-completion",
        action="store_true",
        help="each completion a sample with its own copy of the prompt's media (not a group)",
    )
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    for name in ("prompts", "group", "block", "tokens", "micro"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.max_new < SHORTEST:
        ap.error(f"--max-new must be >= {SHORTEST}")
    try:
        devices = [int(x) for x in args.devices.split(",")]
    except ValueError:
        ap.error(f"--devices: comma-separated counts, got {args.devices!r}")
    cfg = bench_config(args.config, CONFIG)
    per_token = units_per_token(cfg)
    try:
        sources = length_tables(cfg, args.mix, args.lengths)
    except (OSError, ValueError) as e:
        return fail(e, 2)
    cost = CostModel.from_model(cfg.model)
    n = args.prompts * args.group
    med, sig = args.completion_median, args.completion_sigma
    grouped = 0 if args.per_completion else args.group
    opts = (args.tokens, args.micro, cost, args.block, args.devices_per_host, per_token, args.seed)
    opts += (grouped,)
    rows = []
    for name, table in sources:
        comp = completion_lengths(n, args.seed, med, sig, args.max_new)
        index = rollout_layout(table, args.prompts, args.group, comp, args.seed)
        llm = index.llm_tokens(per_token)
        clipped = int((comp >= args.max_new).sum())
        print(
            f"\n== {name}: {args.prompts} prompts x {args.group} = {n} completions, lognormal "
            f"median {med:g} sigma {sig:g} ({SHORTEST}..{args.max_new}): mean {comp.mean():.0f}, "
            f"p99 {np.percentile(comp, 99):.0f}, most {comp.max()}, {clipped} at the clip; "
            f"LLM tokens a completion: mean {llm.mean():.0f}, most {llm.max()}, "
            f"{llm.sum() / 1e6:.2f}M in all; --tokens {args.tokens}, --micro {args.micro}"
        )
        print(HEADER)
        for d in devices:
            for pol in args.policies.split(","):
                try:
                    row = plan_rollout(index, pol, d, *opts)
                except ValueError as e:  # an unknown policy, a completion too long for a row
                    return fail(e, 2)
                row["mix"] = name
                rows.append(row)
                print(_fmt_row(row), flush=True)
    if args.json:
        out = {
            "config": args.config,
            "prompts": args.prompts,
            "group": args.group,
            "layout": "per_completion" if args.per_completion else "grouped",
            "completions": {"median": med, "sigma": sig, "clip": [SHORTEST, args.max_new]},
            "counted": "each sample once (count_once); repeats computed, not useful",
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
