"""Balancer benchmark: every planner policy on the same workload, capacities and devices.

    python -m jaxmllm.bench.balance --mix omni,ai2d,chartqa --devices 8,64,512,2560 \\
        [--policies orchestrated,balanced,grain,naive] [--tokens 32768] [--micro 2] \\
        [--json OUT.json] [--plot OUT.png]
    python -m jaxmllm.bench.balance --lengths FILE.jsonl|INDEX_FOLDER --devices 64  # load timed
    python -m jaxmllm.bench.balance --mix omni --devices 8,64,512,2560 --simulate \
        [--devices-per-host 8] [--pair-capacity auto|whole] [--flops 4e14] \
        [--intra-bw 4.5e11] [--inter-bw 5e10] [--latency 1e-5]
    python -m jaxmllm.bench.balance --random 1 --seed 100 --family docqa --devices 64 \
        --policies orchestrated,grain,groups,long_groups,auto_groups [--group-size 4] \
        [--config configs/gpu/qwen3_vl_8b.yaml] [--context-strategy gather]  # context groups:
        # every step's (groups), or a context degree per step (long_groups: the long steps'),
        # or the one of the two that mesh.context_steps: auto keeps (auto_groups)
    python -m jaxmllm.bench.balance --context 2,4,8 [--mix ai2d,chartqa] [--tokens 8192] \
        [--groups 8] [--max-steps 8]   # context groups: per-rank tiles (jaxmllm.bench.context)

Capacities come from `suggest_capacities(..., match_llm=True)` for `--tokens` LLM tokens per
device and microbatch (the LLM length may move one ladder step to match the modality ratios; the
table header prints orchestrated's shapes: its encoder buckets hold the largest item, those of a
policy that keeps a sample's items on one device, as grain's, the largest sample's, `routed`).
The default, 32768, is in the range MaxText trains with (8k-32k a device) and large enough
that no single item dominates a device: with 16384 the omni mix has chats of 6000 tokens whose
attention alone is 1.7x a device's mean attention cost, so no plan can get `quad` near 1.

Per policy, one table row (all figures over the steps run, steady state included):
  fill       real units / capacity, per phase (llm / vision / audio); `*` marks the phases
             whose capacity binds (data demand within 2% of the largest)
  bound      (in each mix's header; JSON `fill_bound`) per phase, the highest fill any
             packing of the data's items into that phase's bins (LLM rows, a device's patches
             or frames) reaches over an epoch (`fill_bound`): coarse items hold it below 1
  steps/LB   steps taken / lower bound, the bound = max over phases of the planned work /
             (devices x microbatches x capacity)
  quad       max/mean over devices of the attention (quadratic) cost of a microbatch (a decoder's
             sliding-window layers priced by their window, `cost.model.window_sq`): phases are
             summed as sum_p max_d / sum_p mean_d (encoders and LLM are separated by the
             all-to-all, so each phase waits for its slowest device); `bound` = the same with
             each max_d replaced by max(mean, the largest single item): no plan of these samples
             can do better
  cv         coefficient of variation of the cost of a device's microbatch (one [m, d] bucket:
             the linear + quadratic cost, from the cost model, of every item it computes, all
             phases: its LLM rows and the images / clips it encodes), over all buckets of all
             steps; and the ratio random / ours, where `random` deals the same step's samples
             at random to the buckets, equal counts per (microbatch, device), media with their
             text. The JSON also has `micro_total_cv`: the same over whole microbatches (all
             devices summed), within each step, averaged over steps
  age        most steps any sample waited; deferred = mean samples carried to the next step
  routed     share of encoder output rows encoded on another device than their text
  inter      share of encoder output rows encoded on another host than their text's
             (`--devices-per-host`, default 8; the planner routes within a host first)
  pair       per-pair route capacity in rows, as the trainer sizes -1 (`route_caps`;
             `--pair-capacity whole`: a device's whole encoder output, `whole`, as before
             issue 18); the dense exchange's buffer is buckets x pair rows a device and phase
             (JSON: exchange_rows[_whole]; most_pair_rows: the most a pair carried)
  (first N)  when grain ran fewer steps (--grain-max-steps), a line with every policy's fill
             over the same first N steps (JSON: fill_first_steps; fill_per_step per row)
  tiles      attention tiles of `--block` tokens (block-sparse attention, `jaxmllm.plan.tiles`),
             all phases: `cap` = the tile capacity a device's bucket needs (orchestrated:
             the capacity it is given and holds, as the trainer sizes it: near the mean need,
             or a dry run's most where that is less; any other: the most its
             buckets needed over the run, the smallest capacity they never exceed, as the
             trainer's dry run gives it),
             `mean` = the mean need per bucket, `cap/mean` what a device computes over what it
             needs on average, `max/mean` = max over devices / mean per microbatch.
             --block 0 leaves them out
  goodput    (with tiles) useful FLOPs over the FLOPs the buckets compute (the cost model's
             per unit and per computed tile, `CostModel.tile_weights`): real units and the
             tiles their documents need, over every bucket's capacity in units and tiles.
             With context groups the JSON also has `exchange_share` (the groups' exchange
             priced in FLOPs, `jaxmllm.cost.exchange`, over the computed FLOPs: the --config
             model's decoder, --context-strategy) and `score` (useful FLOPs over computed plus
             exchange: what `mesh.context_steps: auto` compares, `jaxmllm.resolve.degree`);
             auto_groups runs groups and long_groups and keeps the higher score (`chose`;
             each one's figures in `<figure>_by_choice`)
  sim        (--simulate) predicted ms a step (`jaxmllm.bench.simulate`): `fl` compute alone,
             `ragged` / `dense` with that exchange, `x LB` = ragged x steps/LB (the time per
             lower-bound step of work: a policy that fills less takes more steps)
  ms/step    host planning time per step on one core: median over the steps after the first of
             time.process_time() around plan() (JSON: also the min); grain: per host, each host
             packs its own devices; `peak MB`: the process's peak resident memory so far
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from jaxmllm.bench import family, plot, simulate
from jaxmllm.bench.mixes import FAMILIES, MIXES, lengths_of, load_mix, peak_rss_mb, repatched
from jaxmllm.bench.sizes import make_caps, sized_caps, steps_for
from jaxmllm.bench.table import (
    HEADER,
    PHASES,
    SIM_HEADER,
    TILE_HEADER,
    format_row,
    print_like_for_like,
)
from jaxmllm.config import ModelConfig, load_config
from jaxmllm.config.command import fail, run
from jaxmllm.config.decoder import LLMConfig
from jaxmllm.config.phases import BY_NAME, LLM, NAMES
from jaxmllm.cost.exchange import FLOPS_PER_BYTE, step_bytes
from jaxmllm.cost.model import CostModel, window_sq
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.plan.contract import Capacities, StepPlan, check_plan, item_rows, pair_rows, step_tiles
from jaxmllm.plan.registry import HOLDS_TILES, make_planner
from jaxmllm.resolve.capacity import (
    fill_bound,
)
from jaxmllm.resolve.tilesize import flop_parts, step_window_tiles, window_cap

POLICIES = ("orchestrated", "balanced", "grain", "naive")  # the default --policies
# orchestrated with context groups of --group-size devices (--policies may name them):
# (context, long_context) of its capacities: every step's groups, or the long variants' alone
# (a context degree per step; the base steps plan each device's own rows)
GROUPED = {"groups": lambda c: (c, 0), "long_groups": lambda c: (1, c)}
AUTO = "auto_groups"  # (both of GROUPED, the higher `score` kept: mesh.context_steps: auto)


class _Items:
    """Per-sample and per-item sizes of an index, in each phase's attention units."""

    def __init__(self, index: LengthsIndex, caps: Capacities):
        """Each sample's work per phase in attention units at these capacities ([sample, phase];
        the LLM's column apart)."""
        self.index = index
        self.work = index.work(caps.per_token)  # [sample, phase]
        self.llm = self.work[:, 0]
        self.caps = caps


def phase_loads(plan: StepPlan, items: _Items, cost: CostModel, rng=None):
    """Per phase [M, D] arrays: attention cost, real cost, largest item's attention cost per
    micro (the attention cost: the quadratic term, and the windowed one of a decoder's
    sliding-window layers).

    With `rng`, the plan's samples are dealt at random instead (equal counts per bucket)."""
    caps, idx = items.caps, items.index
    m_n, d_n = caps.microbatches, caps.devices
    micro, dev = plan.micro, plan.device
    if rng is not None:
        slot = rng.permutation(len(plan.samples)) % (m_n * d_n)
        micro, dev = slot % m_n, slot // m_n
    out = {}
    s = plan.samples
    units = {"llm": (items.llm[s], micro, dev, 1)}
    group = 1 if rng is not None else caps.at(plan.variant).context
    for p in NAMES:
        it, per = plan.items[p], caps.row_units(p)
        size = idx.items[p].size(s[it.owner], it.item)
        d = it.device if rng is None else dev[it.owner]
        units[p] = (size, micro[it.owner], d, per)
    for p, (size, m, d, per) in units.items():
        c = cost.phase(p)
        q = np.zeros((m_n, d_n))
        real = np.zeros((m_n, d_n))
        big = np.zeros(m_n)
        if len(size):
            qq = (size / per) ** 2 * per * per  # attention over encoder rows, in units^2
            attention = qq * c.quadratic + c.windowed * window_sq(size, c.window)
            ranks = group if p == "llm" else 1  # (a context group's LLM: a rank's share each)
            for k in range(ranks):
                np.add.at(q, (m, d * ranks + k), attention / ranks)
                np.add.at(real, (m, d * ranks + k), c.item_cost(size) / ranks)
            np.maximum.at(big, m, attention / ranks)
        out[p] = (q, real, big)
    return out


def run_policy(
    policy: str,
    index: LengthsIndex,
    devices: int,
    tokens: int,
    micro: int,
    steps: int,
    cost: CostModel,
    seed: int = 0,
    block: int = 0,
    per_host: int = 0,
    pair: str = "auto",
    machine: simulate.Machine | None = None,
    merge_area: int = 4,
    groups: tuple[int, int] = (1, 0),
    exchange: tuple[LLMConfig, str, int] | None = None,
) -> tuple[dict, list]:
    """Runs planner `policy` for `steps` steps on `index` over `devices` devices (`tokens` an LLM
    row's, `micro` microbatches, `merge_area` patches an LLM token, capacities sized as a run
    sizes them) and measures each plan:
    fill per phase, steps over the lower bound, attention balance, microbatch variation,
    deferral, routing and the planner's ms a step. Returns the summary row and each step's
    figures. `groups`: (context, long_context) of the capacities (`Capacities`: context
    groups of every step, or of the long variants alone); `exchange`: (the decoder, its
    context strategy, bytes an element) that prices the groups' exchange (`score`)."""
    caps = make_caps(
        index,
        devices,
        tokens,
        micro,
        policy,
        merge_area,
        block=block,
        devices_per_host=per_host,
        context=groups[0],
        long_context=groups[1],
    )
    whole = caps.route_pair_capacity
    caps = sized_caps(index, caps, policy, steps, cost, seed, pair)
    items = _Items(index, caps)
    planner = make_planner(policy, index, caps, seed)
    cap_vec = np.array(
        [caps.llm_rows * caps.llm_row_len, *(caps.units[p] for p in NAMES)], np.float64
    )
    rng = np.random.default_rng([seed, devices])
    work = np.zeros(1 + len(NAMES))
    quad, bound, ours_cost, rand_cost, micro_cv = [], [], [], [], []
    ages, deferred, routed, remote_rows, times = 0, [], 0.0, 0.0, []
    inter_rows, most_pair, sim = 0.0, 0, []
    host = min(per_host or devices, devices)  # devices a host (0: one host)
    first_plan = None
    step_fill = []  # per step, real units / capacity per phase
    tile_need, tile_spread, tile_most = [], [], dict.fromkeys(PHASES, 0)
    tile_total = dict.fromkeys(PHASES, 0.0)
    weights = cost.tile_weights(block, caps.per_row, caps.context) if block else {}
    window = weights[LLM].window if block else 0  # (windowed layers' own list: its tiles)
    window_total = 0.0
    variants = []  # each step's (`plan.ladder`: 1 for a long step)
    for _ in range(steps):
        t = time.process_time()
        plan = planner.plan()
        times.append(time.process_time() - t)
        check_plan(plan, index, caps)
        first_plan = first_plan or plan
        step_work = items.work[plan.samples].sum(0)
        work += step_work
        step_cap = devices * micro * cap_vec
        step_fill.append(np.divide(step_work, step_cap, out=np.zeros(3), where=step_cap > 0))
        loads = phase_loads(plan, items, cost)
        rand = phase_loads(plan, items, cost, rng)
        num = sum(q.max(1) for q, _, _ in loads.values())
        den = sum(q.mean(1) for q, _, _ in loads.values())
        bnd = sum(np.maximum(q.mean(1), b) for q, _, b in loads.values())
        ok = den > 0
        quad += list(num[ok] / den[ok])
        bound += list(bnd[ok] / den[ok])
        ours_cost += list(sum(r for _, r, _ in loads.values()).ravel())
        rand_cost += list(sum(r for _, r, _ in rand.values()).ravel())
        totals = sum(r.sum(1) for _, r, _ in loads.values())
        micro_cv.append(float(np.std(totals) / np.mean(totals)) if np.mean(totals) > 0 else 0.0)
        ages = max(ages, int(planner.ages.max(initial=0)))
        variants.append(plan.variant)
        if block:
            need = step_tiles(plan, index, caps)  # per phase [M, D]
            view = caps.at(plan.variant)
            if view.context > 1:  # (a context group's LLM tiles: a rank's share each)
                need[LLM] = np.repeat(need[LLM] / view.context, view.context, axis=1)
            for p, n in need.items():
                tile_most[p] = max(tile_most[p], int(n.max(initial=0)))
                tile_total[p] += float(n.sum())
            total = sum(need.values())
            tile_need += total.ravel().tolist()
            mean = total.mean(1)
            tile_spread += list(total.max(1)[mean > 0] / mean[mean > 0])
            if window:
                window_total += float(step_window_tiles(plan, index, caps, window).sum())
        deferred.append(plan.deferred)
        view = caps.at(plan.variant)  # (its LLM buckets: devices, or context groups)
        for p in NAMES:
            it = plan.items[p]
            rows = item_rows(plan, index, view, p)
            home = plan.device[it.owner] * view.context  # (its group's first device)
            routed += rows.sum()
            remote_rows += rows[it.device // view.context * view.context != home].sum()
            inter_rows += rows[it.device // host != home // host].sum()
            most_pair = max(most_pair, int(pair_rows(plan, index, view, p).max(initial=0)))
        if machine:
            cost_md = {p: loads[p][1] for p in ("vision", "audio", "llm")}
            sim.append(simulate.plan_times(plan, index, caps.at(plan.variant), cost_md, machine))
    capacity = steps * devices * micro * cap_vec
    fill = np.divide(work, capacity, out=np.zeros(3), where=capacity > 0)
    lower = max(work / np.where(cap_vec > 0, devices * micro * cap_vec, np.inf))
    demand = np.where(cap_vec > 0, items.work.sum(0) / np.maximum(cap_vec, 1), 0)
    steady = np.array(times[1:] if len(times) > 1 else times)
    if policy == "grain":
        steady = steady / len(planner.host_devices)
    cv = lambda x: float(np.std(x) / np.mean(x)) if np.mean(x) > 0 else 0.0
    row = {
        "policy": policy,
        "devices": devices,
        "steps": steps,
        "fill": dict(zip(PHASES, fill.round(4).tolist(), strict=True)),
        "fill_per_step": np.round(step_fill, 5).tolist(),
        "binding": [
            p for p, dm in zip(PHASES, demand, strict=True) if dm > 0 and dm >= 0.98 * demand.max()
        ],
        "fill_bound": fill_bound(index, caps),
        "steps_over_lb": float(steps / lower) if lower > 0 else float("inf"),
        "quad_max_mean": float(np.mean(quad)),
        "quad_max_mean_worst": float(np.max(quad)),
        "quad_bound": float(np.mean(bound)),
        "micro_cv": cv(ours_cost),
        "random_cv": cv(rand_cost),
        "micro_total_cv": float(np.mean(micro_cv)),
        "max_age": ages,
        "deferred": float(np.mean(deferred)),
        "routed": float(remote_rows / routed) if routed else 0.0,
        "routed_intra": float((remote_rows - inter_rows) / routed) if routed else 0.0,
        "routed_inter": float(inter_rows / routed) if routed else 0.0,
        "devices_per_host": host,
        "most_pair_rows": most_pair,
        # the dense exchange's buffer per device and phase: LLM buckets (devices, or context
        # groups) x route_pair_capacity rows
        "exchange_rows": caps.llm_buckets * caps.route_pair_capacity,
        "exchange_rows_whole": caps.llm_buckets * whole if caps.route_pair_capacity else 0,
        "ms_per_step": 1000 * float(np.median(steady)),
        "ms_per_step_min": 1000 * float(np.min(steady)),
        "caps": {
            "llm_rows": caps.llm_rows,
            "llm_row_len": caps.llm_row_len,
            **{BY_NAME[p].capacity: caps.units[p] for p in NAMES},
            "route_pair_capacity": caps.route_pair_capacity,
            "route_pair_whole": whole if caps.route_pair_capacity else 0,
            "microbatches": micro,
        },
    }
    if sim:
        row["simulated"] = {k: 1000 * float(np.mean([s[k] for s in sim])) for k in sim[0]}
        # per lower-bound step of work: what compares policies that fill differently
        row["simulated"]["work_ragged"] = row["simulated"]["step_ragged"] * row["steps_over_lb"]
    if block:
        holds = policy in HOLDS_TILES
        caps_by_phase = caps.tile_caps() if holds else tile_most
        ladder = [caps.tile_caps(v) for v in range(1, caps.variants)] if holds else []
        # what a bucket computes, on average over the steps (a long step: its variant's)
        by_step = [caps.tile_caps(v) if v else caps_by_phase for v in variants]
        computed = {p: float(np.mean([c[p] for c in by_step])) for p in caps_by_phase}
        long_by_phase = ladder[-1] if ladder else {}
        row["tile_capacity"] = int(sum(caps_by_phase.values()))
        row["tile_capacity_long"] = int(sum(long_by_phase.values()))
        row["long_steps"] = int(np.count_nonzero(variants))
        row["tile_ladder"] = [int(sum(c.values())) for c in ladder]  # (each long variant's)
        cap_window = np.mean([window_cap(caps, c[LLM], weights[LLM]) for c in by_step])
        buckets = steps * devices * micro
        useful, total = flop_parts(
            work, tile_total, caps, computed, buckets, weights, window_total, float(cap_window)
        )
        row["goodput"] = useful / total if total > 0 else 0.0
        size = max(caps.context, caps.long_context)
        if exchange is not None and size > 1:  # (every step split, or the long steps)
            llm, strategy, itemsize = exchange
            split = steps if caps.context > 1 else row["long_steps"]
            moved = step_bytes(llm, strategy, caps.llm_rows * caps.llm_row_len, size, itemsize)
            priced = split * micro * devices * moved * FLOPS_PER_BYTE
            row["exchange_share"] = priced / total if total > 0 else 0.0
            row["score"] = useful / (total + priced) if total + priced > 0 else 0.0
        row["tile_capacity_by_phase"] = dict(caps_by_phase)
        row["tile_capacity_long_by_phase"] = dict(long_by_phase)
        row["tile_mean"] = float(np.mean(tile_need))
        row["tile_max_mean"] = float(np.mean(tile_spread)) if tile_spread else 0.0
        row["tile_cap_over_mean"] = sum(computed.values()) / max(row["tile_mean"], 1e-9)
        row["block"] = block
    return row, [first_plan, items]


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxmllm.bench.balance`: every planner policy on the same workload (a lengths
    file, built-in mixes or --random families of them), capacities and device counts; prints the
    table (and --json, --plot). Exit code 0, 2 for bad arguments."""
    ap = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.balance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--lengths", help="lengths: JSONL, an InternVL table, or an index folder")
    src.add_argument("--mix", help=f"built-in mix(es), comma-separated: {', '.join(MIXES)}")
    src.add_argument(
        "--random",
        type=int,
        metavar="N",
        help="N random workloads (mixes.random_mix, seeds --seed..+N-1), then the "
        "distribution of each figure over them (bench/family.py)",
    )
    ap.add_argument("--seed", type=int, default=0, help="first seed of --random")
    ap.add_argument(
        "--family",
        choices=tuple(FAMILIES),
        default="random",
        help="--random's workloads: mixes.random_mix (every kind of sample), "
        "mixes.video_mix (video-heavy, long videos), tails.docqa_mix (documents "
        "with a rare tail of 30k tokens), tails.chats_mix (long-tailed chats with "
        "images and clips)",
    )
    ap.add_argument(
        "--samples",
        type=int,
        default=0,
        help="samples of a synthetic --mix or --random workload (0: its own "
        "default: 20k, 200k for the long-tailed ones)",
    )
    ap.add_argument("--devices", default="8,64", help="device counts, comma-separated")
    ap.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"of {', '.join(POLICIES)}, and {', '.join(GROUPED)}, {AUTO} (orchestrated with "
        "context groups: every step's, the long steps' alone, or the one of those two that "
        "mesh.context_steps: auto keeps)",
    )
    ap.add_argument(
        "--group-size", type=int, default=4, help="devices a context group (--policies groups)"
    )
    ap.add_argument(
        "--context-strategy",
        default="gather",
        choices=("gather", "ulysses"),
        help="the groups' exchange priced in `score` (mesh.context_strategy)",
    )
    ap.add_argument("--tokens", type=int, default=32768, help="LLM tokens per device and micro")
    ap.add_argument("--micro", type=int, default=2, help="microbatches per step")
    ap.add_argument(
        "--block",
        type=int,
        default=128,
        help="attention block for the tile columns (0: leave them out)",
    )
    ap.add_argument(
        "--min-steps",
        type=int,
        default=8,
        help="at least this many steps (timing: the median of all but the first)",
    )
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument(
        "--grain-max-steps",
        type=int,
        default=None,
        help="fewer steps for the (slow, pure Python) grain packer",
    )
    ap.add_argument(
        "--devices-per-host",
        type=int,
        default=8,
        help="data-parallel devices a host (routing: within a host first)",
    )
    ap.add_argument(
        "--pair-capacity",
        choices=("auto", "whole"),
        default="auto",
        help="route capacity: the trainer's auto, or a whole output",
    )
    ap.add_argument("--simulate", action="store_true", help="predicted step times (simulate)")
    ap.add_argument("--flops", type=float, default=400e12, help="--simulate: FLOP/s a device")
    ap.add_argument("--intra-bw", type=float, default=450e9, help="--simulate: B/s in a host")
    ap.add_argument("--inter-bw", type=float, default=50e9, help="--simulate: B/s across hosts")
    ap.add_argument("--latency", type=float, default=10e-6, help="--simulate: s an exchange")
    ap.add_argument("--json", help="write all rows here")
    ap.add_argument(
        "--cost-file",
        help="a calibrated cost model (python -m jaxmllm.cost.calibrate RUN_DIR) for the "
        "cost columns; default the FLOP model of the default model config",
    )
    ap.add_argument(
        "--linear-every",
        type=int,
        default=0,
        help="price a hybrid LLM: full attention every N-th layer, Gated DeltaNet elsewhere "
        "(Qwen3.5: 4), same width; 0: every layer full attention",
    )
    ap.add_argument("--plot", help="PNG of per-device load of one step (needs matplotlib)")
    ap.add_argument(
        "--config",
        default="",
        help="a config whose model prices the items (its towers' sizes, what trains: e.g. "
        "configs/gpu/qwen3_vl_8b.yaml) and whose patch size and merge the built-in mixes' "
        "images take (written in 14 px patches: the same pixels in its patches)",
    )
    ap.add_argument("--context", help="context sizes (jaxmllm.bench.context's split tiles)")
    ap.add_argument("--groups", type=int, default=8, help="--context: context groups")
    args = ap.parse_args(argv)
    if args.context:
        from jaxmllm.bench import context

        return context.from_balance(args)
    if not (args.lengths or args.mix or args.random):
        ap.error("one of the arguments --lengths --mix --random (or --context) is required")
    model = load_config(args.config).model if args.config else ModelConfig()
    if args.linear_every:  # (the cost model's quadratic term: its full-attention layers only)
        linear = dataclasses.replace(model.llm.linear, every=args.linear_every)
        model = dataclasses.replace(model, llm=dataclasses.replace(model.llm, linear=linear))
    v = model.vision
    row_bytes = 2 * model.llm.width  # (an encoder output row: the LLM width in bf16)
    sim = (args.flops, args.intra_bw, args.inter_bw, args.latency, row_bytes)
    machine = simulate.Machine(*sim) if args.simulate else None
    try:
        cost = CostModel.from_file(args.cost_file) if args.cost_file else None
        if args.lengths:
            sources = [(Path(args.lengths).name, lengths_of(args.lengths))]
        elif args.random:
            seeds = range(args.seed, args.seed + args.random)
            draw = FAMILIES[args.family]
            sources = [(f"{args.family}:{s}", draw(s, args.samples)) for s in seeds]
        else:
            sources = [(m, load_mix(m, samples=args.samples)) for m in args.mix.split(",")]
            if args.config:  # (the same pixels in the config's patches)
                sources = [(m, repatched(i, v.patch_size, v.merge)) for m, i in sources]
    except (OSError, ValueError) as e:  # a missing table, an unknown mix, a bad cost file
        return fail(e, 2)
    cost = cost or CostModel.from_model(model)
    itemsize = np.dtype(model.compute_dtype).itemsize  # (the exchange's elements)
    area = v.merge**2  # (patches an LLM token: the model's merge, 2 x 2 by default)
    rows, plots = [], {}
    for name, index in sources:
        c = make_caps(index, 1, args.tokens, args.micro, "orchestrated", area, block=args.block)
        fits = int(index.llm_tokens(c.per_token).max(initial=0)) <= c.llm_row_len  # (no groups)
        print(
            f"\n== {name}: {len(index)} samples, --tokens {args.tokens}: buckets of "
            f"{c.llm_rows}x{c.llm_row_len} LLM tokens, "
            + ", ".join(f"{c.units[p]} {BY_NAME[p].unit}" for p in NAMES)
            + f"; {args.micro} microbatches; packing bound on fill "
            + " ".join(f"{v:.3f}" for v in fill_bound(index, c).values())
        )
        print(HEADER + (TILE_HEADER if args.block else "") + (SIM_HEADER if machine else ""))
        for d in (int(x) for x in args.devices.split(",")):
            steps = steps_for(index, d, args.tokens, args.micro, args.min_steps, args.max_steps)
            for pol in args.policies.split(","):
                n = steps
                if pol == "grain" and args.grain_max_steps:
                    n = min(steps, args.grain_max_steps)
                tried = []
                # (auto: in `resolve.degree`'s order, which a tie keeps: none, where every
                # sample fits a device's row, then long, then all)
                choices = {"long": "long_groups", "all": "groups"}
                if fits:
                    choices = {"none": "orchestrated", **choices}
                names = tuple(choices.values()) if pol == AUTO else (pol,)
                for each in names:
                    grouped = GROUPED.get(each)
                    tried.append(
                        run_policy(
                            "orchestrated" if grouped else each,
                            index,
                            d,
                            args.tokens,
                            args.micro,
                            n,
                            cost,
                            block=args.block,
                            per_host=args.devices_per_host,
                            pair=args.pair_capacity,
                            machine=machine,
                            merge_area=area,
                            groups=grouped(args.group_size) if grouped else (1, 0),
                            exchange=(model.llm, args.context_strategy, itemsize),
                        )
                    )
                if pol == AUTO:
                    for got, _ in tried:  # (no groups: nothing moved, its goodput its score)
                        got.setdefault("score", got.get("goodput", 0.0))
                        got.setdefault("exchange_share", 0.0)
                k = max(range(len(tried)), key=lambda i: tried[i][0].get("score", 0.0))
                row, first = tried[k]
                if pol == AUTO:
                    row["chose"] = list(choices)[k]
                    for key in ("score", "goodput", "exchange_share", "long_steps"):
                        got = [t[0].get(key) for t in tried]
                        row[f"{key}_by_choice"] = dict(zip(choices, got, strict=True))
                row.update(
                    policy=pol, mix=name, peak_rss_mb=peak_rss_mb(), linear_every=args.linear_every
                )
                rows.append(row)
                plots[(name, d, pol)] = first
                print(format_row(row), flush=True)
            print_like_for_like([r for r in rows if r["mix"] == name and r["devices"] == d])
    if args.random:
        print(f"\n== over {args.random} {args.family} workloads (seeds {args.seed}..)")
        print(family.table(family.summarize(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.plot:
        name, d = sources[0][0], int(args.devices.split(",")[0])
        base = "grain" if (name, d, "grain") in plots else "naive"
        if (name, d, base) in plots and (name, d, "orchestrated") in plots:
            plot.plot_step(
                [plots[(name, d, base)], plots[(name, d, "orchestrated")]],
                Path(args.plot),
                f"{name}, {d} devices, step 0",
                (base, "orchestrated"),
            )
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
