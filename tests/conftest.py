"""Test set-up: 8 forced CPU devices, set before JAX is imported anywhere."""

import importlib.util
import os
import tempfile

import pytest

from runs import quick_compile

# Everything the session's tools cache on disk lives in one folder, deleted at its end
# (pytest_unconfigure) by the process that made it: JAX's compile cache, and torch's inductor
# cache, which importing peft creates as `torchinductor_<user>` in the temporary folder (its
# children inherit the place). The folder is named by JAXMLLM_TEST_CACHE, so pytest-xdist's
# workers (started after this import, with its environment) share their controller's, and
# `.ci/run` hands one folder to all its sessions: the slow files, each a fresh process, then
# find the tiny programs the default suite compiled (JAX's keys hold its version and the
# compile options, so the Python 3.12 leg's jax cannot take another's entry).
OWN_TMP = "JAXMLLM_TEST_CACHE" not in os.environ
if OWN_TMP:
    os.environ["JAXMLLM_TEST_CACHE"] = tempfile.mkdtemp(prefix="jaxmllm-test-")
SESSION_TMP = os.environ["JAXMLLM_TEST_CACHE"]
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(SESSION_TMP, "torchinductor"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
FLAGS = ["--xla_force_host_platform_device_count=8"]
if os.environ["JAX_PLATFORMS"] == "cpu":
    # Quicker XLA:CPU compiles (runs.quick_compile says which and why), each unless XLA_FLAGS
    # names its flag already (`XLA_FLAGS=--xla_cpu_use_fusion_emitters=true pytest` runs
    # without it)
    given = os.environ.get("XLA_FLAGS", "")
    FLAGS += [f for f in quick_compile() if f.split("=")[0] not in given]
    # XLA:CPU aborts the process when a collective's participants have not all arrived within
    # 40 s. On the 2-core box the 8 forced devices share two cores with compiles and other
    # jobs, and a training step under load once went past it (test_hf_train's stage-1 run, in
    # XLA's rendezvous: "Termination timeout ... 6 of 8 arrived"). Wait longer; warn at 20 s.
    FLAGS += ["--xla_cpu_collective_call_terminate_timeout_seconds=300"]
    FLAGS += ["--xla_cpu_collective_call_warn_stuck_timeout_seconds=20"]
    # XLA:CPU's pool sized so the 8 devices' overlapping collectives cannot block every thread
    # (the deadlock of test_hf_train's first step: jaxmllm.process.cpu_pool says why).
    from jaxmllm.process.cpu_pool import size_pool

    size_pool(8)
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *FLAGS]).strip()


def pytest_configure(config):
    """One persistent compilation cache per test session: the trainer tests build the same
    tiny-config program many times over (a fresh jit each run), and compiling it dominates them."""
    import jax

    cache = os.path.join(SESSION_TMP, "xla-cache")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # ... and the child processes' (killed, resumed, launched, `python -m` runs of the same
    # tiny programs), through the variables JAX reads at import: a tiny run's start 35 s ->
    # 24 s once the session has compiled its step (measured, 2-core box). A child that finds
    # an entry another is still writing reads it as a miss (JAX warns and compiles).
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    # The same-math tests compare fp32 programs at 1e-5: on a GPU (JAX_PLATFORMS=cuda), fp32
    # matrix products default to TF32-like precision, ~1e-4 off.
    if os.environ["JAX_PLATFORMS"] != "cpu":
        jax.config.update("jax_default_matmul_precision", "highest")
    jax.monitoring.register_event_duration_secs_listener(_count_jax)  # (the `host` mark's check)


def pytest_unconfigure(config):
    """Tests leave nothing in the temporary folder: the session's caches go too (the process that
    made the folder removes it; xdist's workers and `.ci/run`'s sessions leave it to theirs)."""
    import shutil

    if OWN_TMP:
        shutil.rmtree(SESSION_TMP, ignore_errors=True)


TORCH = importlib.util.find_spec("torch") is not None


@pytest.hookimpl(tryfirst=True)  # (before the test's fixtures are set up)
def pytest_runtest_setup(item):
    """Tests marked `torch` hold jaxmllm to transformers' models, which run on torch: where torch
    is not installed they skip, saying so (CI's Python 3.12 leg: torch's CPU build is a local
    wheel for 3.11 only, and the registry's torch pulls several GB of CUDA packages; the 3.11
    leg runs them)."""
    if not TORCH and item.get_closest_marker("torch"):
        pytest.skip("torch is not installed: transformers' models (the oracle) run on it")


# `host` (pyproject's markers): a file whose default tests run no JAX program, which CI's Python
# 3.12 leg leaves out (`-m "not slow and not host"`: the leg is there for the GPU image's jax,
# and what runs no JAX cannot see its version; the leg's trainer and model tests run the host
# code under them on that Python). The mark is checked as its tests run, in every leg: one that
# traces or compiles a JAX program in this process fails, naming it. (A program another test of
# the worker already traced runs without tracing and is not seen: the first file to trace it
# is. What a child process runs is not seen: a host file starts no JAX program in a child.)
JAX_EVENTS = [0]  # the traces and compiles this process has seen


def _count_jax(event: str, duration: float, **_) -> None:
    if event.startswith("/jax/core/compile/"):  # (a jaxpr traced, lowered, compiled)
        JAX_EVENTS[0] += 1


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    host = item.get_closest_marker("host") and not item.get_closest_marker("slow")
    before = JAX_EVENTS[0]
    result = yield
    if host and JAX_EVENTS[0] > before:
        pytest.fail(
            f"{item.nodeid} is marked host (its file's pytestmark: no JAX program) but traced "
            "or compiled one: take the mark off its file, or move the test to a file of JAX "
            "tests (CI's Python 3.12 leg runs no host test)",
            pytrace=False,
        )
    return result


# The default suite's longest files (summed call and setup times, 2-core box, 2026-11-27),
# longest first. pytest-xdist's `--dist loadfile` with `--no-loadscope-reorder` (pyproject's
# addopts) hands files to its workers in collection order; by default it deals them by their
# number of tests, so long files of few tests (test_grpo_grad, test_vocab: 2 each) came among
# the last and kept one worker busy after the other had finished. Longest first, the last
# files dealt are short. (`.ci/run` orders the slow files the same way; a file not named here
# keeps its place after them.)
LONGEST = (
    "test_lora_hf",
    "test_hf_gemma4_whole",
    "test_generate",
    "test_train",
    "test_grpo_grad",
    "test_generate_hf",
    "test_preference",
    "test_commands",
    "test_memory_budget",
    "test_vocab",
    "test_hf_gemma4",
    "test_hf_gemma3_whole",
    "test_deltanet",
    "test_step_hlo",
    "test_ulysses",
    "test_attention",
    "test_grpo",
)


def pytest_collection_modifyitems(config, items):
    """Files in `LONGEST`'s order first (a stable sort: each file's tests keep theirs)."""
    rank = {name: k for k, name in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(LONGEST)))
