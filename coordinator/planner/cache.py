"""The planner's cache across runs: JSON files, each holding the key it was computed for, under
$HETPIPE_CACHE. What is kept is what a shape-only pass or a timing found for a model's layers."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coordinator.planner.meter import signature


def default_cache_dir() -> str:
    """$HETPIPE_CACHE, else under $XDG_CACHE_HOME (a container with a read-only home sets it), else ~/.cache."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return os.environ.get("HETPIPE_CACHE", str(Path(cache) / "hetpipe" / "profiles"))


def layers_digest(model: nn.Module) -> str | None:
    """What a model's layers compute, for a cache key: each layer's signature, torch's version, and
    the source files of every class outside torch among their modules (a user's model code may
    change, its args not). None where such a file cannot be read: nothing is then cached."""
    digest = hashlib.sha256(repr([signature(layer) for layer in model.children()]).encode())
    digest.update(torch.__version__.encode())
    for name in sorted({type(m).__module__ for m in model.modules()}):
        if name == "torch" or name.startswith("torch."):
            continue
        file = getattr(sys.modules.get(name), "__file__", None)
        if not file:   # a class defined in a notebook
            return None
        try:
            digest.update(Path(file).read_bytes())
        except OSError:
            return None
    return digest.hexdigest()[:16]


def jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def load(path: Path, key: Mapping[str, Any]) -> dict[str, Any] | None:
    """What path keeps for key, or None (absent, unreadable, or kept for another key)."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("key") != json.loads(json.dumps(key)):
        return None
    return kept


def store(path: Path, kept: Mapping[str, Any]) -> None:
    """Writes kept (with its "key") to path whole or not at all, through a temporary file of its
    own (two processes may store the same entry at once). A folder that cannot be written keeps
    nothing: the next run computes it again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(kept, f)
        os.replace(tmp, path)
    except OSError:   # a full disk, say
        Path(tmp).unlink(missing_ok=True)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
