"""Nothing leaks: no worker process, shared-memory file or temporary folder outlives the run,
the test session or a SIGKILL; workers stop quietly on Ctrl-C; no JAX program runs unseen in a
file marked `host`."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxmllm import train
from jaxmllm.config import load_config
from jaxmllm.data import shared

from runs import ROOT, TINY_TEXT, child_env, logged_step, train_cmd


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines())
        except (OSError, ValueError):
            continue
        if fields.get("PPid", "").strip() == str(pid) and not fields["State"].startswith("Z"):
            out.append(int(status.parent.name))
    return out


def _workers(pid: int) -> list[int]:
    """The children of `pid` that are spawned multiprocessing workers (not its tracker)."""
    out = []
    for child in _children(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
        except OSError:
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:\t", 1)[1]
    except (OSError, IndexError):
        return False
    return not state.startswith(("Z", "X"))


def _wait(until, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if until():
            return True
        time.sleep(0.1)
    return until()


@pytest.mark.slow  # (a pytest session of its own, ~12 s: CI's slow phase runs it)
def test_tests_leave_nothing_in_the_temporary_folder(tmp_path):
    """conftest's compile cache is deleted at the session's end, and so is torch's compile
    cache (importing peft makes torch's inductor create `torchinductor_<user>` there):
    test_lora_hf is collected, so peft is imported. The session runs on an xdist worker, which
    shares its controller's cache folder: the controller, which made it, deletes it (pytest's
    own base folder, which xdist makes for its workers, goes to --basetemp). (One worker, not
    CI's two: a second only imports torch and peft again, and deletes nothing either.)"""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    env.pop("XLA_FLAGS", None)  # (conftest sets its own)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # (this session's, which this conftest deletes)
    env.pop("JAXMLLM_TEST_CACHE", None)  # (this session's: the child makes and deletes its own)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "1",
            f"--basetemp={tmp_path / 'base'}",
            "tests/test_layout.py",
            "tests/test_lora_hf.py",
            "-k",
            "test_the_cycle_finder_finds_a_cycle",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in temp.iterdir()) == []


CTRL_C = """
import faulthandler, signal, sys
faulthandler.register(signal.SIGUSR1, all_threads=True)  # (the test's dump of a hang)
# A terminal's foreground job takes Ctrl-C with Python's handler. A child inherits an ignored
# SIGINT, and Python then leaves it ignored: a shell without job control starts its background
# jobs so (bash's `cmd &`), and a test suite run under one would have this owner ignore the
# test's Ctrl-C and feed forever.
signal.signal(signal.SIGINT, signal.default_int_handler)
from jaxmllm.config import load_config
from jaxmllm.feed.iterator import make_pipeline
from jaxmllm.resolve.run import resolve_run

def main():
    cfg = load_config("configs/tiny.yaml", ["data.workers=2", "data.synthetic.num_samples=64",
        "data.eval.source=none", "train.output_dir={out}"])
    feed = make_pipeline(resolve_run(cfg, 8), prefetch=2)
    try:
        while True:
            next(feed)
    except KeyboardInterrupt:
        print("interrupted")
    finally:
        feed.close()


if __name__ == "__main__":
    main()
"""


def _signal_masks(pid: int) -> str:
    """Each thread of process `pid`: its name and its signal masks from /proc (pending to it,
    pending to the process, blocked, ignored, caught), to tell where a signal went."""
    keys = ("Name", "Pid", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            status = (task / "status").read_text().splitlines()
        except OSError:  # (a thread that ended meanwhile)
            continue
        fields = dict(line.split(":", 1) for line in status if ":" in line)
        lines.append("  ".join(f"{k}={fields.get(k, '').strip()}" for k in keys))
    return "\n".join(lines)


def test_ctrl_c_stops_the_workers_quietly(tmp_path):
    """Ctrl-C reaches the terminal's whole process group, workers still importing included:
    none prints a KeyboardInterrupt traceback; the owner closes them. (~7 s: a child Python and
    its two spawned workers import jaxmllm.)"""
    script = tmp_path / "feed.py"
    script.write_text(CTRL_C.format(out=tmp_path / "out"))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=child_env(),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert _wait(lambda: len(_workers(proc.pid)) >= 2, 120), "no workers started"
        workers = _workers(proc.pid)
        others = set(_children(proc.pid)) - set(workers)  # multiprocessing's resource tracker
        os.killpg(proc.pid, signal.SIGINT)  # (the workers are still importing jaxmllm)
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # a hang: every thread's stack, to read what it waits on
            masks = _signal_masks(proc.pid)  # (which thread blocks, holds or ignores the SIGINT)
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2)  # (faulthandler writes from its C handler once the signal lands)
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(
                f"the owner did not exit 120 s after SIGINT; its threads' signal masks:\n{masks}"
                f"\nits threads:\n{err[-6000:]}"
            )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "interrupted" in out, err
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err
    assert not [w for w in workers if _alive(w)]  # (the owner joined them before it exited)
    # The resource tracker ends by itself once its owner's pipe closes, a moment after the
    # owner: asynchronously (seen exiting, its command line already empty, in loaded runs)
    assert _wait(lambda: not any(_alive(w) for w in others), 30), "the resource tracker lives on"


@pytest.mark.slow  # ~15 s: a text-only training's compile
def test_a_training_that_raises_stops_its_workers(tmp_path):
    """Every exit of the trainer closes the feed, an exception's too: its workers stop and its
    shared-memory files go (the loader's lock file among them, whatever its samples hold)."""
    import multiprocessing

    cfg = load_config(
        "configs/tiny.yaml",
        [
            *TINY_TEXT,
            "data.workers=2",
            "data.eval.source=none",
            "train.steps=5",
            "train.progress_bar=false",
            f"train.output_dir={tmp_path}",
        ],
    )
    before = set(shared.SHM.glob("jaxmllm-*"))

    def fail(step, metrics):
        assert len(multiprocessing.active_children()) == 2  # the feed's workers, running
        assert set(shared.SHM.glob("jaxmllm-*.lock")) - before  # and the loader's lock file
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        train.main(cfg, on_step=fail)
    assert not multiprocessing.active_children()
    assert set(shared.SHM.glob("jaxmllm-*")) <= before


@pytest.mark.slow  # ~1 min: a tiny training's compile in a child process
def test_a_sigkilled_trainer_leaves_no_worker_or_shared_memory_after_the_next_start(tmp_path):
    """SIGKILL mid-step: the workers exit by themselves; the next loader's start deletes the
    dead one's shared-memory files (its lock is free) and nothing of a live loader's."""
    out = tmp_path / "run"
    before = set(shared.SHM.glob("jaxmllm-*.lock"))
    cmd = train_cmd(
        out,
        "data.workers=2",
        "train.steps=1000",
        "train.log_every=1",
        "train.progress_bar=false",
        "data.synthetic.num_samples=256",
    )
    log = open(tmp_path / "log.txt", "wb")  # noqa: SIM115  (closed below)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        assert _wait(lambda: logged_step(out) >= 2 or proc.poll() is not None, 600)
        assert proc.poll() is None, (tmp_path / "log.txt").read_text()
        workers = _workers(proc.pid)
        locks = set(shared.SHM.glob("jaxmllm-*.lock")) - before
        assert len(workers) >= 2 and len(locks) == 1, (workers, locks)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert _wait(lambda: not any(_alive(w) for w in workers), 10), "workers outlived the trainer"
    [lock] = locks
    token = lock.name[len("jaxmllm-") : -len(".lock")]
    live = shared.Owner()  # another loader, alive: its files must stay
    try:
        shared.remove_stale()  # what the next start does first
        assert not list(shared.SHM.glob(f"jaxmllm-{token}*"))
        assert (shared.SHM / f"jaxmllm-{live.token}.lock").exists()
    finally:
        live.close()


def test_the_host_marks_check_sees_a_program_traced():
    """conftest.py's check of the `host` mark counts JAX's compile events: a program traced
    here is seen (an event a jax release renamed would let a host file run JAX unseen, and CI's
    Python 3.12 leg would leave out what its jax changes)."""
    import conftest
    import jax

    before = conftest.JAX_EVENTS[0]
    jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(7.0)).block_until_ready()  # (a new program)
    assert conftest.JAX_EVENTS[0] > before
