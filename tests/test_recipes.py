"""The GPU recipes (configs/gpu/): they load, start with the command that runs them, and their
train step compiled on a fake mesh of their size (abstract shapes, nothing allocated) fits a
GPU of 80 GB (`python -m jaxmllm.bench.memory --check`, in a process with as many forced CPU
devices)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxmllm.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs" / "gpu").glob("*.yaml"))


def devices_of(path: Path) -> int:
    """The GPUs a recipe runs on: 8 per node, NNODES of them in its launch command."""
    nodes = re.search(r"NNODES=(\d+)", path.read_text().splitlines()[0])
    return 8 * (int(nodes.group(1)) if nodes else 1)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_loads_and_starts_with_the_command_that_runs_it(path):
    cfg = load_config(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and f"--config configs/gpu/{path.name}" in first, first
    assert cfg.model.attention == "auto" and cfg.model.compute_dtype == "bfloat16"
    assert cfg.mesh.fsdp * cfg.mesh.tensor == 8  # (within a node)


@pytest.mark.slow
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_step_compiles_on_its_mesh_and_fits_80_gb(path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    command = [sys.executable, "-m", "jaxmllm.bench.memory", "--config", str(path), "--check",
               "--devices", str(devices_of(path)), "--device-gib", "80"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0 and " fits 80 GiB" in done.stdout, done.stdout + done.stderr[-3000:]
    print(done.stdout)


def test_the_bounds_without_data_hold_what_the_data_resolves_to():
    """What the compile-only measurements size buckets with (`resolve_bounds`) is at least
    what a run resolves from its data: tiles, route capacity (so what fits there fits a run)."""
    from jaxmllm.data.source import make_source
    from jaxmllm.plan.sizing import resolve_batch, resolve_bounds, tile_keys

    sets = ["batch.capacity=fixed", "data.synthetic.num_samples=256", "train.steps=4"]
    cfg = load_config("configs/tiny.yaml", sets)
    _, index = make_source(cfg)
    bound, data = resolve_bounds(cfg, 8).batch, resolve_batch(cfg, index, 8).batch
    for key in ["route_pair_capacity", *tile_keys().values()]:
        assert getattr(bound, key) >= getattr(data, key) > 0, key
    with pytest.raises(ConfigError, match=r"batch\.capacity: fixed"):
        resolve_bounds(load_config("configs/tiny.yaml"), 8)  # (auto: from the data)
