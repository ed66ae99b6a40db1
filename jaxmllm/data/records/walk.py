"""The files under a folder or matching a glob, links to folders followed once each.

Python's recursive glob (`**`) follows every link to a folder, so a link into one of its own
ancestors (`data/loop -> ..`) is a loop it walks until the path is too long, branching at each
such link: a data folder with two of them did not answer in a minute. A link to a sibling
folder reads its files twice, and their records are then each other's `duplicate_id`.

Here a folder is read once, by the first path that reaches it (its real path decides): a link
that leads back into a folder already read is left out, and the log names it; a file reached
by two paths is one file. Hidden files and folders (a leading dot) are not matched by a
wildcard, as glob's; a folder ending in `.index` (an index beside its data) is never walked.
"""

from __future__ import annotations

import fnmatch
import glob
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from jaxmllm.config import printable

log = logging.getLogger("jaxmllm")


class _Walk:
    """One walk's folders already read (their real paths), shared by a glob's `**`s."""

    def __init__(self):
        self.seen: set[str] = set()
        self.skipped: list[str] = []

    def folders(self, top: Path) -> Iterator[Path]:
        """`top` and every folder below it (links followed, each real folder once)."""
        stack = [top]
        while stack:
            folder = stack.pop()
            real = os.path.realpath(folder)
            if real in self.seen:
                self.skipped.append(str(folder))
                continue
            self.seen.add(real)
            yield folder
            below = [
                Path(e.path)
                for e in _entries(folder)
                if _is_dir(e) and not e.name.startswith(".") and not e.name.endswith(".index")
            ]
            stack.extend(reversed(below))

    def report(self, what: str) -> None:
        if self.skipped:
            shown = ", ".join(printable(s) for s in self.skipped[:3])
            more = f" and {len(self.skipped) - 3} more" if len(self.skipped) > 3 else ""
            log.warning(
                "%s: left out %d folder path(s) that lead back into folders already read (a "
                "link to a parent, or a second link to one folder): %s%s",
                printable(what),
                len(self.skipped),
                shown,
                more,
            )


def files_below(top: Path) -> list[Path]:
    """Every file in `top` and the folders below it (see the module docstring), sorted."""
    walk = _Walk()
    found = [Path(e.path) for folder in walk.folders(top) for e in _entries(folder) if _is_file(e)]
    walk.report(str(top))
    return _once(found)


def glob_files(pattern: str) -> list[Path]:
    """The files matching `pattern` (glob syntax, `**` any depth of folders), sorted."""
    path = Path(pattern)
    current = [Path(path.anchor)] if path.is_absolute() else [Path()]
    parts = path.parts[1:] if path.is_absolute() else path.parts
    walk = _Walk()
    for part in parts:
        if part == "**":
            current = [f for c in current if c.is_dir() for f in walk.folders(c)]
        elif glob.has_magic(part):
            hidden = part.startswith(".")
            current = [
                c / e.name
                for c in current
                for e in _entries(c)
                if (hidden or not e.name.startswith(".")) and fnmatch.fnmatchcase(e.name, part)
            ]
        else:
            current = [c / part for c in current]
    walk.report(pattern)
    return _once([c for c in current if c.is_file()])


def _once(files: list[Path]) -> list[Path]:
    """`files` sorted, a file reached by two paths (a link) kept once: by the first."""
    seen: set[str] = set()
    out = []
    for f in sorted(files):
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            out.append(f)
    return out


def _entries(folder: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError:  # (not a folder, gone, or not readable: nothing in it is matched)
        return []


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # (follows a link)
    except OSError:
        return False


def _is_file(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file()  # (follows a link)
    except OSError:
        return False
