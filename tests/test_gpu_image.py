"""The GPU image's Python with only its own packages (Python 3.12, jax 0.11.2, no torch, no
grain) plus the wheels `python -m jaxmllm.bench.gpu --wheels` downloads, installed as a lent
GPU's call installs them (`--no-deps --target`): the campaign's smoke runs there, so the first
GPU call finds nothing missing. (A tiny training there was cut for CI's time, 35 s: the campaign
never runs the trainer, which the Python 3.12 leg runs on the image's jax.)

The virtualenv is made from the registry's wheels (`gpu_plan.IMAGE`: the image's packages that
jaxmllm and its tests import); it needs a Python 3.12 here (`tools/python.sh`) and the package
registry, and skips, saying so, without them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_gpu_bench import check_smoke

from jaxmllm.bench import gpu_plan

ROOT = Path(__file__).resolve().parents[1]


def python312() -> str | None:
    done = subprocess.run([str(ROOT / "tools" / "python.sh"), "3.12"], capture_output=True)
    return done.stdout.decode().strip() or None


@pytest.fixture(scope="module")
def image_python(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """(the image-only virtualenv's python, the environment a GPU call gives it)."""
    base = python312()
    if base is None:
        pytest.skip("no Python 3.12 here (tools/python.sh): the GPU image's Python")
    where = tmp_path_factory.mktemp("image")
    subprocess.run([base, "-m", "venv", str(where / "venv")], check=True)
    python = str(where / "venv" / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    pip += gpu_plan.IMAGE  # (not byte-compiled: Python compiles what the runs import)
    done = subprocess.run(pip, capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"the image's packages could not be installed: {done.stderr[-500:]}")
    wheels = where / "wheels"
    download = [sys.executable, "-m", "jaxmllm.bench.gpu", "--wheels", str(wheels)]
    done = subprocess.run(download, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    install = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    install += ["--target", str(where / "site"), *map(str, sorted(wheels.glob("*.whl")))]
    subprocess.run(install, check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env |= {"PYTHONPATH": f"{where / 'site'}{os.pathsep}{ROOT}", "JAX_PLATFORMS": "cpu"}
    # Without conftest's forced devices (a GPU call sets none), but with its quicker XLA:CPU
    # compiles (tests/runs.py's child_env too): LLVM's optimisations of the CPU code, ~half a
    # compile, change neither what is compiled nor which packages it takes.
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    return python, env


@pytest.mark.slow
def test_the_image_lacks_what_the_wheels_bring_and_nothing_else(image_python):
    python, env = image_python
    code = "import jax, grain, soundfile, array_record, portpicker; print(jax.__version__)"
    done = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == gpu_plan.JAX, done.stderr[-2000:]
    no_torch = subprocess.run([python, "-c", "import torch"], env=env, capture_output=True)
    assert no_torch.returncode != 0  # (the image has torch; what runs here must not need it)


# A case of every part whose imports differ: what the image lacks is a part's imports, the
# same for each of its cases (the recipe's on the mixes reads them as the plain one does and
# more). The vision-language and MoE parts are the recipe part's code (gpu_cases.vlm and .moe
# call gpu_cases.recipe) on other models, whose recipes' steps test_recipes compiles at full
# size on the image's jax; their cases were cut for CI's time (~57 s). The 7 left out then run
# in no CI leg at tiny shapes: every case is checked well formed, its data in its buckets, in
# test_gpu_bench; `python -m jaxmllm.bench.gpu --smoke` runs them all. 5 of the 11 cases: their
# sum ~80 s of ~185 s on this 2-core box, alone (2026-11-29).
PICKED = r"^(env|tests|attention|host)|/mixes$"


@pytest.mark.slow
def test_the_smoke_campaign_runs_in_the_gpu_images_packages(image_python, tmp_path):
    python, env = image_python
    out = tmp_path / "out"
    cmd = [python, "-m", "jaxmllm.bench.gpu", "--out", str(out), "--smoke", "--cases", PICKED]
    cmd += ["--cache", str(tmp_path / "cache")]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    check_smoke(out, done, PICKED)
    assert "jax 0.11.2" in (out / "report.md").read_text()
    assert "missing here (carry as wheels): av, tensorboardX" in (out / "report.md").read_text()
