"""gRPC handlers of the Stage service: translate protobuf to StageRuntime calls and back."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc

from hetpipe import wire
from hetpipe.rpc import handler
from hetpipe.v1 import stage_pb2, stage_pb2_grpc, wire_pb2
from stage_worker.runtime import StageRuntime


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, runtime: StageRuntime, on_stop: Callable[[], None]) -> None:
        self.runtime = runtime
        self._on_stop = on_stop

    @handler
    def Assign(self, request: stage_pb2.StageAssignment, context: grpc.ServicerContext) -> wire_pb2.Ack:
        self.runtime.assign(request)
        return wire_pb2.Ack(message="assigned")

    @handler
    def LoadWeights(self, request_iterator: Iterator[wire_pb2.TensorFrame], context: grpc.ServicerContext) -> wire_pb2.Ack:
        self.runtime.load_weights(wire.decode(request_iterator))
        return wire_pb2.Ack(message="weights loaded")

    @handler
    def Start(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> wire_pb2.Ack:
        self.runtime.start()
        return wire_pb2.Ack(message="started")

    @handler
    def Forward(self, request_iterator: Iterator[wire_pb2.TensorFrame], context: grpc.ServicerContext) -> wire_pb2.Ack:
        self.runtime.offer_forward(wire.decode(request_iterator))
        return wire_pb2.Ack()

    @handler
    def Backward(self, request_iterator: Iterator[wire_pb2.TensorFrame], context: grpc.ServicerContext) -> wire_pb2.Ack:
        self.runtime.offer_backward(wire.decode(request_iterator))
        return wire_pb2.Ack()

    @handler
    def Status(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> stage_pb2.StageStatus:
        return self.runtime.status()

    @handler
    def GetWeights(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> Iterator[wire_pb2.TensorFrame]:
        return wire.encode(self.runtime.weights())  # weights() runs now, inside the handler

    @handler
    def Stop(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> wire_pb2.Ack:
        # Answer first, then stop: the caller should not see its own Stop cut off.
        threading.Timer(0.1, self._on_stop).start()
        return wire_pb2.Ack(message="stopping")
