"""The reference model of one parameter-server shard, written from DESIGN §3 and not from
`ps_server.shard.Shard`, and the refusal check that the shard's tests share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hetpipe import wire
from hetpipe.v1 import wire_pb2
from hetpipe.wsp import clock_distance
from ps_server.durability import Durability
from ps_server.shard import Shard
from ps_server.sync_rule import ShardError

Kind = ShardError.Kind
Deltas = list[tuple[str, torch.Tensor]]


class RefShard:
    """DESIGN §3 for one shard: float64 weights, a clock per (key, vw), and the acknowledged pushes."""

    def __init__(self, n: int, init: dict[str, torch.Tensor], *, exact: bool = False, D: int | None = None) -> None:
        self.n = n
        # wsp with D = 0: the values hold exactly the waves below each key's c_global, each wave
        # summed in VW order (bit for bit, whatever the pushes' order); later ones are held.
        self.exact = exact
        # G4, when the shard is told D: a VW pushes wave c of a key only once its c_global >= c - D.
        self.lead = 0 if exact else D
        self.w0 = {k: v.clone() for k, v in init.items()}
        self.w = {k: v.clone() for k, v in init.items()}
        self.clock = {(k, v): 0 for k in init for v in range(n)}
        self.acked: list[tuple[int, int, Deltas]] = []   # every push answered "applied", in order
        self.max_distance = 0

    def expect_push(self, vw: int, c: int, deltas: Deltas) -> str | Kind:
        """'applied', 'duplicate', or the kind of refusal; changes nothing."""
        keys = [k for k, _ in deltas]
        if not 0 <= vw < self.n or not keys or len(set(keys)) != len(keys):
            return Kind.INVALID
        if any(k not in self.w for k in keys):
            return Kind.NOT_OWNED
        if any(d.dtype != self.w[k].dtype or d.shape != self.w[k].shape for k, d in deltas):
            return Kind.INVALID
        clocks = [self.clock[(k, vw)] for k in keys]
        if all(x == c for x in clocks):
            return Kind.CLOCK if self.past_g4(c, keys) else "applied"
        if all(x == c + 1 for x in clocks):
            return "duplicate"
        return Kind.CLOCK

    def past_g4(self, c: int, keys: list[str]) -> bool:
        return self.lead is not None and any(c > self.key_c_global(k) + self.lead for k in keys)

    def apply(self, vw: int, c: int, deltas: Deltas) -> None:
        for k, d in deltas:
            if not self.exact:
                self.w[k] = self.w[k] + d
            self.clock[(k, vw)] = c + 1
        self.acked.append((vw, c, [(k, d.clone()) for k, d in deltas]))
        if self.exact:
            self.w = {k: self.waves_below(k, self.key_c_global(k)) for k in self.w}
        self.max_distance = max(self.max_distance, clock_distance(self.vw_clocks()))

    def pushed(self, key: str, wave: int) -> dict[int, torch.Tensor]:
        """Each VW's acknowledged delta of wave `wave` for key."""
        return {vw: d for vw, c, deltas in self.acked if c == wave for k, d in deltas if k == key}

    def waves_below(self, key: str, end: int) -> torch.Tensor:
        """w0 plus every VW's waves below `end` of key: wave by wave, each in VW order."""
        w = self.w0[key].clone()
        for wave in range(end):
            by_vw = self.pushed(key, wave)
            for vw in sorted(by_vw):
                w = w + by_vw[vw]
        return w

    def held(self, key: str) -> list[torch.Tensor]:
        """exact: key's acknowledged deltas of the wave its c_global has not reached, in VW order."""
        by_vw = self.pushed(key, self.key_c_global(key))
        return [by_vw[vw] for vw in sorted(by_vw)]

    def expect_pull(self, vw: int, keys: list[str]) -> Kind | None:
        if not 0 <= vw < self.n or not keys or len(set(keys)) != len(keys):
            return Kind.INVALID
        if any(k not in self.w for k in keys):
            return Kind.NOT_OWNED
        return None

    def vw_clocks(self, keys: list[str] | None = None) -> list[int]:
        ks = list(self.w) if keys is None else keys
        return [min(self.clock[(k, v)] for k in ks) for v in range(self.n)]

    def c_global(self, keys: list[str] | None = None) -> int:
        return min(self.vw_clocks(keys))

    def key_c_global(self, key: str) -> int:
        return min(self.clock[(key, v)] for v in range(self.n))

    def exact_pull(self, vw: int, keys: list[str]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """An exact pull (wsp, D = 0): per key, w0 plus the acknowledged pushes of the waves below
        its c_global, of every VW, wave by wave in VW order; the puller's own clock as far as that."""
        w = {k: self.waves_below(k, self.key_c_global(k)) for k in keys}
        return w, [min(self.clock[(k, vw)], self.key_c_global(k)) for k in keys]

    def conserved(self) -> dict[str, torch.Tensor]:
        """O3: w0 + the sum of every acknowledged push, recomputed from scratch (exact: of the
        waves below c_global; the rest is held, held())."""
        if self.exact:
            return {k: self.waves_below(k, self.key_c_global(k)) for k in self.w0}
        w = {k: v.clone() for k, v in self.w0.items()}
        for _, _, deltas in self.acked:
            for k, d in deltas:
                w[k] = w[k] + d
        return w


def two_key_shard(n: int = 3) -> Shard:
    """A shard of n VWs holding a (2x3 zeros) and b (3 ones), float64."""
    shard = Shard()
    assert shard.init(n, [("a", torch.zeros(2, 3, dtype=torch.float64)), ("b", torch.ones(3, dtype=torch.float64))])
    return shard


def tensor(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def assert_refused(kind: Kind, fn, *args) -> ShardError:  # type: ignore[no-untyped-def]
    with pytest.raises(ShardError) as info:
        fn(*args)
    assert info.value.kind == kind, f"{info.value.kind} ({info.value}), want {kind}"
    assert str(info.value), "a refusal must say what is wrong"
    return info.value



def log_push(dur: Durability, vw: int, clock: int, deltas: Deltas) -> tuple[int, Deltas]:
    """The servicer's WSP logging of a push: from its stream into the entry; (entry, tensors to apply)."""
    return dur.log_stream(vw, clock, wire.read(wire.encode(deltas, push=wire_pb2.PushTag(vw=vw, clock=clock))))


def record_fsyncs(monkeypatch: pytest.MonkeyPatch, failures: list[OSError] | None = None) -> list[str]:
    """From now on, the name of every file or folder fsynced, in order (the list returned); the
    first fsyncs raise failures' errors instead, one each."""
    synced: list[str] = []
    fail = failures if failures is not None else []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if fail:
            raise fail.pop()
        real_fsync(fd)
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced
