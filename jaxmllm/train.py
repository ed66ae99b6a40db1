"""Train a multimodal LLM: `python -m jaxmllm.train --config configs/tiny.yaml [--set k=v ...]`.

Reads top to bottom in stages: config -> mesh -> data -> shapes -> init or resume -> loop. The
step is built in `jaxmllm/step/`, the data fed by `jaxmllm/feed/`, and the loop's parts
(checkpoints, guards against a stuck peer, divergence and preemption, metrics) are `jaxmllm/loop/`.
Rerunning the same command resumes from the latest checkpoint in `train.output_dir`; the data
pipeline's planner state is part of every checkpoint, so the resumed run sees exactly the steps
the uninterrupted one would have.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grain
import jax

import sharding
from jaxmllm.config import Config, load_config
from jaxmllm.config.command import add_config_args, configure_logging, run
from jaxmllm.feed.info import StepInfo
from jaxmllm.feed.iterator import make_pipeline
from jaxmllm.init_from import initial_params, precomputed_reference, start_base, start_reference
from jaxmllm.loop import checkpoint, guards
from jaxmllm.loop.checkpoint import (
    NONFINITE_KEY,
    check_process_count,
    check_resumable,
    format_stamp,
    make_checkpoint_manager,
    restore_latest,
    save_args,
    write_config,
)
from jaxmllm.loop.evaluate import open_evaluator
from jaxmllm.loop.guards import NonFiniteError, NonFiniteGuard, Preemption
from jaxmllm.loop.ledger import Ledger
from jaxmllm.loop.lock import hold_output_dir
from jaxmllm.loop.metrics import MetricsWindow, MetricsWriter, device_peak, logged_step
from jaxmllm.loop.rollouts import RolloutIterator
from jaxmllm.loop.summary import RunReport, rejects_file, schedule_note
from jaxmllm.loop.timings import TimingsRecorder
from jaxmllm.loop.watchdog import startup_signals, step_watchdog
from jaxmllm.process import distributed, xla_flags
from jaxmllm.resolve.run import Run, resolve_run
from jaxmllm.step.stages.program import build_program

log = logging.getLogger("jaxmllm")


def main(cfg: Config, *, on_step: Callable[[int, dict], None] | None = None) -> dict:
    """Trains per `cfg`; returns the last logged metrics. `on_step(step, metrics)` is a hook.

    In a multi-process job (see jaxmllm/process/distributed.py) every process calls this with the
    same config; JAX is started here, before anything touches a device.
    """
    distributed.start(cfg)
    checkpoint.check_output_dir(Path(cfg.train.output_dir))  # (read-only, a file: stop here)
    xla_flags.report()  # (the GPU flag set in effect, on a GPU)
    # Resolved once: the mesh, the kernel for these devices, the source and its index, the
    # batch's sizes from the data (a resumed run's: as it was planned), the bucket spec.
    run = resolve_run(cfg, resume=cfg.train.output_dir)
    # Under the mesh, the model pins the encoder-row exchange to the data axes (an all-to-all).
    with jax.set_mesh(run.mesh), contextlib.ExitStack() as closing:
        return _train(run, on_step, closing)


def _train(run: Run, on_step, closing: contextlib.ExitStack) -> dict:
    """The stages after the config; what they open is closed by `closing`, in reverse."""
    cfg, mesh = run.cfg, run.mesh
    t = cfg.train
    out = Path(t.output_dir)
    is_main = jax.process_index() == 0
    closing.enter_context(hold_output_dir(out, is_main))  # (a second run there stops here)
    check_resumable(cfg, out)

    # Mesh: data x fsdp x tensor over all devices; D = data-parallel buckets per step.
    log.info(
        "mesh %s over %d %s devices; %d data-parallel buckets",
        dict(mesh.shape),
        mesh.size,
        jax.devices()[0].platform,
        sharding.data_parallel_size(mesh),
    )

    # Shapes, shardings (checked for clashes), and the one compiled step.
    prog = build_program(cfg, mesh)

    # Data: the planner fills fixed-shape buckets; planning, loading and the copy to the devices
    # run ahead in a thread. Each process plans the whole step and loads only its own devices'.
    # (preference.reference: precomputed: the pairs' reference log-probs first, in one pass)
    run = precomputed_reference(run, prog, out)
    data_iter = open_data(run, out, prog, lambda: prog.weights(state))  # (RL: the policy now)
    closing.callback(data_iter.close)
    if is_main:
        print(prog.describe())
        if prog.parts.frozen_keys:
            print(f"frozen (no gradient, no optimizer state): {', '.join(prog.parts.frozen_keys)}")
        if prog.parts.adapted:
            print(f"LoRA adapters train, their base frozen: {', '.join(prog.parts.adapted)}")
        log.log(*schedule_note(cfg))  # (a warm-up over most of a short run: said)

    # Evaluation (data.eval): a fixed held-out set planned at the step's shapes, and questions.
    evaluator = open_evaluator(run, prog, out)

    # Init: jitted straight into its shardings (no full copy on one device), or restore. A
    # checkpoint of another format (stamp) is refused, never restored into the wrong tree; it
    # holds the state in a form the mesh does not change (pipelined stacks as [depth, ...]).
    mngr = make_checkpoint_manager(cfg)
    closing.callback(checkpoint.wait_for_saves, mngr, True)  # waits for a save in flight
    saved_form = prog.saved_abstract()
    stamp = format_stamp(prog.abstract_params())
    check_process_count(mngr)
    fresh, base = start_base(cfg, prog, stamp)  # (adapters: their base, never in checkpoints)
    state = restore_latest(mngr, saved_form, data_iter, stamp)
    if state is None:  # a fresh run: random, or the pretrained weights model.init_from names
        state = fresh if fresh is not None else prog.init(initial_params(cfg, prog))
    else:
        state = prog.restored(state, base)
    state = start_reference(cfg, prog, state)  # (preference: the reference policy, frozen)
    if is_main:  # (only once the resume checks passed: a refused run leaves the folder as it was)
        write_config(cfg, out)
    if evaluator is not None:  # (the eval set's rejects likewise: each process its own file)
        evaluator.write_rejects()
    start = int(state["step"])
    guard = NonFiniteGuard(t.max_nonfinite_steps)  # (its count in a row goes on from a resume)
    if start:
        guard.resumed((checkpoint.read_stamp(mngr, start) or {}).get(NONFINITE_KEY, 0))
        if guard.limit_reached() and start >= t.steps:  # (stopped at its last step: not done)
            guard.stopped_at = start
            raise NonFiniteError(guard.message(mngr.directory))
    if start >= t.steps:  # a finished run rerun: said, with its summary and how to train on
        report = RunReport(cfg, out, start, rejects_file(out))
        return report.finished(start, Path(mngr.directory) / str(start))
    if start:
        print(f"resumed from checkpoint at step {start} in {mngr.directory}")

    # Loop: dispatch a step on the batch the pipeline already put on the devices, then do the
    # host's bookkeeping while the devices run it.
    writer = closing.enter_context(contextlib.closing(MetricsWriter(out, enabled=is_main)))
    bar = closing.enter_context(contextlib.closing(_progress(cfg, start, is_main)))
    preempt = Preemption()
    closing.callback(preempt.restore)
    ledger = Ledger(out, jax.process_index()) if t.ledger else None
    if ledger is not None:
        closing.callback(ledger.close)
    watchdog = step_watchdog(cfg, start, preempt, mngr.directory)  # (a hung step ends it)
    closing.callback(watchdog.close)
    peak = device_peak(t.peak_tflops, jax.devices()[0].device_kind) if is_main else None
    window = MetricsWindow(mesh.size, cfg.data, peak)
    timings = open_timings(cfg, out, start, is_main, closing)
    report = RunReport(cfg, out, start, rejects_file(out))  # (what the terminal is told)
    last: dict = {}
    due = False  # a periodic save waiting for a rollout's end (RL: `loop.rollouts`)
    try:
        for step in range(start, t.steps):
            waited, element = time.perf_counter(), next(data_iter)  # batch on the devices
            waited = time.perf_counter() - waited  # (the devices idle while the feed is behind)
            waited -= getattr(data_iter, "sampling_s", 0.0)  # (RL: the devices were generating)
            batch, info = element["batch"], element["info"]
            with jax.transfer_guard("disallow"):  # no hidden host<->device copies in the step
                state, metrics = prog.step_of(info.long)(state, batch)
            done = step + 1
            if timings is not None:  # times the step before, now done, as the guard waits on it
                timings.dispatched(done, metrics["loss"], info.work, info.variant)
            checkpoint.check_saves(mngr)  # a save that failed in the background stops the run
            # (a step to be saved is read first: its checkpoint's count in a row is exact, and
            # the limit holds at the run's last step)
            saves = done == t.steps or preempt.requested is not None or mngr.should_save(done)
            if guard.check(done, metrics["nonfinite"]) or (saves and guard.settle()):
                args = save_args(prog.saved(state), data_iter, stamped(stamp, guard))
                checkpoint.save(mngr, guard.stopped_at, args, force=True)
                checkpoint.wait_for_saves(mngr)
                raise NonFiniteError(guard.message(mngr.directory))
            watchdog.beat(done)
            if ledger is not None:
                ledger.write(done, info.parts)
            window.add(info, waited)
            report.step(info)
            if logged_step(done, t):
                last = log_step(done, metrics, info, window, guard.total, writer, bar)
                report.logged(done)
            if evaluator is not None and evaluator.due(done):  # (reads the params, no more)
                writer.write(done, evaluator(prog.weights(state), done))  # [depth, ...]
                window.exclude(evaluator.seconds)  # (throughput is the training's)
                if timings is not None:
                    timings.evaluated()
            # (RL: a checkpoint and a preemption's stop wait for the rollout's end, where the
            # state names the next rollout: resumed, it samples what this run would have)
            boundary = getattr(data_iter, "at_boundary", True)
            stopping = preempt.requested is not None and boundary
            force = done == t.steps or stopping
            due = due or mngr.should_save(done)
            saving = force or (due and boundary)  # (converted only when it is saved)
            due = due and not saving
            args = (
                save_args(prog.saved(state), data_iter, stamped(stamp, guard)) if saving else None
            )
            saved = saving and checkpoint.save(mngr, done, args, force=saving)
            if saved and timings is not None:
                timings.saved()
            bar.update(1)
            if on_step is not None:
                on_step(done, last)
            if stopping:
                _stopped(preempt.requested, done, mngr, bar)
                break
        else:  # every step done (not stopped by a signal): the summary
            if last:
                checkpoint.wait_for_saves(mngr)  # (the summary names the last checkpoint)
                bar.close()
                report.finish(t.steps, last, window, Path(mngr.directory) / str(t.steps))
    except KeyboardInterrupt:
        checkpoint.wait_for_saves(mngr)
        print(
            f"\ninterrupted; the latest checkpoint is step {mngr.latest_step()}. "
            "Rerun the same command to resume from it.",
            file=sys.stderr,
        )
        raise
    return last


def stamped(stamp: dict, guard: NonFiniteGuard) -> dict:
    """A checkpoint's stamp: the format's, and the non-finite steps in a row it was saved after
    (a resumed run's count goes on from there)."""
    return {**stamp, NONFINITE_KEY: guard.run}


def _stopped(signal_name: str, done: int, mngr, bar) -> None:
    """After a preemption signal: the checkpoint of step `done` is written; say how to resume."""
    checkpoint.wait_for_saves(mngr)
    bar.close()
    print(
        f"stopped by {signal_name} after step {done}; checkpoint saved in "
        f"{mngr.directory}. Rerun the same command to resume at step {done + 1}.",
        file=sys.stderr,
    )


def open_timings(cfg: Config, out: Path, start: int, is_main: bool, closing):
    """The recorder of each step's time and work (timings.jsonl), on process 0 when
    train.record_timings; steps after `start` left by an earlier run are dropped."""
    if not (cfg.train.record_timings and is_main):
        return None
    timings = TimingsRecorder(out, start)
    closing.callback(timings.close)  # times the last step
    return timings


def open_data(run: Run, out: Path, prog, policy: Callable[[], dict]) -> grain.DatasetIterator:
    """This process's step iterator: it yields each step's global device arrays, assembled from
    this process's rows in the pipeline's thread while the devices run the step before; under
    `train.objective: grpo`, the rollouts of the policy's current weights (`policy()`)."""
    if run.cfg.train.objective == "grpo":
        return RolloutIterator(run, prog, policy)
    if run.positions is not None:
        log.info(
            "process %d of %d: data-parallel positions %d..%d of %d",
            jax.process_index(),
            jax.process_count(),
            run.positions[0],
            run.positions[-1],
            run.devices,
        )
    return make_pipeline(
        run,
        reject_log=rejects_file(out),
        to_device=lambda host_batch: sharding.make_global_batch(host_batch, run.mesh),
    )


def log_step(done: int, metrics: dict, info: StepInfo, window, nonfinite_total, writer, bar):
    """A logged step's row: the step's own metrics (this waits for the step to finish), the
    window's throughput and padding and the job's cumulative counts; written and shown."""
    row = {k: float(v) for k, v in jax.device_get(metrics).items()}
    stats, rejects = window.close(info)  # summed over processes: every process logs this step
    row.update(stats)
    row["nonfinite_total"] = nonfinite_total
    row.update(rejects)  # cumulative bad-input counts
    row.update(info.extra)  # (RL: the step's rollout's rewards, lengths and times)
    row["samples"] = len(info.samples)
    row["long_variant"] = info.long  # (the ladder's: 0 base, v the long variant v)
    row.update({f"samples/{name}": n for name, n in info.sources.items()})  # (a mixture's)
    writer.write(done, row)
    mfu = {"mfu": f"{row['mfu']:.1%}"} if "mfu" in row else {}
    bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", **mfu)
    return row


def _progress(cfg: Config, start: int, enabled: bool):
    """The step progress bar (tqdm) from `start` to train.steps: shown on process 0 with
    train.progress_bar, disabled elsewhere."""
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
    """The command line of `python -m jaxmllm.train`: --config and its --set overrides."""
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(p)
    return p.parse_args(argv)


def cli(argv: list[str] | None = None) -> int:
    """The command line; its exit code (2: a config, data or checkpoint to fix, said in one
    line; 3: diverged; 5: a checkpoint save failed; `jaxmllm.config.command`)."""
    return run(_command, argv)


def _command(argv: list[str] | None) -> None:
    """Trains per the command line's config; a SIGTERM during start-up says what it interrupted.
    Errors are `cli`'s to report (`jaxmllm.config.command`)."""
    guards.outlive_closed_pipes()  # (a `| tee` that Ctrl-C ended never costs the checkpoint)
    configure_logging(logging.WARNING, ours=logging.INFO)  # (with their time; not orbax chatter)
    args = parse_args(argv)
    with startup_signals():  # (SIGTERM before the loop: says what it interrupted, exit 143)
        main(load_config(args.config, args.set))


if __name__ == "__main__":
    sys.exit(cli())
