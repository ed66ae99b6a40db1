"""Starting training runs in child processes, for the tests that signal, kill or launch them."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_env() -> dict[str, str]:
    """The environment for a child run: unbuffered output, the repo importable, and without
    conftest's forced device count (the config's mesh.cpu_devices splits the CPU itself)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


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
        *sets,
        f"train.output_dir={out}",
    ]
