"""The GPU campaign: what a GPU should measure, case by case, within one GPU's memory.

    python -m jaxmllm.bench.gpu --plan [--plan-seconds 1560] [--job-seconds 600]
        [--start-seconds 120]                                       the campaign as short jobs
    python -m jaxmllm.bench.gpu --wheels DIR [--video]              what a GPU node lacks
    python -m jaxmllm.bench.gpu --out DIR [--parts env,tests,...] [--cases REGEX] [--budget S]
        [--timeout 480] [--cache DIR] [--smoke] [--list]

`--plan` splits the campaign into short jobs (`jaxmllm.bench.gpu_plan`: each at most
--job-seconds, a fresh node's start before each, most valuable cases first, all within
--plan-seconds) and prints each job's shell command; `--wheels` downloads the wheels a GPU
node without a package index lacks (grain, array-record, portpicker, soundfile, cffi; PyAV with
--video) into DIR and prints their sizes.

The campaign: each case runs in a process of its own (one train state at a time; XLA's
persistent compilation cache shared under --cache), bounded by --timeout and by what is left of
--budget: a case whose estimate (`gpu_cases.CAMPAIGN`, one H100) no longer fits the budget is
not started (a row says so), and one still running when the budget ends is stopped, so the call
around it never outlasts its limit. Rows go to DIR/rows.jsonl the moment they are measured (a
recipe's step time and MFU before its profile: a failure there keeps them); after every case
DIR/report.md holds the tables so far and how long each case took, and DIR holds only what a
remote job copies back (`LIMITS`: rows.jsonl, report.md, log.txt and hlo.zip, each bounded). The
memory share JAX takes of the GPU is set to 0.9 (`xla_flags.set_memory_fraction`, the variable
the installed jaxlib reads) unless the environment sets it.

Parts (`--cases` picks cases by a regular expression over their names, `part/...`):
- env: Python, jax and jaxlib, devices, the XLA flags and memory share in effect, and which
  modules jaxmllm imports that this Python lacks.
- tests: the cuDNN kernel's correctness tests (tests/test_attention.py -k cudnn) on the GPU.
- recipe: configs/gpu/qwen2vl_2b.yaml's per-GPU shapes on this one GPU (fsdp 1, 2 microbatches,
  built-in data with images of up to 64 x 64 patches, or `.../mixes`: ChartQA's and AI2D's real
  lengths, `gpu_mix`) under remat policies that fit 72 GiB (`gpu_cases.PEAK_GIB`), with cuDNN
  and block-sparse attention and XLA's GPU flag set: step time, tokens/s, model TFLOP/s and
  MFU, each phase's fill, the peak memory; then a profile of two steps (time per kernel
  category, the top 15 kernels: `jaxmllm.bench.profile`) and the dots by dtype.
- attention: forward + backward of one packed row, block-sparse and (GPU) cuDNN, dense up to
  8,192 tokens, at the recipes' head shapes (`jaxmllm.bench.attention`); then a hybrid's two
  token mixers at Qwen3.5-9B's widths, one document a row of 4k, 16k and 64k tokens: Gated
  DeltaNet's training step against full attention's (`jaxmllm.bench.linear`).
- moe: the mixtures of experts' per-GPU expert work on this one GPU, text, full remat (each
  recipe's own; `gpu_cases.MOE_PEAK_GIB`): configs/gpu/qwen3_30b_a3b.yaml's (16 experts of
  768, top-8, 12 of its 48 layers) and gemma4_26b_a4b.yaml's (16 experts of 704, top-8, all
  30 layers, five windowed to one full; LoRA on the bf16 base; block-sparse only): the recipe
  part's measurements.
- vlm: the vision-language recipes' per-GPU steps on this one GPU with images, the towers
  whole: configs/gpu/qwen3_vl_8b.yaml's and qwen3_vl_30b_a3b.yaml's (DeepStack into the LLM's
  first 3 layers; the 8B's LLM 3 of its 36 layers, the MoE's 12 of 48 with 16 experts) and
  gemma3_4b.yaml's (6 of its 34 layers: five windowed, one full; images read both ways;
  block-sparse only): what fits one GPU, each recipe's own remat (`gpu_cases.VLM_PEAK_GIB`):
  the recipe part's measurements.
- host: an 8-GPU host's feed for the recipe's step (`jaxmllm.bench.host --measure-device`).

`--smoke` runs every part at tiny shapes on the CPU (a few minutes; tests/test_gpu_bench.py):
the campaign cannot rot between the times a GPU is at hand. docs/gpu-step.md has the plan.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxmllm.bench import gpu_plan
from jaxmllm.bench.gpu_cases import PARTS, Case, cases

# What a short job on a remote node copies back of its output folder (`--plan`'s jobs): at
# most 8 files of 16 MiB, 64 MiB in all, no deeper than 2 folders, names of letters, digits,
# '.', '_' and '-'.
LIMITS = {"files": 8, "file_bytes": 16 << 20, "bytes": 64 << 20, "depth": 2}
LOG_TAIL = 256 << 10  # of each case's output, the end kept in log.txt
LOG_MAX = 8 << 20  # log.txt's size, past which a case's output is left out

# ----------------------------------------------------------------------------- the parent


def run_cases(todo: list[Case], out: Path, timeout: int, cache: Path, budget: int) -> list[dict]:
    """Each case in a child process, bounded by `timeout` and what is left of `budget` (0:
    none); its rows appended to out/rows.jsonl, then one of its own: how it ended, in what time."""
    rows_file, started = out / "rows.jsonl", time.perf_counter()
    for case in todo:
        left = budget - (time.perf_counter() - started) if budget else timeout
        if budget and case.estimate_s > left:
            why = f"not started: ~{case.estimate_s} s needed, {left:.0f} s left of --budget"
            append(rows_file, {"part": case.part, "case": case.name, "kind": "case", "skip": why})
            print(f"{case.name}: {why}", flush=True)
            write_report(out)
            continue
        seconds, error = run_child(case, out, cache, int(max(1, min(timeout, left))))
        status = {"kind": "case", "seconds": round(seconds, 1)}
        append(rows_file, {"part": case.part, "case": case.name, **status, "error": error})
        print(f"{case.name}: {error or 'done'} after {seconds:.0f} s", flush=True)
        write_report(out)
    return read_rows(rows_file)


def run_child(case: Case, out: Path, cache: Path, timeout: int) -> tuple[float, str | None]:
    """Runs one case's child; (seconds, its error or None). The end of its output goes to
    out/log.txt (bounded: `LOG_TAIL` a case, `LOG_MAX` in all)."""
    cmd = [sys.executable, "-m", "jaxmllm.bench.gpu", "--child", json.dumps(vars(case))]
    cmd += ["--out", str(out), "--cache", str(cache)]
    error, started = None, time.perf_counter()
    # (the case's temporary files, its children's too, in a folder this process removes: a
    # case stopped at its budget is killed, and what it had open in the temporary folder, a
    # profile's trace, the tests' junit file, would stay on the node)
    with (
        tempfile.TemporaryDirectory(prefix="jaxmllm-case-") as scratch,
        tempfile.TemporaryFile() as output,
    ):
        # (a session of its own, ended whole: a case stopped, failed or done takes its
        # processes with it, the tests' pytest, data workers, which would hold the GPU's
        # memory from the next case)
        env = {**os.environ, "TMPDIR": scratch}
        child = subprocess.Popen(
            cmd, stdout=output, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            code = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        if code is None:
            error = f"stopped after {timeout} s (--timeout or what was left of --budget)"
        elif code:
            error = f"exit {code} (log.txt)"
        seconds = time.perf_counter() - started
        keep_log(out / "log.txt", case.name, output)
    return seconds, error


def keep_log(log: Path, name: str, output) -> None:
    """Appends the end of a case's output to `log`, bounded."""
    size = output.seek(0, os.SEEK_END)
    output.seek(max(0, size - LOG_TAIL))
    tail = output.read()
    used = log.stat().st_size if log.exists() else 0
    with open(log, "ab") as f:
        f.write(f"\n=== {name} ({size} bytes of output".encode())
        if used + len(tail) > LOG_MAX:
            f.write(b"; left out: log.txt is at its size limit)\n")
            return
        f.write(f"{'; its last ' + str(len(tail)) if size > len(tail) else ''})\n".encode())
        f.write(tail)


def append(path: Path, row: dict) -> None:
    """Appends one result row to the campaign's JSONL file (`rows.jsonl`), so a case killed later
    loses nothing written before."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def read_rows(path: Path) -> list[dict]:
    """The rows of a JSONL file so far ([] before the first)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_report(out: Path) -> None:
    """Writes `report.md` in `out` from its `rows.jsonl`: the tables a run leaves to read."""
    from jaxmllm.bench.gpu_report import report

    (out / "report.md").write_text(report(read_rows(out / "rows.jsonl")))


def over_limits(out: Path) -> list[str]:
    """What under `out` a remote job would not copy back (`LIMITS`), each named."""
    found = [p for p in out.rglob("*") if p.is_file()]
    problems = []
    if len(found) > LIMITS["files"]:
        problems.append(f"{len(found)} files (at most {LIMITS['files']})")
    for p in found:
        rel = p.relative_to(out)
        if p.stat().st_size > LIMITS["file_bytes"]:
            problems.append(f"{rel}: {p.stat().st_size} bytes (at most {LIMITS['file_bytes']})")
        if len(rel.parts) - 1 > LIMITS["depth"]:
            problems.append(f"{rel}: deeper than {LIMITS['depth']} folders")
        if not all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts):
            problems.append(f"{rel}: a name of other characters than letters, digits, ._-")
    total = sum(p.stat().st_size for p in found)
    if total > LIMITS["bytes"]:
        problems.append(f"{total} bytes in all (at most {LIMITS['bytes']})")
    return problems


# ----------------------------------------------------------------------------- a child


def child(case: Case, out: Path, cache: Path) -> None:
    """Measures one case in this process and appends its rows as they come."""
    from jaxmllm.process import xla_flags

    xla_flags.apply()  # (before JAX starts its backends)
    import jax

    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    from jaxmllm.bench import gpu_cases

    measure = getattr(gpu_cases, case.part)
    for row in measure(case, out):
        append(out / "rows.jsonl", {"part": case.part, "case": case.name, **row})


# ----------------------------------------------------------------------------- the command


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxmllm.bench.gpu`: prints the campaign split into jobs (--plan), downloads the
    wheels a GPU image lacks (--wheels), lists the cases (--list), or runs the chosen cases, each
    in a child process within --timeout and the whole within --budget, then writes and prints the
    report. Exit code 0, 2 when no case matches; a failed case makes it nonzero."""
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", help="folder for rows.jsonl, report.md, log.txt, hlo.zip")
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of " + ", ".join(PARTS))
    p.add_argument("--cases", default="", help="only the cases whose names match this regex")
    p.add_argument("--timeout", type=int, default=480, help="seconds a case may take")
    p.add_argument("--budget", type=int, default=0, help="seconds for all cases (0: no bound)")
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "jaxmllm-xla-cache"))
    p.add_argument("--smoke", action="store_true", help="every part at tiny shapes (CPU)")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--plan", action="store_true", help="print the campaign's jobs and exit")
    p.add_argument(
        "--plan-seconds",
        type=int,
        default=gpu_plan.BUDGET_S,
        help="--plan: the GPU seconds all jobs fit in, each node's start included",
    )
    p.add_argument(
        "--job-seconds", type=int, default=gpu_plan.CALL_S, help="--plan: one job's limit"
    )
    p.add_argument(
        "--start-seconds",
        type=int,
        default=gpu_plan.START_S,
        help="--plan: a fresh node's start, counted before each job",
    )
    p.add_argument("--wheels", metavar="DIR", help="download the wheels a GPU image lacks")
    p.add_argument("--video", action="store_true", help="--wheels: PyAV too (video cases)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if args.plan:
        for key in ("plan_seconds", "job_seconds", "start_seconds"):
            if getattr(args, key) < 0 or (key == "job_seconds" and args.job_seconds <= 0):
                p.error(f"--{key.replace('_', '-')} must be a positive number of seconds")
        todo = cases(parts, True, False)
        calls, left_out = gpu_plan.plan(
            todo, args.plan_seconds, args.job_seconds, args.start_seconds
        )
        print(gpu_plan.describe(calls, left_out, args.plan_seconds, args.start_seconds))
        return 0
    if args.wheels:
        wheels = gpu_plan.download_wheels(args.wheels, args.video)
        for name, size in wheels:
            print(f"{size / 2**20:8.2f} MiB  {name}")
        total = sum(s for _, s in wheels) / 2**20
        print(f"{total:8.2f} MiB in {len(wheels)} wheels in {args.wheels}")
        return 0
    if args.child:
        child(Case(**json.loads(args.child)), Path(args.out), Path(args.cache))
        return 0
    from jaxmllm.process import xla_flags

    gpu = not args.smoke and xla_flags.gpu_expected()
    todo = [c for c in cases(parts, gpu, args.smoke) if re.search(args.cases, c.name)]
    if args.list or not todo:
        print("\n".join(f"{c.name} (~{c.estimate_s} s)" for c in todo) or "no case matches")
        return 0 if todo else 2
    if not args.out:
        p.error("--out DIR is needed (or --plan, --wheels, --list)")
    out, cache = Path(args.out), Path(args.cache)
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"  # (the children's too)
    print(f"memory: {xla_flags.set_memory_fraction()} (the children's)", flush=True)
    rows = run_cases(todo, out, args.timeout, cache, args.budget)
    write_report(out)
    print((out / "report.md").read_text())
    for problem in over_limits(out):
        print(f"warning: {out}: {problem}: a remote job would not copy it back")
    ended = [r for r in rows if r.get("kind") == "case"]
    failed = [r for r in ended if r.get("error")]
    skipped = [r for r in ended if r.get("skip")]
    print(
        f"{len(todo)} cases: {len(failed)} failed, {len(skipped)} not started (--budget); "
        f"rows in {out / 'rows.jsonl'}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
