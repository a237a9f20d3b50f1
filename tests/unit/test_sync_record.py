"""The sync trace and O3's ledger: a trace saves the ledger only when the job asks for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stage_worker.sync_record import SyncRecord

KEYS = ("0.weight", "0.bias")


def _record(tmp_path: Path, ledger: bool) -> SyncRecord:
    return SyncRecord(str(tmp_path / "trace"), "vw0_stage1.jsonl", KEYS, [torch.zeros(2, 2), torch.zeros(2)],
                      ledger=ledger)


def test_a_trace_without_the_ledger_writes_its_rows_and_saves_no_ledger(tmp_path: Path) -> None:
    record = _record(tmp_path, ledger=False)
    sent = [torch.ones(2, 2), torch.ones(2)]
    record.in_flight(sent)
    record.write({"event": "push", "wave": 0})
    record.acknowledged(sent)
    record.close()
    assert (tmp_path / "trace" / "sync" / "vw0_stage1.jsonl").read_text().count('"push"') == 1
    assert not list((tmp_path / "trace").glob("acked_*")) and record.ledger == []


@pytest.mark.parametrize("trace", [True, False])
def test_the_ledger_holds_the_acknowledged_sum_and_the_push_in_flight(tmp_path: Path, trace: bool) -> None:
    """Saved at every push, for O3: a stage killed mid-push leaves the update in flight beside the
    acknowledged sum. Without a trace folder (an untraced job) nothing is kept."""
    record = SyncRecord(str(tmp_path / "trace") if trace else "", "vw0_stage1.jsonl", KEYS,
                        [torch.zeros(2, 2), torch.zeros(2)], ledger=True)
    path = tmp_path / "trace" / "acked_vw0_stage1.pt"
    first, second = [torch.ones(2, 2), torch.full((2,), 2.0)], [torch.full((2, 2), 3.0), torch.ones(2)]
    record.acknowledged(first)
    record.in_flight(second)
    if not trace:
        assert not path.exists() and record.ledger == []
        return
    saved = torch.load(path, weights_only=True)
    assert torch.equal(saved["acked"]["0.weight"], first[0]) and torch.equal(saved["pending"]["0.bias"], second[1])
    record.acknowledged(second)
    saved = torch.load(path, weights_only=True)
    assert torch.equal(saved["acked"]["0.bias"], first[1] + second[1]) and saved["pending"] == {}


def test_a_ledger_goes_on_from_its_cut_and_none_is_kept_from_a_cut_without_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A resumed stage adds to the ledger its cut saved. From a cut taken with output.ledger off
    (state None) it cannot know what was acknowledged before: it writes no ledger at all, and says
    so, rather than one that starts at zero and makes O3 fail for a push it did count."""
    assert _record(tmp_path / "off", ledger=False).state() is None
    cut = _record(tmp_path / "a", ledger=True)
    cut.acknowledged([torch.ones(2, 2), torch.ones(2)])
    resumed = _record(tmp_path / "b", ledger=True)
    resumed.restore(cut.state())
    resumed.acknowledged([torch.ones(2, 2), torch.ones(2)])
    saved = torch.load(tmp_path / "b" / "trace" / "acked_vw0_stage1.pt", weights_only=True)
    assert torch.equal(saved["acked"]["0.bias"], torch.full((2,), 2.0)), "the cut's sum, plus the push after it"
    unknown = _record(tmp_path / "c", ledger=True)
    unknown.restore(None)
    unknown.acknowledged([torch.ones(2, 2), torch.ones(2)])
    assert not list((tmp_path / "c" / "trace").glob("acked_*")) and unknown.state() is None
    assert "has no ledger (taken with output.ledger off); this stage writes none" in caplog.text
