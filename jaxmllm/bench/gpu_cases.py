"""The GPU campaign's cases (`jaxmllm.bench.gpu`) and their measurements, one function per part,
each run in a child process of its own: `part(case, out)` yields the case's rows, each appended
to rows.jsonl the moment it is measured (a recipe's step row before its profile's, so a failure
in profiling keeps the step's time and MFU)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import jax

from jaxmllm.config.checks import UserError

RECIPE = "configs/gpu/qwen2vl_2b.yaml"
# The recipe's per-GPU shapes on one device, on the built-in data (no files, no tokenizer).
BUILT_IN_DATA = [
    "data.source=synthetic",
    "data.path=",  # (the recipe names its data file; the built-in data refuses one)
    "data.tokenizer=byte",
    "data.workers=8",
    "data.synthetic.min_image_side=16",
    "data.synthetic.max_image_side=64",
    "data.synthetic.max_text_words=1000",
    "data.synthetic.audio_fraction=0",
    "data.synthetic.video_fraction=0",
    "train.steps=20",
]
PER_GPU = [
    "mesh.data=1",
    "mesh.fsdp=1",
    "batch.microbatches=2",
    "batch.devices_per_host=-1",
    *BUILT_IN_DATA,
]
# --smoke's rows, devices and data, every case's: tiny and fast on one CPU device
SMOKE_ROWS = [
    "batch.llm_row_len=1024",
    "batch.vision_patches=1024",
    "mesh.cpu_devices=1",
    "data.workers=0",
    "data.synthetic.num_samples=64",
    "data.synthetic.max_text_words=100",
    "data.synthetic.min_image_side=4",
    "data.synthetic.max_image_side=16",
]
# --smoke: the same recipe, every size tiny, on one CPU device.
SMOKE = [
    "model.llm.depth=2",
    "model.llm.width=64",
    "model.llm.heads=4",
    "model.llm.kv_heads=2",
    "model.llm.mlp_dim=128",
    "model.llm.vocab_size=512",
    "model.llm.mrope_section=[2,3,3]",
    "model.vision.depth=2",
    "model.vision.width=32",
    "model.vision.heads=2",
    "model.vision.mlp_dim=64",
    "model.vision.projector_dim=64",
    *SMOKE_ROWS,
]
# The remat policies of the campaign's cases, as overrides, and the peak each takes of one GPU at
# the recipe's per-GPU shapes (GiB: python -m jaxmllm.bench.memory --config
# configs/gpu/qwen2vl_2b.yaml --devices 1 --check, PER_GPU's mesh, microbatches and data and the
# policy's overrides; XLA:CPU, the tiles at their bound for any data, 2026-11-25): each within
# the 71.7 GiB JAX takes of an 80 GB H100 at xla_flags.MEMORY_FRACTION; the first two not within
# the 59.7 of JAX's default 0.75. The recipe's own save_dots is left out (more at fsdp 1).
POLICIES = {
    "save_dots_except_mlp": ["model.remat=save_dots_except_mlp"],
    "llm_save_dots": ["model.remat=full", "model.llm.remat=save_dots"],
    "full": ["model.remat=full"],
}
PEAK_GIB = {"save_dots_except_mlp": 65.2, "llm_save_dots": 68.4, "full": 51.5}
# The mixtures of experts' recipes (EP 8 over a node) at their per-GPU shapes on one GPU, text
# only, each under its recipe's remat (full): a GPU of the node holds 16 of a layer's 128
# experts and computes its tokens' 8 assignments each on average, so one GPU with 16 experts
# and top-8 does that node's per-GPU expert work (the same widths, experts and rows a GPU; the
# router 16 wide, not 128). Qwen3-30B-A3B (configs/gpu/qwen3_30b_a3b.yaml: fp32 weights and
# Adam) at 12 of its 48 layers, so parameters and Adam fit one 80 GB GPU; Gemma-4-26B-A4B
# (configs/gpu/gemma4_26b_a4b.yaml: LoRA on a bf16 base, the exchange at twice the mean) at
# all 30 of its layers (five windowed to one full: a GPU's bf16 base with 16 experts, 5.2B,
# and LoRA's state take 10.6 GiB), block-sparse only (cuDNN's attention has no windows here).
# Their peaks (bench.memory --check as PEAK_GIB's; Qwen's 2026-11-25, Gemma's 2026-11-27, jax
# 0.11.2, temporaries 21.1 GiB): MOE_PEAK_GIB.
MOE = {  # which: (recipe, its per-GPU overrides, --smoke's)
    "qwen3_30b_a3b": ("configs/gpu/qwen3_30b_a3b.yaml", ["model.llm.depth=12"], []),
    "gemma4_26b_a4b": (
        "configs/gpu/gemma4_26b_a4b.yaml",
        [],
        [  # (Gemma 4's: windows, the full layers' own heads, the dense MLP beside the experts)
            "model.llm.full_head_dim=32",
            "model.llm.full_kv_heads=1",
            "model.llm.moe.shared_mlp_dim=128",
            "model.llm.window.size=16",
            "model.llm.window.every=2",
            "model.llm.lora.rank=8",
        ],
    ),
}
# The case names' last part: the 30B-A3B's is its first name, its remat policy (docs name it)
MOE_NAMES = {"full": "qwen3_30b_a3b"}
MOE_PEAK_GIB = {"qwen3_30b_a3b": 40.9, "gemma4_26b_a4b": 31.7}
MOE_PER_GPU = [
    "mesh.data=1",
    "mesh.expert=1",
    "model.llm.moe.experts=16",
    "model.llm.moe.exchange=dense",  # (one device: nothing exchanged)
    "batch.microbatches=2",
    "batch.devices_per_host=-1",
    "data.source=synthetic",
    "data.path=",
    "data.tokenizer=byte",
    "data.workers=4",
    "data.synthetic.image_fraction=0",
    "data.synthetic.multi_image_fraction=0",
    "data.synthetic.audio_fraction=0",
    "data.synthetic.video_fraction=0",
    "data.synthetic.max_text_words=800",  # (counting runs of up to 3,300 tokens: a 4096 row)
    "train.steps=20",
]
MOE_SMOKE = [
    "model.llm.depth=2",
    "model.llm.width=64",
    "model.llm.heads=4",
    "model.llm.kv_heads=2",
    "model.llm.head_dim=16",
    "model.llm.mlp_dim=128",
    "model.llm.moe.mlp_dim=32",
    "model.llm.vocab_size=512",
    "batch.llm_row_len=512",  # (the built-in text samples of up to 100 words: 361 tokens)
    "mesh.cpu_devices=1",
    "data.workers=0",
    "data.synthetic.num_samples=64",
    "data.synthetic.max_text_words=100",
]
# The vision-language recipes at their per-GPU shapes on one GPU, with images, each under its
# recipe's remat: Qwen3-VL (configs/gpu/qwen3_vl_8b.yaml, FSDP 8; qwen3_vl_30b_a3b.yaml, EP 8:
# DeepStack, interleaved M-RoPE, the learned table resized bilinearly), the 8B's LLM cut to 3
# of its 36 layers (DeepStack's) and the MoE's to 12 of 48 with 16 experts (a GPU's share of
# the node's, as `moe` does); Gemma 3 (configs/gpu/gemma3_4b.yaml, FSDP 8: windowed layers,
# images read both ways, the pooling projector) cut to 6 of its 34 layers (five windowed, one
# full), block-sparse only (cuDNN's attention has no windows here). So parameters and Adam fit
# one GPU; the towers whole. Their peaks (bench.memory --check as PEAK_GIB's, block-sparse,
# 2026-11-25; Gemma's 2026-11-27, jax 0.11.2: at 12 layers it took 68.3): VLM_PEAK_GIB.
VLM = {  # which: (recipe, its per-GPU overrides, --smoke's)
    "qwen3_vl_8b": ("configs/gpu/qwen3_vl_8b.yaml", ["mesh.fsdp=1", "model.llm.depth=3"], []),
    "qwen3_vl_30b_a3b": (
        "configs/gpu/qwen3_vl_30b_a3b.yaml",
        [
            "mesh.expert=1",
            "model.llm.depth=12",
            "model.llm.moe.experts=16",
            "model.llm.moe.exchange=dense",  # (one device: nothing exchanged)
        ],
        ["model.llm.moe.mlp_dim=32"],
    ),
    "gemma3_4b": ("configs/gpu/gemma3_4b.yaml", ["mesh.fsdp=1", "model.llm.depth=6"], []),
}
VLM_PEAK_GIB = {"qwen3_vl_8b": 67.2, "qwen3_vl_30b_a3b": 28.6, "gemma3_4b": 47.4}
# (at depth 6 the 8B's took 79.2)
VLM_PER_GPU = [
    "mesh.data=1",
    "batch.microbatches=2",
    "batch.devices_per_host=-1",
    *BUILT_IN_DATA,
]
# --smoke: each recipe's own kind of model, tiny (`VLM_SMOKE[kind]`)
QWEN3_VL_SMOKE = [  # (Qwen3-VL's: M-RoPE, DeepStack)
    "model.llm.depth=3",
    "model.llm.width=64",
    "model.llm.heads=4",
    "model.llm.kv_heads=2",
    "model.llm.head_dim=24",
    "model.llm.mlp_dim=128",
    "model.llm.mrope_section=[4,4,4]",
    "model.llm.vocab_size=512",
    "model.vision.depth=3",
    "model.vision.width=32",
    "model.vision.heads=2",
    "model.vision.mlp_dim=64",
    "model.vision.projector_dim=128",
    "model.vision.patch_size=4",
    "model.vision.position_grid=6",
    "model.vision.deepstack=[0,2]",
    *SMOKE_ROWS,
]
GEMMA3_SMOKE = [  # (Gemma 3's: windows, the pooling projector; its own norms and MLPs)
    "model.llm.depth=2",
    "model.llm.width=64",
    "model.llm.heads=4",
    "model.llm.kv_heads=2",
    "model.llm.head_dim=24",
    "model.llm.mlp_dim=128",
    "model.llm.vocab_size=512",
    "model.llm.attn_scalar=24",
    "model.llm.window.size=16",
    "model.llm.window.every=2",
    "model.vision.depth=2",
    "model.vision.width=32",
    "model.vision.heads=2",
    "model.vision.mlp_dim=64",
    "model.vision.patch_size=4",
    "model.vision.position_grid=8",
    *SMOKE_ROWS,
]
VLM_SMOKE = {"qwen3_vl_8b": QWEN3_VL_SMOKE, "qwen3_vl_30b_a3b": QWEN3_VL_SMOKE}
VLM_SMOKE["gemma3_4b"] = GEMMA3_SMOKE
# (kind, heads, kv heads, head dim): the recipes' LLM and vision attention
HEADS = {"llm": ("llm", 12, 2, 128), "vision": ("vision", 16, 16, 80)}
PARTS = ("env", "tests", "recipe", "attention", "moe", "vlm", "host")
# The campaign on a GPU, most valuable first (`--plan` packs it into device calls in this
# order), and the seconds each case takes on one H100 from an empty compile cache, its
# process's start-up included. Measured on one H100 80GB (jax 0.11.2): env 3-4 s, tests/cudnn
# 58 s, attention 226 s (2026-11-26); moe/cudnn/full 101 s, vlm/cudnn/qwen3_vl_8b 256 s, and
# vlm/block_sparse/gemma3_4b stopped at 262 s in its profile, its step measured (2026-11-27).
# The first recipe case was stopped after 463 s still compiling its step (XLA's "Very slow
# compile" alarm), so a recipe case is priced at a whole call's budget until a run says what
# its compile costs; the others not named here are estimates. Every run's report lists what
# each case took, to put here.
CAMPAIGN = {
    "env": 15,  # versions, devices, flags, memory, what this Python lacks
    "tests/cudnn": 60,  # the cuDNN kernel's correctness tests (tests/test_attention.py)
    "attention": 230,  # the kernels' table at the recipes' head shapes, 4k-16k tokens
    "recipe/cudnn/save_dots_except_mlp": 500,  # the 2B recipe's step with the flag set
    "recipe/block_sparse/save_dots_except_mlp": 500,  # the flash-style kernel instead
    "recipe/cudnn/full": 500,  # full remat: what recomputing every block costs
    "recipe/cudnn/save_dots_except_mlp/mixes": 500,  # on ChartQA's and AI2D's lengths
    "moe/cudnn/full": 110,  # the 30B-A3B mixture of experts' per-GPU expert work (Qwen3's)
    "recipe/cudnn/llm_save_dots": 500,  # the vision tower recomputed, the LLM's dots kept
    "vlm/cudnn/qwen3_vl_8b": 270,  # Qwen3-VL-8B's per-GPU step: DeepStack, its table, images
    "vlm/cudnn/qwen3_vl_30b_a3b": 200,  # Qwen3-VL-30B-A3B's: the tower beside the MoE's experts
    "vlm/block_sparse/gemma3_4b": 300,  # Gemma-3-4B's: windowed layers, images both ways
    "moe/block_sparse/gemma4_26b_a4b": 180,  # Gemma-4-26B-A4B's: windows, LoRA, capacity 2x
    "host": 500,  # an 8-GPU host's feed against this step (its compile as a recipe case's)
}
# --smoke's seconds a case at tiny shapes on the 2-core CPU, shared (load average 10; 2026-11-25)
SMOKE_S = {
    "env": 5,
    "tests": 60,
    "recipe": 100,
    "attention": 30,
    "moe": 60,
    "vlm": 100,
    "host": 100,
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One measurement, run in a process of its own."""

    part: str
    name: str
    sets: tuple[str, ...] = ()  # config overrides (recipe, moe, host)
    smoke: bool = False
    config: str = RECIPE  # the recipe its overrides apply to (recipe, moe)
    mixes: bool = False  # samples of real length mixes (`gpu_mix`), not the built-in data
    estimate_s: int = 0  # what it takes: on one H100 (CAMPAIGN), or --smoke's (SMOKE_S)


def cases(parts: list[str], gpu: bool, smoke: bool) -> list[Case]:
    """The campaign's cases of `parts`, most valuable first: on a GPU both kernels, elsewhere
    block-sparse only; --smoke one remat policy (the others differ in overrides alone)."""
    for part in parts:
        if part not in PARTS:
            raise UserError(f"--parts: {part!r} is not one of {', '.join(PARTS)}")
    names = [n if gpu else n.replace("/cudnn/", "/block_sparse/") for n in CAMPAIGN]
    if smoke:
        names = [n for n in names if n.split("/")[-1] not in ("full", "llm_save_dots")]
        names += ["moe/block_sparse/full"]  # (the mixture of experts' own policy)
    names = [n for n in dict.fromkeys(names) if n.split("/")[0] in parts]
    return [case(n, smoke) for n in names]


def case(name: str, smoke: bool) -> Case:
    """The case a campaign name stands for: part/kernel/policy[/mixes], env, tests/..., ..."""
    part, *rest = name.split("/")
    on_gpu = name if name in CAMPAIGN else name.replace("/block_sparse/", "/cudnn/")
    estimate = SMOKE_S[part] if smoke else CAMPAIGN[on_gpu]
    if part in ("env", "tests", "attention"):
        return Case(part, name, smoke=smoke, estimate_s=estimate)
    shrink = tuple(SMOKE) if smoke else ()
    if part == "host":  # (the remat of the recipe's main case: the recipe's own takes 68.5 GiB)
        sets = (*PER_GPU, *shrink, *POLICIES["save_dots_except_mlp"])
        return Case(part, name, sets, smoke, estimate_s=estimate)
    if part == "vlm":  # (the recipe's own remat: VLM_PEAK_GIB measured it)
        kernel, which = rest
        config, own, more = VLM[which]
        tiny = (*VLM_SMOKE[which], *more) if smoke else ()
        sets = (*VLM_PER_GPU, *own, *tiny, f"model.attention={kernel}")
        return Case(part, name, sets, smoke, config, estimate_s=estimate)
    if part == "moe":  # (the recipe's own remat: MOE_PEAK_GIB measured it)
        kernel, last = rest
        config, own, more = MOE[MOE_NAMES.get(last, last)]
        tiny = (*MOE_SMOKE, *more) if smoke else ()
        sets = (*MOE_PER_GPU, *own, *tiny, f"model.attention={kernel}")
        return Case(part, name, sets, smoke, config, estimate_s=estimate)
    kernel, policy, *mixes = rest
    sets = (*PER_GPU, *shrink, f"model.attention={kernel}", *POLICIES[policy])
    return Case(part, name, sets, smoke, mixes=bool(mixes), estimate_s=estimate)


# Modules jaxmllm imports and the distributions that hold them: what a GPU machine's Python
# may lack (its image has jax, flax, optax, orbax, pyarrow, tokenizers, ...; not these).
MODULES = {
    "grain": "grain",
    "array_record": "array-record",
    "portpicker": "portpicker",
    "soundfile": "soundfile",
    "cffi": "cffi",
    "av": "av",
    "tensorboardX": "tensorboardX",
    "jax": "jax",
    "flax": "flax",
    "optax": "optax",
    "orbax.checkpoint": "orbax-checkpoint",
    "tokenizers": "tokenizers",
    "pyarrow": "pyarrow",
    "jinja2": "jinja2",
    "PIL": "pillow",
    "yaml": "pyyaml",
    "ml_dtypes": "ml-dtypes",
    "tqdm": "tqdm",
}


def env(case: Case, out: Path) -> Iterator[dict]:
    """Versions, devices, the flags and memory share in effect, what this Python lacks."""
    import jaxlib

    from jaxmllm.loop.metrics import peak_tflops
    from jaxmllm.process import xla_flags

    missing = sorted(dist for module, dist in MODULES.items() if not _importable(module))
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    names = (xla_flags.MEMORY_VARIABLE, xla_flags.MEMORY_VARIABLE_OLD)
    yield {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "device_kind": device.device_kind,
        "peak_tflops": peak_tflops(device.device_kind),
        "memory_gib": stats.get("bytes_limit", 0) / 2**30,
        "memory_fraction": " ".join(f"{n}={os.environ[n]}" for n in names if n in os.environ),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "missing": missing,
    }


def _importable(module: str) -> bool:
    """Whether this Python can import `module` (found without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


# The cuDNN kernel's correctness tests: its output and gradients against the dense reference,
# the model's loss and every gradient with it (they skip off a GPU).
TESTS = ("tests/test_attention.py", "-k", "cudnn")


def tests(case: Case, out: Path) -> Iterator[dict]:
    """pytest on `TESTS` in a process of its own (this one starts no backend: the tests' takes
    the GPU), on the GPU where one is expected; a row of counts and what failed."""
    from jaxmllm.process.xla_flags import gpu_expected

    root = Path(__file__).resolve().parents[2]
    if not (root / TESTS[0]).is_file():
        raise UserError(f"{root / TESTS[0]}: no such file (the campaign runs from a checkout)")
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        # One process: pyproject's addopts less pytest-xdist's workers (-n auto), which the
        # GPU image does not carry and which would each start a backend on the one GPU.
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        cmd += ["-o", "addopts=-ra -m 'not slow'", *TESTS]
        env = {**os.environ, "JAX_PLATFORMS": "cuda" if gpu_expected() else "cpu"}
        done = subprocess.run([*cmd, f"--junitxml={xml}"], cwd=root, env=env)
        row = junit_counts(xml) if xml.exists() else {"exit": done.returncode}
    yield {"kind": "tests", "tests": " ".join(TESTS), "platform": env["JAX_PLATFORMS"], **row}
    if done.returncode not in (0, 5):  # (5: none collected)
        raise UserError(f"pytest {' '.join(TESTS)}: exit {done.returncode}: {row}")


def junit_counts(path: Path) -> dict:
    """Passed, failed and skipped tests of a JUnit XML report, and each failure's first line."""
    counts, failures = {"passed": 0, "failed": 0, "skipped": 0}, []
    for test in ElementTree.parse(path).getroot().iter("testcase"):
        bad = next((x for x in test if x.tag in ("failure", "error")), None)
        if bad is not None:
            message = (bad.get("message") or bad.tag).splitlines() or [bad.tag]
            failures.append(f"{test.get('name')}: {message[0][:200]}")
        skipped = test.find("skipped") is not None
        kind = "failed" if bad is not None else "skipped" if skipped else "passed"
        counts[kind] += 1
    return {**counts, "failures": failures}


def attention(case: Case, out: Path) -> Iterator[dict]:
    """Forward + backward of one packed row per head shape and row length, every kernel: a row
    the moment each length is measured (dense past its largest measured length: the report's
    T^2 estimate)."""
    from jaxmllm.bench.attention import measure

    lengths = [1024] if case.smoke else [4096, 8192, 16384]
    for name, (kind, heads, kv_heads, head_dim) in HEADS.items():
        if case.smoke:
            heads, kv_heads, head_dim = 4, min(kv_heads, 2), 16
        args = argparse.Namespace(
            mix="chartqa",
            block=128,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            kind=kind,
            repeat=2 if case.smoke else 10,
            dense_max=8192,
            dtype="bfloat16",
        )
        for n in lengths:
            row = measure(n, args)
            pairs = row["doc_tiles"] * args.block**2 * heads * head_dim
            # (forward: 2 matmuls of 2 FLOPs a pair; backward: 5; the documents' own tiles)
            row["tflops"] = 14.0 * pairs / row["sparse_s"] / 1e12
            yield {"shape": f"{name} {heads}/{kv_heads}x{head_dim}", **row}
    yield from layers(case)


# A hybrid's token mixers at Qwen3.5-9B's widths (4096 wide; full attention 32 / 4 heads of
# 128, Gated DeltaNet 16 key / 32 value heads of 128), one document a row (`bench.linear`)
LAYER = ["--width", "4096", "--heads", "32", "--kv-heads", "4"]
LAYER += ["--key-heads", "16", "--value-heads", "32", "--head-dim", "128"]
LAYER_SMOKE = ["--width", "64", "--heads", "4", "--kv-heads", "2"]
LAYER_SMOKE += ["--key-heads", "2", "--value-heads", "4", "--head-dim", "16"]


def layers(case: Case) -> Iterator[dict]:
    """A linear-attention layer's training step against a full-attention layer's of the same
    width, by row length: time and memory (`jaxmllm.bench.linear`)."""
    from jaxmllm.bench import linear

    lengths = [1024] if case.smoke else [4096, 16384, 65536]
    shape = LAYER_SMOKE if case.smoke else LAYER
    sets = [*shape, "--dtype", "bfloat16", "--repeat", "2" if case.smoke else "5"]
    args = linear.parser().parse_args([*sets, "--full-max", str(max(lengths))])
    rows = [linear.measure(n, kind, args) for kind in ("linear", "full") for n in lengths]
    linear.extrapolate(rows)
    for row in rows:
        yield {"shape": f"{args.width}-wide layer", **row}


def recipe(case: Case, out: Path) -> Iterator[dict]:
    """The recipe's step on this device: a row of its time, MFU, fill and peak memory, then one
    of its profile and dots (its compiled HLO into hlo.zip)."""
    import grain

    import sharding
    from jaxmllm.bench import hlo, profile
    from jaxmllm.bench.gpu_mix import MixSource
    from jaxmllm.bench.throughput import setup, summarize
    from jaxmllm.config import load_config
    from jaxmllm.loop.metrics import peak_tflops
    from jaxmllm.process.distributed import split_cpu

    cfg = load_config(case.config, list(case.sets))
    split_cpu(cfg.mesh.cpu_devices)
    mesh = sharding.make_mesh(cfg.mesh)
    data = None
    if case.mixes:
        source = MixSource(cfg, shrink=16 if case.smoke else 1)
        data = (grain.MapDataset.source(source), source.lengths())
    warmup, steps = (1, 2) if case.smoke else (2, 5)
    with jax.set_mesh(mesh):
        [run] = setup(cfg, ["orchestrated"], mesh, per_device=False, data=data)
        for i in range(warmup + steps):
            run.run_step(mesh, measure=i >= warmup)
        row = summarize(run, sharding.data_parallel_size(mesh))
        kind = jax.devices()[0].device_kind
        peak = peak_tflops(kind)
        stats = jax.devices()[0].memory_stats() or {}
        fill = {k.split("/", 1)[1]: 1.0 - v for k, v in row.items() if k.startswith("padding/")}
        yield {
            "kind": "step",
            **row,
            "kernel": run.cfg.model.attention,
            "data": "mixes" if case.mixes else "built-in",
            "device_kind": kind,
            "mfu": row["tflops_per_device"] / peak if peak else None,
            "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / 2**30 or None,
            "fill": fill,
        }
        batch = sharding.make_global_batch(next(run.data)["batch"], mesh)
        lowered = run.step.lower(run.state, batch)
        compiled = lowered.compile().as_text()
        with tempfile.TemporaryDirectory() as trace:
            with profile.trace(trace):
                for _ in range(2):
                    run.run_step(mesh, measure=False)
            summary = profile.summarize(trace, 2, compiled)
    dots = hlo.describe(lowered.as_text())
    hlo_file = add_hlo(out, case.name.replace("/", "_") + ".hlo.txt", compiled)
    yield {"kind": "profile", "profile": summary, "hlo": dots, **hlo_file}


HLO_ZIP = "hlo.zip"
HLO_ZIP_MAX = 12 << 20  # (a file the device machine returns holds at most 16 MiB)


def add_hlo(out: Path, name: str, text: str) -> dict:
    """Adds a step's compiled HLO to out/hlo.zip (one file, whatever the cases), unless the
    archive is at its size limit; returns what became of it."""
    path = out / HLO_ZIP
    if path.exists() and path.stat().st_size > HLO_ZIP_MAX:
        return {"hlo_file": f"left out: {HLO_ZIP} is over {HLO_ZIP_MAX >> 20} MiB"}
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as z:
        z.writestr(name, text)
    return {"hlo_file": f"{HLO_ZIP}:{name}"}


def moe(case: Case, out: Path) -> Iterator[dict]:
    """A mixture of experts' step on this device (`recipe`'s measurements, MOE)."""
    yield from recipe(case, out)


def vlm(case: Case, out: Path) -> Iterator[dict]:
    """A vision-language recipe's step on this device (`recipe`'s measurements, VLM)."""
    yield from recipe(case, out)


def host(case: Case, out: Path) -> Iterator[dict]:
    """bench.host at the recipe's per-GPU shapes for an 8-GPU host, this device's step."""
    from jaxmllm.bench import host as bench_host

    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "host.json"
        argv = ["--config", RECIPE, "--devices", "8", "--measure-device", "--json", str(rows)]
        argv += ["--workers", "0" if case.smoke else "0,8", "--steps", "2" if case.smoke else "6"]
        argv += [f"--set={s}" for s in case.sets]
        bench_host.main(argv)
        yield from json.loads(rows.read_text())
