"""XLA:CPU's thread pool against the collective deadlock (jaxmllm.process.cpu_pool): the pool is
sized before the backend starts, and the step that deadlocked (test_hf_train's recipes: 8
devices, FSDP gathers beside the microbatch loop's routed all-to-all) runs in fresh processes
beside a CPU burner, every run to its end."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from jaxmllm.process.cpu_pool import POOL_THREADS, VARIABLE, size_pool

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def test_size_pool_sets_the_variable_only_for_several_devices_and_never_over_the_users():
    env: dict[str, str] = {}
    assert not size_pool(1, env) and env == {}
    assert size_pool(8, env) and env == {VARIABLE: str(POOL_THREADS)}
    mine = {VARIABLE: "512"}
    assert not size_pool(8, mine) and mine == {VARIABLE: "512"}


def test_a_smaller_pool_the_user_set_is_kept_with_a_warning(caplog):
    env = {VARIABLE: "8"}
    with caplog.at_level(logging.WARNING, logger="jaxmllm"):
        assert not size_pool(8, env)
    assert env == {VARIABLE: "8"}
    assert "deadlock" in caplog.text and "jaxmllm.process.cpu_pool" in caplog.text


def test_the_test_sessions_backend_started_with_the_sized_pool():
    """The variable reached XLA: its intra-op pool ("tf_XLAEigen" threads) has POOL_THREADS
    threads, not max(cores, devices)."""
    assert jax.device_count() == 8  # (the backend is up)
    names = [
        Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")
    ]
    assert sum(n == "tf_XLAEigen" for n in names) == POOL_THREADS


HF_TRAIN = "tests/test_hf_train.py::test_recipes_stage1_then_stage2_then_export"
PYTEST_ARGS = ["-q", "-n", "0", "-m", "slow", "-p", "no:cacheprovider"]  # (in one process)
# (with XLA's own pool 3 runs in 8 hung: 2 runs miss that with odds of ~39%, 3 runs ~24% for
# 30 s more of CI's budget; the fast test above holds the pool's size itself, every run, and
# that is the cause: these runs hold its symptom)
RUNS = 2


@pytest.mark.slow  # two fresh runs of test_hf_train's recipes beside a burner: ~1 min
def test_the_step_that_deadlocked_runs_to_its_end_beside_a_cpu_burner():
    """test_hf_train's recipes (stage 1, stage 2, export) in fresh processes beside a CPU
    burner, RUNS times, each to its end. With the pool as XLA sizes it (PJRT_NPROC=8 on this
    2-core box) 3 of 8 such runs hung: every thread in a rendezvous, 0% CPU, until XLA's
    abort; with the sized pool 8 of 8 ended, in 38-41 s."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # (this session's XLA_FLAGS and pool)
    # Each run compiles in a cache of its own, as it did when the deadlock was found: the
    # session's shared cache (JAXMLLM_TEST_CACHE) made the second run load the step run 0
    # compiled, and that run hung beside the burner (20 s of CPU in 300 s, reproduced twice;
    # the first run, compiling, took 38 s). A step loaded from JAX's persistent cache hanging
    # on XLA:CPU is an issue of its own; this test holds the pool's sizing.
    env.pop("JAXMLLM_TEST_CACHE", None)
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for run in range(RUNS):
            start = time.monotonic()
            try:
                done = subprocess.run(
                    [sys.executable, "-m", "pytest", *PYTEST_ARGS, HF_TRAIN],
                    env=env,
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    timeout=280,  # (under XLA's 300 s abort)
                )
            except subprocess.TimeoutExpired as e:
                pytest.fail(f"run {run} did not end in 280 s (a hang): {str(e.stdout)[-2000:]}")
            took = time.monotonic() - start
            assert done.returncode == 0, (run, took, done.stdout[-3000:])
    finally:
        burner.kill()
        burner.wait()
