"""The GPU recipes (configs/gpu/): they load, start with the command that runs them, resolve on
their device count, and their train step compiled on a fake mesh of their size (abstract
shapes, nothing allocated) fits a GPU of 80 GB (`python -m jaxmllm.bench.memory --check`, in a
process with as many forced CPU devices): within 72 GiB, the 90% of its 79.6 GiB that JAX
takes with the recipes' XLA_CLIENT_MEM_FRACTION=0.9.

A compile takes ~1-3 min on a CPU, so the slow test compiles one recipe per model path,
seven: the 7B on one node (Qwen2-VL, the most memory per GPU), the 7B's LoRA on one GPU
(CUDA_VISIBLE_DEVICES=0 in its command), the 30B mixture of experts (expert parallelism, its
dropless buffers; 71.1 of the 72 GiB), Qwen3-VL-8B (DeepStack), Qwen3-VL-30B-A3B (EP 8,
LoRA on the routed experts), Qwen2.5-VL-3B's GRPO (a windowed tower, GRPO's step) and
Gemma-3-4B (windowed layers, images read both ways, the pooling projector). The others share
a path with one of them and are held to it by the fast tests: the 2B (Qwen2-VL's path at the
7B's per-GPU rows and patches, a narrower LLM), Gemma-3-12B (the 4B's path and per-GPU
shapes, a wider and deeper decoder: its peak, in its header, is bench.memory's) and every
multinode recipe (its node's per-GPU shapes; the data x fsdp mesh resolves on its devices
above)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxmllm.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs" / "gpu").glob("*.yaml"))
COMPILED = [
    ROOT / "configs" / "gpu" / f"{name}.yaml"
    for name in ["qwen2vl_7b", "qwen2vl_7b_lora", "qwen3_30b_a3b", "qwen3_vl_8b"]
    + ["qwen3_vl_30b_a3b", "qwen2_5vl_3b_grpo", "gemma3_4b", "gemma4_26b_a4b"]
]
GIB = 72  # what JAX may take of an 80 GB GPU (79.6 GiB) with XLA_CLIENT_MEM_FRACTION=0.9


def devices_of(path: Path) -> int:
    """The GPUs a recipe runs on: its nodes (NNODES or sbatch's --nodes in its command) times
    a node's GPUs; one with CUDA_VISIBLE_DEVICES=0."""
    first = path.read_text().splitlines()[0]
    if "CUDA_VISIBLE_DEVICES=0 " in first:
        return 1
    nodes = re.search(r"(?:NNODES=|--nodes=)(\d+)", first)
    return node_gpus(path) * (int(nodes.group(1)) if nodes else 1)


def node_gpus(path: Path) -> int:
    """A node's GPUs: sbatch's --gpus-per-node in the recipe's command, else 8."""
    first = path.read_text().splitlines()[0]
    per_node = re.search(r"--gpus-per-node=(\d+)", first)
    return int(per_node.group(1)) if per_node else 8


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_loads_and_starts_with_the_command_that_runs_it(path):
    cfg = load_config(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and f" configs/gpu/{path.name}" in first, first
    assert cfg.model.attention == "auto" and cfg.model.compute_dtype == "bfloat16"
    inner = cfg.mesh.expert * cfg.mesh.fsdp * cfg.mesh.tensor
    assert inner == min(devices_of(path), node_gpus(path))  # (within a node)
    # Your data in whatever format it is (data.format: auto): no data.source pins one
    assert "source" not in yaml.safe_load(path.read_text())["data"]
    assert cfg.data.format == "auto" and cfg.data.source == "files"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_resolves_on_its_devices(path):
    """Its mesh takes all its GPUs, `auto` attention resolves (block-sparse on this CPU), and
    the batch sizes resolve to their bounds without data (what bench.memory compiles)."""
    from jaxmllm.resolve.attention import resolve_attention
    from jaxmllm.resolve.sizing import resolve_bounds
    from sharding.mesh import AXES, resolve_axis_sizes

    cfg, devices = load_config(path), devices_of(path)
    sizes = dict(zip(AXES, resolve_axis_sizes(cfg.mesh, devices), strict=True))
    node = sizes["expert"] * sizes["fsdp"] * sizes["tensor"]  # (a node's)
    assert math.prod(sizes.values()) == devices and node == min(devices, node_gpus(path)), sizes
    assert cfg.batch.devices_per_host in (-1, min(devices, node_gpus(path)))
    resolved = resolve_bounds(resolve_attention(cfg), devices)  # (data x fsdp: all)
    assert resolved.model.attention == "block_sparse"
    assert resolved.batch.route_pair_capacity > 0 or devices == 1  # (one GPU: no exchange)


def test_a_multinode_recipe_has_its_nodes_shapes_per_gpu():
    """What fits one node's GPUs fits each node's: the same model, remat and shapes per GPU,
    and the same rows a step (fewer microbatches over more GPUs)."""
    pairs = [
        (p, p.with_name(re.sub(r"_multinode|_4gpu_nodes", "", p.name)))
        for p in RECIPES
        if re.search(r"_multinode|_4gpu_nodes", p.stem)
    ]
    assert len(pairs) == 4  # (Qwen2-VL-2B on 8- and 4-GPU nodes, 7B, Qwen3-VL-30B-A3B)
    for many_path, one_path in pairs:
        many, one = load_config(many_path), load_config(one_path)
        inner = many.mesh.expert * many.mesh.fsdp * many.mesh.tensor  # (split within a node)
        assert many.model == one.model and inner == node_gpus(many_path)
        for key in ["llm_rows", "llm_row_len", "vision_patches"]:
            assert getattr(many.batch, key) == getattr(one.batch, key), key
        step = many.batch.microbatches * devices_of(many_path)
        assert step == one.batch.microbatches * devices_of(one_path)


@pytest.mark.slow
@pytest.mark.parametrize("path", COMPILED, ids=lambda p: p.stem)
def test_a_recipe_step_compiles_on_its_mesh_and_fits_80_gb(path):  # (72 GiB of it)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    command = [
        sys.executable,
        "-m",
        "jaxmllm.bench.memory",
        "--config",
        str(path),
        "--check",
        "--devices",
        str(devices_of(path)),
        "--device-gib",
        str(GIB),
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0 and f" fits {GIB} GiB" in done.stdout, (
        done.stdout + done.stderr[-3000:]
    )
    print(done.stdout)


def test_the_bounds_without_data_hold_what_the_data_resolves_to():
    """What the compile-only measurements size buckets with (`resolve_bounds`) is at least
    what a run resolves from its data: tiles, route capacity (so what fits there fits a run)."""
    from jaxmllm.resolve.run import resolve_run
    from jaxmllm.resolve.sizing import resolve_bounds, tile_keys

    sets = ["batch.capacity=fixed", "data.synthetic.num_samples=256", "train.steps=4"]
    cfg = load_config("configs/tiny.yaml", sets)
    bound, data = resolve_bounds(cfg, 8).batch, resolve_run(cfg, 8).cfg.batch
    for key in ["route_pair_capacity", *tile_keys().values()]:
        assert getattr(bound, key) >= getattr(data, key) > 0, key
    with pytest.raises(ConfigError, match=r"batch\.capacity: fixed"):
        resolve_bounds(load_config("configs/tiny.yaml"), 8)  # (auto: from the data)
