"""gRPC handlers of the Stage service: translate protobuf to StageRuntime calls and back."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator

import grpc

from hetpipe import cuda_ipc, link_socket, shm, wire
from hetpipe.rpc import handler
from hetpipe.v1 import stage_pb2, wire_pb2
from stage_worker.lifecycle import StageState
from stage_worker.progress import Progress
from stage_worker.runtime import StageRuntime

ProtoState = stage_pb2.StageStatus.State
PROTO_STATE = {
    StageState.IDLE: ProtoState.IDLE,
    StageState.LOADING: ProtoState.LOADING,
    StageState.READY: ProtoState.READY,
    StageState.RUNNING: ProtoState.RUNNING,
    StageState.DONE: ProtoState.DONE,
    StageState.FAILED: ProtoState.FAILED,
}


def status_message(p: Progress) -> stage_pb2.StageStatus:
    s = stage_pb2.StageStatus(state=PROTO_STATE[p.state], error=p.error, failed_at=p.failed_at, detail=p.detail)
    if p.state == StageState.IDLE:
        return s
    s.vw, s.stage, s.device = p.vw, p.stage, p.label or p.device
    s.forwards_done, s.backwards_done, s.local_version = p.forwards_done, p.backwards_done, p.local_version
    s.in_flight, s.received, s.queue_depth, s.waiting = p.in_flight, p.received, p.queue_depth, p.waiting
    s.cut, s.eval_minibatches = p.cut, p.eval_minibatches
    s.shm_bytes, s.cuda_ipc_bytes = p.shm_bytes, p.cuda_ipc_bytes
    s.link_socket_bundles = p.socket_forward_bundles + p.socket_backward_bundles
    s.last_loss, s.recent_loss, s.last_loss_minibatch = p.last_loss, p.recent_loss, p.last_loss_minibatch
    s.diverged_minibatch, s.diverged_loss = p.diverged_minibatch, p.diverged_loss
    s.wait_seconds, s.wait_idle_seconds, s.idle_seconds = p.wait_seconds, p.wait_idle_seconds, p.idle_seconds
    s.compute_seconds = p.compute_seconds
    s.clock, s.min_clock = p.clock, p.min_clock
    s.steady_minibatches, s.steady_seconds = p.steady_minibatches, p.steady_seconds
    s.weights_digest = p.weights_digest
    s.memory_used_bytes, s.memory_capacity_bytes = int(p.memory_used_bytes), int(p.memory_capacity_bytes)
    s.peak_rss_bytes, s.device_peak_bytes = p.peak_rss_bytes, p.device_peak_bytes
    for e in p.evals:
        s.evals.add(id=e.id, minibatches=e.minibatches, final=e.final, time=e.time, rows=e.rows, loss=e.loss,
                    accuracy=e.accuracy)
    return s


class StageServicer:
    def __init__(self, runtime: StageRuntime, on_stop: Callable[[], None]) -> None:
        self.runtime = runtime
        self._on_stop = on_stop
        self.reader = shm.Reader()  # activations and gradients from stages on this host
        self._ipc: cuda_ipc.Opener | None = None   # and from GPU stages on this host, to our GPU
        # Forward and backward bundles decode on two server threads: one Opener, or a share
        # mapped by both would have torch's counter of it lowered twice.
        self._ipc_lock = threading.Lock()
        self._link_socket: link_socket.Server | None = None   # made when a peer first asks for it
        self._link_socket_lock = threading.Lock()

    def _decode(self, frames: Iterable[bytes], check: Callable[[wire.Stream], None]) -> wire.Bundle:
        """An activation or gradient, in frames, through shared memory or by CUDA IPC; a GPU
        stage receives host bytes into pinned memory. check(stream) refuses a bad header before
        anything is allocated for its tensors."""
        device = self.runtime.gpu
        ipc = None
        if device is not None:
            with self._ipc_lock:
                if self._ipc is None or self._ipc.device != device:
                    self._ipc = cuda_ipc.Opener(self.reader, device)
                ipc = self._ipc
        return wire.decode(frames, check=check, reader=self.reader, pinned=device is not None, ipc=ipc)

    def close(self) -> None:
        """Ends the link socket (rpc.Server.stop calls this)."""
        with self._link_socket_lock:
            if self._link_socket is not None:
                self._link_socket.close()

    @handler
    def Assign(self, request: stage_pb2.StageAssignment, context: grpc.ServicerContext) -> wire_pb2.Ack:
        self.runtime.assign(request)
        return wire_pb2.Ack(message="assigned")

    @handler
    def Start(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> wire_pb2.Ack:
        self.runtime.start()
        return wire_pb2.Ack(message="started")

    @handler
    def Forward(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> wire_pb2.Ack:
        self._offer("Forward", request_iterator)
        return wire_pb2.Ack()

    def _offer(self, method: str, frames: Iterable[bytes]) -> None:
        """A bundle from a call, a held stream (one frame) or the link socket (wire.decode reads
        every frame, and refuses one past the bundle's end, before it is offered)."""
        if method == "Forward":
            self.runtime.offer_forward(self._decode(frames, self.runtime.check_forward))
        else:
            self.runtime.offer_backward(self._decode(frames, self.runtime.check_backward))

    @handler
    def ForwardLink(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[wire_pb2.Ack]:
        for frame in frames:   # each a whole bundle
            self._offer("Forward", [frame])
            yield wire_pb2.Ack()

    @handler
    def Backward(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> wire_pb2.Ack:
        self._offer("Backward", request_iterator)
        return wire_pb2.Ack()

    @handler
    def BackwardLink(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[wire_pb2.Ack]:
        for frame in frames:
            self._offer("Backward", [frame])
            yield wire_pb2.Ack()

    @handler
    def LinkSocket(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> stage_pb2.LinkSocketAddress:
        with self._link_socket_lock:
            if self._link_socket is None:
                self._link_socket = link_socket.Server(self._offer)
            return self._link_socket.address()

    @handler
    def Status(self, request: stage_pb2.StatusRequest, context: grpc.ServicerContext) -> stage_pb2.StageStatus:
        return status_message(self.runtime.progress(weights_digest=request.weights_digest))

    @handler
    def GetWeights(self, request: stage_pb2.WeightsRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        return wire.encode(self.runtime.weights(list(request.keys)))  # weights() runs now, inside the handler

    @handler
    def Evaluate(self, request: stage_pb2.EvalRequest, context: grpc.ServicerContext) -> wire_pb2.Ack:
        self.runtime.evaluate(int(request.min_clock))
        return wire_pb2.Ack(message="evaluating")

    @handler
    def Continue(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> wire_pb2.Ack:
        return wire_pb2.Ack(message=f"past the checkpoint of wave {self.runtime.continue_past_cut()}")

    @handler
    def Stop(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> wire_pb2.Ack:
        # Answer first, then stop: the caller should not see its own Stop cut off.
        threading.Timer(0.1, self._on_stop).start()
        return wire_pb2.Ack(message="stopping")
