"""Compile time of the train step as the models get deeper.

    python -m jaxmllm.bench.compile --config configs/small.yaml --depth 4,32 [--json OUT]
        [--platform cpu] [--set key=value ...]

For each depth, the vision encoder, the audio encoder and the decoder all get that many layers;
the train step is built from abstract shapes only (no data read, no parameter materialised) on
the config's mesh, then lowered and compiled. Reported per depth: seconds to lower and to
compile, this process's CPU time for both (steadier than wall time on a busy machine), the size
of the lowered program (StableHLO characters: it should not grow with depth now that layers are
scanned), parameter count, and XLA's temporary buffer size and a device's peak (arguments +
outputs + temporaries, less the donated state the outputs reuse; where the backend reports it).
Nothing is cached between depths: each one is a new program, and the persistent compilation
cache is switched off.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax

import sharding
from jaxmllm.batch.bucketize import batch_shapes
from jaxmllm.bench.table import cell
from jaxmllm.config import Config, load_config
from jaxmllm.config.command import add_config_args
from jaxmllm.process.distributed import split_cpu
from jaxmllm.resolve.attention import resolve_attention
from jaxmllm.resolve.sizing import resolve_bounds
from jaxmllm.step.program import build_program, join


def with_depth(config: str, depth: int, overrides: list[str]) -> Config:
    """The config with every transformer `depth` layers deep, batch sizes at their bounds."""
    depths = [f"model.{part}.depth={depth}" for part in ("vision", "audio", "llm")]
    cfg = resolve_attention(load_config(config, [*overrides, *depths]))
    # No data: the sizes it would resolve at their bounds (tiles of the longest documents).
    return resolve_bounds(cfg, sharding.data_parallel_size(sharding.make_mesh(cfg.mesh)))


def abstract_batch(cfg: Config, mesh) -> dict:
    """The step batch's shapes, dtypes and shardings (no data)."""
    shapes = batch_shapes(cfg, sharding.data_parallel_size(mesh))
    return {
        name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharding(mesh, len(shape)))
        for name, (shape, dtype) in shapes.items()
    }


def lower_step(cfg: Config, mesh):
    """(the program, the train step lowered from abstract shapes on `mesh`)."""
    with jax.set_mesh(mesh):
        prog = build_program(cfg, mesh)
        return prog, prog.step.lower(prog.abstract_sharded(), abstract_batch(cfg, mesh))


def measure(cfg: Config, mesh) -> dict:
    """Lowers and compiles the train step of `cfg` on `mesh`; times and sizes."""
    with jax.set_mesh(mesh):
        t0 = time.perf_counter()
        prog = build_program(cfg, mesh)
        batch = abstract_batch(cfg, mesh)
        t1, cpu1 = time.perf_counter(), time.process_time()
        lowered = prog.step.lower(prog.abstract_sharded(), batch)
        t2 = time.perf_counter()
        compiled = lowered.compile()
        t3, cpu3 = time.perf_counter(), time.process_time()
    params = join(prog.abstract["params"], prog.abstract["frozen"])
    memory = compiled.memory_analysis()
    return {
        "build_s": t1 - t0,
        "lower_s": t2 - t1,
        "compile_s": t3 - t2,
        "total_s": t3 - t1,
        "cpu_s": cpu3 - cpu1,  # this process's CPU time: less sensitive to a busy machine
        "stablehlo_chars": len(lowered.as_text()),
        "params": sum(math.prod(p.shape) for p in jax.tree.leaves(params)),
        # (totals over the devices) every parameter's, the trained ones' and their optimizer
        # state's bytes: LoRA trains a few parameters beside a frozen base
        "param_bytes": _bytes(params),
        "trained_params": sum(math.prod(p.shape) for p in jax.tree.leaves(prog.abstract["params"])),
        "opt_bytes": _bytes(prog.abstract["opt_state"]),
        "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "peak_bytes": _peak(memory),
    }


def _bytes(tree) -> int:
    """The bytes the arrays of a tree take (shape x itemsize), abstract ones included."""
    return int(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _peak(memory) -> int | None:
    """A device's memory while the step runs (arguments + outputs + temporaries, less what the
    outputs reuse of the donated arguments), where the backend reports it."""
    if memory is None:
        return None
    parts = ("argument", "output", "temp")
    total = sum(getattr(memory, f"{p}_size_in_bytes", 0) for p in parts)
    return int(total - getattr(memory, "alias_size_in_bytes", 0))


def table(rows: list[dict]) -> str:
    """The markdown table of compile times by depth: lowering, compiling and their total in wall
    and CPU seconds, the StableHLO's size, the parameters and the compiled step's temporary and
    peak memory."""
    cols = ["depth", "lower s", "compile s", "total s", "CPU s", "StableHLO chars", "params"]
    cols += ["temp MiB", "peak MiB"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    mib = lambda b: cell(b, ".0f", unit=2**20)
    for r in rows:
        temp = mib(r["temp_bytes"])
        cells = [
            str(r["depth"]),
            f"{r['lower_s']:.1f}",
            f"{r['compile_s']:.1f}",
            f"{r['total_s']:.1f}",
            f"{r['cpu_s']:.1f}",
            f"{r['stablehlo_chars']:,}",
            f"{r['params'] / 1e6:.1f}M",
            temp,
            mib(r["peak_bytes"]),
        ]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxmllm.bench.compile`: lowers and compiles the config's train step at each
    --depth (on --platform, the compilation cache off) and prints how long each took and how
    large it is: whether scanned layers keep compile time flat in depth."""
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.compile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    p.add_argument("--depth", default="4,32", help="comma-separated layer counts")
    p.add_argument("--platform", default="cpu", help="backend to compile for (cpu, gpu, tpu)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    jax.config.update("jax_platforms", args.platform)
    jax.config.update("jax_enable_compilation_cache", False)
    depths = [int(d) for d in args.depth.split(",") if d.strip()]
    split_cpu(load_config(args.config, args.set).mesh.cpu_devices)
    rows = []
    for depth in depths:
        cfg = with_depth(args.config, depth, args.set)
        mesh = sharding.make_mesh(cfg.mesh)
        rows.append({"depth": depth, **measure(cfg, mesh)})
        lower, compile_ = rows[-1]["lower_s"], rows[-1]["compile_s"]
        print(f"depth {depth}: lower {lower:.1f} s, compile {compile_:.1f} s", flush=True)
    print(
        f"{args.config}: train step on {mesh.size} {jax.devices()[0].platform} device(s), "
        f"mesh {dict(mesh.shape)}, jax {jax.__version__}"
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "overrides": args.set, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run

    raise SystemExit(run(main))
