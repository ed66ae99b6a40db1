"""Start-up of a host on a columnar lengths index: each stage's time and the resident memory.

    python -m jaxmllm.bench.lengths_synth --samples 100000000 --out /tmp/synth-1e8
    python -m jaxmllm.bench.startup --lengths /tmp/synth-1e8 [--row-len 32768] \\
        [--window 65536] [--plan orchestrated --devices 64 --tokens 32768] [--json OUT]
    python -m jaxmllm.bench.startup --sizes 1e6,1e7,1e8 [--tmp /tmp] [--json OUT]

`--sizes` writes a synthetic index of each size (`bench.lengths_synth`) under `--tmp`, runs
the stages on it in a fresh process (its own peak memory), deletes it, and prints one row a
size: open (open, check, oversize, shuffle), size (the capacities from the index), the first
plan, their CPU time together, and the process's peak resident memory (a mapped page counts
while it stays mapped).

Stages, in the order a training host runs them (`jaxmllm.data.source.open_data_set`):
  import     importing the data layer (numpy, the media decoders, the tokenizers)
  open       the summary and every column's header mapped (`stored.StoredIndex`), the
             planner's lengths as views (`LengthsIndex`)
  check      the counts checked in one windowed pass (`stored.check_lengths`)
  oversize   the samples over the LLM row (`--row-len`) found in one windowed pass
             (`oversize.over_bounds`; the encoder buckets are sized from the data)
  shuffle    the first window of the epoch's order (`--window` samples, the index shuffle)
  size       (with --plan) capacities sized from the index (`bench.sizes.make_caps`: the
             index's summary, one windowed pass)
  plan       (with --plan) the planner made and its first plan
`s` is wall time, `cpu s` this process's CPU time (steadier on a shared machine); `rss` the
process's resident memory after the stage, `peak` its most so far (a mapped page a stage
touched counts while it stays mapped).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

T0 = time.perf_counter()

from jaxmllm.data.oversize import over_bounds  # noqa: E402
from jaxmllm.data.preprocess import Limits  # noqa: E402
from jaxmllm.data.stored import StoredIndex, check_lengths  # noqa: E402
from jaxmllm.plan.stream import SampleStream  # noqa: E402

IMPORTED, CPU = time.perf_counter() - T0, time.process_time()


def memory_mb() -> tuple[float, float]:
    """(resident now, resident at most so far) in MB."""
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * resource.getpagesize()
    return resident / 1e6, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


def stages(folder: Path, row_len: int, window: int, plan: str, devices: int, tokens: int) -> list:
    rows = [{"stage": "import", "s": IMPORTED, "cpu_s": CPU}]

    def stage(name: str, fn):
        started, cpu = time.perf_counter(), time.process_time()
        out = fn()
        now, peak = memory_mb()
        took = time.perf_counter() - started
        row = {"stage": name, "s": took, "cpu_s": time.process_time() - cpu}
        rows.append({**row, "rss_mb": now, "peak_mb": peak})
        return out

    rows[0]["rss_mb"], rows[0]["peak_mb"] = memory_mb()
    summary = json.loads((folder / "summary.json").read_text())
    stored = stage("open", lambda: StoredIndex(folder, summary, lengths_only=True))
    index = stored.lengths()
    stage("check", lambda: check_lengths(stored, {}))
    per_token = {"vision": 4, "audio": 4}
    over, _ = stage("oversize", lambda: over_bounds(index, per_token, Limits(max_tokens=row_len)))
    rows[-1]["over"] = len(over)
    stage("shuffle", lambda: SampleStream(len(index), 0, index.shuffle).take(0, window))
    if plan:
        from jaxmllm.bench.sizes import make_caps
        from jaxmllm.plan.registry import make_planner

        caps = stage("size", lambda: make_caps(index, devices, tokens, 2, plan))
        stage("plan", lambda: make_planner(plan, index, caps, 0).plan())
    return rows


OPEN = ("open", "check", "oversize", "shuffle")  # what a host does to open its index


def sweep(sizes: list[int], tmp: Path, plan: str, devices: int) -> list[dict]:
    """One row per index size: a synthetic index written, its stages run in a fresh process,
    the index deleted (`df -h` its folder first: 10^8 samples are about 4 GB)."""
    out = []
    for n in sizes:
        folder = tmp / f"jaxmllm-startup-{n}"
        try:
            _python("jaxmllm.bench.lengths_synth", "--samples", n, "--out", folder)
            rows_file = folder / "rows.json"
            _python(
                "jaxmllm.bench.startup",
                *("--lengths", folder, "--plan", plan, "--devices", devices, "--json", rows_file),
            )
            rows = {r["stage"]: r for r in json.loads(rows_file.read_text())["rows"]}
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        row = {"samples": n}
        for name, stages_of in (("open", OPEN), ("size", ("size",)), ("plan", ("plan",))):
            row[f"{name}_s"] = sum(rows[k]["s"] for k in stages_of)
            row[f"{name}_cpu_s"] = sum(rows[k]["cpu_s"] for k in stages_of)
        row["cpu_s"] = row["open_cpu_s"] + row["size_cpu_s"] + row["plan_cpu_s"]
        row["peak_mb"] = max(r["peak_mb"] for r in rows.values())
        out.append(row)
    return out


def _python(module: str, *args) -> None:
    """`python -m module args...` in a process of its own (its own peak memory), quietly."""
    command = [sys.executable, "-m", module, *map(str, args)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def print_sweep(rows: list[dict]) -> None:
    print(
        f"{'samples':>12}{'open s':>9}{'cpu':>7}{'size s':>9}{'cpu':>7}{'plan s':>9}{'cpu':>7}"
        f"{'cpu s':>8}{'peak MB':>9}"
    )
    for r in rows:
        print(
            f"{r['samples']:>12,}{r['open_s']:>9.2f}{r['open_cpu_s']:>7.2f}{r['size_s']:>9.2f}"
            f"{r['size_cpu_s']:>7.2f}{r['plan_s']:>9.2f}{r['plan_cpu_s']:>7.2f}{r['cpu_s']:>8.2f}"
            f"{r['peak_mb']:>9.0f}"
        )
    print(
        "open: map, check, oversize, shuffle; size: capacities from the index; plan: the "
        "first plan; cpu s: the three together (this process's CPU time)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.startup",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--lengths", help="a columnar index folder")
    ap.add_argument(
        "--sizes", help="instead: synthetic indexes of these sizes, e.g. 1e6,1e7,1e8 (a row each)"
    )
    ap.add_argument("--tmp", default="/tmp", help="where --sizes writes its indexes")
    ap.add_argument("--row-len", type=int, default=32768, help="the LLM row (batch.llm_row_len)")
    ap.add_argument("--window", type=int, default=65536, help="samples of the first window")
    ap.add_argument("--plan", default="", help="also size and plan with this policy")
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.sizes:
        sizes = [int(float(x)) for x in args.sizes.split(",")]
        rows = sweep(sizes, Path(args.tmp), args.plan or "orchestrated", args.devices)
        print_sweep(rows)
        if args.json:
            Path(args.json).write_text(json.dumps({"sizes": rows}, indent=1) + "\n")
        return 0
    if not args.lengths:
        ap.error("give --lengths FOLDER or --sizes N,N,...")
    folder = Path(args.lengths)
    if not (folder / "summary.json").is_file():
        ap.error(
            f"--lengths {folder}: no summary.json there, so not a columnar index (build one "
            "with python -m jaxmllm.data.index, or a synthetic one with "
            "python -m jaxmllm.bench.lengths_synth)"
        )
    rows = stages(folder, args.row_len, args.window, args.plan, args.devices, args.tokens)
    n = json.loads((folder / "summary.json").read_text())["accepted"]
    print(f"{folder}: {n} samples")
    print(f"{'stage':<10}{'s':>9}{'cpu s':>9}{'rss MB':>10}{'peak MB':>10}")
    for r in rows:
        note = f"   ({r['over']} over the row)" if "over" in r else ""
        print(
            f"{r['stage']:<10}{r['s']:>9.3f}{r['cpu_s']:>9.3f}{r['rss_mb']:>10.0f}"
            f"{r['peak_mb']:>10.0f}{note}"
        )
    index = [r for r in rows if r["stage"] != "plan"]
    total = sum(r["s"] for r in index)
    print(f"index start-up (import to shuffle): {total:.2f} s, peak {index[-1]['peak_mb']:.0f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": n, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
