"""The GPU campaign (jaxmllm.bench.gpu): its kernel categories on names GPUs give kernels, its
cases and their memory, the plan that fits a lent GPU's time, --budget, the output a lent GPU
gives back, the wheels its image lacks, and the whole campaign at tiny shapes on the CPU
(--smoke), so it cannot rot between GPUs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxmllm.bench import gpu_plan, profile
from jaxmllm.bench.gpu import main, over_limits, run_cases
from jaxmllm.bench.gpu_cases import (
    CAMPAIGN,
    MOE,
    MOE_NAMES,
    MOE_PEAK_GIB,
    PARTS,
    PEAK_GIB,
    POLICIES,
    VLM,
    VLM_PEAK_GIB,
    Case,
    cases,
)
from jaxmllm.bench.gpu_report import report
from jaxmllm.process import xla_flags

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("kernel", "want"),
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas", "matmul"),
        ("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNT", "matmul"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "collectives"),
        ("memcpy32_post", "copies"),
        ("loop_convert_fusion_3", "other"),
    ],
)
def test_kernels_fall_in_their_category(kernel, want):
    assert profile.category(kernel) == want


def test_what_a_fusion_computes_comes_from_the_hlo():
    """An XLA fusion's name says nothing; the compiled HLO says it holds a dot (matmul), and a
    scan's while op, whose event spans its body's, is a container (not counted twice)."""

    def f(w, x):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, w)[0].sum()

    text = jax.jit(f).lower(jnp.ones((3, 64, 64)), jnp.ones((64, 64))).compile().as_text()
    kinds = profile.hlo_categories(text)
    assert "matmul" in kinds.values() and "container" in kinds.values()
    op = next(name for name, kind in kinds.items() if kind == "matmul")
    assert profile.category(f"some_kernel {op}", kinds) == "matmul"


def test_every_case_is_well_formed_once_and_the_campaign_covers_its_recipes():
    """Properties, not a list of names (a new case is an entry of CAMPAIGN, no edit here):
    each case runs its part on a recipe file that exists, with the kernel its name says and
    overrides of the form key=value, each name once; the GPU campaign, in CAMPAIGN's order
    (most valuable first: what `--plan` packs), measures every part, both kernels and every
    remat policy on the recipe, a case on real length mixes and both Qwen3-VL recipes; the
    CPU's (and --smoke's) has no cuDNN case."""
    for gpu, smoke in ((True, False), (False, False), (False, True)):
        todo = cases(list(PARTS), gpu, smoke)
        names = [c.name for c in todo]
        assert len(names) == len(set(names)), names
        for c in todo:
            assert c.part in PARTS and c.name.split("/")[0] == c.part and c.estimate_s > 0
            assert (ROOT / c.config).is_file(), (c.name, c.config)
            assert all(re.fullmatch(r"[\w.]+=.*", s) for s in c.sets), (c.name, c.sets)
            if c.part in ("recipe", "moe", "vlm"):
                assert f"model.attention={c.name.split('/')[1]}" in c.sets, c.name
            assert c.mixes == c.name.endswith("/mixes"), c.name
        assert gpu or not [n for n in names if "cudnn/" in n], names
    on_gpu = cases(list(PARTS), True, False)
    assert [c.name for c in on_gpu] == list(CAMPAIGN)
    assert {c.part for c in on_gpu} == set(PARTS)
    recipe = [c.name.split("/") for c in on_gpu if c.part == "recipe"]
    assert {r[1] for r in recipe} == {"cudnn", "block_sparse"}
    assert {r[2] for r in recipe} == set(POLICIES) and ["mixes"] in [r[3:] for r in recipe]
    for part, recipes in (("vlm", VLM), ("moe", MOE)):
        configs = {c.config for c in on_gpu if c.part == part}
        assert configs == {recipe for recipe, _, _ in recipes.values()}, part


def test_every_case_remat_fits_the_memory_a_run_takes():
    """Each recipe case's remat policy has its bench.memory peak at these shapes, within the
    0.9 of an 80 GB GPU the campaign gives JAX (the host case runs the recipe's main policy),
    and the MoE and vision-language cases' too (each its recipe's own remat)."""
    budget = xla_flags.MEMORY_FRACTION * 79.6
    for case in cases(["recipe", "host", "moe", "vlm"], True, False):
        if case.part in ("moe", "vlm"):
            last = case.name.split("/")[-1]
            moe = case.part == "moe"
            peak = MOE_PEAK_GIB[MOE_NAMES.get(last, last)] if moe else VLM_PEAK_GIB[last]
            assert peak <= budget, case.name
            assert not [s for s in case.sets if s.startswith("model.remat=")], case.name
            continue
        policy = next(p for p, sets in POLICIES.items() if sets[-1] in case.sets)
        assert PEAK_GIB[policy] <= budget, case.name
        assert case.sets[-len(POLICIES[policy]) :] == tuple(POLICIES[policy]), case.name


def test_every_cases_data_fits_its_buckets():
    """Each case that runs a step plans its data at its full (not --smoke) shapes: no sample is
    longer than the row the case gives it (a case that cannot plan would only be found on a
    GPU, after the wait for one). Planned for one device, as the cases run."""
    from jaxmllm.config import load_config
    from jaxmllm.resolve.run import resolve_run

    for case in cases(["recipe", "moe", "vlm", "host"], True, False):
        if case.mixes:  # (real length tables from ../shared: test_gpu_mix plans them)
            continue
        cfg = load_config(case.config, list(case.sets))
        run = resolve_run(cfg, 1)  # (raises OversizeError naming the key to raise)
        assert len(run.index) > 0, case.name


@pytest.mark.parametrize("minutes", [26, 15, 60])
def test_the_plan_fits_its_budget_most_valuable_first(minutes):
    """The jobs' limits and a node's start each fit the budget, no job passes its 10 minutes,
    each case is in one job once, in the campaign's order."""
    todo = cases(list(PARTS), True, False)
    budget = minutes * 60
    calls, left_out = gpu_plan.plan(todo, budget)
    assert sum(c.timeout_s + gpu_plan.START_S for c in calls) <= budget
    assert all(c.timeout_s <= gpu_plan.CALL_S for c in calls)
    planned = [case.name for call in calls for case in call.cases]
    assert sorted(planned + [c.name for c in left_out]) == sorted(c.name for c in todo)
    assert planned == [c.name for c in todo if c.name in planned]  # (the campaign's order)
    for call in calls:
        command = call.command("out")
        assert len(command) <= gpu_plan.COMMAND_CHARS and f"--budget {call.budget_s} " in command
        assert call.timeout_s >= call.budget_s + gpu_plan.SETUP_S
    recipes = [call for call in calls if call.cases[0].name.startswith("recipe/")]
    if minutes == 26:  # (a recipe case's compile took a job of its own on an H100)
        assert planned[:3] == ["env", "tests/cudnn", "attention"]
        assert [c.name for c in calls[0].cases] == planned[:3]  # (all in the first job)
        assert [len(call.cases) for call in recipes] == [1]
    if minutes == 60:
        assert len(recipes) == 4


def test_plan_prints_each_job_as_a_shell_command_within_the_limits_asked(capsys):
    """Every line of the plan is a comment or a command a shell runs as printed (each job's
    campaign under `timeout`, into its own folder or $OUT), within --plan-seconds and
    --job-seconds; nothing says where the GPU comes from."""
    import shlex

    assert main(["--plan", "--plan-seconds", "1500", "--job-seconds", "400"]) == 0
    text = capsys.readouterr().out
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines[0] == "python -m jaxmllm.bench.gpu --wheels .whl"
    jobs = [line for line in text.splitlines() if line.startswith("# Job ")]
    assert len(lines) - 1 == len(jobs) >= 2
    for i, (line, job) in enumerate(zip(lines[1:], jobs, strict=True), 1):
        words = shlex.split(line)  # (quotes balanced: a shell reads it as printed)
        limit = int(re.search(r"at most (\d+) s", job).group(1))
        assert limit <= 400 and words[:3] == ["python3", "-m", "pip"]
        timeout = words.index("timeout")
        assert int(words[timeout + 1]) < limit and words[timeout + 2 : timeout + 5] == [
            "python3",
            "-m",
            "jaxmllm.bench.gpu",
        ]
        assert f'--out "${{OUT:-gpu-job{i}}}"' in line
    total = int(re.search(r"(\d+) s of a 1500 s budget", text).group(1))
    assert total <= 1500
    assert not re.search(r"\b(lent|lend|carry|run\(|device calls?)\b", text)
    with pytest.raises(SystemExit):
        main(["--plan", "--job-seconds", "0"])


def test_the_docs_show_the_plan_as_it_prints(capsys):
    """docs/gpu-step.md's first GPU call is --plan's output (rerun it into the page after
    changing the campaign or its estimates)."""
    assert main(["--plan"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed in (ROOT / "docs" / "gpu-step.md").read_text()


def test_budget_starts_no_case_it_cannot_finish_and_stops_one_at_its_end(tmp_path, monkeypatch):
    """A case that outruns what is left is stopped at the budget (its rows so far kept), and
    one whose estimate no longer fits is not started: both said in the report. The stopped
    case leaves nothing in the temporary folder (killed, its own cleanup never runs)."""
    out, temporary = tmp_path / "out", tmp_path / "temporary"
    out.mkdir()
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))  # (the children's)
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))  # (this process's)
    slow = Case("tests", "tests/cudnn", smoke=True, estimate_s=1)  # (runs ~50 s on a CPU)
    env = Case("env", "env", smoke=True, estimate_s=10)
    started = time.perf_counter()
    rows = run_cases([slow, env], out, 600, tmp_path / "cache", budget=4)
    assert time.perf_counter() - started < 30
    ended = {r["case"]: r for r in rows if r.get("kind") == "case"}
    assert "stopped after" in ended["tests/cudnn"]["error"]
    assert "not started: ~10 s needed" in ended["env"]["skip"]
    report = (out / "report.md").read_text()
    assert "tests/cudnn" in report and "not started" in report
    assert over_limits(out) == []
    assert list(temporary.iterdir()) == []


def test_a_step_row_stands_without_its_profile():
    """The recipe's step row comes before its profile's: a profile that failed leaves the
    step's time, MFU and fill in the report, its shares '-'."""
    step = {"part": "recipe", "case": "recipe/cudnn/full", "kind": "step", "step_time_s": 1.5}
    step |= {"tokens_per_s": 10922.0, "tflops_per_device": 400.0, "mfu": 0.404}
    step |= {"peak_memory_gib": 51.5, "recompute_share": 0.25, "device_kind": "NVIDIA H100"}
    step |= {"fill": {"llm": 0.93, "vision": 0.41}}
    failed = {"part": "recipe", "case": "recipe/cudnn/full", "kind": "case", "error": "exit 1"}
    text = report([step, failed])
    line = next(x for x in text.splitlines() if x.startswith("recipe/cudnn/full |"))
    assert "40.4%" in line and "93%" in line and "41%" in line and line.endswith("| -")
    assert "recipe/cudnn/full | - | exit 1" in text


def test_what_a_lent_gpu_would_not_give_back_is_named(tmp_path):
    for i in range(9):
        (tmp_path / f"f{i}.txt").write_text("x")
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "deep.txt").write_text("x")
    (tmp_path / "odd name.txt").write_text("x")
    problems = over_limits(tmp_path)
    assert any("11 files" in p for p in problems)
    assert any("deep.txt: deeper than 2 folders" in p for p in problems)
    assert any("odd name.txt" in p for p in problems)


def test_the_wheels_are_what_the_image_lacks_of_the_dependencies():
    """Every dependency in pyproject.toml is in the GPU image or among the wheels carried to
    it (a new one must say which); soundfile needs cffi, grain array-record and portpicker."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=\[;\s]", d, maxsplit=1)[0].lower() for d in deps}
    carried = set(gpu_plan.WHEELS) | set(gpu_plan.VIDEO_WHEELS) | {"tensorboardx"}
    image = {name.split("==")[0] for name in gpu_plan.IMAGE}
    assert names - carried <= image, names - carried - image
    assert {"grain", "soundfile", "array-record", "portpicker", "cffi"} <= set(gpu_plan.WHEELS)


def test_the_gpu_images_python_runs_the_gpu_images_jax():
    """The default suite on Python 3.12 (CI's second leg, docs/development.md) stands for the
    GPU image (Python 3.12, jax and jaxlib `gpu_plan.JAX`): there, the jax imported is the
    image's, so a leg left on another jax (the image's pin moved, CI's not) fails here rather
    than on a lent GPU. (It read .ci/run's text for the two strings before.)"""
    if sys.version_info[:2] != (3, 12):
        pytest.skip("not the GPU image's Python (3.12): the leg that pins its jax runs this")
    import jaxlib

    assert (jax.__version__, jaxlib.__version__) == (gpu_plan.JAX, gpu_plan.JAX)


@pytest.mark.slow
def test_the_smoke_campaign_runs_every_part(tmp_path):
    """In this interpreter where there is no Python 3.12: where there is, the smoke runs in the
    GPU image's packages instead (tests/test_gpu_image.py), once in CI."""
    if subprocess.run([ROOT / "tools" / "python.sh", "3.12"], capture_output=True).returncode == 0:
        pytest.skip("tests/test_gpu_image.py runs the smoke in the GPU image's Python 3.12")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "jaxmllm.bench.gpu", "--out", str(out), "--smoke"]
    cmd += ["--cache", str(tmp_path / "cache")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    check_smoke(out, done)


def check_smoke(out, done, picked: str = "") -> None:
    """What a smoke campaign must leave: its parts' rows, no error, a step row before each
    profile, the steps' HLO in hlo.zip, the report's sections, nothing a GPU would keep.
    `picked`: the `--cases` it ran, else all of them."""
    assert done.returncode == 0, done.stdout[-3000:] + (out / "log.txt").read_text()[-3000:]
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    ran = [c for c in cases(list(PARTS), False, True) if re.search(picked, c.name)]
    parts = {c.part for c in ran}
    assert {r["part"] for r in rows} == parts
    assert picked or parts == set(PARTS)  # (the whole smoke: every part)
    assert not [r for r in rows if r.get("error") or r.get("skip")]
    steps = [r for r in rows if r.get("kind") == "step"]
    profiles = [r for r in rows if r.get("kind") == "profile"]
    # (a step and its profile per case that runs one: the recipe's, on the mixes, each MoE
    # recipe's, each vision-language recipe's)
    stepped = [c for c in ran if c.part in ("recipe", "moe", "vlm")]
    assert len(steps) == len(profiles) == len(stepped) == (1 if picked else 7)
    for step, prof in zip(steps, profiles, strict=True):
        assert rows.index(step) < rows.index(prof) and step["case"] == prof["case"]
        assert step["tokens_per_s"] > 0 and 0 < step["fill"]["llm"] <= 1
        assert prof["hlo"]["dots"] and "f32 x f32 -> f32" not in prof["hlo"]["dots"]
        assert sum(prof["profile"]["category_share"].values()) == pytest.approx(1.0)
        assert prof["profile"]["category_s"]["matmul"] > 0
    mixes = next(r for r in steps if r["case"].endswith("/mixes"))
    assert mixes["data"] == "mixes" and mixes["fill"]["vision"] > 0.5  # (ChartQA's tiles)
    [tests_row] = [r for r in rows if r["part"] == "tests" and r.get("kind") == "tests"]
    assert tests_row["failed"] == 0 and tests_row["passed"] + tests_row["skipped"] > 0
    report = (out / "report.md").read_text()
    sections = {"env": "Environment", "tests": "Kernel tests", "attention": "Attention kernels"}
    sections |= {"recipe": "Recipe step", "moe": "Mixture-of-experts steps"}
    sections |= {"vlm": "Vision-language recipes' steps", "host": "Host against the step"}
    for section in [sections[p] for p in parts] + ["Cases"]:
        assert f"## {section}" in report
    with zipfile.ZipFile(out / "hlo.zip") as z:
        assert len(z.namelist()) == len(stepped)
    assert sorted(p.name for p in out.iterdir()) == [
        "hlo.zip",
        "log.txt",
        "report.md",
        "rows.jsonl",
    ]
    assert over_limits(out) == []
