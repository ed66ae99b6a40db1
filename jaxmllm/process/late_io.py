"""Checkpoint reads and writes that orbax abandoned, finishing after it closed their event loop:
counted and logged once, not printed as a traceback each.

orbax runs a restore (and a save's writes) as a coroutine on an event loop of its own, which
it closes as soon as the coroutine ends (`orbax.checkpoint._src.asyncio_utils.run_sync`). When
one tensorstore read of a damaged checkpoint fails, the coroutine raises at once while the
checkpoint's other reads are still in flight. Each of those, as it completes, calls the closed
loop's `call_soon_threadsafe` from tensorstore's thread, and Python prints the RuntimeError
("Event loop is closed") as an unraisable exception: 73 tracebacks around the three warnings
that named three damaged checkpoints of the tiny config (orbax 0.12.8, tensorstore 0.1.86). A
save that failed on a full disk leaves its other writes the same way.

A read that fails while the loop still runs, after the coroutine has already raised, ends
the other way: its task holds an exception no one will retrieve, and asyncio logs "Task
exception was never retrieved" with a traceback and the read's whole TensorStore spec when the
collector frees it, whenever that is (a loaded machine's CI printed these inside a later
test's output).

Nothing is lost with them: the operation they belonged to has already failed and been
reported (`restore_latest`'s warning, `SaveError`). `install` puts a hook in front of Python's
that counts exactly the first kind (that exception, raised in asyncio's
`call_soon_threadsafe`), and a filter on asyncio's logger that counts exactly the second (a
task of orbax's code, or awaiting a TensorStore future, whose exception was never retrieved:
CI met both); the first of either
is logged once. Every other unraisable exception goes to the hook that was there before, and
every other asyncio record is logged as it was.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

log = logging.getLogger("jaxmllm")

_lock = threading.Lock()
_late = 0


def late_completions() -> int:
    """How many abandoned operations have finished after their loop closed, in this process."""
    return _late


def is_late_completion(unraisable) -> bool:
    """An unraisable "Event loop is closed" raised in asyncio's call_soon_threadsafe."""
    if not isinstance(unraisable.exc_value, RuntimeError):
        return False
    if str(unraisable.exc_value) != "Event loop is closed":
        return False
    tb = unraisable.exc_traceback
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "call_soon_threadsafe" and "asyncio" in code.co_filename:
            return True
        tb = tb.tb_next
    return False


def is_unretrieved_read(record: logging.LogRecord) -> bool:
    """asyncio's "Task exception was never retrieved" for one of orbax's reads or writes: a
    task whose failed frames run orbax.checkpoint's code (its `async_deserialize`, say) or
    hold the TensorStore future it awaited (a future wrapped as a task)."""
    if not str(record.msg).startswith("Task exception was never retrieved"):
        return False
    if not record.exc_info or record.exc_info[2] is None:
        return False
    import orbax.checkpoint
    import tensorstore as ts

    orbax_code = str(Path(orbax.checkpoint.__file__).parent)
    tb = record.exc_info[2]
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.startswith(orbax_code):
            return True
        if any(isinstance(v, ts.Future) for v in frame.f_locals.values()):
            return True
        tb = tb.tb_next
    return False


def _count() -> None:
    global _late
    with _lock:
        _late += 1
        first = _late == 1
    if first:
        log.info(
            "checkpoint reads or writes that orbax abandoned when the operation failed "
            "finished after it raised; counted, not printed (jaxmllm.process.late_io)"
        )


def _unretrieved_filter(record: logging.LogRecord) -> bool:
    if is_unretrieved_read(record):
        _count()
        return False
    return True


def install() -> None:
    """Puts the counting hook in front of sys.unraisablehook and the counting filter on
    asyncio's logger (once per process)."""
    previous = sys.unraisablehook
    if getattr(previous, "_jaxmllm_late_io", False):
        return

    def hook(unraisable):
        if not is_late_completion(unraisable):
            previous(unraisable)
            return
        _count()

    hook._jaxmllm_late_io = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_unretrieved_filter)
