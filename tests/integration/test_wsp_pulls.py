"""A stage's pulls (stage_worker/wsp_sync.py) and exchanges (elastic_sync.py) against a real shard.

Through shared memory, w_global is copied from the shard's pull slot straight into the weights,
G3's own unpushed waves added after it; a slot that changes before the merge fails the stage
instead of leaving torn weights. With D = 0, a pull that arrives after a faster VW's next push
gets what it would have got before it (exact pulls): the race that broke O2 across hosts. An
elastic exchange sends the replica as its wave left it, on the CPU and from a GPU."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hetpipe import rpc
from ps_server.durability import Durability
from ps_server.servicer import ShardServicer
from ps_server.shard import Shard
from stage_worker.elastic_sync import ElasticSync
from stage_worker.sync import SyncCallbacks, SyncConfig
from stage_worker.wsp_sync import WspSync

pytestmark = pytest.mark.timeout(60)
KEYS = ("0.weight", "0.bias")
ON_A_GPU = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class Weights:
    """A stage's weights as WspSync sees them, recording how each merge reached them."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.params = [torch.zeros(4, 3, device=device), torch.zeros(4, device=device)]
        self.merges: list[str] = []

    def set_weights(self, values: list[torch.Tensor]) -> None:
        self.merges.append("set_weights")
        for p, v in zip(self.params, values):
            p.copy_(v)

    def overwrite(self, fill: Callable[[list[torch.Tensor]], None]) -> None:
        self.merges.append("overwrite")
        fill(self.params)


@pytest.fixture
def shard(tmp_path: Path) -> Iterator[tuple[str, ShardServicer]]:
    servicer = ShardServicer(Shard(), Durability(str(tmp_path / "ckpt")), max_pull_wait_s=30.0)
    server = rpc.Server("127.0.0.1", 0, workers=8)
    server.add("ParameterServer", servicer)
    server.start()
    yield server.address, servicer
    server.stop(grace=0)


def _stage(address: str, vw: int, D: int, shm: bool, failures: list[str], **fields: Any) -> tuple[WspSync, Weights]:
    """fields: other SyncConfig fields (nm, push_dtype)."""
    weights = Weights()
    config = SyncConfig(**{"vw": vw, "nm": 1, "D": D, "steps": 4, "keys": KEYS, "key_shards": (0, 0),
                           "addresses": (address,), "shared_memory": (shm,), **fields})
    callbacks = SyncCallbacks(on_failure=failures.append, wake=lambda: None, next_forward=lambda: 3)
    return WspSync(config, callbacks, weights.params), weights


def _push(sync: WspSync, wave: int, update: list[torch.Tensor], failures: list[str]) -> None:
    sync.after_update(wave + 1, [u.clone() for u in update])
    sync.on_wave_end(wave)
    deadline = time.monotonic() + 20
    while sync.acked_waves <= wave:
        assert time.monotonic() < deadline and not failures, failures
        time.sleep(0.01)


@pytest.fixture
def pushed(shard: tuple[str, ShardServicer]) -> Iterator[tuple[WspSync, Weights, list[torch.Tensor]]]:
    """One VW's stage that has pushed wave 0 (u1) and holds wave 1 (u2) unpushed; w0 + u1 + u2."""
    failures: list[str] = []
    sync, weights = _stage(shard[0], 0, 0, True, failures)
    try:
        w0 = [torch.arange(12.0).reshape(4, 3), torch.ones(4)]
        u1, u2 = [torch.full((4, 3), 0.5), torch.full((4,), 0.25)], [torch.full((4, 3), 2.0), torch.full((4,), 4.0)]
        sync.initialise(1, w0)
        _push(sync, 0, u1, failures)
        sync.after_update(2, [u.clone() for u in u2])
        yield sync, weights, [w + a + b for w, a, b in zip(w0, u1, u2)]
    finally:
        sync.close()


def test_a_pull_is_merged_from_the_shards_slot_straight_into_the_weights(
        pushed: tuple[WspSync, Weights, list[torch.Tensor]]) -> None:
    sync, weights, want = pushed
    sync.pull_now(weights, 1)
    assert weights.merges == ["overwrite"], "merged from the slot, not received and set"
    for got, expected in zip(weights.params, want):
        assert torch.equal(got, expected), "G3: w_global (w0 + u1) plus the unpushed wave 1 (u2)"
    assert sync.min_clock == 1 and sync.shm_bytes > 0


def test_a_slot_that_changes_before_the_merge_fails_the_stage(
        pushed: tuple[WspSync, Weights, list[torch.Tensor]], shard: tuple[str, ShardServicer]) -> None:
    sync, weights, _ = pushed
    sync._request(1)
    deadline = time.monotonic() + 20
    while sync._pending is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (slot,) = [slot for group in shard[1].pull_slots._groups.values() for slot in group]
    slot.segment.write([memoryview(bytes(64))])   # the shard breaking its promise: the slot is rewritten
    with pytest.raises(RuntimeError, match="pull reply for min_clock 1 changed while it was merged.*stale"):
        sync.apply_pending(weights)


@pytest.mark.parametrize("shm", [False, True])
@pytest.mark.parametrize("D", [0, 1])
def test_with_d0_a_pull_after_a_faster_vws_next_push_excludes_it(shard: tuple[str, ShardServicer], D: int,
                                                                   shm: bool) -> None:
    """Both VWs push wave 0; vw 1 runs on and pushes wave 1 before vw 0's pull for min_clock 1
    arrives. With D = 0 that pull gets w0 + both waves 0, as synchronous SGD would, and vw 1's own
    pull adds its wave 1 back (G3). With D = 1 WSP lets the later wave in: G2 is a lower bound."""
    failures: list[str] = []
    (vw0, weights0), (vw1, weights1) = (_stage(shard[0], vw, D, shm, failures) for vw in (0, 1))
    try:
        w0 = [torch.arange(12.0).reshape(4, 3), torch.ones(4)]
        u0, u1, v = ([torch.full((4, 3), x), torch.full((4,), x)] for x in (0.5, 0.25, 8.0))
        vw0.initialise(2, w0)
        _push(vw0, 0, u0, failures)
        _push(vw1, 0, u1, failures)
        _push(vw1, 1, v, failures)
        vw0.pull_now(weights0, 1)
        vw1.pull_now(weights1, 1)
        both = [w + a + b for w, a, b in zip(w0, u0, u1)]
        for got0, got1, want, later in zip(weights0.params, weights1.params, both, v):
            assert torch.equal(got0, want + later if D else want), "vw 0 holds vw 1's wave 1 only where D allows"
            assert torch.equal(got1, want + later), "vw 1 holds its own wave 1 either way"
        assert not failures
    finally:
        vw0.close()
        vw1.close()


@pytest.mark.parametrize("shm", [False, True])
def test_a_bf16_job_pushes_its_wave_sums_in_bf16_and_the_shard_adds_them_as_sent(
        shard: tuple[str, ShardServicer], shm: bool) -> None:
    """push_dtype bfloat16 (train.precision bf16): half the bytes reach the shard, which adds the
    rounded sum to its float32 w_global; the stage's own pending wave stays whole (G3)."""
    address, servicer = shard
    failures: list[str] = []
    sync, weights = _stage(address, 0, 0, shm, failures, push_dtype="bfloat16")
    try:
        w0 = [torch.zeros(4, 3), torch.zeros(4)]
        u1 = [torch.full((4, 3), 1 / 3), torch.full((4,), 1 / 7)]
        u2 = [torch.full((4, 3), 1 / 9), torch.full((4,), 1 / 11)]
        sync.initialise(1, w0)
        before = servicer.received_bytes
        _push(sync, 0, u1, failures)
        assert servicer.received_bytes - before == (12 + 4) * 2, "bf16: 2 bytes an element"
        sent = [u.to(torch.bfloat16).float() for u in u1]
        assert all(not torch.equal(s, u) for s, u in zip(sent, u1)), "the case rounds"
        for key, want in zip(KEYS, sent):
            assert torch.equal(servicer.shard.values[key], want) and servicer.shard.values[key].dtype == torch.float32
        sync.after_update(2, [u.clone() for u in u2])
        sync.pull_now(weights, 1)
        for got, s, u in zip(weights.params, sent, u2):
            assert torch.equal(got, s + u), "G3: the pulled w_global (the sent wave 0) plus the whole wave 1"
    finally:
        sync.close()


def test_a_push_dtype_it_does_not_know_is_refused(shard: tuple[str, ShardServicer]) -> None:
    with pytest.raises(ValueError, match="push_dtype 'float16': one of"):
        _stage(shard[0], 0, 0, False, [], push_dtype="float16")


def test_updates_buffers_are_reused_once_neither_the_wave_sum_nor_the_pusher_needs_them(
        shard: tuple[str, ShardServicer]) -> None:
    """Sync.spare_update: a step writes its update into buffers the sync is done with, instead of
    allocating a model-sized update each step. A wave's second update is free once added; a wave's
    sum once a pull includes it and its push is acknowledged."""
    failures: list[str] = []
    sync, weights = _stage(shard[0], 0, 0, False, failures, nm=2)
    try:
        sync.initialise(1, [torch.zeros(4, 3), torch.zeros(4)])
        assert sync.spare_update() is None
        first, second = [torch.ones(4, 3), torch.ones(4)], [torch.full((4, 3), 2.0), torch.full((4,), 2.0)]
        sync.after_update(1, first)
        sync.after_update(2, second)
        assert sync.spare_update() is second and torch.equal(first[0], torch.full((4, 3), 3.0)), "added, then free"
        sync.on_wave_end(0)
        deadline = time.monotonic() + 20
        while sync.acked_waves < 1:
            assert time.monotonic() < deadline and not failures, failures
            time.sleep(0.01)
        sync.pull_now(weights, 1)
        assert sync.spare_update() is first, "wave 0's sum: pulled back and acknowledged"
        assert torch.equal(weights.params[0], torch.full((4, 3), 3.0))
    finally:
        sync.close()


@pytest.mark.parametrize("shm", [False, True])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=ON_A_GPU)])
def test_a_gpu_stages_pull_is_set_on_its_gpu_with_its_unpushed_wave(shard: tuple[str, ShardServicer], device: str,
                                                                    shm: bool) -> None:
    """A GPU stage's pull, from the shard's slot or over gRPC, reaches its GPU and is set there:
    the weights are w_global plus the stage's unpushed wave (G3), on its device."""
    failures: list[str] = []
    weights = Weights(device)
    config = SyncConfig(vw=0, nm=1, D=0, steps=4, keys=KEYS, key_shards=(0, 0), addresses=(shard[0],),
                        shared_memory=(shm,))
    callbacks = SyncCallbacks(on_failure=failures.append, wake=lambda: None, next_forward=lambda: 3)
    sync = WspSync(config, callbacks, weights.params)
    try:
        w0 = [torch.arange(12.0).reshape(4, 3), torch.ones(4)]
        u1, u2 = [torch.full((4, 3), 0.5), torch.full((4,), 0.25)], [torch.full((4, 3), 2.0), torch.full((4,), 4.0)]
        sync.initialise(1, w0)
        _push(sync, 0, [u.to(device) for u in u1], failures)
        sync.after_update(2, [u.to(device) for u in u2])
        sync.pull_now(weights, 1)
        for got, w, a, b in zip(weights.params, w0, u1, u2):
            assert got.device.type == device and torch.equal(got.cpu(), w + a + b), "G3: w_global plus wave 1"
        assert weights.merges == ["set_weights"]
        assert (sync.shm_bytes > 0) == shm and not failures
    finally:
        sync.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_A_GPU)])
def test_an_elastic_exchange_sends_the_replica_as_its_wave_left_it(shard: tuple[str, ShardServicer],
                                                                   device: str) -> None:
    """The steps after a wave's end change the weights in place, on a GPU before the exchanger
    has copied anything to the host: the shard gets the replica as the wave left it, and the
    delta alpha * (replica - master) comes back to the weights' device."""
    failures: list[str] = []
    weights = Weights(device)
    config = SyncConfig(vw=0, nm=1, D=0, steps=4, keys=KEYS, key_shards=(0, 0), addresses=(shard[0],),
                        shared_memory=(False,), sync="elastic", alpha=0.5, period=1)
    callbacks = SyncCallbacks(on_failure=failures.append, wake=lambda: None, next_forward=lambda: 2)
    sync = ElasticSync(config, callbacks, weights.params)
    try:
        w0 = [torch.arange(12.0).reshape(4, 3), torch.ones(4)]
        sync.initialise(1, w0)   # the master x~ = w0
        for p, w in zip(weights.params, w0):
            p.copy_(w + 1.0)     # the replica after wave 0
        sync.on_wave_end(0)
        for p in weights.params:
            p.add_(100.0)        # the next steps, queued right behind the exchange's copy
        deadline = time.monotonic() + 20
        while sync._arrived is None:
            assert time.monotonic() < deadline and not failures, failures
            time.sleep(0.01)
        sync.apply_pending(weights)
        for p, w in zip(weights.params, w0):
            assert p.device.type == device and torch.equal(p.cpu(), w + 101.0 - 0.5), "delta of the replica at wave 0"
        master = shard[1].shard.values
        assert torch.equal(master["0.weight"], w0[0] + 0.5) and torch.equal(master["0.bias"], w0[1] + 0.5)
        assert not failures
    finally:
        sync.close()


def _wait_acked(sync: WspSync, waves: int, failures: list[str]) -> None:
    deadline = time.monotonic() + 20
    while sync.acked_waves < waves:
        assert time.monotonic() < deadline and not failures, failures
        time.sleep(0.01)


@pytest.mark.parametrize("shm", [False, True])
def test_a_pull_merged_mid_wave_keeps_the_open_waves_updates_for_its_push(shard: tuple[str, ShardServicer],
                                                                         shm: bool) -> None:
    """nm 2: a pull merged between the two minibatches of wave 1 drops the pushed wave 0 (now in
    w_global), not the half of wave 1 summed so far: the weights keep it (G3), and wave 1's push
    carries both its minibatches (G1), so w_global ends as w0 plus every update."""
    address, servicer = shard
    failures: list[str] = []
    sync, weights = _stage(address, 0, 0, shm, failures, nm=2)
    try:
        w0 = [torch.arange(12.0).reshape(4, 3), torch.ones(4)]
        u = {p: [torch.full((4, 3), float(2 ** p)), torch.full((4,), float(3 ** p))] for p in (1, 2, 3, 4)}
        sync.initialise(1, w0)
        for p in (1, 2):
            sync.after_update(p, [t.clone() for t in u[p]])
        sync.on_wave_end(0)
        _wait_acked(sync, 1, failures)
        sync.after_update(3, [t.clone() for t in u[3]])
        sync.pull_now(weights, 1)
        for got, w, a, b, c in zip(weights.params, w0, u[1], u[2], u[3]):
            assert torch.equal(got, w + a + b + c), "G3: w_global (w0 + wave 0) plus the open wave's minibatch 3"
        sync.after_update(4, [t.clone() for t in u[4]])
        sync.on_wave_end(1)
        _wait_acked(sync, 2, failures)
        for key, w, *ups in zip(KEYS, w0, u[1], u[2], u[3], u[4]):
            assert torch.equal(servicer.shard.values[key], w + sum(ups)), f"{key}: an update was lost"
    finally:
        sync.close()


@pytest.mark.parametrize("shm", [False, True])
def test_a_pull_adds_back_every_own_wave_the_shard_has_not_applied(shard: tuple[str, ShardServicer],
                                                                   shm: bool) -> None:
    """Wave 1's push is still on its way (an emulated network holds it) and wave 2 is open when a
    pull for min_clock 1 is merged: both are added to w_global (G3), from the slot or the frames."""
    failures: list[str] = []
    sync, weights = _stage(shard[0], 0, 1, shm, failures, steps=6)
    try:
        w0 = [torch.arange(12.0).reshape(4, 3), torch.ones(4)]
        u = {p: [torch.full((4, 3), float(2 ** p)), torch.full((4,), float(3 ** p))] for p in (1, 2, 3)}
        sync.initialise(1, w0)
        _push(sync, 0, u[1], failures)
        sync.cfg = dataclasses.replace(sync.cfg, push_hold_s=5.0)   # wave 1's push waits on the "network"
        sync.after_update(2, [t.clone() for t in u[2]])
        sync.on_wave_end(1)
        sync.after_update(3, [t.clone() for t in u[3]])
        sync.pull_now(weights, 1)
        assert sync.acked_waves == 1, "wave 1 had not reached the shard"
        for got, w, a, b, c in zip(weights.params, w0, u[1], u[2], u[3]):
            assert torch.equal(got, w + a + b + c), "G3: w_global (w0 + wave 0) plus waves 1 and 2"
    finally:
        sync.close()


def test_a_stage_over_two_shards_holds_the_clock_of_the_one_behind(tmp_path: Path) -> None:
    """G2 across shards: the stage's keys live on two shards, and the first has applied one more
    wave than the second. Merged, the stage's weights are w_global through the second's c_global
    only for its keys, so its min_clock is the smaller of the two."""
    servers = []
    for i in range(2):
        servicer = ShardServicer(Shard(), Durability(str(tmp_path / f"ckpt{i}")), max_pull_wait_s=30.0)
        server = rpc.Server("127.0.0.1", 0, workers=8)
        server.add("ParameterServer", servicer)
        server.start()
        servers.append((server, servicer))
    failures: list[str] = []
    weights = Weights()
    config = SyncConfig(vw=0, nm=1, D=1, steps=4, keys=KEYS, key_shards=(0, 1),
                        addresses=tuple(s.address for s, _ in servers), shared_memory=(False, False))
    sync = WspSync(config, SyncCallbacks(on_failure=failures.append, wake=lambda: None, next_forward=lambda: 3),
                   weights.params)
    try:
        sync.initialise(1, [torch.zeros(4, 3), torch.zeros(4)])
        _push(sync, 0, [torch.ones(4, 3), torch.ones(4)], failures)
        # Wave 1 reached the first shard only (its push to the second is still on its way).
        assert servers[0][1].shard.push(0, 1, [(KEYS[0], torch.full((4, 3), 2.0))])
        sync.pull_now(weights, 1)
        assert sync.min_clock == 1, "c_global is the smallest over the shards the stage's keys live on"
        assert not failures
    finally:
        sync.close()
        for server, _ in servers:
            server.stop(grace=0)


def test_a_stopping_stage_ends_its_wait_for_w_global_at_once() -> None:
    """The final merge waits for c_global, here from a shard that never answers: a stage told to
    stop must not wait out its compute thread's join for it (StageRuntime.stop interrupts it)."""
    import threading

    weights = Weights()
    config = SyncConfig(vw=0, nm=1, D=0, steps=2, keys=KEYS, key_shards=(0, 0), addresses=("127.0.0.1:1",))
    sync = WspSync(config, SyncCallbacks(on_failure=lambda why: None, wake=lambda: None, next_forward=lambda: 3),
                   weights.params)
    ended: list[str] = []

    def final_merge() -> None:
        try:
            sync.pull_now(weights, 2)
        except RuntimeError as exc:
            ended.append(str(exc))

    thread = threading.Thread(target=final_merge, daemon=True)
    thread.start()
    time.sleep(0.3)
    started = time.monotonic()
    sync.interrupt()
    thread.join(timeout=5)
    try:
        assert not thread.is_alive() and time.monotonic() - started < 2
        assert ended == ["closed while waiting for w_global"] and weights.merges == []
    finally:
        sync.close()


def test_a_stage_closed_while_the_shard_holds_its_push_back_under_g4_ends_at_once(
        shard: tuple[str, ShardServicer]) -> None:
    """Two VWs at D 0: VW 0's push of wave 1 waits at the shard for VW 1's wave 0, which never
    comes. close() joined the pusher for 5 s before it closed the channels that would end that
    call: a stopping stage outlived the launcher's 3 s grace and was killed."""
    failures: list[str] = []
    sync, _ = _stage(shard[0], 0, 0, True, failures)
    try:
        sync.initialise(2, [torch.zeros(4, 3), torch.zeros(4)])
        _push(sync, 0, [torch.ones(4, 3), torch.ones(4)], failures)
        sync.after_update(2, [torch.ones(4, 3), torch.ones(4)])
        sync.on_wave_end(1)
        time.sleep(0.5)
        assert sync.acked_waves == 1, "the shard holds wave 1 back"
    finally:
        started = time.monotonic()
        sync.close()
    assert time.monotonic() - started < 2


def test_under_a_quorum_of_fewer_than_all_a_slow_vw_pulls_the_rounds_the_others_closed(
        shard: tuple[str, ShardServicer]) -> None:
    """No G4 bounds it: with rounds closed without it, G2 would ask for no pull until its own
    clock got to them, its wave sums (each the stage's size) piling up meanwhile. Its push's
    answer says how far the rounds are: it pulls them then, and lets go of the waves they hold."""
    failures: list[str] = []
    mode = {"sync": "quorum", "quorum": 1, "steps": 8}
    fast, _ = _stage(shard[0], 0, 0, False, failures, **mode)
    slow, slow_weights = _stage(shard[0], 1, 0, False, failures, **mode)
    try:
        w0 = [torch.zeros(4, 3), torch.zeros(4)]
        fast.initialise(2, w0)
        slow.initialise(2, w0)
        u = [torch.ones(4, 3), torch.ones(4)]
        for wave in range(5):   # the fast VW closes rounds 0..4 on its own
            _push(fast, wave, u, failures)

        def merged(n: int) -> None:   # the pull its push's answer asked for, merged at its next task
            deadline = time.monotonic() + 20
            while len(slow_weights.merges) < n:
                assert time.monotonic() < deadline and not failures, failures
                slow.apply_pending(slow_weights)
                time.sleep(0.01)

        _push(slow, 0, u, failures)   # late: it goes into round 5, still open
        merged(1)
        assert slow._have == 5 and list(slow._acc) == [0]
        _push(fast, 5, u, failures)   # closes round 5, the slow VW's wave 0 in it
        _push(slow, 1, u, failures)
        merged(2)
        assert slow._have == 6 and list(slow._acc) == [1], "its wave 0 is in a closed round: held no longer"
    finally:
        fast.close()
        slow.close()
