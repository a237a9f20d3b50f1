"""Reading a config file and its mappings, with errors that name the key, the value and what was expected."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import yaml

from hetpipe.errors import closest


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
            meant = closest(str(unknown[0]), known)
            raise ConfigError(f"{self.path(str(unknown[0]))}: unknown key{f' (did you mean {meant}?)' if meant else ''}; "
                              f"known keys are {', '.join(known)}")


class JobLoader(yaml.SafeLoader):
    """Every job file's YAML: safe_load's, with YAML 1.2's floats, and no key given twice.
    key_lines: the line of each key, by its dotted path ("data.batch_size", "cluster.nodes[0]")."""

    def construct_document(self, node: yaml.Node) -> Any:
        self.key_lines: dict[str, int] = {}
        _refuse_repeats(node, "", set(), self.key_lines)
        return super().construct_document(node)


def at_line(message: str, name: str, key_lines: Mapping[str, int]) -> str:
    """A validation error prefixed with the file's name and the line of the key it names (or of
    the nearest section around it), as compilers name a line: "job.yaml:4: data.batch_sise: ..."."""
    key = message.split(":", 1)[0]
    while key and key not in key_lines:
        key = re.sub(r"(\.[^.\[]*|\[\d+\])$", "", key) if re.search(r"[.\[]", key) else ""
    return f"{name}:{key_lines[key]}: {message}" if key else message


# PyYAML reads YAML 1.1, where 1e-3 (no dot) and 1.0e3 (no exponent sign) are strings that the
# validator refuses as not a number. Bare digits are left to YAML 1.1's integers (09 stays text).
JobLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)$"),
    list("-+.0123456789"))


def _refuse_repeats(node: yaml.Node, key: str, seen: set[int], lines_of: dict[str, int]) -> None:
    """PyYAML keeps the last of a key given twice: the author meant one of them, and we cannot tell
    which. Notes each key's line in lines_of: the first to spell its path, a mapping's own keys
    before those of its merge keys (which they override), and a key spelt with a dot or a bracket
    (`data.batch_size:` at the top) before any other (no known key has one: an error names it)."""
    if id(node) in seen:  # an alias: checked where it was anchored (and a recursive one would never end)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            if id(item) not in seen:   # an alias's mark is its anchor's: the list's line stands for it
                lines_of.setdefault(f"{key}[{i}]", item.start_mark.line + 1)
            _refuse_repeats(item, f"{key}[{i}]", seen, lines_of)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        merges = []
        for k, v in node.value:
            # A merge key's entries may be overridden here: that is what it is for.
            if not isinstance(k, yaml.ScalarNode) or k.tag == "tag:yaml.org,2002:merge":
                merges.append(v)
                continue
            name, line = f"{key}.{k.value}" if key else k.value, k.start_mark.line + 1
            if (k.tag, k.value) in lines:
                raise ConfigError(f"{name}: given twice (lines {lines[k.tag, k.value]} and {line})")
            lines[k.tag, k.value] = line
            if re.search(r"[.\[]", k.value):
                lines_of[name] = line
            else:
                lines_of.setdefault(name, line)
            _refuse_repeats(v, name, seen, lines_of)
        for v in merges:
            _refuse_repeats(v, key, seen, lines_of)
