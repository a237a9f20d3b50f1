"""The planner's cache across runs: JSON files, each holding the key it was computed for, under
$HETPIPE_CACHE. What is kept is what a shape-only pass or a timing found for a model's layers."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coordinator.planner.meter import signature
from hetpipe.config import ModelConfig
from hetpipe.models import describe

# A temporary file of store()'s this old is a killed writer's: a live one takes milliseconds.
STALE_TMP_S = 600.0


def default_cache_dir() -> str:
    """$HETPIPE_CACHE, else under $XDG_CACHE_HOME (a container with a read-only home sets it), else ~/.cache."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return os.environ.get("HETPIPE_CACHE", str(Path(cache) / "hetpipe" / "profiles"))


def model_key(cfg: ModelConfig, base_dir: str, args: Mapping[str, Any], model: nn.Module) -> dict[str, Any] | None:
    """What a model's layers compute, for a cache key: its factory and args (a list among them
    can set what no signature records, a pooling's output size), each layer's signature, torch's
    version, and the code of every module outside torch that its classes or their bases come from
    or that was loaded from the job's folder (a helper a forward calls). None where some of that
    code cannot be read: nothing is then cached."""
    names = {c.__module__ for m in model.modules() for c in type(m).__mro__}
    folder = str(Path(base_dir).resolve())
    names |= {name for name, module in list(sys.modules.items())
              if str(getattr(module, "__file__", None) or "").startswith(folder + os.sep)}
    code = hashlib.sha256(torch.__version__.encode())
    for name in sorted(names):
        if name in ("builtins", "torch") or name.startswith("torch."):
            continue
        file = getattr(sys.modules.get(name), "__file__", None)
        if not file:   # a class defined in a notebook
            return None
        try:
            code.update(Path(file).read_bytes())
        except OSError:
            return None
    return {"model": describe(cfg), "args": jsonable(args), "code": code.hexdigest()[:16],
            "layers": hashlib.sha256(repr([signature(layer) for layer in model.children()]).encode()).hexdigest()[:16]}


def jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def entry(folder: str | os.PathLike[str] | None, name: str, key: Mapping[str, Any]) -> Path | None:
    """The file in folder that keeps what was found for key, named after it; None without a folder."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(folder, f"{name}-{digest}.json") if folder else None


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
    own (two processes may store the same entry at once), and removes the entry's temporary files
    that killed writers left. A folder that cannot be written keeps nothing: the next run computes
    it again."""
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
    _sweep(path)


def _sweep(path: Path) -> None:
    """Removes path's temporary files older than STALE_TMP_S."""
    now = time.time()
    for left in path.parent.glob(f"{path.name}*.tmp"):
        try:
            if now - left.stat().st_mtime > STALE_TMP_S:
                left.unlink()
        except OSError:   # gone meanwhile, or not ours to remove
            pass
