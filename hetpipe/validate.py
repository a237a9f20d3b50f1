"""Reading one mapping of a config file, with errors that name the key, the value and what was expected."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A bad job file value; the message names the key, the value and what was expected."""


def fail(key: str, value: Any, expected: str) -> ConfigError:
    shown = repr(value)
    if len(shown) > 200:  # a message must stay readable (and fit in gRPC metadata)
        shown = shown[:200] + "..."
    return ConfigError(f"{key}: expected {expected}, got {shown}")


def is_number(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past float's range: no setting of ours takes one
        return False


class Section:
    """One mapping of the job file: typed reads with defaults, and a check for unknown keys."""

    def __init__(self, raw: Any, key: str) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise fail(key or "job file", raw, "a mapping")
        self.raw, self.key = dict(raw), key

    def path(self, name: str) -> str:
        return f"{self.key}.{name}" if self.key else name

    def get(self, name: str, default: Any = None) -> Any:
        return self.raw.get(name, default)

    def section(self, name: str) -> Section:
        return Section(self.raw.get(name), self.path(name))

    def integer(self, name: str, default: int, *, minimum: int = 0, maximum: int | None = None) -> int:
        value = self.raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
                maximum is not None and value > maximum):
            bound = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
            raise fail(self.path(name), value, bound)
        return value

    def number(self, name: str, default: float, *, minimum: float = 0.0, maximum: float | None = None) -> float:
        value = self.raw.get(name, default)
        if not is_number(value) or value < minimum or (maximum is not None and value > maximum):
            bound = f"a finite number >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
            raise fail(self.path(name), value, bound)
        return float(value)

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        value = self.raw.get(name, default)
        if value not in choices:
            raise fail(self.path(name), value, "one of " + ", ".join(choices))
        return str(value)

    def text(self, name: str, default: str | None = None) -> str:
        value = self.raw.get(name, default)
        if not isinstance(value, str) or not value or "\0" in value:  # NUL: no path or name holds one
            raise fail(self.path(name), value, "a non-empty string without NUL bytes")
        return value

    def optional_text(self, name: str) -> str | None:
        value = self.raw.get(name)
        if value is None:
            return None
        if not isinstance(value, str) or not value or "\0" in value:
            raise fail(self.path(name), value, "null or a non-empty string without NUL bytes")
        return value

    def flag(self, name: str, default: bool) -> bool:
        value = self.raw.get(name, default)
        if not isinstance(value, bool):
            raise fail(self.path(name), value, "true or false")
        return value

    def mapping(self, name: str) -> dict[str, Any]:
        value = self.raw.get(name) or {}
        if not isinstance(value, Mapping):
            raise fail(self.path(name), value, "a mapping")
        try:  # the job travels as JSON: what would not come back the same (a date, a set, NaN) is refused
            same = json.loads(json.dumps(value, allow_nan=False)) == value
        except (TypeError, ValueError, RecursionError):
            same = False
        if not same:
            raise fail(self.path(name), value, "a mapping of JSON values (strings, finite numbers, booleans, null, "
                                               "lists, and mappings with string keys)")
        return dict(value)

    def check_known(self, known: tuple[str, ...]) -> None:
        unknown = sorted(set(self.raw) - set(known), key=str)
        if unknown:
            raise ConfigError(f"{self.path(str(unknown[0]))}: unknown key; known keys are {', '.join(known)}")
