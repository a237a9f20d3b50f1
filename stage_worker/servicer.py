"""gRPC handlers of the Stage service: translate protobuf to StageRuntime calls and back."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc
from google.protobuf import message_factory

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
    def Status(self, request: stage_pb2.StatusRequest, context: grpc.ServicerContext) -> stage_pb2.StageStatus:
        return self.runtime.status(weights_digest=request.weights_digest)

    @handler
    def GetWeights(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> Iterator[wire_pb2.TensorFrame]:
        return wire.encode(self.runtime.weights())  # weights() runs now, inside the handler

    @handler
    def Stop(self, request: wire_pb2.Empty, context: grpc.ServicerContext) -> wire_pb2.Ack:
        # Answer first, then stop: the caller should not see its own Stop cut off.
        threading.Timer(0.1, self._on_stop).start()
        return wire_pb2.Ack(message="stopping")


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_to_server(servicer: StageServicer, server: grpc.Server) -> None:
    """Registers the Stage service as the generated add_StageServicer_to_server does, except that
    TensorFrame streams reach the handlers as raw bytes: wire.decode then copies data frames
    straight into the tensors instead of parsing each into a protobuf object first.
    """
    service = stage_pb2.DESCRIPTOR.services_by_name["Stage"]
    handlers = {}
    for method in service.methods:
        raw = method.client_streaming and method.input_type is wire_pb2.TensorFrame.DESCRIPTOR
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        handlers[method.name] = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)](
            getattr(servicer, method.name),
            request_deserializer=None if raw else request.FromString,
            response_serializer=response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
