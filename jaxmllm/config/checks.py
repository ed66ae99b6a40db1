"""The bottom of the config package: the errors a user can fix (every bad config raises one),
and the checks."""

from __future__ import annotations

import math


class UserError(ValueError):
    """Bad input a user can fix (a config, an override, a data file, a checkpoint, a record):
    its message names the key, file or record and what to change. Every `python -m jaxmllm.*`
    command prints it as one message and exits 2 (`jaxmllm.config.command.run`), never a
    traceback."""


class ConfigError(UserError):
    """A config file or override that cannot be used; the message names the key and source."""


def positive(section, *keys: str) -> None:
    """Each key of `section` must be >= 1."""
    for key in keys:
        check(getattr(section, key) >= 1, "must be >= 1", key)


def lr_scale_valid(section, key: str = "lr_scale") -> None:
    """A module's learning-rate scale: a finite number above 0 (a module that should not learn
    is frozen, which also drops its optimizer state)."""
    value = getattr(section, key)
    check(math.isfinite(value), f"{value!r} must be a finite number", key)
    check(value > 0, "must be > 0 (freeze the module to stop it learning)", key)


def check(ok: bool, message: str, key: str) -> None:
    """Raises ConfigError `key: message` unless `ok`; loading adds the file and section."""
    if not ok:
        raise ConfigError(f"{key}: {message}")
