"""How every `python -m jaxmllm.*` command takes its config and how it ends: its own exit code,
or one message.

    add_config_args(parser)   # --config FILE --set a.b=1 c.d=2 ... (one parser for all)
    configure_logging(logging.WARNING, ours=logging.INFO)   # lines with their time and level
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

import argparse
import logging
import sys
from collections.abc import Callable

from jaxmllm.config.checks import UserError
from jaxmllm.config.printable import guard_logs, printable

EXIT_USER = 2  # what the user can fix: the message says what
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it
SET_HELP = "override config values, e.g. --set optim.lr=3e-4 train.steps=50"


def add_config_args(
    parser: argparse.ArgumentParser,
    *,
    required: bool = True,
    default: str | None = None,
    config_help: str = "experiment YAML, e.g. configs/tiny.yaml",
    set_help: str = SET_HELP,
) -> None:
    """`--config FILE` and `--set KEY=VALUE ...`, as every command takes them: one `--set`
    takes several pairs, and it may be repeated (`load_config(args.config, args.set)`; an
    error an override causes names the `--set`, not the file)."""
    parser.add_argument("--config", required=required, default=default, help=config_help)
    parser.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help=f"{set_help} (several after one --set, or --set repeated)",
    )


class StderrHandler(logging.StreamHandler):
    """A handler that writes to whatever `sys.stderr` is when a line is logged, not the one it
    was made under. A command run in-process (a test, a notebook) by a caller that swaps
    stderr and closes it afterwards (pytest's capture) otherwise leaves the root logger
    writing to a closed file: every later line fails with "--- Logging error ---" and a
    traceback, printed into whoever's output is current then."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: D102 (the current stderr, read at each line)
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # (StreamHandler sets it; the current one is used)
        pass


def configure_logging(level: int = logging.INFO, ours: int | None = None) -> None:
    """Log lines with their time and level, at `level` and above (jaxmllm's own at `ours`,
    default `level`), on the current stderr (`StderrHandler`), record ids and file names in
    them escaped (`guard_logs`). Forced: importing grain installed a handler on the root
    logger already, beside which `basicConfig` alone does nothing (the lines had no time)."""
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(message)s",
        handlers=[StderrHandler()],
        force=True,
    )
    guard_logs()
    logging.getLogger("jaxmllm").setLevel(level if ours is None else ours)


def run(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """`main(argv)`'s exit code (None: 0), or the code of the error it raised, printed."""
    try:
        code = main(argv)
    except KeyboardInterrupt:  # (the shell shows ^C; a training run said where it stopped)
        return EXIT_INTERRUPTED
    except BaseException as e:  # (a BaseException with a code: a signal's, e.g. at start-up)
        user = isinstance(e, Exception) and user_error(e)
        code = EXIT_USER if user else getattr(e, "exit_code", None)
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
