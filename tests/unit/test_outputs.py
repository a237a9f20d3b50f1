"""What a run leaves in output.dir (hetpipe/outputs.py): strict JSON, and a folder checked before
any process starts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hetpipe import outputs
from hetpipe.config import ConfigError


def _strict(text: str) -> object:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_summary_and_evaluations_never_hold_nan_or_infinity(tmp_path: Path) -> None:
    """NaN and infinities become null at any depth: DESIGN §8's readers parse strict JSON."""
    fields = {"steps": 3, "final_loss": math.nan, "eval_loss": math.inf, "eval_accuracy": 0.5,
              "plan": [{"vw": 0, "predicted": -math.inf}], "processes": {"stage 0": {"peak": math.nan}}}
    written = outputs.write_summary(tmp_path, fields)
    summary = _strict((tmp_path / "summary.json").read_text())
    assert summary == written == {"steps": 3, "final_loss": None, "eval_loss": None, "eval_accuracy": 0.5,
                                  "plan": [{"vw": 0, "predicted": None}], "processes": {"stage 0": {"peak": None}}}
    outputs.append_evals(tmp_path, [{"id": 1, "loss": math.nan, "accuracy": 0.1}])
    assert [_strict(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()] == [
        {"id": 1, "loss": None, "accuracy": 0.1}]


def test_an_output_dir_that_can_be_made_passes_and_nothing_is_left(tmp_path: Path) -> None:
    outputs.check_dir(tmp_path / "a" / "b")
    outputs.check_dir(tmp_path)
    assert list(tmp_path.iterdir()) == [], "the check creates nothing and leaves no probe"


def test_an_output_dir_under_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    for target in (tmp_path / "f", tmp_path / "f" / "out" / "deeper"):
        with pytest.raises(ConfigError, match=rf"^output\.dir: {target}: {tmp_path}/f is a file$"):
            outputs.check_dir(target)
