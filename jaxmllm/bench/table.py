"""Benches' tables: the cell every bench's markdown table prints a figure with (a dash where the
figure is missing), and the balance bench's per-policy table: one row per (mix, devices,
policy), its headers, and the like-for-like fill line when a policy ran fewer steps (the
columns: bench/balance.py)."""

from __future__ import annotations

import numpy as np

from jaxmllm.config.phases import PHASES  # (re-exported to the benches)


def cell(value, spec: str = "", suffix: str = "", unit: float = 1) -> str:
    """One figure of a bench's table in `unit`s (bytes in MiB: 2**20) formatted by `spec`
    (then `suffix`), or '-' where it is missing (None: not measured, nothing to extrapolate it
    from), so a table always prints."""
    if value is None:
        return "-"
    return f"{value / unit if unit != 1 else value:{spec}}{suffix}"


def ratio(num, den) -> float | None:
    """num / den, or None where either is missing or den is 0 (a speed-up without its times)."""
    if num is None or not den:
        return None
    return num / den


def markdown(cols: list[str], rows: list[list[str]]) -> str:
    """A markdown table of the column names and the rows' cells."""
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    return "\n".join(lines + [" | ".join(cells) for cells in rows])


def format_row(r: dict) -> str:
    """One row of the balance benchmark's table: the policy, devices, each phase's fill (* where
    binding), steps over the lower bound, attention balance, microbatch variation, deferral age,
    routing shares and capacities, ms a step and peak memory, then the tile columns when
    measured."""
    fill = " ".join(f"{r['fill'][p]:.3f}{'*' if p in r['binding'] else ' '}" for p in PHASES)
    ratio = r["random_cv"] / r["micro_cv"] if r["micro_cv"] > 0 else float("inf")
    return (
        (
            f"{r['policy']:<13}{r['devices']:>5} {fill}  {r['steps_over_lb']:6.3f}  "
            f"{r['quad_max_mean']:5.2f} ({r['quad_bound']:4.2f})  {r['micro_cv']:.4f} "
            f"{ratio:6.1f}x  {r['max_age']:3d} {r['deferred']:8.0f}  {r['routed']:5.3f} "
            f"{r['routed_inter']:5.3f} {r['caps']['route_pair_capacity']:6d} "
            f"{r['caps']['route_pair_whole']:6d} {r['ms_per_step']:8.1f}"
            f" {r.get('peak_rss_mb', float('nan')):7.0f}"
        )
        + (
            f"  {r['tile_capacity']:7d} {_long(r):>11} {r['tile_mean']:8.0f} "
            f"{r['tile_cap_over_mean']:8.3f} {r['tile_max_mean']:8.3f} {r['goodput']:8.3f}"
            if "tile_capacity" in r
            else ""
        )
        + (
            "  {compute:8.1f} {step_ragged:8.1f} {step_dense:8.1f} {work_ragged:8.1f}".format(
                **r["simulated"]
            )
            if "simulated" in r
            else ""
        )
        + (  # (context groups: their exchange priced, and what auto compares)
            f"  exchange {r['exchange_share']:.1%} score {r['score']:.3f}"
            + (f" ({r['chose']})" if "chose" in r else "")
            if "score" in r
            else ""
        )
    )


def _long(r: dict) -> str:
    """The long variant's tile capacity and its steps (`plan.ladder`), or '-' without one."""
    if not r.get("tile_capacity_long"):
        return "-"
    return f"{r['tile_capacity_long']}/{r['long_steps']}"


def fill_over(row: dict, steps: int) -> dict:
    """A row's fill per phase over its first `steps` steps (each step has the same capacity)."""
    mean = np.mean(row["fill_per_step"][:steps], 0)
    return dict(zip(PHASES, mean.round(4).tolist(), strict=True))


def print_like_for_like(rows: list[dict]) -> None:
    """When a policy ran fewer steps (grain, --grain-max-steps), every other policy's fill over
    the same first steps, so that fills compare like for like."""
    n = min((r["steps"] for r in rows), default=0)
    if not rows or all(r["steps"] == n for r in rows):
        return
    for r in rows:
        r["fill_first_steps"] = {"steps": n, "fill": fill_over(r, n)}
    cols = "  ".join(
        f"{r['policy']} " + " ".join(f"{v:.4f}" for v in r["fill_first_steps"]["fill"].values())
        for r in rows
    )
    print(f"  fill over the first {n} steps (llm vision audio): {cols}")


HEADER = (
    f"{'policy':<13}{'D':>5} {'fill llm   vision audio':<24}  steps/LB  quad (bound)  "
    f"cv     rand/ours age deferred routed inter   pair  whole  ms/step peak MB"
)
TILE_HEADER = (
    f"  {'tiles':>7} {'long/steps':>11} {'mean':>8} {'cap/mean':>8} {'max/mean':>8} {'goodput':>8}"
)
SIM_HEADER = f"  {'sim: fl':>8} {'ragged':>8} {'dense':>8} {'x LB':>8}"
