"""The GPU campaign's cases (`jaxmllm.bench.gpu`) and their measurements, one function per part,
each run in a child process of its own: `part(case, out)` yields the case's rows."""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.util
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax

from jaxmllm.config.checks import UserError

RECIPE = "configs/gpu/qwen2vl_2b.yaml"
# The recipe's per-GPU shapes on one device, on the built-in data (no files, no tokenizer).
PER_GPU = [
    "mesh.data=1",
    "mesh.fsdp=1",
    "batch.microbatches=2",
    "batch.devices_per_host=-1",
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
    "batch.llm_row_len=1024",
    "batch.vision_patches=1024",
    "mesh.cpu_devices=1",
    "data.workers=0",
    "data.synthetic.num_samples=64",
    "data.synthetic.max_text_words=100",
    "data.synthetic.min_image_side=4",
    "data.synthetic.max_image_side=16",
]
# The policies that fit 80 GB at these shapes (bench.memory, XLA:CPU's estimate): every tower's,
# or the LLM's beside the vision tower's.
POLICIES = {
    "save_dots_except_mlp": ["model.remat=save_dots_except_mlp"],
    "llm_save_dots": ["model.remat=full", "model.llm.remat=save_dots"],
    "full": ["model.remat=full"],
}
# The mixture of experts' recipe (configs/gpu/qwen3_30b_a3b.yaml, EP 8 over a node) at its
# per-GPU shapes on one GPU: a GPU of the node holds 16 of a layer's 128 experts and computes
# its tokens' 8 assignments each on average, so one GPU with 16 experts and top-8 does that
# node's per-GPU expert work (the same widths, experts and rows a GPU; the router 16 wide, not
# 128); 12 of its 48 layers, so parameters and Adam fit one 80 GB GPU; text only.
MOE_RECIPE = "configs/gpu/qwen3_30b_a3b.yaml"
MOE_PER_GPU = [
    "mesh.data=1",
    "mesh.expert=1",
    "model.llm.depth=12",
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
    "data.synthetic.max_text_words=2000",
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
    "batch.llm_row_len=256",
    "mesh.cpu_devices=1",
    "data.workers=0",
    "data.synthetic.num_samples=64",
    "data.synthetic.max_text_words=100",
]
# (kind, heads, kv heads, head dim): the recipes' LLM and vision attention
HEADS = {"llm": ("llm", 12, 2, 128), "vision": ("vision", 16, 16, 80)}
PARTS = ("env", "attention", "recipe", "moe", "host")


@dataclasses.dataclass(frozen=True)
class Case:
    """One measurement, run in a process of its own."""

    part: str
    name: str
    sets: tuple[str, ...] = ()  # config overrides (recipe, host)
    flags: bool = True  # XLA's GPU flag set (added before JAX starts)
    smoke: bool = False
    config: str = RECIPE  # the recipe its overrides apply to (recipe, moe)


def cases(parts: list[str], gpu: bool, smoke: bool) -> list[Case]:
    """The campaign's cases, in order: on a GPU both kernels, on a CPU block-sparse only."""
    kernels = ["cudnn", "block_sparse"] if gpu else ["block_sparse"]
    shrink = tuple(SMOKE) if smoke else ()
    out = []
    for part in parts:
        if part in ("env", "attention"):
            out.append(Case(part, part, smoke=smoke))
        elif part == "recipe":
            for kernel in kernels:
                for i, (policy, sets) in enumerate(POLICIES.items()):
                    if smoke and i > 0:
                        break  # (one policy: the flags' two cases cover the mechanics)
                    base = (*PER_GPU, *shrink, f"model.attention={kernel}", *sets)
                    for flags in (True, False) if i == 0 else (True,):
                        name = f"recipe/{kernel}/{policy}/{'flags' if flags else 'no-flags'}"
                        out.append(Case(part, name, base, flags, smoke))
        elif part == "moe":  # the mixture of experts' per-GPU step, the best kernel only
            base = (*MOE_PER_GPU, *(MOE_SMOKE if smoke else ()), f"model.attention={kernels[0]}")
            out.append(Case(part, f"moe/{kernels[0]}/full", base, smoke=smoke, config=MOE_RECIPE))
        elif part == "host":
            out.append(Case(part, "host", (*PER_GPU, *shrink), smoke=smoke))
        else:
            raise UserError(f"--parts: {part!r} is not one of {', '.join(PARTS)}")
    return out


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
    """Versions, devices, the flags in effect, what this Python lacks."""
    from jaxmllm.loop.metrics import peak_tflops

    missing = sorted(dist for module, dist in MODULES.items() if not _importable(module))
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    yield {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "device_kind": device.device_kind,
        "peak_tflops": peak_tflops(device.device_kind),
        "memory_gib": stats.get("bytes_limit", 0) / 2**30,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "missing": missing,
    }


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def attention(case: Case, out: Path) -> Iterator[dict]:
    """Forward + backward of one packed row per head shape and row length, every kernel."""
    from jaxmllm.bench.attention import extrapolate, measure

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
        rows = [measure(n, args) for n in lengths]
        extrapolate(rows)
        for row in rows:
            pairs = row["doc_tiles"] * args.block**2 * heads * head_dim
            # (forward: 2 matmuls of 2 FLOPs a pair; backward: 5; the documents' own tiles)
            row["tflops"] = 14.0 * pairs / row["sparse_s"] / 1e12
            yield {"shape": f"{name} {heads}/{kv_heads}x{head_dim}", **row}


def recipe(case: Case, out: Path) -> Iterator[dict]:
    """The recipe's step on this device: throughput, MFU, memory, profile, dots, HLO."""
    import sharding
    from jaxmllm.bench import hlo, profile
    from jaxmllm.bench.throughput import setup, summarize
    from jaxmllm.config import load_config
    from jaxmllm.loop.metrics import peak_tflops
    from jaxmllm.process.distributed import split_cpu

    cfg = load_config(case.config, list(case.sets))
    split_cpu(cfg.mesh.cpu_devices)
    mesh = sharding.make_mesh(cfg.mesh)
    warmup, steps = (1, 2) if case.smoke else (2, 5)
    with jax.set_mesh(mesh):
        [run] = setup(cfg, ["orchestrated"], mesh, per_device=False)
        for i in range(warmup + steps):
            run.run_step(mesh, measure=i >= warmup)
        row = summarize(run, sharding.data_parallel_size(mesh))
        batch = sharding.make_global_batch(next(run.data)["batch"], mesh)
        lowered = run.step.lower(run.state, batch)
        compiled = lowered.compile().as_text()
        with tempfile.TemporaryDirectory() as trace:
            with profile.trace(trace):
                for _ in range(2):
                    run.run_step(mesh, measure=False)
            row["profile"] = profile.summarize(trace, 2, compiled)
    kind = jax.devices()[0].device_kind
    peak = peak_tflops(kind)
    stats = jax.devices()[0].memory_stats() or {}
    row.update(
        kernel=run.cfg.model.attention,
        flags=case.flags,
        device_kind=kind,
        mfu=row["tflops_per_device"] / peak if peak else None,
        peak_memory_gib=stats.get("peak_bytes_in_use", 0) / 2**30 or None,
        hlo=hlo.describe(lowered.as_text()),
    )
    (out / "hlo").mkdir(exist_ok=True)
    name = case.name.replace("/", "_") + ".hlo.txt.gz"
    with gzip.open(out / "hlo" / name, "wt") as f:
        f.write(compiled)
    yield row


def moe(case: Case, out: Path) -> Iterator[dict]:
    """The mixture of experts' step on this device (`recipe`'s measurements, MOE_PER_GPU)."""
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
