"""A profile of a few steps, summarised: device time per kernel category and the top kernels.

    with trace(directory):
        ... run two steps ...
    summary = summarize(directory, steps=2)

`jax.profiler.trace` writes an XSpace protobuf; `jax.profiler.ProfileData` reads it. On a GPU
the kernels are the events of the device plane's stream lines (CUPTI's), named as launched
(cuBLAS / CUTLASS gemms, cuDNN's attention, NCCL's collectives, XLA's fusions); elsewhere (the
CPU) the XLA operations the host's threads ran, the events that name an `hlo_op`. Each kernel
falls in one category by its name and HLO op: matmul, attention, collectives, copies, other
(`CATEGORIES`, the first that matches). Times are per step (the trace's total / `steps`).
"""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import jax

# Kernel names and HLO ops by category, the first match wins (an attention kernel's name may
# say gemm: cuDNN's fmha before matmul).
_COLLECTIVE = r"nccl|all-?reduce|all-?gather|reduce-?scatter|all-?to-?all|collective|ragged"
CATEGORIES = (
    ("attention", re.compile(r"fmha|flash|cudnn|attention|__cudnn\$", re.I)),
    ("collectives", re.compile(_COLLECTIVE, re.I)),
    ("matmul", re.compile(r"gemm|cublas|cutlass|xmma|nvjet|wgmma|matmul|dot|triton_gemm", re.I)),
    ("copies", re.compile(r"memcpy|memset|copy|dynamic-update-slice|transpose", re.I)),
)
TOP = 15  # kernels listed
CONTAINERS = ("while", "conditional", "call")  # ops whose events hold their bodies' events


def category(name: str, ops: dict[str, str] | None = None) -> str:
    """The category of a kernel (its name and HLO op, space-separated): by its name, else by
    what its HLO op computes (`hlo_categories` of the step's compiled HLO)."""
    found = next((c for c, pattern in CATEGORIES if pattern.search(name)), "other")
    if found == "other" and ops:
        found = next((ops[word] for word in name.split() if word in ops), found)
    return found


_COMPUTATION = re.compile(r"^%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\b([a-z][\w\-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def hlo_categories(hlo_text: str) -> dict[str, str]:
    """HLO op name -> category, for ops whose names say nothing (`fusion.3`, XLA:CPU's
    `ynn_fusion`): an op that is, or calls a computation that holds, a dot or convolution is a
    matmul; a collective op is a collective; control flow (a scan's while) is a container,
    whose event spans its body's (XLA:CPU), not counted."""
    holds_dot, calls, opcode = {}, {}, {}
    current = None
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            current = m.group(1)
            holds_dot[current] = False
        elif m := _INSTRUCTION.match(line):
            name, op = m.groups()
            opcode[name] = op
            if current is not None and op in ("dot", "convolution"):
                holds_dot[current] = True
            if c := _CALLS.search(line):
                calls[name] = c.group(1)
    out = {}
    for name, op in opcode.items():
        if op in CONTAINERS:
            out[name] = "container"
        elif op in ("dot", "convolution") or holds_dot.get(calls.get(name, ""), False):
            out[name] = "matmul"
        elif CATEGORIES[1][1].fullmatch(op.replace("-start", "").replace("-done", "")):
            out[name] = "collectives"
    return out


@contextlib.contextmanager
def trace(directory: str | Path) -> Iterator[None]:
    """Profiles what runs inside (`jax.profiler.trace`) into `directory`."""
    with jax.profiler.trace(str(directory)):
        yield


def kernels(directory: str | Path) -> dict[str, float]:
    """Seconds per kernel (name, or name and HLO op where they differ) over the whole trace."""
    paths = sorted(Path(directory).rglob("*.xplane.pb"))
    if not paths:
        return {}
    data = jax.profiler.ProfileData.from_file(str(paths[-1]))
    device = [p for p in data.planes if p.name.startswith("/device:")]
    totals: dict[str, float] = collections.defaultdict(float)
    for plane in device or [p for p in data.planes if p.name == "/host:CPU"]:
        for line in plane.lines:
            if device and not line.name.lower().startswith("stream"):
                continue  # (a GPU plane's derived lines repeat the streams' time)
            for event in line.events:
                op = dict(event.stats).get("hlo_op")
                if op is None and not device:
                    continue  # (a host thread's own work, not an XLA operation)
                name = event.name if op in (None, event.name) else f"{event.name} {op}"
                totals[name] += event.duration_ns * 1e-9
    return dict(totals)


def summarize(directory: str | Path, steps: int, hlo_text: str = "") -> dict:
    """Per step: seconds by category, their shares, and the TOP kernels (seconds, category);
    `hlo_text`: the step's compiled HLO, to tell what fusions compute."""
    ops = hlo_categories(hlo_text) if hlo_text else {}
    per_kernel = {k: v / steps for k, v in kernels(directory).items()}
    by_category = dict.fromkeys([c for c, _ in CATEGORIES] + ["other"], 0.0)
    per_kernel = {k: v for k, v in per_kernel.items() if category(k, ops) != "container"}
    total = sum(per_kernel.values())
    for name, seconds in per_kernel.items():
        by_category[category(name, ops)] += seconds
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:TOP]
    return {
        "kernel_s": total,
        "category_s": by_category,
        "category_share": {c: s / total if total else 0.0 for c, s in by_category.items()},
        "top": [{"kernel": k[:160], "s": s, "category": category(k, ops)} for k, s in top],
    }


def table(summary: dict) -> str:
    """The category split and the top kernels as Markdown."""
    lines = ["category | ms/step | share", "--- | --- | ---"]
    for c, s in summary["category_s"].items():
        lines.append(f"{c} | {1e3 * s:.2f} | {summary['category_share'][c]:.1%}")
    lines += ["", "kernel | category | ms/step", "--- | --- | ---"]
    for k in summary["top"]:
        lines.append(f"`{k['kernel'][:90]}` | {k['category']} | {1e3 * k['s']:.3f}")
    return "\n".join(lines)
