"""Train a multimodal LLM: `python -m jaxmllm.train --config configs/tiny.yaml [--set k=v ...]`.

Reads top to bottom in stages: config -> mesh -> data -> shapes -> shardings -> init -> restore
-> step -> loop. Rerunning the same command resumes from the latest checkpoint in
`train.output_dir`; the data pipeline's planner state is part of every checkpoint, so the resumed
run sees exactly the steps the uninterrupted one would have.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

import sharding
from jaxmllm import distributed
from jaxmllm.config import Config, ConfigError, load_config, to_dict
from jaxmllm.data.cost import CostModel
from jaxmllm.data.pipeline import make_pipeline, make_source, resolve_batch
from jaxmllm.data.planner import OversizeError
from jaxmllm.data.rejects import REASONS
from jaxmllm.ledger import Ledger
from jaxmllm.metrics import MetricsWriter, step_flops
from jaxmllm.models import MultimodalLM, param_axes, token_losses

log = logging.getLogger("jaxmllm")

# Top-level model attributes, and the config switch that freezes each.
FREEZE_SWITCHES = {
    "vision": lambda m: m.vision.freeze,
    "vision_projector": lambda m: m.projector_freeze,
    "audio": lambda m: m.audio.freeze,
    "audio_projector": lambda m: m.projector_freeze,
    "llm": lambda m: m.llm.freeze,
}


# ----------------------------------------------------------------------------- model state


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """How to rebuild the model from pure-dict params: the graph and the state template."""

    graphdef: Any
    template: Any  # abstract nnx.State the pure dicts are poured into
    frozen_keys: tuple[str, ...]  # top-level modules whose params are not trained

    def merge(self, params: dict, frozen: dict) -> MultimodalLM:
        state = jax.tree.map(lambda x: x, self.template)  # a fresh copy to fill
        nnx.replace_by_pure_dict(state, {**params, **frozen})
        return nnx.merge(self.graphdef, state)


def build_model(cfg: Config, seed: int) -> tuple[dict, dict]:
    """Initialises the model; returns (trainable params, frozen params) as pure dicts."""
    model = MultimodalLM(cfg.model, cfg.batch, rngs=nnx.Rngs(seed))
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    frozen = {k for k, is_frozen in FREEZE_SWITCHES.items() if k in pure and is_frozen(cfg.model)}
    return (
        {k: v for k, v in pure.items() if k not in frozen},
        {k: v for k, v in pure.items() if k in frozen},
    )


def model_parts(cfg: Config) -> tuple[ModelParts, dict]:
    """Shape-only model build: graph, state template, and logical axes of every parameter."""
    abstract = nnx.eval_shape(lambda: MultimodalLM(cfg.model, cfg.batch, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract, nnx.Param)
    frozen = tuple(k for k, f in FREEZE_SWITCHES.items() if k in state and f(cfg.model))
    return ModelParts(graphdef, state, frozen), param_axes(state)


# ----------------------------------------------------------------------------- optimizer


def make_optimizer(cfg: Config) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warm-up then cosine decay, global-norm clipping, decay on matrices."""
    o = cfg.optim
    warmup = min(o.warmup_steps, max(cfg.train.steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=warmup,
        decay_steps=max(cfg.train.steps, warmup + 1),
        end_value=o.lr * o.min_lr_ratio,
    )
    chain = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
    chain.append(
        optax.adamw(
            schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask
        )
    )
    return optax.chain(*chain), schedule


def decay_mask(params: dict) -> dict:
    """True for matrices (kernels, embeddings), False for norm scales and biases.

    By name, not ndim: scanned layers give a norm scale a leading `layers` dim.
    """
    decayed = lambda path, _: sharding.rules.key_parts(path)[-1] in ("kernel", "embedding")
    return jax.tree_util.tree_map_with_path(decayed, params)


# ----------------------------------------------------------------------------- train step


def make_loss_and_grads(parts: ModelParts) -> Callable:
    """(params, frozen, batch [M, D, ...]) -> (loss, grads) over all microbatches of a step.

    loss = sum of token losses / global count of loss tokens in the whole step, so the loss and
    the gradient do not depend on how the planner spread samples over devices or microbatches.
    Only `params` are differentiated: frozen modules get no gradient, and a frozen encoder with
    nothing trainable below it runs forward only.
    """

    def loss_fn(params, frozen, mb, denom):
        logits = parts.merge(params, frozen)(mb)
        loss_sum, count = token_losses(logits, mb["llm_targets"], mb["llm_loss_mask"])
        return loss_sum / denom, count

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def loss_and_grads(params, frozen, batch):
        denom = jnp.maximum(batch["llm_loss_mask"].sum(), 1.0)

        def microbatch(acc, mb):
            (loss, _), grads = grad_fn(params, frozen, mb, denom)
            return jax.tree.map(jnp.add, acc, (loss, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(microbatch, zero, batch)
        return loss, grads

    return loss_and_grads


def make_train_step(
    parts: ModelParts, optimizer: optax.GradientTransformation, schedule: optax.Schedule
) -> Callable:
    """One optimizer step over all microbatches of a step batch [M, D, ...]."""
    loss_and_grads = make_loss_and_grads(parts)

    def train_step(state, batch):
        loss, grads = loss_and_grads(state["params"], state["frozen"], batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        # A non-finite loss or gradient skips the update: params and optimizer state stay.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_state = {
            **state,
            "params": keep(optax.apply_updates(state["params"], updates), state["params"]),
            "opt_state": keep(opt_state, state["opt_state"]),
            "step": state["step"] + 1,
        }
        metrics = {
            "nonfinite": 1.0 - finite.astype(jnp.float32),
            "loss": loss,
            "grad_norm": grad_norm,
            # The optimizer's own update count: it does not advance on skipped steps.
            "lr": schedule(
                optax.tree_utils.tree_get_all_with_path(state["opt_state"], "count")[0][1]
            ),
            "loss_tokens": jnp.maximum(batch["llm_loss_mask"].sum(), 1.0),
        }
        return new_state, metrics

    return train_step


# ----------------------------------------------------------------------------- program


@dataclasses.dataclass
class Program:
    """What a config compiles to on a mesh: shapes, shardings, init and the train step."""

    cfg: Config
    mesh: Any
    parts: ModelParts
    axes: dict
    optimizer: optax.GradientTransformation
    abstract: dict  # eval_shape of the train state
    shardings: dict  # NamedSharding per train-state leaf
    step: Callable  # jitted (state, batch) -> (state, metrics); the state is donated

    def abstract_sharded(self) -> dict:
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self.abstract,
            self.shardings,
        )

    def init(self) -> dict:
        """A fresh train state, created by a jitted init straight into its shardings."""
        init = lambda: _init_state(self.cfg, self.optimizer)
        return jax.jit(init, out_shardings=self.shardings)()

    def describe(self) -> str:
        params = {**self.abstract["params"], **self.abstract["frozen"]}
        return sharding.describe(self.axes, params, self.mesh)


def build_program(cfg: Config, mesh) -> Program:
    """Abstract model -> logical axes -> physical shardings -> jitted train step.

    `cfg` must be resolved against the data (`resolve_batch`).
    """
    parts, axes = model_parts(cfg)
    optimizer, schedule = make_optimizer(cfg)
    abstract = jax.eval_shape(lambda: _init_state(cfg, optimizer))
    sharding.validate(axes)
    trained = {k: v for k, v in axes.items() if k not in parts.frozen_keys}
    frozen = {k: v for k, v in axes.items() if k in parts.frozen_keys}
    shardings = {
        "params": sharding.param_shardings(trained, abstract["params"], mesh),
        "frozen": sharding.param_shardings(frozen, abstract["frozen"], mesh),
        "step": sharding.replicated(mesh),
    }
    shardings["opt_state"] = sharding.opt_state_shardings(
        optimizer, abstract["opt_state"], shardings["params"], mesh
    )
    # One compiled program; the state is donated so params are updated in place.
    step = jax.jit(
        make_train_step(parts, optimizer, schedule),
        donate_argnums=0,
        out_shardings=(shardings, sharding.replicated(mesh)),
    )
    return Program(cfg, mesh, parts, axes, optimizer, abstract, shardings, step)


# ----------------------------------------------------------------------------- checkpoints


def make_checkpoint_manager(cfg: Config) -> ocp.CheckpointManager:
    """Orbax manager for `<output_dir>/checkpoints`; saves are atomic (written aside, renamed).

    A save interrupted by a kill leaves a `*.orbax-checkpoint-tmp*` directory: it is reported
    and cleaned up, and the run resumes from the latest complete checkpoint.
    """
    t = cfg.train
    directory = Path(t.output_dir).absolute() / "checkpoints"
    for tmp in sorted(directory.glob("*.orbax-checkpoint-tmp*")) if directory.exists() else []:
        log.warning(
            "discarding %s: a checkpoint save that was interrupted before it completed", tmp.name
        )
    options = ocp.CheckpointManagerOptions(
        max_to_keep=t.keep_checkpoints,
        save_interval_steps=t.checkpoint_every,
        enable_async_checkpointing=t.async_checkpointing,
        cleanup_tmp_directories=True,
        create=True,
    )
    return ocp.CheckpointManager(directory, options=options)


def save_args(state, data_iter) -> ocp.args.Composite:
    return ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iter)
    )


def restore_latest(mngr: ocp.CheckpointManager, abstract_state, data_iter):
    """Restores the newest checkpoint that reads back; None if there is none.

    A newer checkpoint that cannot be restored (damaged after it was committed) is reported and
    moved aside, never deleted or overwritten, once an older one restores; if none restores the
    run stops and says why rather than start over.
    """
    steps = sorted(mngr.all_steps(), reverse=True)
    failed = []
    for step in steps:
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=grain.checkpoint.CheckpointRestore(data_iter),
        )
        try:
            restored = mngr.restore(step, args=args)
        except Exception as e:  # orbax/tensorstore raise many types for a damaged checkpoint
            log.warning(
                "checkpoint %d cannot be restored (%s: %s)",
                step,
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
            )
            failed.append(step)
            continue
        for bad in failed:  # out of the way of the saves that will reuse these step numbers
            path = Path(mngr.directory) / str(bad)
            aside = path.with_name(f"{bad}.unreadable-{int(time.time())}")
            path.rename(aside)
            log.warning(
                "moved unreadable checkpoint %d to %s; resuming from step %d", bad, aside.name, step
            )
        if failed:
            mngr.reload()
        return restored["state"]
    if failed:
        raise ConfigError(
            f"no checkpoint in {mngr.directory} could be restored (steps {failed}; see the "
            "warnings above). Fix or move them, or use a new train.output_dir"
        )
    return None


# ----------------------------------------------------------------------------- main


def main(cfg: Config, *, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Trains per `cfg`; returns the last logged metrics. `on_step(step, metrics)` is a hook.

    In a multi-process job (see jaxmllm/distributed.py) every process calls this with the same
    config; JAX is started here, before anything touches a device.
    """
    distributed.start(cfg)
    mesh = sharding.make_mesh(cfg.mesh)
    if cfg.batch.exchange == "ragged" and jax.default_backend() == "cpu":
        raise ConfigError(
            "batch.exchange=ragged: XLA:CPU does not implement ragged_all_to_all; use "
            "batch.exchange: dense on CPU (ragged is for GPU backends)"
        )
    # The data decides `auto` sizes before anything is shaped by them.
    source, index = make_source(cfg)
    cfg = resolve_batch(cfg, index)
    # Under the mesh, the model pins the encoder-row exchange to the data axes (an all-to-all).
    with jax.set_mesh(mesh):
        return _train(cfg, mesh, source, index, on_step)


def _train(cfg: Config, mesh, source, index, on_step) -> dict:
    t = cfg.train
    out = Path(t.output_dir)
    is_main = jax.process_index() == 0
    check_resumable(cfg, out)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f"config.json.tmp{os.getpid()}"  # other processes may be reading it
        tmp.write_text(json.dumps(to_dict(cfg), indent=2))
        tmp.replace(out / "config.json")

    # Mesh: data x fsdp x tensor over all devices; D = data-parallel buckets per step.
    devices = sharding.data_parallel_size(mesh)
    log.info(
        "mesh %s over %d %s devices; %d data-parallel buckets",
        dict(mesh.shape),
        mesh.size,
        jax.devices()[0].platform,
        devices,
    )

    # Data: the planner fills fixed-shape buckets; planning and loading run ahead in a thread.
    # Each process plans the whole step and loads only its own devices' samples.
    multi = jax.process_count() > 1
    positions = host_positions(mesh) if multi else None
    rank = jax.process_index()
    data_iter = make_pipeline(
        cfg,
        devices,
        source=source,
        index=index,
        positions=positions,
        reject_log=out / ("rejects.jsonl" if rank == 0 else f"rejects.process{rank}.jsonl"),
    )
    if multi:
        log.info(
            "process %d of %d: data-parallel positions %d..%d of %d",
            rank,
            jax.process_count(),
            positions[0],
            positions[-1],
            devices,
        )
    ledger = Ledger(out, rank) if t.ledger else None
    watchdog = Watchdog(cfg.distributed.step_timeout_s) if multi else None

    # Shapes, shardings (checked for clashes), and the one compiled step.
    prog = build_program(cfg, mesh)
    if is_main:
        print(prog.describe())
        if prog.parts.frozen_keys:
            print(f"frozen (no gradient, no optimizer state): {', '.join(prog.parts.frozen_keys)}")

    # Init: jitted straight into its shardings (no full copy on one device), or restore.
    mngr = make_checkpoint_manager(cfg)
    check_process_count(mngr)
    state = restore_latest(mngr, prog.abstract_sharded(), data_iter)
    if state is None:
        state = prog.init()
    start = int(state["step"])
    if start:
        print(f"resumed from checkpoint at step {start} in {mngr.directory}")
    step_fn = prog.step

    # Loop.
    writer = MetricsWriter(out, enabled=is_main)
    bar = _progress(cfg, start, is_main)
    last: dict = {}
    window_start, window_tokens, window_flops, window_steps = time.perf_counter(), 0.0, 0.0, 0
    cost = CostModel.from_model(cfg.model)  # analytic FLOPs of the real work, for metrics
    preempt = Preemption()
    guard = NonFiniteGuard(t.max_nonfinite_steps)
    try:
        for step in range(start, t.steps):
            host = next(data_iter)
            batch = sharding.make_global_batch(host["batch"], mesh)
            with jax.transfer_guard("disallow"):  # no hidden host<->device copies in the step
                state, metrics = step_fn(state, batch)
            if guard.check(step + 1, metrics["nonfinite"]):
                mngr.save(guard.stopped_at, args=save_args(state, data_iter), force=True)
                mngr.wait_until_finished()
                raise NonFiniteError(guard.message(mngr.directory))
            if watchdog is not None:
                watchdog.progress(step + 1)
            if ledger is not None:
                ledger.write(step + 1, host["info"]["parts"])
            window_tokens += float((host["batch"]["llm_segment_ids"] > 0).sum())
            window_flops += step_flops(cfg, host["batch"], cost)
            window_steps += 1
            done = step + 1
            if done % t.log_every == 0 or done in (1, t.steps):
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                elapsed = time.perf_counter() - window_start
                # This host's share of the step; summed over hosts when there are several.
                tokens, flops, fill, rejects = _global_stats(
                    window_tokens, window_flops, host["info"]["fill"], host["info"]["rejects"]
                )
                metrics.update(_throughput(tokens, flops, window_steps, elapsed, mesh.size))
                metrics.update({f"padding/{k}": 1.0 - v for k, v in fill.items()})
                metrics["nonfinite_total"] = guard.total
                metrics.update(rejects)  # cumulative bad-input counts
                metrics["samples"] = len(host["info"]["samples"])
                writer.write(done, metrics)
                bar.set_postfix(
                    loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:.0f}"
                )
                last = metrics
                window_start, window_tokens, window_flops, window_steps = (
                    time.perf_counter(),
                    0.0,
                    0.0,
                    0,
                )
            stopping = preempt.requested is not None
            mngr.save(done, args=save_args(state, data_iter), force=done == t.steps or stopping)
            bar.update(1)
            if on_step is not None:
                on_step(done, last)
            if stopping:
                mngr.wait_until_finished()
                bar.close()
                print(
                    f"stopped by {preempt.requested} after step {done}; checkpoint saved in "
                    f"{mngr.directory}. Rerun the same command to resume at step {done + 1}.",
                    file=sys.stderr,
                )
                break
    except KeyboardInterrupt:
        mngr.wait_until_finished()
        latest = mngr.latest_step()
        print(
            f"\ninterrupted; the latest checkpoint is step {latest}. "
            "Rerun the same command to resume from it.",
            file=sys.stderr,
        )
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        if ledger is not None:
            ledger.close()
        preempt.restore()
        bar.close()
        mngr.wait_until_finished()
        mngr.close()
        writer.close()
        data_iter.close()
    return last


# What a resumed run must share with the run that wrote its checkpoints: the parameters' shapes
# and split, the bucket shapes and planner (their state is in the checkpoint), the sample stream.
# The mesh, optimizer settings and step count may change between runs.
RESUME_KEYS = ("model", "batch", "data.source", "data.path", "data.seed", "data.synthetic")


def check_resumable(cfg: Config, out: Path) -> None:
    """Refuses an output dir whose checkpoints come from an incompatible config."""
    saved_path = out / "config.json"
    ckpts = out / "checkpoints"
    if not saved_path.exists() or not ckpts.exists() or not any(ckpts.iterdir()):
        return
    saved = distributed.flatten(json.loads(saved_path.read_text()))
    now = distributed.flatten(to_dict(cfg))
    changed = [
        k
        for k in sorted(set(saved) | set(now))
        if k.startswith(RESUME_KEYS) and saved.get(k) != now.get(k)
    ]
    if changed:
        diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:6])
        raise ConfigError(
            f"train.output_dir={out} holds checkpoints of a run with a different config "
            f"({diffs}{', ...' if len(changed) > 6 else ''}); it cannot be resumed with this "
            f"one. Use a new train.output_dir, or the config in {saved_path}."
        )


def host_positions(mesh) -> Any:
    """This process's data-parallel positions; they must be one contiguous run (the mesh
    lays devices out process by process), which is what make_global_batch assembles."""
    positions = sharding.local_dp_indices(mesh)
    if len(positions) == 0 or (positions != positions[0] + range(len(positions))).any():
        raise sharding.ShardingError(
            f"process {jax.process_index()} holds data-parallel positions {positions.tolist()}, "
            "not one contiguous run; use a mesh whose fsdp x tensor fits within a host"
        )
    return positions


def check_process_count(mngr: ocp.CheckpointManager) -> None:
    """A checkpoint's data state is one file per process: resume with the same process count."""
    latest = mngr.latest_step()
    if latest is None:
        return
    files = list((Path(mngr.directory) / str(latest) / "data").glob("process_*-of-*.json"))
    counts = {int(f.stem.rsplit("-of-", 1)[1]) for f in files}
    if counts and jax.process_count() not in counts:
        raise ConfigError(
            f"checkpoint {latest} in {mngr.directory} was written by {counts.pop()} processes "
            f"but this run has {jax.process_count()}; relaunch with the same number of processes"
        )


def _global_stats(tokens: float, flops: float, fill: dict, rejects: dict):
    """Sums this host's step statistics over all processes (a no-op with one process).

    Every process calls this at the same (logged) steps: it is a collective.
    """
    if jax.process_count() == 1:
        return tokens, flops, fill, rejects
    from jax.experimental import multihost_utils

    fills = sorted(fill)
    loads = [f"rejects/load_{r}" for r in sorted(REASONS)]
    mine = [tokens, flops] + [fill[k] for k in fills] + [rejects.get(k, 0.0) for k in loads]
    every = np.asarray(multihost_utils.process_allgather(np.asarray(mine, np.float64)))
    total = every.sum(0)
    fill = {k: float(every[:, 2 + i].mean()) for i, k in enumerate(fills)}  # equal-size hosts
    rejects = dict(rejects)
    for i, k in enumerate(loads):
        value = float(total[2 + len(fills) + i])
        if value or k in rejects:
            rejects[k] = value
    if "rejects/load_total" in rejects:
        rejects["rejects/load_total"] = sum(rejects.get(k, 0.0) for k in loads)
    return float(total[0]), float(total[1]), fill, rejects


class Watchdog:
    """Stops a process whose step has not advanced in `timeout` seconds (a peer hung or died).

    JAX's own heartbeat stops the job when a process dies; this catches a process that is
    alive but stuck, and says so instead of waiting forever.
    """

    def __init__(self, timeout: int):
        self.timeout, self.step, self.last = timeout, 0, time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxmllm-watchdog", daemon=True)
        self._thread.start()

    def progress(self, step: int) -> None:
        self.step, self.last = step, time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(5.0, self.timeout / 4)):
            if self.step and time.monotonic() - self.last > self.timeout:
                print(
                    f"error: process {jax.process_index()}: step {self.step + 1} has not "
                    f"finished in distributed.step_timeout_s={self.timeout} s; another process "
                    "is probably dead or stuck. Stopping; relaunch every process to resume "
                    "from the latest checkpoint.",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(4)


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient."""


class NonFiniteGuard:
    """Counts skipped (non-finite) steps; says when `limit` came in a row.

    It reads a step's flag only after the next step is dispatched, so the host never waits on
    the device; the step it stops at holds the last good parameters (updates were skipped).
    """

    def __init__(self, limit: int):
        self.limit, self.run, self.total = limit, 0, 0
        self.stopped_at = 0
        self._pending: tuple[int, jax.Array] | None = None

    def check(self, step: int, flag: jax.Array) -> bool:
        previous, self._pending = self._pending, (step, flag)
        if previous is None:
            return False
        done, prev_flag = previous
        bad = bool(jax.device_get(prev_flag))
        self.run = self.run + 1 if bad else 0
        self.total += bad
        if bad:
            log.warning(
                "step %d: non-finite loss or gradient; update skipped (%d in a row)", done, self.run
            )
        if self.limit and self.run >= self.limit:
            self.stopped_at = step  # the latest dispatched step also kept the good state
            return True
        return False

    def message(self, directory) -> str:
        return (
            f"{self.run} steps in a row had a non-finite loss or gradient (train."
            f"max_nonfinite_steps={self.limit}); stopped at step {self.stopped_at} with the "
            f"last good parameters checkpointed in {directory}. Lower optim.lr, raise "
            f"optim.warmup_steps or set model.compute_dtype: float32, then resume."
        )


class Preemption:
    """SIGTERM / SIGINT ask the loop to finish its step, checkpoint and exit cleanly.

    A second signal while stopping raises KeyboardInterrupt at once (the latest complete
    checkpoint stays usable). Outside the main thread signals cannot be caught: no-op.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        print(f"\n{self.requested}: finishing this step, then checkpointing", file=sys.stderr)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def _init_state(cfg: Config, optimizer: optax.GradientTransformation) -> dict:
    params, frozen = build_model(cfg, cfg.train.seed)
    return {
        "params": params,
        "frozen": frozen,
        "opt_state": optimizer.init(params),
        "step": jnp.zeros((), jnp.int32),
    }


def _throughput(tokens: float, flops: float, steps: int, seconds: float, n_dev: int) -> dict:
    seconds = max(seconds, 1e-9)
    return {
        "step_time_s": seconds / max(steps, 1),
        "tokens_per_s": tokens / seconds,
        "tflops_per_device": flops / seconds / n_dev / 1e12,
    }


def _progress(cfg: Config, start: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=cfg.train.steps,
        initial=start,
        desc="train",
        unit="step",
        disable=not (enabled and cfg.train.progress_bar),
        dynamic_ncols=True,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="experiment YAML, e.g. configs/tiny.yaml")
    p.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override config values, e.g. --set optim.lr=3e-4 train.steps=50 (repeatable)",
    )
    return p.parse_args(argv)


def cli(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        main(cfg)
    except (ConfigError, OversizeError, sharding.ShardingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli())
