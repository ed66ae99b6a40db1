"""The GPU campaign split into short jobs (`python -m jaxmllm.bench.gpu --plan`), and the
wheels a node without a package index lacks (`--wheels DIR`).

The jobs it plans for: GPU time in short jobs (by default 26 usable minutes in all, counted
from each node's start), one job at most 10 minutes, each on a fresh node (a minute or two to
start, an empty compile cache) with no package index. So the campaign is a few jobs (calls)
of at most 10 minutes, each naming the cases it runs and a `--budget` that stops it starting a
case it cannot finish before the job's limit; the most valuable cases go first, and the
plan's jobs, a node's start each, fit the budget.

The GPU image it was written for has Python 3.12 with jax 0.11.2 and most of what jaxmllm
imports; what it lacks travels with the working tree as wheels (`WHEELS`), installed by each
job's first command.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

from jaxmllm.bench.gpu_cases import Case

BUDGET_S = 26 * 60  # the GPU time to fit by default (--plan-seconds)
CALL_S = 600  # one job's limit by default (--job-seconds)
START_S = 120  # a node's start, before each job's command (a fresh one every job)
SETUP_S = 30  # a job's command before the campaign's clock: the wheels' install, Python
MARGIN_S = 20  # after its budget: the last case's kill and the report
COMMAND_CHARS = 2000  # the most a call's command may hold
# What the GPU image lacks of jaxmllm's imports, at the versions tested here (by its package
# list, read 2026-11-17: jax 0.11.2, flax, optax, orbax-checkpoint, numpy, pyarrow,
# pillow, tokenizers, jinja2, pyyaml, tqdm, ml-dtypes and xxhash are there): grain and its
# array-record and portpicker, soundfile and the cffi it loads libsndfile through (imported
# only where audio is read). PyAV only for a campaign with videos; tensorboardX never (metrics
# go to JSONL without it).
WHEELS = {
    "grain": "0.2.18",
    "array-record": "0.8.6",
    "portpicker": "1.6.0",
    "soundfile": "0.14.0",
    "cffi": "2.1.1",
}
VIDEO_WHEELS = {"av": "18.1.0"}
JAX = "0.11.2"  # the GPU image's jax and jaxlib (CI's Python 3.12 leg pins the same)
# The image's packages that jaxmllm, its tests and the carried wheels import (all in its list;
# their own dependencies come with them): what tests/test_gpu_image.py makes its virtualenv of.
IMAGE = [f"jax=={JAX}", f"jaxlib=={JAX}", "flax", "optax", "orbax-checkpoint", "numpy", "pyyaml"]
IMAGE += ["pillow", "tqdm", "tokenizers", "ml-dtypes", "jinja2", "pyarrow", "xxhash"]
IMAGE += ["cloudpickle", "pytest", "hypothesis"]
WHEEL_DIR = ".whl"  # (git-ignored; each call carries it)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64"]
PLATFORMS += ["manylinux2014_x86_64", "manylinux1_x86_64"]
INSTALL = (
    f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
    f"--target /tmp/site {WHEEL_DIR}/*.whl"
)


@dataclasses.dataclass
class Call:
    """One job: its cases, in order, and the seconds the campaign may spend on them."""

    cases: list[Case] = dataclasses.field(default_factory=list)

    @property
    def budget_s(self) -> int:
        """The seconds this call's cases are estimated to take (the campaign's --budget for the
        call)."""
        return sum(c.estimate_s for c in self.cases)

    @property
    def timeout_s(self) -> int:
        """The call's wall-clock limit: its setup, its cases' budget and a margin for the last
        case's kill and the report."""
        return SETUP_S + self.budget_s + MARGIN_S

    def command(self, out: str) -> str:
        """The shell command a job runs, in a copy of the repository with the wheels beside it:
        install the wheels, set PYTHONPATH, run the campaign on exactly these cases with this
        job's budget under `timeout`, writing into `out` (a shell word: `"${OUT:-gpu-job1}"`
        writes into $OUT where the job's runner sets one)."""
        names = "|".join(re.escape(c.name) for c in self.cases)
        campaign = ["timeout", str(self.budget_s + MARGIN_S)]
        campaign += ["python3", "-m", "jaxmllm.bench.gpu", "--out", out]
        campaign += ["--budget", str(self.budget_s), "--cases", f"^({names})$"]
        env = "export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1"
        return f"{INSTALL} && {env} && " + " ".join(
            a if a == out else shlex.quote(a) for a in campaign
        )


def plan(
    cases: list[Case], budget_s: int = BUDGET_S, call_s: int = CALL_S, start_s: int = START_S
) -> tuple[list[Call], list[Case]]:
    """The device calls for `cases` (most valuable first) within `budget_s`: each case joins the
    last call while it stays within `call_s`, else starts a call of its own if that call and
    its start fit what is left; (the calls, the cases left out)."""
    calls: list[Call] = []
    left_out: list[Case] = []
    for case in cases:
        spent = sum(c.timeout_s + start_s for c in calls)
        if calls and calls[-1].timeout_s + case.estimate_s <= call_s:
            if spent + case.estimate_s <= budget_s:
                calls[-1].cases.append(case)
                continue
        alone = Call([case])
        if alone.timeout_s <= call_s and spent + start_s + alone.timeout_s <= budget_s:
            calls.append(alone)
        else:
            left_out.append(case)
    return calls, left_out


def describe(calls: list[Call], left_out: list[Case], budget_s: int, start_s: int) -> str:
    """The plan as its reader runs it: the wheels, then each job's cases, limit and command."""
    total = sum(c.timeout_s + start_s for c in calls)
    lines = [
        f"# GPU campaign: {len(calls)} jobs, {total} s of a {budget_s} s budget "
        f"(each job's limit and a node's {start_s} s start)",
        "",
        f"# Once, on a machine with a package index: the wheels the GPU node lacks, into "
        f"{WHEEL_DIR}/ (git-ignored; copy it with the repository):",
        f"python -m jaxmllm.bench.gpu --wheels {WHEEL_DIR}",
    ]
    for i, call in enumerate(calls, 1):
        lines += [
            "",
            f"# Job {i}, at most {call.timeout_s} s, in the repository's root on the GPU node "
            f"(its cases' budget {call.budget_s} s):",
            *(f"#   {c.name} (~{c.estimate_s} s)" for c in call.cases),
            call.command(f'"${{OUT:-gpu-job{i}}}"'),
        ]
    if left_out:
        lines += ["", "# Left out (no room in this budget):"]
        lines += [f"#   {c.name} (~{c.estimate_s} s)" for c in left_out]
    lines += [
        "",
        "# What each job leaves in its folder: report.md (the tables so far), rows.jsonl, "
        "log.txt, hlo.zip",
    ]
    return "\n".join(lines)


def download_wheels(folder: str | Path, video: bool = False) -> list[tuple[str, int]]:
    """Downloads `WHEELS` (and `VIDEO_WHEELS`) for the image's Python 3.12 on x86-64 Linux into
    `folder`, replacing what is there; (file name, bytes) of each."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.whl"):
        old.unlink()  # (two versions of one package stop the install)
    wanted = {**WHEELS, **(VIDEO_WHEELS if video else {})}
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(folder)]
    cmd += [a for p in PLATFORMS for a in ("--platform", p)]
    cmd += [f"{name}=={version}" for name, version in wanted.items()]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        from jaxmllm.config import UserError

        raise UserError(f"pip download of {', '.join(wanted)} failed: {done.stderr[-500:]}")
    return [(p.name, p.stat().st_size) for p in sorted(folder.glob("*.whl"))]
