"""The GPU campaign: what a lent GPU should measure, case by case, within one GPU's memory.

    python -m jaxmllm.bench.gpu --out DIR [--parts env,attention,recipe,moe,host] [--cases REGEX]
        [--timeout 480] [--cache DIR] [--smoke]

Each case runs in a process of its own (one train state at a time; XLA's persistent
compilation cache shared under --cache, so a rerun compiles nothing twice), bounded by
--timeout, and appends its row to DIR/rows.jsonl the moment it is measured: a case that runs
out of memory or time leaves an error row and the next one runs. After every case DIR/report.md
holds the tables so far; the compiled HLO of each recipe step goes to DIR/hlo.tar.gz at the end.

Parts (`--cases` picks cases by a regular expression over their names, `part/...`):
- env: jax's version and devices, the XLA flags in effect, and which modules jaxmllm imports
  that this Python lacks (a machine without a package index needs them carried as wheels).
- attention: forward + backward of one packed row, block-sparse and (GPU) cuDNN, dense up to
  8,192 tokens, at the recipes' head shapes: the LLM's 12 query / 2 KV heads of 128 (causal, the
  samples' tokens) and the vision tower's 16 heads of 80 (the images' patches), bf16
  (`jaxmllm.bench.attention`).
- recipe: configs/gpu/qwen2vl_2b.yaml's per-GPU shapes on this one GPU (fsdp 1, 2 microbatches,
  built-in data with images of up to 64 x 64 patches) under the remat policies that fit 80 GB,
  with cuDNN and block-sparse attention, with XLA's GPU flag set (`jaxmllm.process.xla_flags`) and,
  for one policy per kernel, without: step time, tokens/s, model TFLOP/s and MFU, the device's
  peak memory, the dots by dtype, and a profile of two steps (time per kernel category and the
  top 15 kernels: `jaxmllm.bench.profile`).
- moe: configs/gpu/qwen3_30b_a3b.yaml's per-GPU expert work on this one GPU (16 experts of
  768, top-8, as a GPU of its EP-8 node holds and computes; 12 of its 48 layers; text), full
  remat, the best kernel: the recipe part's measurements.
- host: an 8-GPU host's feed for that step (`jaxmllm.bench.host --measure-device`): planning,
  loading and the serial rest against the step this device measures.

`--smoke` runs every part at tiny shapes on the CPU (a minute or two; tests/test_gpu_bench.py):
the campaign cannot rot between the times a GPU is at hand. On one H100 (estimates): env and
attention ~3 min, a recipe case ~2 min (8 cases), host ~2 min: run it in commands of at most
9 minutes with --parts and --cases (docs/gpu-step.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from jaxmllm.bench.gpu_cases import PARTS, Case, cases

# ----------------------------------------------------------------------------- the parent


def run_cases(todo: list[Case], out: Path, timeout: int, cache: Path) -> list[dict]:
    """Each case in a child process, bounded; its rows appended to out/rows.jsonl."""
    rows_file = out / "rows.jsonl"
    for case in todo:
        started = time.perf_counter()
        cmd = [sys.executable, "-m", "jaxmllm.bench.gpu", "--child", json.dumps(vars(case))]
        cmd += ["--out", str(out), "--cache", str(cache)]
        error = None
        with open(out / "log.txt", "a") as log:
            log.write(f"\n=== {case.name}\n")
            log.flush()
            try:
                done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
                if done.returncode:
                    error = f"exit {done.returncode} (log.txt)"
            except subprocess.TimeoutExpired:
                error = f"over --timeout {timeout} s"
        seconds = time.perf_counter() - started
        if error is not None:
            append(rows_file, {"part": case.part, "case": case.name, "error": error})
        print(f"{case.name}: {error or 'done'} after {seconds:.0f} s", flush=True)
        write_report(out)
    return read_rows(rows_file)


def append(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_report(out: Path) -> None:
    from jaxmllm.bench.gpu_report import report

    (out / "report.md").write_text(report(read_rows(out / "rows.jsonl")))


def pack_hlo(out: Path) -> None:
    """The steps' HLO files in one archive (few files to carry back), the folder removed."""
    folder = out / "hlo"
    if not folder.exists():
        return
    with tarfile.open(out / "hlo.tar.gz", "w:gz") as tar:
        for path in sorted(folder.iterdir()):
            tar.add(path, arcname=path.name)
            path.unlink()
    folder.rmdir()


# ----------------------------------------------------------------------------- a child


def child(case: Case, out: Path, cache: Path) -> None:
    """Measures one case in this process and appends its rows."""
    from jaxmllm.process import xla_flags

    xla_flags.apply(case.flags)  # (before JAX starts its backends)
    import jax

    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    from jaxmllm.bench import gpu_cases

    measure = getattr(gpu_cases, case.part)
    for row in measure(case, out):
        append(out / "rows.jsonl", {"part": case.part, "case": case.name, **row})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="folder for rows.jsonl, report.md, hlo.tar.gz")
    p.add_argument("--parts", default=",".join(PARTS), help="comma list of " + ", ".join(PARTS))
    p.add_argument("--cases", default="", help="only the cases whose names match this regex")
    p.add_argument("--timeout", type=int, default=480, help="seconds a case may take")
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "jaxmllm-xla-cache"))
    p.add_argument("--smoke", action="store_true", help="every part at tiny shapes (CPU)")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out, cache = Path(args.out), Path(args.cache)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(Case(**json.loads(args.child)), out, cache)
        return 0
    from jaxmllm.process.xla_flags import gpu_expected

    gpu = not args.smoke and gpu_expected()
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    todo = [c for c in cases(parts, gpu, args.smoke) if re.search(args.cases, c.name)]
    if args.list or not todo:
        print("\n".join(c.name for c in todo) or f"no case matches --cases {args.cases!r}")
        return 0 if todo else 2
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"  # (the children's too)
    rows = run_cases(todo, out, args.timeout, cache)
    pack_hlo(out)
    print((out / "report.md").read_text())
    failed = [r for r in rows if "error" in r]
    print(f"{len(todo)} cases, {len(failed)} failed; rows in {out / 'rows.jsonl'}")
    return 1 if failed else 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
