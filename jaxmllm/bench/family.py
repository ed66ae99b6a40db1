"""The balance bench over a family of workloads: the distribution of each figure per policy.

`python -m jaxmllm.bench.balance --random N --seed S` runs N random workloads
(`mixes.random_mix`, seeds S..S+N-1) and prints, per policy and device count, over the mixes:

  bfill      the binding phases' lowest fill per mix: min / median
  fill ok    mixes whose every binding phase fills >= FILL_TARGET or within FILL_SLACK of the
             packing bound the bench prints (`fill_bound`): the issue's target
  steps/LB   median / max
  quad/bnd   quad max/mean over its bound (1.00: no plan of those samples does better): median / max
  cv ratio   random / ours, over the mixes where random dealing's CV is above 0.05 (`n` of them):
             min / median
  age        the most steps any sample waited, over all mixes
  cap/mean   tile capacity over mean need (block-sparse): median / max
  ms/step    planning time: median / max
"""

from __future__ import annotations

import statistics

NOISY_CV = 0.05  # random dealing's CV above which the CV ratio is a target (issue 18)
FILL_TARGET, FILL_SLACK = 0.98, 0.005  # binding fill at least this, or this close to its bound


def _stats(values: list[float], low: bool) -> str:
    """`min / median` where low values are the bad ones, else `median / max`."""
    if not values:
        return "-"
    median = statistics.median(values)
    return f"{min(values):.3f} / {median:.3f}" if low else f"{median:.3f} / {max(values):.3f}"


def _fill_ok(row: dict, phase: str) -> bool:
    """Whether a row's fill of `phase` meets the target: at least FILL_TARGET, or within
    FILL_SLACK of the packing bound (a mix that cannot fill more)."""
    fill, bound = row["fill"][phase], row["fill_bound"][phase]
    return fill >= FILL_TARGET or fill >= bound - FILL_SLACK


def summarize(rows: list[dict]) -> list[dict]:
    """One summary per (policy, devices) over the mixes of `rows` (balance bench rows)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["policy"], r["devices"]), []).append(r)
    out = []
    for (policy, devices), rs in groups.items():
        bfill = [min(r["fill"][p] for p in r["binding"]) for r in rs if r["binding"]]
        fill_ok = [all(_fill_ok(r, p) for p in r["binding"]) for r in rs]
        noisy = [r for r in rs if r["random_cv"] > NOISY_CV and r["micro_cv"] > 0]
        out.append(
            {
                "policy": policy,
                "devices": devices,
                "mixes": len(rs),
                "binding_fill": bfill,
                "fill_ok": sum(fill_ok),
                "steps_over_lb": [r["steps_over_lb"] for r in rs],
                "quad_over_bound": [r["quad_max_mean"] / r["quad_bound"] for r in rs],
                "cv_ratio": [r["random_cv"] / r["micro_cv"] for r in noisy],
                "max_age": max(r["max_age"] for r in rs),
                "tile_cap_over_mean": [r[t] for r in rs if (t := "tile_cap_over_mean") in r],
                "ms_per_step": [r["ms_per_step"] for r in rs],
            }
        )
    return out


def table(summaries: list[dict]) -> str:
    """The markdown table over a family of workloads: per policy and device count, each figure's
    distribution over the mixes (see the module docstring for the columns)."""
    cols = [
        "policy",
        "D",
        "mixes",
        "bfill min/med",
        "fill ok",
        "steps/LB med/max",
        "quad/bnd med/max",
        "cv ratio min/med (n)",
        "age",
        "cap/mean med/max",
        "ms/step med/max",
    ]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for s in summaries:
        lines.append(
            " | ".join(
                [
                    s["policy"],
                    str(s["devices"]),
                    str(s["mixes"]),
                    _stats(s["binding_fill"], low=True),
                    f"{s['fill_ok']}/{s['mixes']}",
                    _stats(s["steps_over_lb"], low=False),
                    _stats(s["quad_over_bound"], low=False),
                    _stats(s["cv_ratio"], low=True) + f" ({len(s['cv_ratio'])})",
                    str(s["max_age"]),
                    _stats(s["tile_cap_over_mean"], low=False),
                    _stats(s["ms_per_step"], low=False),
                ]
            )
        )
    return "\n".join(lines)
