"""Hashes of the plans every planner makes on the built-in mixes, to show a change is
bit-identical (a refactor, a speed-up) or to see where it is not.

    python -m tools.plan_hash [--mix omni,ai2d,chartqa] [--devices 8,64,512,2560] \
        [--policies orchestrated,balanced] [--steps 6] [--out hashes.json] [--against old.json]

(`-m` from the repository root hashes this checkout's code; `python tools/plan_hash.py` puts
tools/ first on sys.path, so jaxmllm comes from wherever the package is installed, e.g. an
editable install of another worktree.)

`--policies` takes any names of the planner registry (first_fit, naive, grain too). Per (mix,
devices, policy): a SHA-256 over every array of the first --steps plans and the
planner's carried state after each, with the bench's capacities (`--tokens 32768`, 2
microbatches). `--against` compares with an earlier run's JSON and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np

from jaxmllm.bench.balance import make_caps
from jaxmllm.bench.mixes import load_mix
from jaxmllm.plan.registry import make_planner


def plan_digest(policy: str, index, devices: int, steps: int, tokens: int, micro: int) -> str:
    caps = make_caps(index, devices, tokens, micro, policy)
    planner = make_planner(policy, index, caps, 0)
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
    ap.add_argument("--out")
    ap.add_argument("--against")
    args = ap.parse_args(argv)
    out = {}
    for mix in args.mix.split(","):
        index = load_mix(mix)
        for d in (int(x) for x in args.devices.split(",")):
            for pol in args.policies.split(","):
                t = time.perf_counter()
                key = f"{mix}/{d}/{pol}"
                out[key] = plan_digest(pol, index, d, args.steps, args.tokens, args.micro)
                print(f"{key:<28} {out[key][:16]}  {time.perf_counter() - t:6.1f} s", flush=True)
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


if __name__ == "__main__":
    sys.exit(main())
