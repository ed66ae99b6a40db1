"""Loading a HF checkpoint into sharded parameters: time and peak host memory.

    python -m jaxmllm.bench.hfload [--shape qwen2.5-0.5b] [--devices 8] [--fsdp 8] [--json F]

Writes a random checkpoint of a real model's shapes (bf16 safetensors, as the hub stores them)
and loads it, in a fresh process so its peak RSS is the load's own: `hf import`'s config, the
program's shardings (data x fsdp over `--devices` CPU devices), `jaxmllm.hf.load.pretrained`.
On a CPU the devices' buffers are host memory too, so the peak counts the sharded parameters
themselves (fp32: 4 bytes each) plus what the load holds on the side.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxmllm.hf.table import LLAMA, QWEN2

SHAPES = {  # config.json of real checkpoints (their shapes; weights are random here)
    "tiny": {  # (not a real checkpoint: a smoke run of the bench, tests/test_commands.py)
        "model_type": QWEN2.name,
        "architectures": [QWEN2.hf_class],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    },
    "qwen2.5-0.5b": {
        "model_type": QWEN2.name,
        "architectures": [QWEN2.hf_class],
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    },
    "llama-3.2-1b": {
        "model_type": LLAMA.name,
        "architectures": [LLAMA.hf_class],
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
}


def write_random(directory: Path, shape: str) -> int:
    """A bf16 checkpoint of `shape` with random weights; returns its parameter count."""
    import ml_dtypes

    from jaxmllm.hf.importer import model_section
    from jaxmllm.hf.registry import family_for
    from jaxmllm.hf.safetensors import write_checkpoint

    directory.mkdir(parents=True, exist_ok=True)
    hf = SHAPES[shape]
    (directory / "config.json").write_text(json.dumps(hf))
    cfg = _config(str(directory), model_section(str(directory)))
    rng = np.random.default_rng(0)
    shapes = _hf_shapes(family_for("llm", hf).links(cfg, hf), cfg)

    def tensors():
        """The checkpoint's tensors one at a time, N(0, 0.02) in bf16, so the writer never holds
        them all."""
        for name, shape_ in shapes:
            yield name, (0.02 * rng.standard_normal(shape_, np.float32)).astype(ml_dtypes.bfloat16)

    write_checkpoint(directory, tensors(), max_shard_bytes=1 << 30)
    return int(sum(np.prod(s) for _, s in shapes))


def _hf_shapes(links, cfg) -> list[tuple[str, tuple[int, ...]]]:
    """Each HF tensor's shape, from our parameters' shapes through the links' to_hf."""
    from flax import nnx

    from jaxmllm.step.program import model_parts
    from sharding.rules import keyed_leaves

    parts, _ = model_parts(cfg)
    ours = keyed_leaves(nnx.to_pure_dict(parts.template))
    out = []
    for link in links:
        zeros = [
            np.zeros(ours[p].shape[1:] if link.layers else ours[p].shape, np.int8)
            for p in link.ours
        ]
        for layer in range(link.layers) if link.layers else [None]:
            names = link.hf_names(layer)
            out += [(n, t.shape) for n, t in zip(names, link.to_hf(*zeros), strict=True)]
    return out


def _config(directory: str, model: dict):
    """A config for an LLM-only import of the checkpoint in `directory` (towers off, the simplest
    planner, no routing): enough to build the program's shardings the load targets."""
    from jaxmllm.config import Config, from_dict

    model = {**model, "vision": {"enabled": False}, "audio": {"enabled": False}}
    raw = {"model": model, "batch": {"planner": "first_fit", "route_pair_capacity": 0}}
    return from_dict(Config, raw, source=directory)


def load(directory: str, devices: int, fsdp: int) -> dict:
    """In this process: the load's wall time and the peak RSS (MiB)."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax

    from jaxmllm.hf.importer import model_section
    from jaxmllm.hf.load import pretrained
    from jaxmllm.step.program import build_program
    from sharding import make_mesh

    cfg = _config(directory, model_section(directory))
    mesh = make_mesh({"data": devices // fsdp, "fsdp": fsdp, "tensor": 1})
    prog = build_program(cfg, mesh)
    before = _rss_mib()
    start = time.perf_counter()
    params = pretrained(cfg, prog.abstract_params())
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    leaves = jax.tree.leaves(params)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    return {
        "seconds": round(seconds, 2),
        "rss_before_mib": round(before),
        "peak_rss_mib": round(_rss_mib()),
        "params": int(sum(x.size for x in leaves)),
        "param_mib_total": round(sum(x.nbytes for x in leaves) / 2**20),
        "param_mib_per_device": round(per_device / 2**20),
    }


def _rss_mib() -> float:
    """This process's peak resident memory so far, in MiB (ru_maxrss: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxmllm.bench.hfload`: writes a random bf16 checkpoint of --shape (or uses
    --dir), loads it into sharded parameters in a fresh child process, and prints the load's
    seconds and peak RSS (--json: written there too)."""
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.hfload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--fsdp", type=int, default=8, help="the rest of --devices is data parallel")
    p.add_argument("--dir", default="", help="checkpoint directory (default: a temporary one)")
    p.add_argument("--json", default="", help="also write the figures here")
    p.add_argument("--load", default="", help=argparse.SUPPRESS)  # (the child process)
    args = p.parse_args(argv)
    if args.load:
        print(json.dumps(load(args.load, args.devices, args.fsdp)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.dir or tmp) / args.shape
        start = time.perf_counter()
        count = write_random(directory, args.shape)
        wrote = time.perf_counter() - start
        size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        cmd = [
            sys.executable,
            "-m",
            "jaxmllm.bench.hfload",
            "--load",
            str(directory),
            "--devices",
            str(args.devices),
            "--fsdp",
            str(args.fsdp),
        ]
        child = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if child.returncode:
            print(child.stderr[-3000:], file=sys.stderr)
            return child.returncode
        result = json.loads(child.stdout.strip().splitlines()[-1])
    result.update(
        shape=args.shape,
        devices=args.devices,
        fsdp=args.fsdp,
        hf_params=count,
        checkpoint_mib=round(size / 2**20),
        write_seconds=round(wrote, 1),
    )
    print(
        f"{'shape':14} {'params':>11} {'ckpt MiB':>9} {'mesh':>10} {'load s':>7} "
        f"{'params MiB (per device)':>24} {'RSS before':>11} {'peak RSS':>9}"
    )
    mesh = f"{args.devices // args.fsdp}x{args.fsdp}"
    print(
        f"{args.shape:14} {result['params']:>11,} {result['checkpoint_mib']:>9} {mesh:>10} "
        f"{result['seconds']:>7} {result['param_mib_total']:>13} "
        f"({result['param_mib_per_device']:>6}) {result['rss_before_mib']:>11} "
        f"{result['peak_rss_mib']:>9}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    sys.exit(run(main))
