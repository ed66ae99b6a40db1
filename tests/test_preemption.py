"""Preemption: SIGTERM finishes the step, checkpoints, exits 0; the same command resumes; Ctrl-C
with data workers says one line, no traceback."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from jaxmllm.loop.metrics import read_metrics

from runs import TINY_TEXT, child_env, logged_step, train_cmd

ROOT = Path(__file__).resolve().parents[1]


def tiny_cmd(out, steps):
    """The text-only tiny run (runs.TINY_TEXT: what a signal does does not depend on the model)."""
    return train_cmd(
        out,
        *TINY_TEXT,
        f"train.steps={steps}",
        "train.log_every=1",
        "train.checkpoint_every=1000",
        "train.progress_bar=false",
    )


def checkpoint_steps(out):
    return sorted(int(p.name) for p in (Path(out) / "checkpoints").iterdir() if p.name.isdigit())


def wait_for_step(proc, out, log_path, step):
    """Polls the child's metrics until `step` is logged (a hang guard, not a speed limit: a
    loaded box may take minutes to compile and reach it)."""
    deadline = time.monotonic() + 900
    while logged_step(out) < step:  # tolerates a line being written while it is read
        assert proc.poll() is None, log_path.read_text()[-2000:]
        assert time.monotonic() < deadline, f"training never reached step {step}"
        time.sleep(0.5)


@pytest.mark.slow  # ~30 s: two text-only child runs, the second resumes the first's checkpoint
def test_sigterm_checkpoints_exits_0_and_the_rerun_resumes_then_ctrl_c_with_workers(tmp_path):
    """SIGTERM (a scheduler's preemption) finishes the step, checkpoints and exits 0, naming
    the step to resume at; the same command resumes there.

    The rerun has data workers and is stopped by Ctrl-C, which reaches the terminal's whole
    process group, data workers included: they stop without a word (no `Process
    SpawnProcess-1: Traceback ... KeyboardInterrupt`), the trainer checkpoints and says where,
    and exits 0."""
    log_path = tmp_path / "run.log"  # a file, not a pipe nobody reads while polling: never fills
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            tiny_cmd(tmp_path, 500), cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT
        )
    wait_for_step(proc, tmp_path, log_path, 3)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=900)
    out = log_path.read_text()
    assert proc.returncode == 0, out[-2000:]
    assert "stopped by SIGTERM after step" in out, out[-2000:]
    last = read_metrics(tmp_path)[-1]["step"]
    assert 3 <= last < 500
    assert checkpoint_steps(tmp_path)[-1] == last  # the step it stopped at was saved
    assert f"Rerun the same command to resume at step {last + 1}" in out

    log_path = tmp_path / "rerun.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*tiny_cmd(tmp_path, 500), "data.workers=2"],
            cwd=ROOT,
            env=child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # (its own process group: the terminal's, as for a user)
        )
    wait_for_step(proc, tmp_path, log_path, last + 2)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: every process of the group
    proc.wait(timeout=900)
    out = log_path.read_text()
    assert proc.returncode == 0, out[-3000:]
    assert f"resumed from checkpoint at step {last} in" in out, out[-3000:]
    assert "stopped by SIGINT after step" in out, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    again = read_metrics(tmp_path)[-1]["step"]
    assert last + 2 <= again < 500 and checkpoint_steps(tmp_path)[-1] == again
