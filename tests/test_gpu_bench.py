"""The GPU campaign (jaxmllm.bench.gpu): its kernel categories on names GPUs give kernels, and the
whole campaign at tiny shapes on the CPU (--smoke), so it cannot rot between GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import jax
import jax.numpy as jnp
import pytest

from jaxmllm.bench import profile
from jaxmllm.bench.gpu_cases import cases


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


def test_the_cases_cover_both_kernels_and_the_flags_on_a_gpu():
    parts = ["env", "attention", "recipe", "moe", "qwen3_vl", "host"]
    names = [c.name for c in cases(parts, True, False)]
    assert names[:2] == ["env", "attention"] and names[-1] == "host"
    assert "moe/cudnn/full" in names  # (the mixture of experts' step, on its best kernel)
    assert {"qwen3_vl/8b/cudnn", "qwen3_vl/30b_a3b/cudnn"} <= set(names)  # (both recipes)
    recipe = [n for n in names if n.startswith("recipe/")]
    assert {n.split("/")[1] for n in recipe} == {"cudnn", "block_sparse"}
    assert sum(n.endswith("/no-flags") for n in recipe) == 2 and len(recipe) == 8


@pytest.mark.slow
def test_the_smoke_campaign_runs_every_part(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "jaxmllm.bench.gpu", "--out", str(out), "--smoke"]
    cmd += ["--cache", str(tmp_path / "cache")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + (out / "log.txt").read_text()[-3000:]
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert {r["part"] for r in rows} == {"env", "attention", "recipe", "moe", "qwen3_vl", "host"}
    assert not [r for r in rows if "error" in r]
    for r in (r for r in rows if r["part"] in ("recipe", "moe", "qwen3_vl")):
        assert r["hlo"]["dots"] and "f32 x f32 -> f32" not in r["hlo"]["dots"]
        assert sum(r["profile"]["category_share"].values()) == pytest.approx(1.0)
        assert r["profile"]["category_s"]["matmul"] > 0 and r["tokens_per_s"] > 0
    report = (out / "report.md").read_text()
    sections = ("Environment", "Attention kernels", "Recipe step", "Mixture-of-experts step")
    sections += ("Qwen3-VL steps",)
    for section in (*sections, "Host against the step"):
        assert f"## {section}" in report
    with tarfile.open(out / "hlo.tar.gz") as tar:
        assert len(tar.getnames()) == 5  # (the recipe cases', the MoE's and Qwen3-VL's)
