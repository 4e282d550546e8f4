"""Server reflection under both its names: ``grpc.reflection.v1alpha`` (what
grpcio-reflection serves) and ``grpc.reflection.v1`` (what current grpcurl and Postman ask
first). The two protocols are the same messages under another package, byte for byte on
the wire, so the v1 service is the v1alpha servicer's handler registered under the v1
name, and a v1 copy of its file descriptor joins the default pool so that reflection can
describe itself under either name."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _register_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return  # already there (a second server in this process, or a v1 module)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = _V1_FILE, V1_PACKAGE
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # a message field (setting "" would break it)
                field.type_name = field.type_name.replace(old, f".{V1_PACKAGE}.")
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, f".{V1_PACKAGE}.")
            method.output_type = method.output_type.replace(old, f".{V1_PACKAGE}.")
    proto.ClearField("options")  # v1alpha's java/go package options do not apply
    pool.Add(proto)


def enable(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection of ``service_names`` (plus both reflection services) on ``server``."""
    _register_v1_descriptor()
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        V1_SERVICE, {"ServerReflectionInfo": handler}),))
