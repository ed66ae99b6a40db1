"""How every `python -m jaxmllm.*` command ends: its own exit code, or one message.

    if __name__ == "__main__":
        sys.exit(run(main))

`run(main)` calls `main(argv)` and turns what a user can fix into one line on stderr and exit
code 2, never a traceback: a `UserError` (a config or `--set` that cannot be used, a data file,
a checkpoint, a record: `ConfigError` is one) and a `sharding.ShardingError` (a mesh the
devices cannot make). An error that carries its own `exit_code` (the trainer's: 3 for a run
that kept diverging, 5 for a checkpoint save that failed) exits with that code, and Ctrl-C
outside the training loop (which checkpoints first) with 130. Anything else is a bug in
jaxmllm and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from jaxmllm.config.checks import UserError
from jaxmllm.config.printable import printable

EXIT_USER = 2  # what the user can fix: the message says what
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it


def run(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """`main(argv)`'s exit code (None: 0), or the code of the error it raised, printed."""
    try:
        code = main(argv)
    except KeyboardInterrupt:  # (the shell shows ^C; a training run said where it stopped)
        return EXIT_INTERRUPTED
    except Exception as e:
        code = EXIT_USER if user_error(e) else getattr(e, "exit_code", None)
        if not isinstance(code, int):
            raise  # a bug: its traceback is what a report needs
        return fail(e, code)
    return 0 if code is None else int(code)


def user_error(e: Exception) -> bool:
    """Whether `e` is bad input the user can fix: a UserError, or a mesh the devices cannot
    make (`sharding.ShardingError`: looked up, not imported, so a command that never built a
    mesh does not load JAX for it)."""
    mesh = sys.modules.get("sharding")
    return isinstance(e, UserError) or (mesh is not None and isinstance(e, mesh.ShardingError))


def fail(error: BaseException, code: int) -> int:
    """Prints `error: <message>` on stderr (terminal controls escaped: it may quote a file's
    or a record's name); returns `code`."""
    print(f"error: {printable(error, keep_lines=True)}", file=sys.stderr, flush=True)
    return code
