"""Crash safety: SIGKILL at random points, including during an async checkpoint save.

A run killed and restarted again and again must end where an uninterrupted run with the same
seed ends: the same loss at every step, bit-identical final parameters and optimizer state, and
a sample ledger showing every sample trained once per epoch, no more, no less.
"""

import json
import os
import random
import signal
import subprocess
import time
from collections import Counter

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from runs import child_env, train_cmd

from jaxmllm import ledger
from jaxmllm.metrics import read_metrics

STEPS = 14
SAMPLES = 256  # about 4 steps an epoch: the run crosses 3 epoch boundaries
OVERRIDES = [
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.checkpoint_every=2",
    "train.keep_checkpoints=2",
    "train.ledger=true",
    "train.progress_bar=false",
    "train.async_checkpointing=true",
    f"data.synthetic.num_samples={SAMPLES}",
]


def _start(out, log):
    return subprocess.Popen(
        train_cmd(out, *OVERRIDES), env=child_env(), stdout=log, stderr=subprocess.STDOUT
    )


def _latest_step(out) -> int:
    """The step of the last metrics line (a restarted run logs again from its resume point)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [x for x in path.read_text().splitlines() if x.strip()]
    try:
        return json.loads(lines[-1])["step"] if lines else 0
    except json.JSONDecodeError:  # a line being written
        return 0


def _saving(out) -> bool:
    ckpts = out / "checkpoints"
    try:
        return any("orbax-checkpoint-tmp" in e.name for e in os.scandir(ckpts))
    except FileNotFoundError:
        return False


def _kill(proc, out, after_step: int, during_save: bool, delay: float, timeout=600) -> bool:
    """SIGKILLs the run once it logged `after_step`: `delay` s later, or while it is writing
    a checkpoint (polled every 2 ms). False if the run ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if _latest_step(out) >= after_step and (not during_save or _saving(out)):
            if not during_save:  # somewhere in a step, loading or between steps; not a save
                time.sleep(delay)
                while _saving(out) and proc.poll() is None:
                    time.sleep(0.002)
            if proc.poll() is not None:
                return False
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.002 if during_save else 0.02)
    return False


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out)}  # a redone step: its last value


def _final_state(out):
    tree = ocp.StandardCheckpointer().restore(out / "checkpoints" / str(STEPS) / "state")
    return {
        jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)
    }


@pytest.mark.slow
def test_sigkill_at_random_points_resumes_exactly(tmp_path):
    ref = tmp_path / "ref"
    with open(tmp_path / "ref.log", "wb") as log:
        assert _start(ref, log).wait(timeout=900) == 0, (tmp_path / "ref.log").read_text()

    out = tmp_path / "killed"
    rng = random.Random(7)
    # Kill points move forward so the run also makes progress; every other one lands while an
    # async checkpoint is being written (the steps after a save keep training meanwhile).
    schedule = [(3, True), (5, False), (7, True), (9, False), (11, True)]
    kills, caught_saving = [], 0
    for attempt in range(len(schedule) + 2):
        with open(tmp_path / f"run{attempt}.log", "wb") as log:
            proc = _start(out, log)
            if attempt < len(schedule):
                after, during_save = schedule[attempt]
                if _kill(proc, out, after, during_save, rng.uniform(0, 0.6)):
                    kills.append((attempt, _latest_step(out), during_save))
                    caught_saving += during_save
                    continue
            if proc.wait(timeout=900) == 0:
                break
    else:
        pytest.fail(f"the run never finished after kills {kills}")
    logs = "".join((tmp_path / f"run{i}.log").read_text() for i in range(attempt + 1))
    assert len(kills) >= 4, kills
    assert caught_saving >= 2, kills
    assert logs.count("interrupted before it completed") >= 2  # torn saves seen and discarded
    assert logs.count("resumed from checkpoint at step") >= 3

    # Same losses at every step, same final parameters and optimizer state, bit for bit.
    got, want = _losses(out), _losses(ref)
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_array_equal([got[s] for s in sorted(got)], [want[s] for s in sorted(want)])
    a, b = _final_state(out), _final_state(ref)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)

    # The ledger: redone steps trained the same samples; every sample once per epoch.
    assert ledger.check_replays(out) == []
    assert ledger.read_ledger(out) == ledger.read_ledger(ref)
    audit = ledger.audit(out, range(1, STEPS + 1))
    assert audit["missing_steps"] == []
    counts = Counter(audit["text"])
    trained = sum(counts.values())
    epochs = trained // SAMPLES
    assert len(counts) == SAMPLES  # nothing lost: every sample reached
    assert set(counts.values()) <= {epochs, epochs + 1}  # and none twice within an epoch
    assert sum(v == epochs + 1 for v in counts.values()) == trained - epochs * SAMPLES
