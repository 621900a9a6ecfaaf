"""Registering gRPC services whose request deserializers never raise.

grpc.aio turns an exception raised by a request deserializer into UNKNOWN ("Unexpected
<class DecodeError>") and logs its traceback, once per such request: a client sending
bad bytes (invalid UTF-8 in a string field, a truncated message) to any method (ours,
health's, reflection's) could flood the log. `add_lenient_service` registers a servicer
from its service descriptor with deserializers that return `_Undecodable` instead, and
handlers that answer it with INVALID_ARGUMENT ("request: not a valid <Message> (...)")
and one debug log line; valid requests reach the servicer unchanged. Every kind of
method is covered: unary and server-streaming (Jaxserve, health), and bidirectional
streaming (reflection), where each message of the request stream is checked.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

logger = logging.getLogger("jaxserve.frontend")


class _Undecodable:
    """What the lenient deserializer gives for bytes that are not a valid request message."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _lenient_deserializer(message_class: type[Message]) -> Callable[[bytes], object]:
    """`message_class.FromString` that returns `_Undecodable` instead of raising."""
    name = message_class.DESCRIPTOR.name

    def deserialize(data: bytes) -> object:
        try:
            return message_class.FromString(data)
        except DecodeError as e:
            return _Undecodable(f"request: not a valid {name} ({e})")
        except Exception as e:  # e.g. RecursionError on deeply nested bytes
            return _Undecodable(f"request: not a valid {name} ({type(e).__name__})")

    return deserialize


async def _reject_undecodable(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
    logger.debug("rejected an undecodable request: %s", request.message)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def _checked_handler(method, client_streaming: bool, server_streaming: bool):
    """`method` behind a check that answers `_Undecodable` requests with INVALID_ARGUMENT."""
    if client_streaming:

        async def bidi(request_iterator, context):
            async def checked():
                async for request in request_iterator:
                    if isinstance(request, _Undecodable):
                        await _reject_undecodable(request, context)
                    yield request

            async with contextlib.aclosing(method(checked(), context)) as responses:
                async for response in responses:
                    yield response

        return bidi

    if server_streaming:

        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await _reject_undecodable(request, context)
            # aclosing: the servicer's generator runs its cleanup (aborting the request in
            # the engine) when this one is closed, not whenever it is garbage-collected.
            async with contextlib.aclosing(method(request, context)) as responses:
                async for response in responses:
                    yield response

        return stream

    async def unary(request, context):
        if isinstance(request, _Undecodable):
            await _reject_undecodable(request, context)
        return await method(request, context)

    return unary


_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_lenient_service(servicer, service: ServiceDescriptor, server: grpc.aio.Server) -> None:
    """Register `servicer` (an object with one async method per RPC of `service`) like a
    generated `add_*Servicer_to_server`, with deserializers that never raise.

    Raises NotImplementedError for a client-streaming method with a unary response
    (none of the services served here has one).
    """
    handlers = {}
    for method in service.methods:
        key = (method.client_streaming, method.server_streaming)
        if key not in _MAKERS:
            raise NotImplementedError(f"{method.name}: client streaming is not handled")
        handlers[method.name] = _MAKERS[key](
            _checked_handler(getattr(servicer, method.name), *key),
            request_deserializer=_lenient_deserializer(GetMessageClass(method.input_type)),
            response_serializer=GetMessageClass(method.output_type).SerializeToString,
        )
    name = service.full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)
