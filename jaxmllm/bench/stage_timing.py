"""Each pipeline stage's forward and backward, timed on one device, one stage's programs at a
time (the per-device measure of `jaxmllm.bench.stages`), and the bubble of the schedule they give.

A stage's work is what its switch branch runs in the pipeline (`jaxmllm.step.stages.loop`): its
slice of its module's layers over one microbatch bucket, the first stage also embedding (an
encoder's patches or frames; the LLM's tokens, its slots filled), an encoder's last stage also
projecting. Forward: that function; backward: its gradient with respect to what GPipe
differentiates there (the stage's trainable parameters and, when anything trainable lies below,
its input), timed as forward + backward minus forward; a stage with nothing to differentiate
has none. The stage's times replayed through the schedule table give the measured bubble.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import sharding
from jaxmllm.batch.bucketize import batch_shapes
from jaxmllm.bench.throughput import device_batch
from jaxmllm.config import MeshConfig, load_config
from jaxmllm.feed.iterator import make_pipeline
from jaxmllm.models.mllm import encoder_args
from jaxmllm.pipeline.choose import plan_of
from jaxmllm.pipeline.partition import Stage
from jaxmllm.pipeline.schedule import SCHEDULES
from jaxmllm.process.distributed import split_cpu
from jaxmllm.resolve.run import resolve_run
from jaxmllm.step.program import build_model, model_parts


def measure_bubbles(config: str, sets: list[str], stage_counts: list[int], repeats: int):
    """Per stage count: the plan, its stages' measured times and the measured / predicted
    bubble of its schedule."""
    rows = []
    for stages in stage_counts:
        cfg = load_config(config, [*sets, f"mesh.stage={stages}", "mesh.data=-1"])
        split_cpu(cfg.mesh.cpu_devices)
        run = resolve_run(cfg, sharding.data_parallel_size(sharding.make_mesh(cfg.mesh)))
        cfg = run.cfg
        plan = plan_of(cfg, stages)
        host = next(make_pipeline(run, prefetch=0))
        one = dataclasses.replace(cfg, mesh=MeshConfig(data=1))
        mesh1 = sharding.make_mesh(one.mesh, devices=jax.devices()[:1])
        with jax.set_mesh(mesh1):
            batch = device_batch(host["batch"], 0, batch_shapes(one, 1))
            fwd, bwd = StageTimer(one, plan.stages, batch, repeats).times()
        table = SCHEDULES[plan.schedule](cfg.batch.microbatches, stages)
        measured = table.bubble(fwd, bwd)
        rows.append(
            {
                "stages": stages,
                "microbatches": cfg.batch.microbatches,
                "schedule": plan.schedule,
                "plan": [f"{s.segment}:{s.layers}" for s in plan.stages],
                "fwd_s": fwd,
                "bwd_s": bwd,
                "measured_pipeline_s": table.time(fwd, bwd),
                "predicted_bubble": plan.bubble,
                "measured_bubble": measured,
                "bubble_rel_diff": (measured - plan.bubble) / plan.bubble if plan.bubble else 0.0,
            }
        )
    return rows


class StageTimer:
    """Times each stage's work on microbatch 0 of a one-device batch."""

    def __init__(self, cfg, stage_list: tuple[Stage, ...], batch: dict, repeats: int):
        self.cfg, self.stages, self.repeats = cfg, stage_list, repeats
        self.parts, _ = model_parts(cfg)
        self.params, self.frozen = jax.jit(lambda: build_model(cfg, 0))()
        self.mb = {k: jnp.asarray(v[0]) for k, v in batch.items()}
        model = self.parts.merge(self.params, self.frozen)
        self.phases = [p for p in model.phases if f"{p}_segment_ids" in self.mb]
        self.rows = jax.jit(lambda mb: {p: model.encode(mb, p) for p in self.phases})(self.mb)
        m = cfg.model
        self.trainable_below = {
            "llm": any(not getattr(m, p).freeze for p in self.phases) or not m.projector_freeze,
            "vision": False,
            "audio": False,
        }

    def times(self) -> tuple[list[float], list[float]]:
        """Per stage, the median forward time and the median forward + backward time less the
        forward's. The stages' programs are timed in turn, round after round, so a spell of
        other work on a shared box lands on every stage alike instead of on whichever stage
        was being timed then (GPipe's length takes each tick's slowest stage, so noise that
        hits one stage's figure alone reads as bubble)."""
        programs, carried = [], {}
        for stage in self.stages:
            fn, wrt, const = self._function(stage, carried.get(stage.segment))
            forward = jax.jit(fn)
            out = forward(wrt, const)
            carried[stage.segment] = out if not self._is_last(stage) else None
            grad = None
            if jax.tree.leaves(wrt):  # a stage with nothing to differentiate has no backward
                grad = jax.jit(lambda w, c, fn=fn: jax.grad(lambda w: _total(fn(w, c)))(w))
                jax.block_until_ready(grad(wrt, const))  # compile and warm up
            programs.append((forward, grad, wrt, const))
        runs = [([], []) for _ in programs]
        for _ in range(self.repeats):
            for (forward, grad, wrt, const), (f_runs, fb_runs) in zip(programs, runs, strict=True):
                f_runs.append(_seconds(forward, wrt, const))
                fb_runs.append(_seconds(grad, wrt, const) if grad else f_runs[-1])
        fwd = [float(np.median(f)) for f, _ in runs]
        bwd = [max(float(np.median(fb)) - t, 0.0) for (_, fb), t in zip(runs, fwd, strict=True)]
        return fwd, bwd

    def _is_last(self, stage: Stage) -> bool:
        depth = getattr(self.cfg.model, stage.segment).depth
        return stage.first + stage.layers == depth

    def _function(self, stage: Stage, received):
        """(fn(wrt, const), wrt, const): the stage's work, what its backward differentiates,
        and the rest."""
        seg, first, last = stage.segment, stage.first == 0, self._is_last(stage)
        keys = [
            k
            for k in (seg, f"{seg}_projector" if last and seg != "llm" else None)
            if k and k in self.params
        ]
        cut = lambda tree: {
            k: _slice(v, k == seg, stage.first, stage.layers) for k, v in tree.items()
        }
        params, frozen = cut(self.params), cut(self.frozen)
        wrt = {"params": {k: params[k] for k in keys}}
        inputs = self.rows if (first and seg == "llm") else received
        if inputs is not None and (not first or self.trainable_below[seg]):
            wrt["x"] = inputs
        const = {"x": inputs}
        rest = {k: v for k, v in params.items() if k not in keys}
        mb, parts = self.mb, self.parts

        def fn(wrt, const):
            model = parts.merge({**rest, **wrt["params"]}, frozen)
            x = wrt.get("x", const["x"])
            if seg == "llm":
                segment_ids, positions = model.decoder_rows(mb)
                pack = model.llm.packing(segment_ids, mb.get("llm_tiles"))
                h = model.decoder_inputs(mb, x)[0] if first else x
                return model.llm.transformer.layers(h, pack, positions)
            encoder = getattr(model, seg)
            h, pack, positions = encoder.prepare(*encoder_args(mb, seg))
            h = encoder.transformer.layers(h if first else x, pack, positions)
            if last:
                return getattr(model, f"{seg}_projector")(encoder.transformer.final_norm(h))
            return h

        return fn, wrt, const


def _seconds(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def _slice(tree, stacked: bool, first: int, layers: int):
    """A module's params with its stacked layers cut to [first, first + layers)."""
    if not stacked:
        return tree

    def cut(keypath, leaf):
        parts = sharding.rules.key_parts(keypath)
        inside = any(parts[i : i + 2] == ("transformer", "blocks") for i in range(len(parts)))
        return leaf[first : first + layers] if inside else leaf

    return jax.tree_util.tree_map_with_path(cut, tree)


def _total(out) -> jax.Array:
    return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(out))
