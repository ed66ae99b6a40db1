"""Starting training runs in child processes, for the tests that signal, kill or launch them."""

import json
import os
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOOKS = ROOT / "tests" / "child_hooks"  # sitecustomize + killpoints, for kill=...


def quick_compile() -> tuple[str, ...]:
    """XLA:CPU flags that make compiling quicker, those the installed jaxlib has (conftest sets
    them on a CPU backend; a child run gets the ones its parent has): the tests compile many
    small programs and run each a few times, so compiling dominates them. Neither changes what
    is computed, only how the CPU code is generated (the same-math tests hold either way):
    - LLVM's backend optimisations, ~half a compile (the routed-step test 302 s -> 129 s on the
      loaded 2-core box);
    - jaxlib 0.10's MLIR fusion emitters, for the elemental one that jaxlib 0.11 no longer has
      (a tiny run from an empty cache 17.8-18.1 s -> 14.1-15.7 s; 0.11 does not know the flag,
      and an unknown flag aborts the process)."""
    flags = ("--xla_backend_optimization_level=0",)
    if version("jaxlib").split(".")[:2] == ["0", "10"]:
        flags += ("--xla_cpu_use_fusion_emitters=false",)
    return flags


# tiny.yaml evaluates a held-out set during and at the end of its run (data.eval): runs that test
# other things leave it out
NO_EVAL = ("data.eval.source=none",)

# The cheapest run of the trainer: text only, one layer (a child compiles it in ~1/3 of tiny's
# time), for the tests of what happens around the step (signals, hangs, faults, resumes)
TINY_TEXT = (
    "data.synthetic.num_samples=64",
    "model.vision.enabled=false",
    "model.audio.enabled=false",
    "model.llm.depth=1",
    "batch.microbatches=1",
    "data.synthetic.image_fraction=0",
    "data.synthetic.audio_fraction=0",
    "data.synthetic.multi_image_fraction=0",
    "data.synthetic.video_fraction=0",
)


def child_env(
    kill: dict | None = None, index_kill: dict | None = None, hang: dict | None = None
) -> dict[str, str]:
    """The environment for a child run: unbuffered output, the repo importable, and without
    conftest's forced device count (the config's mesh.cpu_devices splits the CPU itself).

    `kill`: a kill point (see tests/child_hooks/killpoints.py) the child SIGKILLs itself at;
    `index_kill`: one of an index build (tests/child_hooks/indexkill.py); `hang`: a step that
    blocks (tests/child_hooks/hangpoints.py).
    """
    hooks = ("XLA_FLAGS", "JAXMLLM_TEST_KILL", "JAXMLLM_TEST_INDEX_KILL", "JAXMLLM_TEST_HANG")
    env = {k: v for k, v in os.environ.items() if k not in hooks}
    quick = [f for f in os.environ.get("XLA_FLAGS", "").split() if f in quick_compile()]
    if quick:
        env["XLA_FLAGS"] = " ".join(quick)  # (as conftest: compiling is most of a test)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if kill is not None or index_kill is not None or hang is not None:
        env["PYTHONPATH"] = str(HOOKS) + os.pathsep + env["PYTHONPATH"]
    if kill is not None:
        env["JAXMLLM_TEST_KILL"] = json.dumps(kill)
    if index_kill is not None:
        env["JAXMLLM_TEST_INDEX_KILL"] = json.dumps(index_kill)
    if hang is not None:
        env["JAXMLLM_TEST_HANG"] = json.dumps(hang)
    return env


def logged_step(out) -> int:
    """The highest step in a running child's metrics.jsonl; a line still being written is
    skipped (reading while the child appends is safe to poll)."""
    path = Path(out) / "metrics.jsonl"
    steps = [0]
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            continue
    return max(steps)


def train_cmd(out, *sets: str, module: str = "jaxmllm.train", args=()) -> list[str]:
    """`python -m <module> [args] --config configs/tiny.yaml --set <sets> train.output_dir=out`."""
    return [
        sys.executable,
        "-m",
        module,
        *args,
        "--config",
        "configs/tiny.yaml",
        "--set",
        *NO_EVAL,
        *sets,
        f"train.output_dir={out}",
    ]
