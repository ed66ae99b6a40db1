"""A run's output folder and start-up under issue 50's probe: two runs on one output_dir (a
lock), a refused resume that rewrote config.json first, a signal at start-up that said
nothing, a step that hangs (the step watchdog)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from jaxmllm.config import ConfigError, load_config
from jaxmllm.loop.lock import LOCK, hold_output_dir

from runs import NO_EVAL, TINY_TEXT, child_env


def tiny(out, *sets, steps: int = 2):
    """The text-only tiny run (runs.TINY_TEXT: a resume's checks do not depend on the model)."""
    cfg = load_config("configs/tiny.yaml", [*TINY_TEXT, *NO_EVAL, *sets])
    return replace(
        cfg,
        train=replace(
            cfg.train, steps=steps, output_dir=str(out), checkpoint_every=2, progress_bar=False
        ),
    )


def test_an_output_dir_held_by_a_run_refuses_a_second(tmp_path):
    out = tmp_path / "run"
    with hold_output_dir(out):
        with pytest.raises(ConfigError, match=f"train.output_dir={out} is in use by another"):
            with hold_output_dir(out):
                pass
    with hold_output_dir(out):  # (released when the run ends)
        pass
    with hold_output_dir(out, take=False), hold_output_dir(out):  # (process > 0: nothing)
        pass


def test_a_second_trainer_on_a_held_output_dir_stops_naming_the_first(tmp_path, capsys):
    """Two runs started on one output_dir: the second exited 5 with orbax tracebacks and
    removed the first run's unfinished save. It stops at start-up now, exit 2, naming the
    first (here a process holding the folder as a run does), and writes nothing there."""
    from jaxmllm.train import cli

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from jaxmllm.loop.lock import "
            "hold_output_dir\nwith hold_output_dir(Path(sys.argv[1])):\n print('held', "
            "flush=True); time.sleep(120)",
            str(out),
        ],
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        argv = ["--config", "configs/tiny.yaml", "--set", *NO_EVAL, f"train.output_dir={out}"]
        assert cli([*argv, "data.synthetic.num_samples=256", "train.steps=2"]) == 2
        err = capsys.readouterr().err
        assert f"train.output_dir={out} is in use by another run (process {holder.pid}" in err
        assert "Traceback" not in err and sorted(p.name for p in out.iterdir()) == [LOCK]
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow  # ~20 s: three short text-only trainings
def test_a_refused_resume_leaves_config_json_as_it_was(tmp_path, capsys):
    """Checkpoints copied to a new output_dir without config.json and resumed with another
    model: the refused run first wrote its config.json, after which the right config was
    refused with a false claim about the checkpoint's width. Nothing is written now before
    the resume checks pass: the right config then resumes.

    Rerun once finished, the run said it resumed at its last step, drew a full bar and ended
    with no summary: it says it is done now, with the summary and the key that trains on."""
    from jaxmllm.train import main

    out = tmp_path / "run"
    main(tiny(out, steps=2))
    (out / "config.json").unlink()  # (the checkpoints copied without it)
    wide = tiny(out, "model.llm.mlp_dim=96", steps=4)
    with pytest.raises(ConfigError):
        main(wide)
    assert not (out / "config.json").exists()
    last = main(tiny(out, steps=4))
    assert "resumed from checkpoint at step 2" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 4
    again = main(tiny(out, steps=4))  # (finished: nothing trains)
    printed = capsys.readouterr().out
    assert "resumed from checkpoint" not in printed and again["loss"] == last["loss"]
    assert (
        "\nalready done: the checkpoint is at step 4 of train.steps=4, nothing to train" in printed
    )
    assert f"final loss {last['loss']:.4f} (step 4)" in printed
    assert f"checkpoint: {out / 'checkpoints' / '4'}" in printed
    assert "generate from it: python -m jaxmllm.generate --run" in printed
    assert "to train on: raise train.steps past 4 (--set train.steps=8;" in printed


def test_the_nonfinite_limit_holds_at_the_last_step_and_across_a_resume():
    """The guard read each step's flag a step late, so the last step's was never read, and its
    count restarted at a resume: a run stopped by the limit and resumed said `done` with a
    NaN loss. A step to be saved is settled first, and a resume goes on with the count."""
    import jax.numpy as jnp

    from jaxmllm.loop.guards import NonFiniteGuard

    bad, good = jnp.float32(1.0), jnp.float32(0.0)
    guard = NonFiniteGuard(2)
    assert not guard.check(1, good) and not guard.check(2, bad) and not guard.check(3, bad)
    assert guard.run == 1 and guard.settle() and guard.stopped_at == 3  # (step 3: the last)
    assert guard.run == 2 and not guard.settle()  # (nothing left to read)
    resumed = NonFiniteGuard(2)
    resumed.resumed(guard.run)
    assert resumed.limit_reached() and not resumed.check(4, bad)  # (step 4's flag: unread)
    assert resumed.settle() and resumed.stopped_at == 4 and resumed.run == 3
    again = NonFiniteGuard(2)
    again.resumed(2)
    assert not again.check(4, good) and not again.settle() and again.run == 0  # (recovered)


# ----------------------------------------------------------------------------- the watchdog


def test_the_auto_bound_follows_the_measured_steps():
    from jaxmllm.loop import watchdog as w

    now = [0.0]
    dog = w.StepWatchdog(0.0, 0, 100, lambda: False, "resume", clock=lambda: now[0])
    try:
        assert dog.bound() == w.FIRST_STEPS_S  # (compiling)
        for step in range(1, 12):
            now[0] += 40.0 if step == 1 else 2.0  # (the first compiles)
            dog.beat(step)
        assert dog.bound() == w.AUTO_FLOOR_S and dog.hung(now[0] + 299) is None
        for step in range(12, 40):
            now[0] += 60.0
            dog.beat(step)
        assert dog.bound() == 600.0  # (10x the median of the steps since the warm-up)
        message = dog.hung(now[0] + 601)
        assert "step 40 has not finished in 601 s (train.max_step_seconds: auto: 600 s" in message
        assert "the main thread is in" in message and message.endswith("resume")
        fixed = w.StepWatchdog(5.0, 0, 100, lambda: False, "r", peer_bound_s=3.0)
        assert fixed.bound() == w.FIRST_STEPS_S
        for step in range(1, 7):
            fixed.beat(step)
        assert fixed.bound() == 3.0  # (a multi-process job: distributed.step_timeout_s)
        fixed.close()
    finally:
        dog.close()


def hung_run(tmp_path, hang: int | str, *sets: str) -> subprocess.Popen:
    """A trainer whose step `hang` (a number) blocks on the device, or whose start-up blocks
    (`hang="start-up"`: tests/child_hooks/hangpoints); the text-only tiny run (what the
    watchdog does does not depend on the model)."""
    from runs import train_cmd

    cmd = train_cmd(
        tmp_path / "run",
        *TINY_TEXT,
        "train.steps=40",
        "train.progress_bar=false",
        "train.checkpoint_every=100",  # (no save near the hang: it waits in the step's check)
        *sets,
    )
    env = child_env(hang={"at": hang} if isinstance(hang, str) else {"step": hang})
    return subprocess.Popen(
        cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )


def wait_for(proc: subprocess.Popen, marker: str, seconds: float = 600) -> str:
    """proc's stderr up to and including the line holding `marker`; what follows it is left to
    be read. (Read line by line in a thread: a select on the pipe, then readline, missed the
    lines a read had already buffered, and a child that printed the marker with the line before
    it and then blocked was waited on for ever.)"""
    import queue
    import threading

    lines: queue.Queue = queue.Queue()

    def read() -> None:
        while line := proc.stderr.readline():
            lines.put(line)
            if marker in line:
                return
        lines.put("")  # (the end of its output)

    threading.Thread(target=read, daemon=True).start()
    seen, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if not line:
            break
        seen.append(line)
        if marker in line:
            return "".join(seen)
    proc.kill()
    raise AssertionError(f"no {marker!r} in {seconds} s: {''.join(seen)[-2000:]}")


@pytest.mark.slow  # ~15-60 s: a text-only trainer compiles, trains 8 steps, hangs
def test_a_step_that_hangs_ends_the_run_naming_step_and_phase(tmp_path):
    """A step whose device work never completes (a host callback that blocks, as a collective
    that never returns): the trainer waited forever. It ends, exit 4, naming the step and
    the line the main thread waits in, within its bound."""
    proc = hung_run(tmp_path, 8, "train.max_step_seconds=5")
    try:
        wait_for(proc, "hangpoints: step 8 blocks")
        start = time.monotonic()
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert proc.returncode == 4, err
    assert time.monotonic() - start < 60
    assert "error: step 9 has not finished in " in err and "train.max_step_seconds: 5 s" in err
    assert 'the main thread is in `if guard.check(done, metrics["nonfinite"])' in err, err
    assert "(jaxmllm/train.py:" in err, err


@pytest.mark.slow  # ~15-60 s: as above, then a SIGTERM
def test_sigterm_during_a_hung_step_ends_the_run_saying_so(tmp_path):
    """The loop's SIGTERM handler runs between Python bytecodes: a main thread blocked on a
    hung step never ran it, and a scheduler's preemption signal changed nothing. The
    watchdog, woken by the signal itself, ends the process (exit 143) naming the step."""
    import signal

    proc = hung_run(tmp_path, 8, "train.max_step_seconds=600")
    try:
        wait_for(proc, "hangpoints: step 8 blocks")
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert time.monotonic() - start < 60
    assert "error: SIGTERM arrived during step 9, which has not finished in " in err, err
    assert "jaxmllm/train.py" in err and "rerun the same command to resume" in err


@pytest.mark.parametrize("catches", [Exception, BaseException])
def test_sigterm_at_start_up_is_not_swallowed_by_code_that_catches_errors(catches, capsys):
    """In CI the signal landed while JAX read a persistent compilation cache entry: JAX
    caught the start-up error as an Exception, warned, compiled on, and the run trained and
    exited 0. It is a BaseException now, and a signal swallowed even as that still ends the
    start-up when the block ends: exit 143, the message printed."""
    import os
    import signal

    from jaxmllm.config.command import run
    from jaxmllm.loop.watchdog import startup_signals

    def main(argv):
        with startup_signals():
            try:  # (library code in the start-up's way)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # (the handler raises here)
            except catches:
                pass
        return 0

    assert run(main, []) == 128 + signal.SIGTERM
    assert "error: SIGTERM at start-up, in `" in capsys.readouterr().err


@pytest.mark.slow  # ~20-60 s: a trainer's start-up
def test_sigterm_at_start_up_says_what_it_interrupted(tmp_path):
    """SIGTERM while the trainer builds its step (start-up: minutes of compiling on a large
    model) exited 143 with nothing printed; it now says where it was and that nothing was
    written. (The signal is sent once start-up blocks, not a second after a log line: a
    quicker start had reached step 1 by then, and the run checkpointed and exited 0.)"""
    import signal

    proc = hung_run(tmp_path, "start-up")
    try:
        wait_for(proc, "hangpoints: start-up blocks")
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "error: SIGTERM at start-up, in `" in err and "jaxmllm/train.py" in err, err
    assert "wrote no checkpoint" in err
