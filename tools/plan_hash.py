"""Hashes of the plans every planner makes on the built-in mixes, to show a change is
bit-identical (a refactor, a speed-up) or to see where it is not.

    python -m tools.plan_hash [--mix omni,ai2d,chartqa] [--devices 8,64,512,2560] \
        [--policies orchestrated,balanced] [--steps 6] [--out hashes.json] [--against old.json]
    python -m tools.plan_hash --bench [--block 128] [--devices-per-host 8] [--random 5] \
        [--caps-from old.json] ...   # the balance bench's capacities, random mixes too
    python -m tools.plan_hash --config configs/tiny.yaml --devices 8 [--set k=v ...]

(`-m` from the repository root hashes this checkout's code; `python tools/plan_hash.py` puts
tools/ first on sys.path, so jaxmllm comes from wherever the package is installed, e.g. an
editable install of another worktree.)

`--policies` takes any names of the planner registry (first_fit, naive, grain too). Per (mix,
devices, policy): a SHA-256 over every array of the first --steps plans and the
planner's carried state after each, with the bench's capacities (`--tokens 32768`, 2
microbatches). `--against` compares with an earlier run's JSON and exits 1 on any difference.

`--config FILE [--set k=v ...]` hashes the plans of a config as a run makes them (start-up
resolved into `jaxmllm.resolve.run.Run` for each of `--devices` buckets: its sizes from dry
runs of its planner over its data), the resolved batch kept in the JSON (`batch/<key>`).

`--bench` sizes the capacities as `python -m jaxmllm.bench.balance` runs a policy (`--block`
tiles, `--devices-per-host`: the route capacity and a tile-holding policy's tile capacities
from dry runs of its plans, `bench.sizes.sized_caps`) and hashes them with the plans; the JSON
keeps them (`caps/<key>`), and `--caps-from` an earlier run's JSON takes them from there
instead of the dry runs (quicker; the dry runs are plans too). `--random N` adds the mixes
`random:0` .. `random:N-1` (`jaxmllm.bench.mixes.random_mix`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time

import numpy as np

from jaxmllm.bench.mixes import load_mix, random_mix
from jaxmllm.bench.sizes import make_caps, sized_caps, steps_for
from jaxmllm.config import ModelConfig
from jaxmllm.config.command import add_config_args
from jaxmllm.cost.model import CostModel
from jaxmllm.plan.contract import Capacities
from jaxmllm.plan.registry import make_planner


def plan_digest(policy: str, index, devices: int, steps: int, tokens: int, micro: int) -> str:
    caps = make_caps(index, devices, tokens, micro, policy)
    return caps_digest(policy, index, caps, steps)


def bench_caps(policy: str, index, devices: int, args) -> Capacities:
    """The capacities the balance bench runs `policy` with (its dry runs as long as its run)."""
    caps = make_caps(
        index,
        devices,
        args.tokens,
        args.micro,
        policy,
        block=args.block,
        devices_per_host=args.devices_per_host,
    )
    steps = steps_for(index, devices, args.tokens, args.micro, 8, 40)
    return sized_caps(index, caps, policy, steps, CostModel.from_model(ModelConfig()))


def caps_digest(policy: str, index, caps: Capacities, steps: int) -> str:
    return planner_digest(make_planner(policy, index, caps, 0), steps)


def run_digests(config: str, sets: list[str], devices: list[int], steps: int) -> dict:
    """`config`'s plans as its run makes them, per device count: {key: digest, batch/key:
    the resolved batch section}."""
    from jaxmllm.config import load_config, to_dict
    from jaxmllm.resolve.run import resolve_run

    out = {}
    for d in devices:
        run = resolve_run(load_config(config, sets), d)
        key = f"{config}/{d}/run"
        out[f"batch/{key}"] = json.dumps(to_dict(run.cfg)["batch"], sort_keys=True)
        out[key] = planner_digest(run.planner(), steps)
        print(f"{key:<40} {out[key][:16]}", flush=True)
    return out


def planner_digest(planner, steps: int) -> str:
    """A SHA-256 over every array of the planner's next `steps` plans and its carried state
    after each."""
    h = hashlib.sha256()
    for _ in range(steps):
        plan = planner.plan()
        arrays = [plan.samples, plan.micro, plan.device, plan.row, plan.offset]
        for it in plan.items.values():
            arrays += [it.owner, it.item, it.device, it.offset]
        for a in arrays:
            a = np.ascontiguousarray(a, np.int64)
            h.update(str(a.shape).encode())
            h.update(a.tobytes())
        h.update(str(plan.deferred).encode())
        h.update(json.dumps(planner.get_state(), sort_keys=True).encode())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mix", default="omni,ai2d,chartqa")
    ap.add_argument("--devices", default="8,64,512,2560")
    ap.add_argument("--policies", default="orchestrated,balanced")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--bench", action="store_true", help="the balance bench's capacities")
    ap.add_argument("--block", type=int, default=128, help="--bench: attention block (0: dense)")
    ap.add_argument("--devices-per-host", type=int, default=8, help="--bench: routing's hosts")
    ap.add_argument("--random", type=int, default=0, help="add mixes random:0 .. random:N-1")
    ap.add_argument("--caps-from", help="--bench: capacities from an earlier run's JSON")
    ap.add_argument("--out")
    ap.add_argument("--against")
    add_config_args(ap, required=False, config_help="hash this config's plans as a run makes them")
    args = ap.parse_args(argv)
    known = {}
    if args.caps_from:
        with open(args.caps_from) as f:
            known = json.load(f)
    mixes = [m for m in args.mix.split(",") if m] + [f"random:{s}" for s in range(args.random)]
    out = {}
    if args.config:
        devices = [int(x) for x in args.devices.split(",")]
        out, mixes = run_digests(args.config, args.set, devices, args.steps), []
    for mix in mixes:
        index = random_mix(int(mix[7:])) if mix.startswith("random:") else load_mix(mix)
        for d in (int(x) for x in args.devices.split(",")):
            for pol in args.policies.split(","):
                t = time.perf_counter()
                key = f"{mix}/{d}/{pol}"
                if args.bench:
                    key += f"/bench{args.block}/{args.devices_per_host}"
                    if f"caps/{key}" in known:
                        caps = _caps(json.loads(known[f"caps/{key}"]))
                    else:
                        caps = bench_caps(pol, index, d, args)
                    out[f"caps/{key}"] = caps_json(caps)
                    out[key] = caps_digest(pol, index, caps, args.steps)
                else:
                    out[key] = plan_digest(pol, index, d, args.steps, args.tokens, args.micro)
                print(f"{key:<40} {out[key][:16]}  {time.perf_counter() - t:6.1f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if args.against:
        with open(args.against) as f:
            old = json.load(f)
        diff = [k for k in out if k in old and old[k] != out[k]]
        same = [k for k in out if k in old and old[k] == out[k]]
        print(f"{len(same)} identical, {len(diff)} different: {', '.join(diff) or '-'}")
        return 1 if diff else 0
    return 0


def _caps(fields: dict) -> Capacities:
    fields["long_tiles"] = tuple(fields.get("long_tiles", ()))
    fields["attention_block"] = fields.pop("block", fields.get("attention_block", 0))
    return Capacities(**fields)


def caps_json(caps: Capacities) -> str:
    """The capacities as JSON, in the form they had before long variants existed and before
    `block` was named `attention_block` (so that runs of either compare)."""
    fields = dataclasses.asdict(caps)
    if not fields["long_tiles"]:
        del fields["long_tiles"]
    fields["block"] = fields.pop("attention_block")
    return json.dumps(fields, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
