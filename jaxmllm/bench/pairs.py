"""Preference pairs on the planner: packed pairs against grain's packer, and what encoding a
pair's media once saves.

    python -m jaxmllm.bench.pairs [--mix ai2d,chartqa | --lengths FILE.jsonl] [--devices 8,64] \\
        [--steps 8] [--policies orchestrated,grain] [--tokens 32768] [--micro 2] [--block 128] \\
        [--config configs/gpu/qwen3_vl_8b_dpo.yaml] [--completion-median 128] \\
        [--completion-sigma 0.8] [--completion-own 0.4] [--seed 0] [--one-document] \\
        [--json OUT.json]

The pair-length mix: each sample of a real length table (`--mix`: the InternVL tables of
`jaxmllm.bench.mixes`, their images in the config's patches) is a prompt: its text tokens and its
images (the tables' text holds the sample's short answer too: it is counted as prompt). Each
prompt gets two completions, chosen and rejected, drawn lognormal (seeded by `--seed`): median
`--completion-median` tokens (128), spread `--completion-sigma` (0.8) of which `--completion-own`
(0.4) is each side's own and the rest shared by the pair (the two answers to one prompt are
alike in length: correlation 1 - own^2 / sigma^2 = 0.75 in log length), clipped to 4..2048
tokens. Two layouts of the same pairs:

- `paired`: what jaxmllm trains (docs/preference.md): a pair is ONE sample, both documents in
  one row, its media listed (and encoded) once; its index row's text = both documents' tokens
  less one copy of the placeholder rows, so its LLM length is both documents' tokens, and its
  `split` the first document's tokens, so the planner prices its attention as the two
  documents it is (`--one-document`: without the split, a pair priced as one document of both
  lengths, as the planner did before the index said where a pair splits).
- `unpaired`: what a trainer that knows no pairs does: chosen and rejected as two samples, each
  with its own copy of the media (the vision phase encodes every image twice) and planned
  independently (the two halves of a pair may land on different devices or steps).

Per mix, layout, device count and policy, one row (capacities: `bench.sizes.make_caps` for
`--tokens` LLM tokens a device and microbatch, matched to the layout's own modality ratio, as
`batch.capacity: auto` sizes them; the policies of a layout at the same capacities; the tile
capacities as `bench.balance` sizes them):

  fill        real units / capacity, per phase (LLM tokens, vision patches)
  pairs/step  pairs a step trains (unpaired: documents / 2)
  TFLOP/pair  what the buckets compute (capacity, padding included: units and attention tiles
              of `--block`, weighted by the cost model below) per pair trained
  quad        max/mean over devices of the attention (quadratic) cost of a microbatch, phases
              summed as sum_p max_d / sum_p mean_d (as bench.balance; here each document of a
              pair priced alone, as attention computes it); `bound` with each max replaced by
              max(mean, the largest single item)
  goodput     useful FLOPs (real units, and the tiles each document needs alone) over computed
              FLOPs (every bucket's capacity in units and tiles). `priced`: the same with the
              useful tiles as the planner counts them: the same, but under `--one-document`
              (a pair priced as one document of both lengths, its tile capacity sized for
              tiles the two documents never use)
  split       unpaired: share of the pairs (both halves planned in the steps run) whose halves
              landed on different devices or steps
  ms/step     host planning time a step, median after the first (grain: per host)

Then the FLOPs of the same pairs, useful work only (no padding), by the cost model of
`--config`: its training FLOPs per phase plus, where its step runs a reference policy (not
simpo's, nor `preference.reference: precomputed`), the reference's forward pass over the same
batch (`jaxmllm.step.preference` runs the whole model again, encoders included, without
gradient; the adapters a LoRA reference switches off are not counted in it). Per pair: the
vision encoder (with its projector) and the LLM, each layout; what pairing saves; and per step,
the pairs a `paired` step trains at each device count (the first policy). The LLM's FLOPs are
the same in both layouts (the same documents, each attending to itself), and what the planner
prices a pair's LLM at (printed beside: its two documents; one of both lengths under
`--one-document`).

Planner simulations on the host: no device runs, no timing claim beyond the host's planning.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from jaxmllm.bench.mixes import MIXES, bench_config, length_tables, units_per_token
from jaxmllm.bench.sizes import make_caps, sized_caps
from jaxmllm.config.command import fail, run
from jaxmllm.config.phases import LLM, NAMES, PHASES
from jaxmllm.cost.model import CostModel, PhaseCost
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.plan.contract import Capacities, check_plan, phase_docs, step_tiles
from jaxmllm.plan.registry import HOLDS_TILES, make_planner
from jaxmllm.plan.tiles import bin_tiles, window_reach
from jaxmllm.resolve.tilesize import flop_share, step_window_tiles, window_cap
from jaxmllm.step.preference import uses_reference

CONFIG = "configs/gpu/qwen3_vl_8b_dpo.yaml"  # the default model: Qwen3-VL-8B's shapes, DPO + LoRA
SHORTEST, LONGEST = 4, 2048  # completion tokens (the lognormal's clip)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One layout of a pair-length mix: its lengths index, the LLM tokens of each document a
    sample holds ([S, 2], 0 where it holds one) and the pair each sample belongs to."""

    name: str  # "paired" | "unpaired"
    index: LengthsIndex
    docs: np.ndarray  # int64 [S, 2]
    pair: np.ndarray  # int64 [S]
    pairs: int


def completions(
    n: int, seed: int, median: float = 128, sigma: float = 0.8, own: float = 0.4
) -> tuple[np.ndarray, np.ndarray]:
    """(chosen, rejected) completion tokens of `n` pairs: lognormal around `median` with spread
    `sigma`, of which `own` is each side's and the rest the pair's (shared), clipped to
    SHORTEST..LONGEST."""
    if not 0 <= own <= sigma:
        raise ValueError(f"--completion-own must be within 0..--completion-sigma, got {own}")
    rng = np.random.default_rng([seed, 51])
    mu = np.log(median) + rng.normal(0.0, np.sqrt(sigma**2 - own**2), n)
    side = lambda: np.clip(np.exp(mu + rng.normal(0.0, own, n)), SHORTEST, LONGEST)
    return side().astype(np.int64), side().astype(np.int64)


def pair_layouts(
    prompts: LengthsIndex,
    chosen: np.ndarray,
    rejected: np.ndarray,
    per_token: dict[str, int],
    split: bool = True,
) -> tuple[Layout, Layout]:
    """The `paired` and `unpaired` layouts of the pairs (prompt i, chosen[i], rejected[i]);
    `split`: the paired index says where each pair splits (else a pair is priced as one
    document of both lengths)."""
    n = len(prompts)
    slots = prompts.llm_tokens(per_token) - prompts.text  # placeholder rows of a prompt's media
    prompt = prompts.text + slots  # LLM tokens of one prompt
    docs = np.stack([prompt + chosen, prompt + rejected], 1).astype(np.int64)
    # one sample: both documents' text, one copy of the placeholder rows (LLM: both documents)
    text = 2 * prompts.text + slots + chosen + rejected
    paired = LengthsIndex(
        text=text.astype(np.int64), items=dict(prompts.items), split=docs[:, 0] if split else None
    )
    order = np.repeat(np.arange(n), 2)  # chosen, rejected of pair 0, then of pair 1, ...
    halves = np.stack([chosen, rejected], 1).ravel()
    unpaired = LengthsIndex(
        text=(prompts.text[order] + halves).astype(np.int64),
        items={p: items.take(order) for p, items in prompts.items.items()},
    )
    one = np.stack([docs.ravel(), np.zeros(2 * n, np.int64)], 1)
    return (
        Layout("paired", paired, docs, np.arange(n), n),
        Layout("unpaired", unpaired, one, order, n),
    )


def forward_only(model):
    """`model` with nothing trained: its cost model is one forward pass (the reference's)."""
    off = lambda tower: dataclasses.replace(
        tower, freeze=True, lora=dataclasses.replace(tower.lora, rank=0)
    )
    return dataclasses.replace(
        model,
        vision=off(model.vision),
        audio=off(model.audio),
        llm=off(model.llm),
        projector_freeze=True,
        projector_lora=dataclasses.replace(model.projector_lora, rank=0),
    )


def dpo_cost(cfg) -> tuple[CostModel, bool]:
    """The FLOPs a step of `cfg` as a DPO run spends per unit of each phase: training plus,
    where its step runs a reference policy (not simpo's, nor precomputed log-probs), the
    reference's forward; and whether the reference counts."""
    train = CostModel.from_model(cfg.model)
    as_dpo = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, objective="dpo"))
    if not uses_reference(as_dpo):
        return train, False
    ref = CostModel.from_model(forward_only(cfg.model))
    terms = {
        p: PhaseCost(
            train.phase(p).linear + ref.phase(p).linear,
            train.phase(p).quadratic + ref.phase(p).quadratic,
            train.phase(p).windowed + ref.phase(p).windowed,
            train.phase(p).window,  # (one model: the reference's window is the policy's)
        )
        for p in PHASES
    }
    return CostModel(terms), True


def _loads(plan, layout: Layout, caps: Capacities, cost: CostModel):
    """Per phase [M, D] attention cost, each document alone, and per microbatch its largest."""
    m_n, d_n = caps.microbatches, caps.devices
    out = {}
    s = plan.samples
    docs = layout.docs[s]
    where = (np.tile(plan.micro, 2), np.tile(plan.device, 2), docs.T.ravel())
    for p in PHASES:
        if p == LLM:
            micro, dev, size = where
        else:
            micro, dev, _, _, rows = phase_docs(plan, layout.index, caps, p)
            size = rows * caps.row_units(p)
        q = np.zeros((m_n, d_n))
        big = np.zeros(m_n)
        if len(size):
            qq = cost.phase(p).attention_cost(size)
            np.add.at(q, (micro, dev), qq)
            np.maximum.at(big, micro, qq)
        out[p] = (q, big)
    return out


def _llm_tiles(plan, layout: Layout, caps: Capacities, window: int = 0) -> np.ndarray:
    """LLM tiles each bucket needs [M, D] with each document of a pair alone (what the
    planner counts too where the index says where a pair splits: not under
    `--one-document`); with a `window`, the tiles it reaches (the windowed layers' list)."""
    s, rows = plan.samples, caps.llm_rows
    docs = layout.docs[s]
    bins = (plan.micro * caps.llm_buckets + plan.device) * rows + plan.row
    nbins = caps.microbatches * caps.llm_buckets * rows
    tiles = bin_tiles(
        np.concatenate([bins, bins]),
        np.concatenate([plan.offset, plan.offset + docs[:, 0]]),
        np.concatenate([docs[:, 0], docs[:, 1]]),
        nbins,
        caps.attention_block,
        True,
        window_reach(window, caps.attention_block),
    )
    return tiles.reshape(caps.microbatches, caps.llm_buckets, rows).sum(2)


class _Split:
    """Counts the pairs of the unpaired layout whose halves landed on different buckets or
    steps (each pair once both halves were planned)."""

    def __init__(self, pairs: int):
        self.where = np.full(pairs, -1, np.int64)
        self.both = self.split = 0

    def add(self, pair: np.ndarray, key: np.ndarray) -> None:
        order = np.argsort(pair, kind="stable")
        p, k = pair[order], key[order]
        same = p[1:] == p[:-1]  # both halves in this step
        self.both += int(same.sum())
        self.split += int((k[1:] != k[:-1])[same].sum())
        alone = ~(np.r_[same, False] | np.r_[False, same])
        p, k = p[alone], k[alone]
        prev = self.where[p]
        seen = prev >= 0
        self.both += int(seen.sum())
        self.split += int((prev[seen] != k[seen]).sum())
        self.where[p[seen]] = -1
        self.where[p[~seen]] = k[~seen]

    @property
    def share(self) -> float:
        return self.split / self.both if self.both else 0.0


def run_layout(
    layout: Layout,
    policy: str,
    devices: int,
    tokens: int,
    micro: int,
    steps: int,
    cost: CostModel,
    block: int = 128,
    per_host: int = 8,
    merge_area: int = 4,
    subsample: int = 4,
    seed: int = 0,
) -> dict:
    """One row: `policy` planning `steps` steps of `layout` on `devices` devices."""
    if block <= 0:
        raise ValueError("--block must be > 0 (the goodput counts attention tiles)")
    index = layout.index
    caps = make_caps(index, devices, tokens, micro, policy, merge_area, subsample, block, per_host)
    caps = sized_caps(index, caps, policy, steps, cost, seed)
    planner = make_planner(policy, index, caps, seed)
    work = index.work(caps.per_token)
    cap_units = np.array(
        [caps.llm_rows * caps.llm_row_len, *(caps.units[p] for p in NAMES)], np.float64
    )
    units = np.zeros(len(PHASES))
    real_tiles = dict.fromkeys(PHASES, 0.0)
    priced_tiles = dict.fromkeys(PHASES, 0.0)  # the planner's count (the index's documents)
    most = dict.fromkeys(PHASES, 0)  # the planner's own tile count, most a bucket needed
    weights = cost.tile_weights(block, caps.per_row, caps.context)
    window = weights[LLM].window  # (windowed layers with a list of their own: its tiles)
    real_window = priced_window = 0.0
    quad, bound, times, variants = [], [], [], []
    samples, split = 0, _Split(layout.pairs)
    for k in range(steps):
        t = time.process_time()
        plan = planner.plan()
        times.append(time.process_time() - t)
        check_plan(plan, index, caps)
        variants.append(plan.variant)
        units += work[plan.samples].sum(0)
        samples += len(plan.samples)
        for p, need in step_tiles(plan, index, caps).items():
            most[p] = max(most[p], int(need.max(initial=0)))
            priced_tiles[p] += float(need.sum())
            if p != LLM:
                real_tiles[p] += float(need.sum())
        real_tiles[LLM] += float(_llm_tiles(plan, layout, caps).sum())
        if window:
            real_window += float(_llm_tiles(plan, layout, caps, window).sum())
            priced_window += float(step_window_tiles(plan, index, caps, window).sum())
        loads = _loads(plan, layout, caps, cost)
        num = sum(q.max(1) for q, _ in loads.values())
        den = sum(q.mean(1) for q, _ in loads.values())
        bnd = sum(np.maximum(q.mean(1), b) for q, b in loads.values())
        ok = den > 0
        quad += list(num[ok] / den[ok])
        bound += list(bnd[ok] / den[ok])
        if layout.name == "unpaired":
            key = (k * micro + plan.micro) * devices + plan.device
            split.add(layout.pair[plan.samples], key)
    holds = policy in HOLDS_TILES
    by_step = [caps.tile_caps(v) if holds else most for v in variants]
    computed = {p: float(np.mean([c[p] for c in by_step])) for p in PHASES}
    # (the windowed layers' list: each step's capacity from its causal one)
    cap_window = float(np.mean([window_cap(caps, c[LLM], weights[LLM]) for c in by_step]))
    buckets = steps * devices * micro
    per_bucket = sum(
        weights[p].cost(cap_units[i], computed[p], cap_window if p == LLM else 0.0)
        for i, p in enumerate(PHASES)
    )
    pairs = samples / (2 if layout.name == "unpaired" else 1)
    steady = np.array(times[1:] if len(times) > 1 else times)
    if policy == "grain":
        steady = steady / len(planner.host_devices)
    capacity = steps * devices * micro * cap_units
    fill = np.divide(units, capacity, out=np.zeros(len(PHASES)), where=capacity > 0)
    return {
        "layout": layout.name,
        "policy": policy,
        "devices": devices,
        "steps": steps,
        "fill": dict(zip(PHASES, fill.round(4).tolist(), strict=True)),
        "pairs_per_step": pairs / steps,
        "tflop_per_pair": buckets * per_bucket / max(pairs, 1) / 1e12,
        "quad_max_mean": float(np.mean(quad)) if quad else 0.0,
        "quad_bound": float(np.mean(bound)) if bound else 0.0,
        "goodput": flop_share(
            units, real_tiles, caps, computed, buckets, weights, real_window, cap_window
        ),
        "goodput_priced": flop_share(
            units, priced_tiles, caps, computed, buckets, weights, priced_window, cap_window
        ),
        "split": split.share if layout.name == "unpaired" else 0.0,
        "ms_per_step": 1000 * float(np.median(steady)),
        "tile_capacity": {p: round(v, 1) for p, v in computed.items()},
        "caps": {
            "llm_rows": caps.llm_rows,
            "llm_row_len": caps.llm_row_len,
            **{f"{p}_units": caps.units[p] for p in NAMES},
            "microbatches": micro,
        },
    }


def pair_flops(paired: Layout, unpaired: Layout, cost: CostModel) -> dict:
    """Useful FLOPs per pair of each layout, per phase (each document priced alone), and the
    LLM as the planner prices a pair (the documents its index says it holds: its two, or
    without a split one of both lengths)."""
    out = {}
    for lay in (paired, unpaired):
        llm = cost.phase(LLM).item_cost(lay.docs).sum()
        enc = {p: float(cost.phase(p).item_cost(lay.index.items[p].sizes).sum()) for p in NAMES}
        out[lay.name] = {p: v / lay.pairs for p, v in {LLM: float(llm), **enc}.items()}
    priced = paired.docs.sum(1) if paired.index.split is None else paired.docs
    out["paired"]["llm_planned"] = float(cost.phase(LLM).item_cost(priced).sum()) / paired.pairs
    out["paired"]["llm_planned_as"] = "one" if paired.index.split is None else "two"
    saved = sum(out["unpaired"][p] - out["paired"][p] for p in PHASES)
    total = sum(out["unpaired"][p] for p in PHASES)
    vision = out["unpaired"]["vision"]
    out["saved_per_pair"] = saved
    out["saved_vision_share"] = (vision - out["paired"]["vision"]) / vision if vision else 0.0
    out["saved_share"] = saved / total if total else 0.0
    return out


def _fmt_row(r: dict) -> str:
    split = f"{r['split']:5.3f}" if r["layout"] == "unpaired" else "    -"
    return (
        f"{r['layout']:<9}{r['policy']:<13}{r['devices']:>5}  {r['fill'][LLM]:.3f}  "
        f"{r['fill']['vision']:.3f}  {r['pairs_per_step']:10.1f}  {r['tflop_per_pair']:10.2f}  "
        f"{r['quad_max_mean']:5.2f} ({r['quad_bound']:4.2f})  {r['goodput']:7.3f} "
        f"{r['goodput_priced']:7.3f}  {split}  "
        f"{r['ms_per_step']:8.1f}"
    )


HEADER = (
    f"{'layout':<9}{'policy':<13}{'D':>5}  fill llm vision  {'pairs/step':>10}  "
    f"{'TFLOP/pair':>10}  quad (bound)  goodput  priced  split  ms/step"
)


def _flops_lines(f: dict, per_step: list[tuple[int, float]]) -> list[str]:
    t = 1e12
    one = f["paired"]["llm_planned_as"] == "one"
    priced_as = "one document of both lengths" if one else "its two documents"
    lines = [f"  {'layout':<9}{'vision':>9}{'llm':>9}{'total':>9}  (TFLOP a pair, useful)"]
    for name in ("paired", "unpaired"):
        v, llm = f[name]["vision"], f[name][LLM]
        total = sum(f[name][p] for p in PHASES)
        lines.append(f"  {name:<9}{v / t:9.3f}{llm / t:9.2f}{total / t:9.2f}")
    lines.append(
        f"  pairing saves {f['saved_per_pair'] / t:.3f} TFLOP a pair: "
        f"{100 * f['saved_vision_share']:.1f}% of the vision encoder's, "
        f"{100 * f['saved_share']:.1f}% of the total; the planner prices a pair's LLM at "
        f"{f['paired']['llm_planned'] / t:.2f} TFLOP ({priced_as})"
    )
    for d, pairs in per_step:
        v1, v2 = pairs * f["paired"]["vision"], pairs * f["unpaired"]["vision"]
        lines.append(
            f"  a step of {d} devices ({pairs:.0f} pairs): vision {v1 / t:.1f} TFLOP paired, "
            f"{v2 / t:.1f} unpaired; LLM {pairs * f['paired'][LLM] / t:.1f} TFLOP in both"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.pairs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--mix", default="ai2d,chartqa", help=f"prompts: {', '.join(MIXES)}")
    src.add_argument("--lengths", help="prompts from a lengths JSONL file (DESIGN.md format)")
    ap.add_argument("--devices", default="8,64", help="device counts, comma-separated")
    ap.add_argument("--steps", type=int, default=8, help="steps planned per row")
    ap.add_argument("--policies", default="orchestrated,grain")
    ap.add_argument("--tokens", type=int, default=32768, help="LLM tokens per device and micro")
    ap.add_argument("--micro", type=int, default=2, help="microbatches per step")
    ap.add_argument("--block", type=int, default=128, help="attention block for the tiles")
    ap.add_argument("--devices-per-host", type=int, default=8)
    ap.add_argument("--config", default=CONFIG, help="the model the FLOPs are counted for")
    ap.add_argument("--completion-median", type=float, default=128.0)
    ap.add_argument("--completion-sigma", type=float, default=0.8)
    ap.add_argument("--completion-own", type=float, default=0.4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--one-document",
        action="store_true",
        help="price a pair as one document of both lengths (no split in its index row)",
    )
    ap.add_argument("--json", help="write the rows and the FLOPs here")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if args.block < 1:
        ap.error("--block must be >= 1")
    try:
        devices = [int(x) for x in args.devices.split(",")]
    except ValueError:
        ap.error(f"--devices: comma-separated counts, got {args.devices!r}")
    cfg = bench_config(args.config, CONFIG)
    per_token = units_per_token(cfg)
    try:
        sources = length_tables(cfg, args.mix, args.lengths)
        cost, with_ref = dpo_cost(cfg)
        med, sig, own = args.completion_median, args.completion_sigma, args.completion_own
        built = []
        for name, prompts in sources:
            chosen, rejected = completions(len(prompts), args.seed, med, sig, own)
            layouts = pair_layouts(prompts, chosen, rejected, per_token, not args.one_document)
            built.append((name, *layouts))
    except (OSError, ValueError) as e:
        return fail(e, 2)
    what = "training + the reference's forward" if with_ref else "training (no reference run)"
    rows, flops = [], {}
    for name, paired, unpaired in built:
        comp = np.concatenate([paired.docs[:, 0], paired.docs[:, 1]])
        print(
            f"\n== {name}: {paired.pairs} pairs; completions lognormal median {med:g} tokens, "
            f"sigma {sig:g} ({own:g} each side's own), {SHORTEST}..{LONGEST}; LLM tokens a "
            f"pair: mean {paired.docs.sum(1).mean():.0f}, most {paired.docs.sum(1).max()}; "
            f"documents: mean {comp.mean():.0f}; --tokens {args.tokens}, --micro {args.micro}"
        )
        print(HEADER)
        per_step = []
        for d in devices:
            for layout in (paired, unpaired):
                for pol in args.policies.split(","):
                    try:
                        row = run_layout(
                            layout,
                            pol,
                            d,
                            args.tokens,
                            args.micro,
                            args.steps,
                            cost,
                            block=args.block,
                            per_host=args.devices_per_host,
                            merge_area=per_token["vision"],
                            subsample=per_token["audio"],
                            seed=args.seed,
                        )
                    except ValueError as e:  # an unknown policy, a pair too long for a row
                        return fail(e, 2)
                    row["mix"] = name
                    rows.append(row)
                    print(_fmt_row(row), flush=True)
                    if layout is paired and (not per_step or per_step[-1][0] != d):
                        per_step.append((d, row["pairs_per_step"]))
        f = pair_flops(paired, unpaired, cost)
        f["per_step"] = [{"devices": d, "pairs": p} for d, p in per_step]
        flops[name] = f
        print(f"FLOPs ({args.config}: {what}), useful work:")
        print("\n".join(_flops_lines(f, per_step)))
    if args.json:
        out = {
            "config": args.config,
            "reference_counted": with_ref,
            "completions": {"median": med, "sigma": sig, "own": own, "clip": [SHORTEST, LONGEST]},
            "pair_priced_as": "one document" if args.one_document else "two documents",
            "rows": rows,
            "flops": flops,
        }
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
