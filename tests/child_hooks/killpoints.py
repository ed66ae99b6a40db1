"""SIGKILL a training process at a known point, for the crash tests (not part of the product).

`JAXMLLM_TEST_KILL` holds a JSON spec; `install_from_env` patches the process to kill itself
there, printing `killpoints: SIGKILL <where>` first so a test can tell the kill from a crash:

  {"at": "step", "step": 3, "committed": 2}  once step 3's ledger line is written and
                                              checkpoint 2 is committed (needs train.ledger)
  {"at": "before_write", "step": 6}   as the save of step 6 starts: nothing of it on disk yet
  {"at": "before_commit", "step": 6}  every file of step 6 written in its temporary directory,
                                      which is not renamed into place
  {"at": "after_commit", "step": 6}   right after step 6 is renamed into place, before older
                                      checkpoints are garbage-collected
  "process": 1                        in that process of a multi-process job (default: a
                                      single-process run, i.e. no JAXMLLM_PROCESS_ID)

The save points patch orbax's atomic-rename path (orbax-checkpoint 0.12): `create` makes a
checkpoint's temporary directory once the previous save has finished, `finalize` renames it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

POINTS = ("step", "before_write", "before_commit", "after_commit")


def install_from_env() -> None:
    spec = json.loads(os.environ["JAXMLLM_TEST_KILL"])
    if spec["at"] not in POINTS:
        raise ValueError(f"JAXMLLM_TEST_KILL: unknown point {spec['at']!r}; one of {POINTS}")
    process = os.environ.get("JAXMLLM_PROCESS_ID")
    if spec.get("process") != (None if process is None else int(process)):
        return  # another process of the job, or the launcher
    if spec["at"] == "step":
        _patch_ledger(spec["step"], spec["committed"])
    else:
        _patch_orbax(spec["at"], spec["step"])


def die(where: str) -> None:
    print(f"killpoints: SIGKILL {where}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _patch_ledger(step: int, committed: int) -> None:
    from jaxmllm.loop.ledger import Ledger

    write = Ledger.write

    def write_then_die(self, done, parts):
        write(self, done, parts)
        if done == step:
            _wait_for(self.dir.parent / "checkpoints" / str(committed))
            die(f"after step {step}, checkpoint {committed} committed")

    Ledger.write = write_then_die


def _wait_for(path: Path, timeout: float = 900.0) -> None:
    """Waits for a checkpoint to be committed: a condition that, once true, stays true."""
    deadline = time.monotonic() + timeout
    while not path.is_dir():
        if time.monotonic() > deadline:
            print(f"killpoints: {path} never appeared", file=sys.stderr, flush=True)
            os._exit(99)
        time.sleep(0.05)


def _patch_orbax(at: str, step: int) -> None:
    from orbax.checkpoint._src.path import atomicity

    cls = atomicity.AtomicRenameTemporaryPath
    create, finalize = cls.create, cls.finalize
    ours = lambda path: path.get_final().name == str(step)  # the step, not one of its items

    async def create_or_die(self):
        if at == "before_write" and ours(self):
            die(f"before writing checkpoint {step}")
        return await create(self)

    async def finalize_and_die(self):
        if at == "before_commit" and ours(self):
            die(f"before committing checkpoint {step} ({self.get().name} written)")
        await finalize(self)
        if at == "after_commit" and ours(self):
            die(f"after committing checkpoint {step}")

    cls.create, cls.finalize = create_or_die, finalize_and_die
