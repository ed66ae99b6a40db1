"""Text from the data, made safe for a terminal or a log: `printable(text)`.

Record ids, file names, WebDataset member names and the details of a reject come from the
data, which anyone may have written. Printed raw, a newline forges a line of a summary and an
escape sequence acts on the user's terminal (conceal text, set the window's title, clear the
screen); bidirectional overrides make a name read as another. Every such string passes through
`printable` before it reaches a message: control characters (C0, DEL, C1), line and paragraph
separators, the bidirectional controls and lone surrogates (a file name's bytes that are not
UTF-8) become Python-style escapes (`\\n`, `\\x1b`, `\\u202e`, `\\xff`), so the text stays on
its line, readable and searchable; everything else (accents, CJK, emoji) is kept.
`keep_lines=True` keeps newlines (a message of several lines of our own, whose parts were
already made printable) and escapes the rest.
"""

from __future__ import annotations

import logging

_CONTROLS = [*range(0x00, 0x20), *range(0x7F, 0xA0)]  # C0, DEL, C1 (0x9b is CSI on its own)
_FORMAT = [0x061C, 0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
# Lone surrogates: a file name's bytes that are not UTF-8, as Python decodes them (0xff ->
# U+DCFF). Printed, they are either those raw bytes (0x9b: CSI) or, where stdout is strict
# UTF-8, a UnicodeEncodeError; escaped, the byte reads as itself (`\xff`).
_SURROGATES = range(0xD800, 0xE000)
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(code: int) -> str:
    char = chr(code)
    if char in _NAMED:
        return _NAMED[char]
    if 0xDC80 <= code <= 0xDCFF:  # (a byte that was not UTF-8: surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


ESCAPES = {code: _escape(code) for code in (*_CONTROLS, *_FORMAT, *_SURROGATES)}
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
