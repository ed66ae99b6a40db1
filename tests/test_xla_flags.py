"""XLA's GPU flag set (jaxmllm.process.xla_flags): every flag parses on the installed jaxlib (an
unknown one aborts the process at start-up), and it is added only for a GPU backend, leaving
the user's own XLA_FLAGS as they are."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxmllm.loop.metrics import device_peak, peak_tflops
from jaxmllm.process import xla_flags


def starts_with(flags: str) -> subprocess.CompletedProcess:
    """A fresh Python that starts JAX (CPU) and compiles a function with these XLA_FLAGS."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    code = "import jax; jax.jit(lambda x: x + 1)(1).block_until_ready()"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_every_gpu_flag_parses_on_the_installed_jaxlib():
    assert starts_with(xla_flags.format_flags(xla_flags.GPU_FLAGS)).returncode == 0
    # (the check can fail: MaxText's older spelling is unknown to this jaxlib and aborts,
    # naming it: jaxlib 0.10 says "Unknown flag in XLA_FLAGS", 0.11 "Flag parsing failed")
    unknown = starts_with("--xla_gpu_pipeline_all_gather=true")
    assert unknown.returncode != 0 and "--xla_gpu_pipeline_all_gather" in unknown.stderr
    assert "Unknown flag" in unknown.stderr or "Flag parsing failed" in unknown.stderr


def test_the_memory_fraction_is_set_where_the_installed_jaxlib_reads_it(monkeypatch):
    """0.9 of each GPU under the name jaxlib's GPU client reads (its options built here, no GPU
    needed), unless the user set either name: both set is an error in jaxlib."""
    from jaxlib import xla_client

    for name in (xla_flags.MEMORY_VARIABLE, xla_flags.MEMORY_VARIABLE_OLD):
        monkeypatch.delenv(name, raising=False)
    env = {}
    assert xla_flags.set_memory_fraction(env=env) == f"{xla_flags.MEMORY_VARIABLE}=0.9"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert xla_client.generate_pjrt_gpu_plugin_options()["memory_fraction"] == 0.9
    mine = {xla_flags.MEMORY_VARIABLE_OLD: "0.8"}  # (a user's, under the old name)
    assert xla_flags.set_memory_fraction(env=mine) == f"{xla_flags.MEMORY_VARIABLE_OLD}=0.8"
    assert mine == {xla_flags.MEMORY_VARIABLE_OLD: "0.8"}


@pytest.fixture
def backends_down(monkeypatch):
    """JAX's backends not started yet (as at the trainer's start)."""
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(xla_flags, "_applied", {})


def test_the_set_is_added_for_a_gpu_and_the_users_flags_win(backends_down):
    env = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    added = xla_flags.apply(True, env)
    assert "xla_gpu_enable_latency_hiding_scheduler" not in added
    assert set(added) == set(xla_flags.GPU_FLAGS) - {"xla_gpu_enable_latency_hiding_scheduler"}
    assert env["XLA_FLAGS"].count("latency_hiding_scheduler") == 1  # the user's, as set
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in env["XLA_FLAGS"]
    assert xla_flags.user_flags(env) == set(xla_flags.GPU_FLAGS)


@pytest.mark.parametrize(
    ("env", "enabled"),
    [({"JAX_PLATFORMS": "cpu"}, True), ({"JAX_PLATFORMS": "cuda"}, False)],
    ids=["cpu", "switched-off"],
)
def test_nothing_is_added_off_a_gpu_or_when_switched_off(env, enabled, backends_down):
    assert xla_flags.apply(enabled, env) == {} and "XLA_FLAGS" not in env


def test_mfu_peaks_by_device_kind():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0  # (not the SXM part's)
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0  # (not the A10's)
    assert peak_tflops("NVIDIA GH200 480GB") == 989.4
    assert peak_tflops("cpu") is None
    assert device_peak(0.0, "cpu") is None and device_peak(50.0, "cpu") == 50.0
    assert device_peak(0.0, "NVIDIA H200") == 989.4
