"""Elastic averaging for one stage (parallel.sync elastic, EA-Pipe): the stage's local weights are
its VW's replica x_i; after every `period` waves (and after the last) it exchanges them with the
shards' master x~. The rules are hetpipe/elastic.py's and the shard's; this is the driver."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from hetpipe import rpc, wire
from hetpipe.elastic import exchange_after, total_exchanges, waves_covered
from hetpipe.v1 import wire_pb2
from stage_worker import host_copies
from stage_worker.sync import SyncCallbacks, SyncConfig, Weights, in_parallel
from stage_worker.wsp_sync import PUSH_GIVE_UP_S, WspSync


class ElasticSync(WspSync):
    """No summed updates are pushed and no VW waits for another. An exchange sends the replica as
    it is at the end of its wave; each shard answers delta = alpha * (x_i - x~), which it has
    added to x~ once; the stage subtracts it from its replica between tasks, as a pull is merged.
    At most one exchange is in flight, and the next one is sent only once the previous delta is
    merged, so every exchange sees all the earlier ones (the paper's sequential order).

    WspSync gives the channels, Init, retries, the final pull of the master (pull_now: the final
    model is x~) and the ledger, which here sums the deltas the shards acknowledged: x~ = w0 +
    the sum of every VW's acknowledged deltas (O3's form for elastic). The compute thread calls
    every public method; the exchanger thread only talks gRPC and hands the deltas over."""

    def __init__(self, config: SyncConfig, callbacks: SyncCallbacks, params: Sequence[torch.Tensor]) -> None:
        super().__init__(config, callbacks, params)
        self.total_exchanges = total_exchanges(self.total_waves, config.period)
        self._due: list[int] = []         # exchanges whose wave has ended, not yet sent
        self._sent: int | None = None     # the exchange in flight (compute thread only)
        self._arrived: tuple[int, list[torch.Tensor], float, float] | None = None  # under _lock
        self._merged = 0

    def forward_allowed(self, p: int) -> bool:
        return True  # no G2: elastic VWs never wait for each other

    def after_update(self, p: int, update: list[torch.Tensor]) -> None:
        self._recycle(update)  # the replica holds the VW's own updates; nothing is summed or pushed

    def on_wave_end(self, wave: int) -> None:
        self._clock = wave + 1
        exchange = exchange_after(wave, self.cfg.period, self.total_waves)
        if self.keys and exchange is not None:
            self._due.append(exchange)
            self._send_due()

    def apply_pending(self, weights: Weights) -> None:
        super().apply_pending(weights)  # the final pull of the master, if one was asked for
        with self._lock:
            arrived, self._arrived = self._arrived, None
        if arrived is None:
            return
        exchange, deltas, sent, replied = arrived
        weights.set_weights([p.detach() - d.to(p.device) for p, d in zip(self._params, deltas)])
        self.record.acknowledged(deltas)   # with output.ledger only
        self._merged += 1
        self._acked_waves = waves_covered(self._merged, self.cfg.period, self.total_waves)
        self._sent = None
        self.record.write({"event": "exchange", "clock": exchange, "sent": sent, "replied": replied,
                          "merged": time.time()})
        self._send_due()

    def finished(self) -> bool:
        return not self.keys or self._merged == self.total_exchanges

    def _send_due(self) -> None:
        """Sends the next due exchange with the replica as it is now, unless one is in flight."""
        if self._sent is not None or not self._due:
            return
        exchange = self._due.pop(0)
        # A copy where the weights are (on a GPU, one kernel queued on the compute stream): the
        # steps that follow change the weights in place. The exchanger moves it to the host.
        replica = [p.detach().clone() for p in self._params]
        self._sent = exchange
        self._start("exchanger", self._exchange, exchange, replica, host_copies.marker(replica))

    def _exchange(self, exchange: int, replica: list[torch.Tensor], made: object) -> None:
        started, sent = time.perf_counter(), time.time()
        # From a GPU through pinned memory on a side stream, once the copy above is made: the
        # compute thread neither waits for it nor for the deltas' way back (to_device below).
        replica, ready = host_copies.to_host(replica, "push", after=made)
        if ready is not None:
            ready.synchronize()
        if self.cfg.push_hold_s > 0 and self._closed.wait(self.cfg.push_hold_s):  # an emulated network
            return

        def one(shard: int, idx: list[int]) -> wire.Bundle:
            tag = wire_pb2.ExchangeTag(vw=self.cfg.vw, clock=exchange)
            tensors = [(self.keys[i], replica[i]) for i in idx]
            stub = self._stubs[shard]
            return self._retrying(f"exchange {exchange}", shard, PUSH_GIVE_UP_S, lambda: wire.decode(
                stub.Exchange(wire.encode(tensors, exchange=tag), timeout=rpc.DATA_DEADLINE_S), pinned=self._on_gpu))

        deltas: dict[str, torch.Tensor] = {}
        for bundle in in_parallel(lambda item: one(*item), list(self._by_shard().items())):
            deltas.update(bundle.named())
        missing = [k for k in self.keys if k not in deltas]
        if missing:
            raise RuntimeError(f"exchange {exchange}: the shards answered without deltas for {missing[:5]}")
        if self.cfg.pull_hold_s > 0 and self._closed.wait(self.cfg.pull_hold_s):
            return
        self.cb.observe_push(time.perf_counter() - started)
        ordered = [deltas[k] for k in self.keys]
        if self._on_gpu:
            ordered = host_copies.to_device(ordered, self._device, "pull")
        with self._lock:
            self._arrived = (exchange, ordered, sent, time.time())
        self.cb.wake()
