"""Where a command writes: its `--out` checked before anything is read or written.

A command never writes through a symbolic link, under a path one of whose folders is a file,
into a checkpoint it reads, or over a file it did not write: each is one line naming the flag,
the path and what to give instead, never a traceback and never a user's file replaced.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from jaxmllm.config.checks import ConfigError


def _placed(flag: str, path: str | Path, what: str) -> Path:
    """`path` as a Path, refused when it is a symbolic link or one of its folders is a file."""
    path = Path(path)
    if path.is_symlink():
        raise ConfigError(
            f"{flag} {path} is a symbolic link (to {os.readlink(path)}): name the {what} itself "
            "(a command never writes through a link)"
        )
    for folder in path.parents:
        if folder.exists() or folder.is_symlink():
            if not folder.is_dir():
                raise ConfigError(
                    f"{flag} {path}: {folder} is a file, not a directory: name a path under "
                    "a directory"
                )
            break
    return path


def _inside(flag: str, path: Path, reads: Iterable[str | Path]) -> None:
    """Refuses a path inside one of the directories the command reads."""
    where = path.resolve()
    for read in reads:
        if not read:
            continue
        read = Path(read).resolve()
        if read.is_dir() and where.is_relative_to(read):
            raise ConfigError(
                f"{flag} {path} is inside {read}, which this command reads: write it "
                "elsewhere (a checkpoint or run it reads is never written into)"
            )


def new_file(
    flag: str,
    path: str | Path,
    reads: Iterable[str | Path] = (),
    ours: Callable[[Path], bool] = lambda p: False,
) -> Path:
    """`path`, a file the command may write: new, or an existing file `ours` says the command
    itself wrote before (a rerun rewrites it); not a link, a folder, a path under a file or
    inside one of the directories in `reads`.

    Raises:
      ConfigError: naming `flag`, the path and what to give instead.
    """
    path = _placed(flag, path, "file")
    if path.is_dir():
        raise ConfigError(
            f"{flag} {path} is a directory: name the file to write (e.g. {path / 'config.yaml'})"
        )
    _inside(flag, path, reads)
    if path.exists() and not ours(path):
        raise ConfigError(
            f"{flag} {path} exists and this command did not write it: name a new file "
            "(nothing is written over a file of yours)"
        )
    return path


def new_folder(flag: str, path: str | Path) -> Path:
    """`path`, a folder the command may fill: new or empty; not a link, a file or a path under
    a file.

    Raises:
      ConfigError: naming `flag`, the path and what to give instead.
    """
    path = _placed(flag, path, "directory")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file: name a directory to write (new or empty)")
    if path.is_dir() and any(path.iterdir()):
        raise ConfigError(
            f"{flag} {path} is not empty: name a new directory (nothing is written into an "
            "existing one)"
        )
    return path


def write_text(path: Path, text: str) -> None:
    """Writes `text` at `path` whole or not at all (a file beside it, then renamed over)."""
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
