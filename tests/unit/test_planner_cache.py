"""coordinator/planner/cache.py and shapes.boundaries' use of it: what a shape-only pass found is
kept across runs per model code, input and dtype, and never stands in for another model's."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from coordinator.planner import cache
from coordinator.planner.shapes import TensorShape, boundaries
from hetpipe import models
from hetpipe.config import parse_job

NET = '''
import torch
from torch import nn


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 6)
        self.register_buffer("scale", torch.ones(6))   # made in memory by the factory

    def forward(self, x):
        y = self.proj(x) * self.scale
        return y{tail}


def build():
    return nn.Sequential(nn.Linear(4, 8), Head())
'''


class Model(NamedTuple):
    model: torch.nn.Sequential
    key: dict[str, Any] | None


def _model(folder: Path, tail: str = "", factory: str = "cached_net:build", **args: Any) -> Model:
    if factory == "cached_net:build":
        (folder / "cached_net.py").write_text(NET.replace("{tail}", tail))
    job = parse_job({"model": {"factory": factory, "args": args}}, base_dir=str(folder))
    model = models.structure(job.model, job.base_dir)
    return Model(model, cache.model_key(job.model, job.base_dir, job.model.args, model))


def _flows(m: Model, x: TensorShape, cache_dir: Path | str, **kw: Any) -> list[TensorShape]:
    return boundaries(m.model, x, cache_dir=str(cache_dir), model_key=m.key, **kw)


X = ((5, 4), torch.float32)


def test_a_kept_pass_is_read_back_and_a_damaged_one_is_passed_again(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    model = _model(tmp_path)
    flows = _flows(model, X, folder)
    assert flows == [((5, 4), torch.float32), ((5, 8), torch.float32), ((5, 6), torch.float32)]
    kept, = folder.iterdir()
    hit = _model(tmp_path)
    assert _flows(hit, X, folder) == flows
    assert {t.device.type for t in hit.model.state_dict().values()} == {"meta"}, "a hit leaves the buffers in memory"
    # Marked: a pass that returns the mark was read from the cache, not run.
    entry = json.loads(kept.read_text())
    entry["flows"][2] = [[5, 7], "float64"]
    kept.write_text(json.dumps(entry))
    assert _flows(model, X, folder)[2] == ((5, 7), torch.float64)
    # Another input, dtype or precision is another entry.
    assert _flows(model, ((3, 4), torch.float32), folder)[2] == ((3, 6), torch.float32)
    assert _flows(model, X, folder, compute=torch.bfloat16)[2] == ((5, 6), torch.bfloat16)
    # An entry that does not read as shapes and dtypes is run again (and kept anew).
    for flows_kept in ([[[5, 7], "load"]], [[[5, "x"], "float32"]], "nonsense"):
        kept.write_text(json.dumps({**entry, "flows": flows_kept}))
        assert _flows(model, X, folder) == flows
    kept.write_text("{not json")
    assert _flows(model, X, folder) == flows
    assert json.loads(kept.read_text())["flows"] == [[[5, 4], "float32"], [[5, 8], "float32"], [[5, 6], "float32"]]


def test_an_edited_model_file_is_passed_anew(tmp_path: Path) -> None:
    """The edit changes what a layer returns, not its class, attributes or parameters (the
    layers' signature): only the file's code tells the two apart."""
    folder = str(tmp_path / "cache")
    assert _flows(_model(tmp_path), X, folder)[-1] == ((5, 6), torch.float32)
    assert _flows(_model(tmp_path, "[:, :2]"), X, folder)[-1] == ((5, 2), torch.float32)
    assert _flows(_model(tmp_path), X, folder)[-1] == ((5, 6), torch.float32)


def test_a_refused_pass_is_not_kept_and_a_cache_that_cannot_be_written_is_no_error(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    model = _model(tmp_path)
    for _ in range(2):   # integers into a Linear: refused each time, as the kernels would
        with pytest.raises(RuntimeError, match="of float32 and int64 operands"):
            _flows(model, ((5, 4), torch.int64), folder, strict=True)
        with pytest.raises(RuntimeError, match="same reduction dim"):   # x of another width
            _flows(model, ((5, 3), torch.float32), folder)
    assert not folder.exists() or not any(folder.iterdir())
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert _flows(model, X, blocked)[-1] == ((5, 6), torch.float32)


SETTINGS = '''
from torch import nn


class View(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.shape = list(shape)   # a list: no signature records it

    def forward(self, x):
        return x.reshape(x.shape[0], *self.shape)


def pooled(out):
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.AdaptiveAvgPool2d(out), nn.Flatten())


def viewed(shape):
    return nn.Sequential(nn.Linear(4, 8), View(shape))
'''

BASE = '''
from torch import nn


class Base(nn.Module):
    def forward(self, x):
        return self.proj(x){tail}
'''

DERIVED = '''
from torch import nn
from cached_base import Base


class Head(Base):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 6)


def build():
    return nn.Sequential(nn.Linear(4, 8), Head())
'''


def test_what_the_args_set_and_a_base_class_edited_elsewhere_are_passed_anew(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    (tmp_path / "settings.py").write_text(SETTINGS)
    image = ((2, 3, 8, 8), torch.float32)
    assert _flows(_model(tmp_path, factory="settings:pooled", out=[2, 2]), image, folder)[-1][0] == (2, 16)
    assert _flows(_model(tmp_path, factory="settings:pooled", out=[4, 4]), image, folder)[-1][0] == (2, 64)
    assert _flows(_model(tmp_path, factory="settings:viewed", shape=[2, 4]), X, folder)[-1][0] == (5, 2, 4)
    assert _flows(_model(tmp_path, factory="settings:viewed", shape=[4, 2]), X, folder)[-1][0] == (5, 4, 2)
    (tmp_path / "cached_derived.py").write_text(DERIVED)
    for tail, width in (("", 6), ("[:, :2]", 2)):
        (tmp_path / "cached_base.py").write_text(BASE.replace("{tail}", tail))
        for name in ("cached_base", "cached_derived"):   # as the next run's process imports them
            sys.modules.pop(name, None)
        assert _flows(_model(tmp_path, factory="cached_derived:build"), X, folder)[-1][0] == (5, width)


def test_a_killed_writers_temporary_file_is_removed_by_the_next_store(tmp_path: Path) -> None:
    """store() writes through a temporary file of its own: one that a killed writer left is
    removed once it is old, and a live writer's (fresh) is left alone."""
    path = tmp_path / "shapes-0123456789abcdef.json"
    stale, live = Path(f"{path}abc.tmp"), Path(f"{path}def.tmp")
    other = tmp_path / "shapes-fedcba9876543210.jsonabc.tmp"   # another entry's: its own store sweeps it
    for left in (stale, live, other):
        left.write_text("{")
    old = time.time() - cache.STALE_TMP_S - 60
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    cache.store(path, {"key": {"a": 1}, "flows": []})
    assert json.loads(path.read_text()) == {"key": {"a": 1}, "flows": []}
    assert not stale.exists() and live.exists() and other.exists()
