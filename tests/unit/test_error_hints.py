"""What a user's mistake is told with (hetpipe/errors.py): torch's run-time errors from bad data
explained, a close spelling offered, the line of a factory's own code that failed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetpipe.errors import closest, data_hint, user_frame


def _raised(call: object) -> BaseException:
    with pytest.raises(Exception) as info:
        call()   # type: ignore[operator]
    return info.value


def test_torchs_errors_from_bad_data_are_explained() -> None:
    """The messages torch gives today: a torch that words them otherwise fails this, not a run."""
    embedding = torch.nn.Embedding(5, 2)
    assert "token ids" in data_hint(_raised(lambda: embedding(torch.tensor([[1, 5]]))))
    loss = torch.nn.functional.cross_entropy
    assert "a label outside the classes" in data_hint(_raised(lambda: loss(torch.zeros(2, 4), torch.tensor([0, 4]))))
    stacked = _raised(lambda: torch.utils.data.default_collate([torch.zeros(3), torch.zeros(2)]))
    assert "pad or cut each to one length" in data_hint(stacked)
    assert data_hint(_raised(lambda: torch.zeros(2)[5])) == "", "an index error of the model's own code"
    # A GPU's kernel cannot say which index: torch.AcceleratorError's wording, as CUDA gives it.
    assert "the same job on the CPU names which" in data_hint(RuntimeError(
        "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported"))
    assert data_hint(ValueError("my Target 4 is out of bounds")) == ""


def test_a_close_spelling_is_offered_and_a_far_one_is_not() -> None:
    assert closest("batch_sise", ["batch_size", "shuffle"]) == " (did you mean batch_size?)"
    assert closest("vocb", ["vocab", "width"]) == " (did you mean vocab?)"
    assert closest("depth", ["width", "classes"]) == "", "depth is not a misspelt width"
    assert closest("x", []) == ""


def test_where_a_factory_failed_is_its_own_files_line(tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text("def build():\n    cfg = {}\n    return cfg['rows']\n")
    namespace: dict[str, object] = {}
    exec(compile((tmp_path / "mine.py").read_text(), str(tmp_path / "mine.py"), "exec"), namespace)
    exc = _raised(namespace["build"])
    assert user_frame(exc, str(tmp_path)) == " (mine.py:3 in build)"
    assert user_frame(exc, str(tmp_path / "elsewhere")) == "" and user_frame(exc, None) == ""
