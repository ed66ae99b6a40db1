"""Preemption: SIGTERM finishes the step, checkpoints, exits 0; the same command resumes."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from jaxmllm.loop.metrics import read_metrics

from runs import child_env, logged_step, train_cmd

ROOT = Path(__file__).resolve().parents[1]


def tiny_cmd(out, steps):
    return train_cmd(
        out,
        f"train.steps={steps}",
        "train.log_every=1",
        "train.checkpoint_every=1000",
        "train.progress_bar=false",
        "data.synthetic.num_samples=256",
    )


def checkpoint_steps(out):
    return sorted(int(p.name) for p in (Path(out) / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow  # two child runs, a minute or more; CI runs it with the other slow tests
def test_sigterm_checkpoints_exits_0_and_the_rerun_resumes(tmp_path):
    env = child_env()
    log_path = tmp_path / "run.log"  # a file, not a pipe nobody reads while polling: never fills
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            tiny_cmd(tmp_path, 500), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    # A hang guard, not a speed limit: a loaded box may take minutes to compile and reach step 3.
    deadline = time.monotonic() + 900
    while logged_step(tmp_path) < 3:  # tolerates a line being written while it is read
        assert proc.poll() is None, log_path.read_text()[-2000:]
        assert time.monotonic() < deadline, "training never reached step 3"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=900)
    out = log_path.read_text()
    assert proc.returncode == 0, out[-2000:]
    last = read_metrics(tmp_path)[-1]["step"]
    assert 3 <= last < 500
    assert checkpoint_steps(tmp_path)[-1] == last  # the step it stopped at was saved
    assert f"Rerun the same command to resume at step {last + 1}" in out

    again = subprocess.run(
        tiny_cmd(tmp_path, last + 1),
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=900,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from checkpoint at step {last}" in again.stdout
    assert read_metrics(tmp_path)[-1]["step"] == last + 1


@pytest.mark.slow  # one child run, about a minute
def test_ctrl_c_with_data_workers_prints_one_line_and_no_traceback(tmp_path):
    """Ctrl-C reaches the terminal's whole process group, data workers included: they stop
    without a word (no `Process SpawnProcess-1: Traceback ... KeyboardInterrupt`), the trainer
    checkpoints and says where, and exits 0."""
    log_path = tmp_path / "run.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*tiny_cmd(tmp_path, 500), "data.workers=2"],
            cwd=ROOT,
            env=child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # (its own process group: the terminal's, as for a user)
        )
    deadline = time.monotonic() + 900
    while logged_step(tmp_path) < 3:
        assert proc.poll() is None, log_path.read_text()[-2000:]
        assert time.monotonic() < deadline, "training never reached step 3"
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: every process of the group
    proc.wait(timeout=900)
    out = log_path.read_text()
    assert proc.returncode == 0, out[-3000:]
    assert "stopped by SIGINT after step" in out, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
