"""Crash safety: SIGKILL at known points, at the stages of a checkpoint save (between steps:
test_multihost, test_index).

A run killed and restarted again and again must end where an uninterrupted run with the same
seed ends: the same loss at every step, bit-identical final parameters and optimizer state, and
a sample ledger showing every sample trained once per epoch, no more, no less.

The child kills itself (tests/child_hooks/killpoints.py), so where it dies does not depend on
the machine's speed: each kill leaves a known newest committed checkpoint, and the next run must
resume exactly there, discarding a save that was cut short.
"""

import signal
import subprocess
from collections import Counter

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxmllm.loop import ledger
from jaxmllm.loop.metrics import read_metrics

from runs import child_env, train_cmd

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
# (kill point, the step the next run resumes at, whether it finds a save cut short). One kill
# per state a kill can leave on disk: one more committed than train.keep_checkpoints keeps, a
# save written aside and not renamed (the final, forced save; a save in the middle of the run
# is cut short in the same orbax rename). The third, the newest checkpoint committed and
# nothing of the next (a kill between steps, after step 3 with 2 committed; one as a save
# starts, before it writes, leaves the same), is test_multihost's relaunch's kill (two
# processes, asynchronous saves, the same losses and ledger) and test_index's (one process).
SCHEDULE = [
    ({"at": "after_commit", "step": 10}, 10, False),  # 10 committed, old ones not yet deleted
    ({"at": "before_commit", "step": STEPS}, 12, True),  # the final, forced save (12 saved)
]


def _run(out, log_path, kill=None) -> tuple[int, str]:
    with open(log_path, "wb") as log:
        proc = subprocess.run(
            train_cmd(out, *OVERRIDES),
            env=child_env(kill),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=900,
        )
    return proc.returncode, log_path.read_text()


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out)}  # a redone step: its last value


def _final_state(out):
    tree = ocp.StandardCheckpointer().restore(out / "checkpoints" / str(STEPS) / "state")
    return {
        jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)
    }


@pytest.mark.slow  # ~70 s: a reference run, two killed runs and the last resumed one
def test_sigkill_at_known_points_resumes_exactly(tmp_path):
    ref = tmp_path / "ref"
    code, text = _run(ref, tmp_path / "ref.log")
    assert code == 0, text[-3000:]

    out = tmp_path / "killed"
    resumed_at, torn = None, False
    for i, (kill, resumes_at, leaves_torn) in enumerate([*SCHEDULE, (None, None, None)]):
        code, text = _run(out, tmp_path / f"run{i}.log", kill)
        context = f"run {i} (kill {kill}):\n{text[-3000:]}"
        # Where the run before left off, and what it left behind, is known exactly.
        if resumed_at is None:
            assert "resumed from checkpoint" not in text, context
        else:
            assert f"resumed from checkpoint at step {resumed_at} in" in text, context
        assert ("a checkpoint save that was interrupted" in text) == torn, context
        if kill is None:
            assert code == 0, context
        else:
            assert code == -signal.SIGKILL and "killpoints: SIGKILL" in text, context
        resumed_at, torn = resumes_at, leaves_torn

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
