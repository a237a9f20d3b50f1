"""ps_server/exchanges.py: elastic averaging's per-(key, VW) record at a shard: a retry of a VW's
latest exchange gets its deltas again, any other clock out of turn is refused, and the record
survives a snapshot."""

from __future__ import annotations

import hashlib

import pytest
import torch

from ps_server.exchanges import Exchanges
from ps_server.sync_rule import ShardError


def _book() -> Exchanges:
    book = Exchanges()
    for key in ("a", "b"):
        book.add_key(key, 2)
    return book


def _digest(book: Exchanges) -> str:
    h = hashlib.sha256()
    book.feed(h)
    return h.hexdigest()


def test_the_next_exchange_is_new_and_the_latest_one_again_is_a_retry_with_its_deltas() -> None:
    book = _book()
    assert book.retry(1, 0, ["a", "b"]) is None
    deltas = [("a", torch.tensor([1.0, 2.0])), ("b", torch.tensor([3.0]))]
    book.record(1, 0, deltas)
    assert book.count == {"a": [0, 1], "b": [0, 1]} and book.applied == 1
    again = book.retry(1, 0, ["a", "b"])
    assert again is not None and [k for k, _ in again] == ["a", "b"]
    assert all(torch.equal(d, e) for (_, d), (_, e) in zip(again, deltas))
    again[0][1].zero_()   # a copy: the answer to a later retry is the same
    stored = book.retry(1, 0, ["a", "b"])
    assert stored is not None and torch.equal(stored[0][1], torch.tensor([1.0, 2.0]))
    assert book.retry(1, 1, ["a", "b"]) is None and book.retry(0, 0, ["a"]) is None


@pytest.mark.parametrize(("clock", "word"), [(3, "skips ahead"), (0, "goes backwards")])
def test_an_exchange_out_of_turn_is_refused_naming_the_vw_and_its_clocks(clock: int, word: str) -> None:
    book = _book()
    for c in range(2):   # vw 0 has made exchanges 0 and 1: 2 is next, 1 a retry
        book.record(0, c, [("a", torch.ones(1)), ("b", torch.ones(1))])
    before = _digest(book)
    with pytest.raises(ShardError, match=rf"exchange of vw 0 for clock {clock} {word}: .* are \[2\]") as caught:
        book.retry(0, clock, ["a", "b"])
    assert caught.value.kind == ShardError.Kind.CLOCK
    assert _digest(book) == before and book.applied == 2


def test_keys_at_different_counts_are_refused_together() -> None:
    book = _book()
    book.record(0, 0, [("a", torch.ones(1))])   # "a" alone: a and b now disagree for vw 0
    with pytest.raises(ShardError, match=r"its exchanges for these keys are \[0, 1\]"):
        book.retry(0, 1, ["a", "b"])


def test_the_record_survives_a_snapshot_and_an_older_snapshot_has_none() -> None:
    book = _book()
    book.record(1, 0, [("a", torch.tensor([0.5])), ("b", torch.tensor([-1.0]))])
    restored = Exchanges.restored(book.snapshot())
    assert restored.count == book.count and restored.applied == 1 and _digest(restored) == _digest(book)
    assert set(book.snapshot()) == {"exchanged", "last_delta", "exchanges_applied"}   # a checkpoint's names
    empty = Exchanges.restored({"values": {}})
    assert empty.count == {} and empty.applied == 0
