"""Mixture-of-experts layers and steps: compute proportional to the active experts, memory that
does not grow with the expert count, and the dispatch's cost beside a dense model.

    python -m jaxmllm.bench.moe [--parts flops,memory,step] [--tokens 4096] [--experts 64]
        [--top-k 8] [--width 512] [--expert-width 256] [--steps 6] [--json OUT]

- `flops`: one MoE layer's training step (forward and backward of the router, the dispatch
  and `--experts` experts, `--top-k` a token, over `--tokens` tokens; one device) compiled,
  XLA's cost analysis against the analytic FLOPs of the active experts (3 x 2 x 3 x width x
  expert width a token and expert visited, plus the router's): the grouped matmul's scans are
  unrolled for the count (`models.grouped.unrolled`: XLA counts a loop's body once). Beside
  it the same layer computing every expert on every token (what `jax.lax.ragged_dot` lowers
  to on CPU and NVIDIA GPUs): the ratio a dropless dispatch saves.
- `memory`: the layer's step compiled at 16, 64 and 256 experts with top-k fixed: XLA's
  temporaries and the peak beyond the experts' weights and their gradients (the arguments and
  outputs): flat in the expert count, as the dispatch's buffers follow the assignments.
- `step`: configs/tiny_moe.yaml's LLM (text only) trained on 8 CPU devices at
  mesh.expert = 1, 2, 4, beside a dense decoder of the same active parameters (its MLP
  top_k x the experts' width), the runs taking turns step by step: step time, tokens/s, and
  the MoE's cost over the dense model's (its dispatch: routing, sorting, all-to-alls, the
  grouped matmul's tiles); and, per layer, the dispatch alone (routing with the experts
  left out) against the whole MoE layer.

Figures on a CPU are XLA:CPU's; on a GPU the `step` part measures the same on its devices.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmllm.config.checks import UserError
from jaxmllm.models import grouped, moe

DEFAULTS = dict(tokens=4096, experts=64, top_k=8, width=512, expert_width=256)


def layer(experts: int, top_k: int, width: int, expert_width: int, dtype=jnp.float32):
    """An MoE layer (router, stacked experts), its state split for a jitted step."""
    spec = moe.MoESpec(experts, top_k, expert_width, norm_topk_prob=True)
    module = moe.MoE(width, spec, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    return nnx.split(module)


def train_step(graphdef):
    """(state, x) -> (loss, gradients of the state and x): the layer's forward and backward."""

    def loss(state, x):
        y, stats = nnx.merge(graphdef, state).routed(x)
        return jnp.sum(y * y) + moe.balance_loss(jax.tree.map(lambda a: a[None], stats))

    return jax.value_and_grad(loss, argnums=(0, 1))


def analytic(tokens: int, experts: int, top_k: int, width: int, expert_width: int) -> float:
    """The training FLOPs of the active experts and the router: 3 x forward."""
    experts_fwd = tokens * top_k * 2 * 3 * width * expert_width
    router_fwd = tokens * 2 * width * experts
    return 3.0 * (experts_fwd + router_fwd)


def dense_every_expert(graphdef):
    """The same layer computing every expert on every token, weighted (0 off the top-k)."""

    def loss(state, x):
        m = nnx.merge(graphdef, state)
        logits = m.router(x)
        p = jax.nn.softmax(logits, -1)
        top_p, top_e = jax.lax.top_k(p, m.spec.top_k)
        w = (
            jnp.zeros_like(p)
            .at[jnp.arange(x.shape[0])[:, None, None], jnp.arange(x.shape[1])[None, :, None], top_e]
            .set(top_p / top_p.sum(-1, keepdims=True))
        )
        gate, up, down = m.experts.weights()
        h = jax.nn.silu(jnp.einsum("btd,edf->btef", x, gate)) * jnp.einsum("btd,edf->btef", x, up)
        y = jnp.einsum("btef,efd,bte->btd", h, down, w)
        return jnp.sum(y * y)

    return jax.value_and_grad(loss, argnums=(0, 1))


def flops(args) -> list[dict]:
    """The `flops` part's rows (module docstring)."""
    shape = dict(experts=args.experts, top_k=args.top_k, width=args.width)
    graphdef, state = layer(**shape, expert_width=args.expert_width)
    x = jax.ShapeDtypeStruct((1, args.tokens, args.width), jnp.float32)
    want = analytic(args.tokens, **shape, expert_width=args.expert_width)
    rows = []
    for name, fn in (("dropless (tiles)", train_step(graphdef)), ("every expert", None)):
        fn = fn or dense_every_expert(graphdef)
        started = time.perf_counter()
        with grouped.unrolled():
            compiled = jax.jit(fn).lower(state, x).compile()
        got = (compiled.cost_analysis() or {}).get("flops", float("nan"))
        rows.append(
            {
                "part": "flops",
                "layer": name,
                "tokens": args.tokens,
                **shape,
                "expert_width": args.expert_width,
                "xla_flops": float(got),
                "analytic_active_flops": want,
                "ratio": float(got) / want,
                "compile_s": time.perf_counter() - started,
            }
        )
    return rows


def memory(args) -> list[dict]:
    """The `memory` part's rows: the layer's step at several expert counts, top-k fixed."""
    rows = []
    for experts in (16, 64, 256):
        graphdef, state = layer(experts, args.top_k, args.width, args.expert_width)
        x = jax.ShapeDtypeStruct((1, args.tokens, args.width), jnp.float32)
        mem = jax.jit(train_step(graphdef)).lower(state, x).compile().memory_analysis()
        weights = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(state))
        args_b, out_b = mem.argument_size_in_bytes, mem.output_size_in_bytes
        temp = mem.temp_size_in_bytes
        rows.append(
            {
                "part": "memory",
                "experts": experts,
                "top_k": args.top_k,
                "tokens": args.tokens,
                "weights_mib": weights / 2**20,
                "temp_mib": temp / 2**20,
                "peak_mib": (args_b + out_b + temp - mem.alias_size_in_bytes) / 2**20,
                # the peak less the weights in and their gradients out
                "beyond_weights_mib": (args_b + out_b + temp - 2 * weights) / 2**20,
            }
        )
    return rows


def step(args) -> list[dict]:
    """The `step` part's rows: MoE runs at several mesh.expert beside the dense twin."""
    import sharding
    from jaxmllm.bench.throughput import setup
    from jaxmllm.config import load_config

    base = ["model.vision.enabled=false", "model.audio.enabled=false", "data.eval.source=none"]
    base += [f"data.synthetic.{k}_fraction=0" for k in ("image", "audio", "video", "multi_image")]
    base += ["model.llm.width=256", "model.llm.head_dim=64", "model.llm.moe.mlp_dim=128"]
    base += ["batch.llm_row_len=1024", "data.synthetic.max_text_words=200"]
    cfg0 = load_config("configs/tiny_moe.yaml", base)
    m = cfg0.model.llm.moe
    dense_mlp = m.top_k * m.mlp_dim  # (the same active MLP width a token)
    variants = {
        "dense twin": [
            "model.llm.moe.experts=0",
            f"model.llm.mlp_dim={dense_mlp}",
            "mesh.expert=1",
            "mesh.data=4",
        ],
        **{f"moe expert={e}": [f"mesh.expert={e}", f"mesh.data={4 // e}"] for e in (1, 2, 4)},
    }
    runs = []
    for name, extra in variants.items():
        cfg = load_config("configs/tiny_moe.yaml", [*base, *extra])
        mesh = sharding.make_mesh(cfg.mesh)
        with jax.set_mesh(mesh):
            (run,) = setup(cfg, ["orchestrated"], mesh, per_device=False)
        run.policy, run.mesh = name, mesh
        runs.append(run)
    for i in range(args.warmup + args.steps):
        for run in runs:
            with jax.set_mesh(run.mesh):
                run.run_step(run.mesh, measure=i >= args.warmup)
        print(f"\rstep {i + 1}/{args.warmup + args.steps}", end="", file=sys.stderr)
    print(file=sys.stderr)
    rows = []
    for run in runs:
        run.data.close()
        rows.append(
            {
                "part": "step",
                "variant": run.policy,
                "step_time_s": float(np.median(run.times)),
                "tokens_per_s": float(np.sum(run.tokens) / np.sum(run.times)),
                "model_gflop_per_step": float(np.median(run.flops)) / 1e9,
            }
        )
    dense = rows[0]["step_time_s"]
    for r in rows:
        r["vs_dense"] = r["step_time_s"] / dense
        r["dispatch_share"] = max(0.0, 1.0 - dense / r["step_time_s"])
    return rows + dispatch_alone(args)


def dispatch_alone(args, repeat: int = 5) -> list[dict]:
    """Per layer on one device: the MoE layer's forward and backward, and the same with the
    experts left out (routing, sorting and permutations only): the dispatch's share."""
    shape = (args.experts, args.top_k, args.width, args.expert_width)
    graphdef, state = layer(*shape)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, args.tokens, args.width)))
    x = x.astype(jnp.float32)
    whole = jax.jit(train_step(graphdef))
    spec = nnx.merge(graphdef, state).spec

    def routing(state, x):  # the dispatch with identity experts
        m = nnx.merge(graphdef, state)
        p = jax.nn.softmax(m.router(x), -1)
        top_p, top_e = jax.lax.top_k(p, spec.top_k)
        k, d = spec.top_k, x.shape[-1]
        expert = top_e.reshape(-1)
        rows = jnp.repeat(x.reshape(-1, d), k, axis=0)
        order = jnp.argsort(expert, stable=True)
        y = grouped.untake_rows(grouped.take_rows(rows, order) * 1.0, order)
        y = jnp.einsum("nkd,nk->nd", y.reshape(-1, k, d), top_p.reshape(-1, k))
        return jnp.sum(y * y)

    alone = jax.jit(jax.value_and_grad(routing, argnums=(0, 1)))
    times = {}
    for name, fn in (("moe layer", whole), ("dispatch alone", alone)):
        jax.block_until_ready(fn(state, x))
        samples = []
        for _ in range(repeat):
            started = time.perf_counter()
            jax.block_until_ready(fn(state, x))
            samples.append(time.perf_counter() - started)
        times[name] = float(np.median(samples))
    share = times["dispatch alone"] / times["moe layer"]
    return [
        {"part": "step", "variant": f"layer: {k}", "step_time_s": v, "dispatch_share": share}
        for k, v in times.items()
    ]


def table(rows: list[dict]) -> str:
    out = []
    for part in ("flops", "memory", "step"):
        mine = [r for r in rows if r["part"] == part]
        if not mine:
            continue
        keys = [k for k in mine[0] if k != "part"]
        for r in mine[1:]:
            keys += [k for k in r if k not in keys and k != "part"]
        out.append(" | ".join(keys))
        out.append(" | ".join("---" for _ in keys))
        for r in mine:
            out.append(" | ".join(_cell(r.get(k)) for k in keys))
        out.append("")
    return "\n".join(out)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


PARTS = {"flops": flops, "memory": memory, "step": step}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.bench.moe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--parts", default="flops,memory,step")
    for key, value in DEFAULTS.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    for part in args.parts.split(","):
        if part not in PARTS:
            raise UserError(f"--parts: {part!r} is not one of {', '.join(PARTS)}")
        rows += PARTS[part](args)
        print(table(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            meta = {"backend": jax.default_backend(), "devices": jax.device_count()}
            json.dump({**meta, "jax": jax.__version__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    from jaxmllm.config.command import run
    from jaxmllm.process.distributed import split_cpu

    split_cpu(8)  # (the step part's meshes; the layer parts use one device)
    raise SystemExit(run(main))
