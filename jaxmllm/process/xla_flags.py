"""XLA's GPU scheduling flags: on by default when the backend will be a GPU.

By default XLA does not overlap a step's collectives with its compute on GPUs: the FSDP weight
all-gathers and gradient reduce-scatters inside the layers' scan wait for each other and for
the matmuls (on 8 GPUs, ~11.6 GB a GPU and microbatch for the 2B recipe: ~8% of its step if
not hidden). The flags below are the set MaxText and NVIDIA's JAX-Toolbox run LLMs with
(JAX-Toolbox's rosetta/docs/GPU_performance.md), spelled as jaxlib 0.10.2 parses them (an
unknown flag in XLA_FLAGS aborts the process; MaxText's older `--xla_gpu_pipeline_*` spelling
does): the latency-hiding scheduler, which orders collectives to overlap compute; pipelined
all-gather / reduce-scatter / all-reduce, which move a scanned layer's collectives into the
previous iteration; while-loop double buffering (the layers' scan unrolled by two so that one
layer's gathers overlap the other's compute); combine thresholds that merge a layer's small
collectives into few large ones (sized for 8 GPUs a node: JAX-Toolbox's 1 GiB / 8 per gather,
half that per reduce-scatter), not by dimension.

`apply` adds them to XLA_FLAGS before JAX starts its backends (XLA reads the variable once),
when the backend will be a GPU (JAX_PLATFORMS names one, or a CUDA plugin is installed and
nothing excludes it); a flag the user's XLA_FLAGS already sets is left as the user set it.
`train.xla_gpu_flags: false` turns the set off.

`set_memory_fraction` gives JAX a share of each GPU's memory (0.9: the recipes are sized for
72 GiB of an 80 GB GPU; JAX's own default is 0.75) through the variable jaxlib reads,
XLA_CLIENT_MEM_FRACTION (jaxlib 0.10 and 0.11; XLA_PYTHON_CLIENT_MEM_FRACTION is its deprecated
name, and jaxlib refuses to start with both set), unless the user set either.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from collections.abc import MutableMapping

import jax

log = logging.getLogger("jaxmllm")

GPU_FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
    "xla_gpu_all_reduce_combine_threshold_bytes": str(1 << 30),
    "xla_gpu_all_gather_combine_threshold_bytes": str(1 << 27),
    "xla_gpu_reduce_scatter_combine_threshold_bytes": str(1 << 26),
    "xla_gpu_enable_all_gather_combine_by_dim": "false",
    "xla_gpu_enable_reduce_scatter_combine_by_dim": "false",
}
GPU_PLATFORMS = ("cuda", "gpu", "rocm")
CUDA_PLUGINS = (
    "jax_cuda12_plugin",
    "jax_cuda13_plugin",
    "jax_plugins.xla_cuda12",
    "jax_plugins.xla_cuda13",
)
_applied: dict[str, str] = {}  # what `apply` added in this process
MEMORY_FRACTION = 0.9  # of each GPU's memory: 71.7 GiB of an 80 GB H100's 79.6
MEMORY_VARIABLE = "XLA_CLIENT_MEM_FRACTION"  # what jaxlib's GPU client reads
MEMORY_VARIABLE_OLD = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # its deprecated name (still read)


def gpu_expected(env: MutableMapping[str, str] = os.environ) -> bool:
    """Whether JAX will start on a GPU: JAX_PLATFORMS (or jax_platforms) names one, or, with
    neither set, a CUDA plugin is installed (JAX then prefers the GPU)."""
    platforms = env.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""
    if platforms:
        return any(p.strip() in GPU_PLATFORMS for p in platforms.split(","))
    return any(_installed(name) for name in CUDA_PLUGINS)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # (a parent package missing)
        return False


def user_flags(env: MutableMapping[str, str] = os.environ) -> set[str]:
    """The flag names the environment's XLA_FLAGS sets already."""
    return set(re.findall(r"--([A-Za-z0-9_]+)", env.get("XLA_FLAGS", "")))


def apply(enabled: bool = True, env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Adds the GPU flag set to XLA_FLAGS when the backend will be a GPU; returns the flags it
    added (none: disabled, not a GPU, or every one set by the user already).

    Call before JAX starts its backends: after, XLA has read the variable and nothing changes
    (logged, with what to do instead)."""
    if not enabled or not gpu_expected(env):
        return {}
    from jax._src import xla_bridge  # no public way to ask whether backends are up

    added = {k: v for k, v in GPU_FLAGS.items() if k not in user_flags(env)}
    if not added:
        return {}
    if xla_bridge.backends_are_initialized():
        log.warning(
            "XLA's GPU flag set not applied: JAX started its backends before the trainer; put "
            "them in XLA_FLAGS before starting Python: %s",
            format_flags(added),
        )
        return {}
    env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS", ""), format_flags(added)]))
    _applied.update(added)
    return added


def set_memory_fraction(
    fraction: float = MEMORY_FRACTION, env: MutableMapping[str, str] = os.environ
) -> str:
    """Sets the share of each GPU's memory JAX takes (read once, when its GPU backend starts),
    unless the environment sets it already under either name; returns the variable and value
    in effect ("VAR=value")."""
    for name in (MEMORY_VARIABLE, MEMORY_VARIABLE_OLD):
        if env.get(name):
            return f"{name}={env[name]}"
    env[MEMORY_VARIABLE] = f"{fraction:g}"
    return f"{MEMORY_VARIABLE}={env[MEMORY_VARIABLE]}"


def report() -> None:
    """Logs the GPU flags in effect once JAX runs on a GPU: those jaxmllm added and the
    user's own (from XLA_FLAGS)."""
    if jax.default_backend() != "gpu":
        return
    mine = user_flags() - set(_applied)
    log.info(
        "XLA GPU flags added (train.xla_gpu_flags; yours in XLA_FLAGS win): %s%s",
        format_flags(_applied) or "none (all set by you)",
        f"; yours: {', '.join(sorted(mine))}" if mine else "",
    )


def format_flags(flags: dict[str, str]) -> str:
    return " ".join(f"--{k}={v}" for k, v in flags.items())
