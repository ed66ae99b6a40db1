"""Text from the data, made safe for a terminal or a log: `printable(text)`.

Record ids, file names, WebDataset member names and the details of a reject come from the
data, which anyone may have written. Printed raw, a newline forges a line of a summary and an
escape sequence acts on the user's terminal (conceal text, set the window's title, clear the
screen); bidirectional overrides make a name read as another. Every such string passes through
`printable` before it reaches a message: control characters (C0, DEL, C1), line and paragraph
separators and the bidirectional controls become Python-style escapes (`\\n`, `\\x1b`,
`\\u202e`), so the text stays on its line, readable and searchable; everything else (accents,
CJK, emoji) is kept. `keep_lines=True` keeps newlines (a message of several lines of our own,
whose parts were already made printable) and escapes the rest.
"""

from __future__ import annotations

import logging

_CONTROLS = [*range(0x00, 0x20), *range(0x7F, 0xA0)]  # C0, DEL, C1 (0x9b is CSI on its own)
_FORMAT = [0x061C, 0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(code: int) -> str:
    char = chr(code)
    if char in _NAMED:
        return _NAMED[char]
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


ESCAPES = {code: _escape(code) for code in (*_CONTROLS, *_FORMAT)}
KEEP_LINES = {**ESCAPES, ord("\n"): "\n"}


def printable(text: object, keep_lines: bool = False) -> str:
    """`str(text)` with every character that acts on a terminal (or breaks a line) escaped."""
    return str(text).translate(KEEP_LINES if keep_lines else ESCAPES)


class PrintableLogs(logging.Filter):
    """A log handler's filter that escapes terminal controls in every message (newlines kept:
    a message of several lines is ours); the last guard behind `printable` at the source."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        safe = printable(message, keep_lines=True)
        if safe != message:
            record.msg, record.args = safe, ()
        return True


def guard_logs() -> None:
    """Adds `PrintableLogs` to the root logger's handlers (after `logging.basicConfig`)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, PrintableLogs) for f in handler.filters):
            handler.addFilter(PrintableLogs())
