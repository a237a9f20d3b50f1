"""coordinator/planner/cache.py and shapes.boundaries' use of it: what a shape-only pass found is
kept across runs per model code, input and dtype, and never stands in for another model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coordinator.planner.shapes import boundaries
from hetpipe import models
from hetpipe.config import parse_job

NET = '''
import torch
from torch import nn


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 6)

    def forward(self, x):
        return self.proj(x){tail}


def build():
    return nn.Sequential(nn.Linear(4, 8), Head())
'''


def _model(folder: Path, tail: str = "") -> torch.nn.Sequential:
    (folder / "cached_net.py").write_text(NET.replace("{tail}", tail))
    job = parse_job({"model": {"factory": "cached_net:build"}}, base_dir=str(folder))
    return models.structure(job.model, job.base_dir)


X = ((5, 4), torch.float32)


def test_a_kept_pass_is_read_back_and_a_damaged_one_is_passed_again(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    model = _model(tmp_path)
    flows = boundaries(model, X, cache_dir=str(cache))
    assert flows == [((5, 4), torch.float32), ((5, 8), torch.float32), ((5, 6), torch.float32)]
    kept, = cache.iterdir()
    assert boundaries(model, X, cache_dir=str(cache)) == flows
    # Marked: a pass that returns the mark was read from the cache, not run.
    entry = json.loads(kept.read_text())
    entry["flows"][2] = [[5, 7], "float64"]
    kept.write_text(json.dumps(entry))
    assert boundaries(model, X, cache_dir=str(cache))[2] == ((5, 7), torch.float64)
    # Another input, dtype or precision is another entry.
    assert boundaries(model, ((3, 4), torch.float32), cache_dir=str(cache))[2] == ((3, 6), torch.float32)
    assert boundaries(model, X, torch.bfloat16, cache_dir=str(cache))[2] == ((5, 6), torch.bfloat16)
    # An entry that does not read as shapes and dtypes is run again (and kept anew).
    for flows_kept in ([[[5, 7], "load"]], [[[5, "x"], "float32"]], "nonsense"):
        kept.write_text(json.dumps({**entry, "flows": flows_kept}))
        assert boundaries(model, X, cache_dir=str(cache)) == flows
    kept.write_text("{not json")
    assert boundaries(model, X, cache_dir=str(cache)) == flows
    assert json.loads(kept.read_text())["flows"] == [[[5, 4], "float32"], [[5, 8], "float32"], [[5, 6], "float32"]]


def test_an_edited_model_file_is_passed_anew(tmp_path: Path) -> None:
    """The edit changes what a layer returns, not its class, attributes or parameters (the
    layers' signature): only the file's code tells the two apart."""
    cache = str(tmp_path / "cache")
    assert boundaries(_model(tmp_path), X, cache_dir=cache)[-1] == ((5, 6), torch.float32)
    assert boundaries(_model(tmp_path, "[:, :2]"), X, cache_dir=cache)[-1] == ((5, 2), torch.float32)
    assert boundaries(_model(tmp_path), X, cache_dir=cache)[-1] == ((5, 6), torch.float32)


def test_a_refused_pass_is_not_kept_and_a_cache_that_cannot_be_written_is_no_error(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    model = _model(tmp_path)
    for _ in range(2):   # integers into a Linear: refused each time, as the kernels would
        with pytest.raises(RuntimeError, match="of float32 and int64 operands"):
            boundaries(model, ((5, 4), torch.int64), strict=True, cache_dir=str(cache))
        with pytest.raises(RuntimeError, match="same reduction dim"):   # x of another width
            boundaries(model, ((5, 3), torch.float32), cache_dir=str(cache))
    assert not cache.exists() or not any(cache.iterdir())
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert boundaries(model, X, cache_dir=str(blocked))[-1] == ((5, 6), torch.float32)
