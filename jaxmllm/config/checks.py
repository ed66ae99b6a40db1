"""The bottom of the config package: the error every bad config raises, and the checks."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key and source."""


def positive(section, *keys: str) -> None:
    """Each key of `section` must be >= 1."""
    for key in keys:
        check(getattr(section, key) >= 1, "must be >= 1", key)


def check(ok: bool, message: str, key: str) -> None:
    """Raises ConfigError `key: message` unless `ok`; loading adds the file and section."""
    if not ok:
        raise ConfigError(f"{key}: {message}")
