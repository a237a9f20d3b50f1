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
    assert "a token id past" in data_hint(_raised(lambda: embedding(torch.tensor([[1, 5]]))))
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
    assert closest("batch_sise", ["batch_size", "shuffle"]) == "batch_size"
    assert closest("vocb", ["vocab", "width"]) == "vocab"
    assert closest("workers", ["virtual_workers", "stages_per_vw"]) == "virtual_workers"
    assert closest("stages", ["virtual_workers", "stages_per_vw"]) == "stages_per_vw"
    assert closest("lr", ["momentum", "weight_decay"]) is None
    assert closest("x", []) is None


def test_a_data_workers_error_is_explained_as_the_stages_own() -> None:
    """A DataLoader worker's error comes wrapped: its own line last."""
    import sys

    from torch._utils import ExceptionWrapper

    try:
        torch.utils.data.default_collate([torch.zeros(3), torch.zeros(2)])
    except RuntimeError:
        wrapped = ExceptionWrapper(exc_info=sys.exc_info(), where="in DataLoader worker process 0")
    assert "pad or cut each to one length" in data_hint(_raised(wrapped.reraise))


def _built(path: Path, source: str, name: str = "build") -> BaseException:
    namespace: dict[str, object] = {}
    exec(compile(source, str(path), "exec"), namespace)
    return _raised(namespace[name])


def test_where_a_factory_failed_is_its_own_files_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exc = _built(tmp_path / "mine.py", "def build():\n    cfg = {}\n    return cfg['rows']\n")
    assert user_frame(exc, str(tmp_path)) == " (mine.py:3 in build)"
    assert user_frame(exc, str(tmp_path / "elsewhere")) == "" and user_frame(exc, None) == ""
    # Code compiled from a string is nowhere in the folder, whatever the working directory.
    monkeypatch.chdir(tmp_path)
    assert user_frame(_built(Path("<string>"), "def build():\n    return {}['x']\n"), str(tmp_path)) == ""
    # A package installed in a virtual environment inside the folder is not the job's code.
    installed = tmp_path / ".venv" / "lib" / "python3.11" / "site-packages" / "lib.py"
    assert user_frame(_built(installed, "def build():\n    return {}['x']\n"), str(tmp_path)) == ""
    # A module linked into the folder from elsewhere is named as the folder has it.
    (tmp_path / "shared").mkdir()
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "linked.py").symlink_to(tmp_path / "shared" / "linked.py")
    exc = _built(tmp_path / "job" / "linked.py", "def build():\n    return {}['x']\n")
    assert user_frame(exc, str(tmp_path / "job")) == " (linked.py:2 in build)"
