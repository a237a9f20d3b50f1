"""The checked-in stubs are exactly what `make proto` generates from protos/."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetpipe.protogen import ROOT, generate

pytestmark = pytest.mark.timeout(60)


def test_regenerating_stubs_produces_no_diff(tmp_path: Path) -> None:
    fresh = {p.name: p.read_bytes() for p in generate(tmp_path)}
    checked_in = {p.name: p.read_bytes() for p in (ROOT / "hetpipe" / "v1").glob("*_pb2*.py*")}
    assert fresh, "protoc produced nothing"
    assert sorted(fresh) == sorted(checked_in), "stub files differ: run `make proto` and commit"
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"stale generated stubs {stale}: run `make proto` and commit"
