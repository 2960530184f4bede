"""Standard gRPC health checking (``grpc.health.v1.Health/Check``) without grpcio-health-checking.

The client must install with grpcio and protobuf only, so the two tiny messages of health.proto
are declared here in a private descriptor pool (never the default one, where the real package may
register the same names) and called through a plain unary method.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

METHOD = "/grpc.health.v1.Health/Check"
# HealthCheckResponse.ServingStatus
STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _message_classes():
    f = descriptor_pb2.FileDescriptorProto(name="retopk_client/grpc_health_v1.proto", package="grpc.health.v1")
    f.syntax = "proto3"
    req = f.message_type.add(name="HealthCheckRequest")
    req.field.add(name="service", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    resp = f.message_type.add(name="HealthCheckResponse")
    resp.field.add(name="status", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
                   label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)  # an enum on the wire is a varint
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return (
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
        message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")),
    )


HealthCheckRequest, HealthCheckResponse = _message_classes()


def check_method(channel):
    """The Health/Check callable on a sync or asyncio channel."""
    return channel.unary_unary(
        METHOD, request_serializer=HealthCheckRequest.SerializeToString,
        response_deserializer=HealthCheckResponse.FromString,
    )


def status_name(response) -> str:
    return STATUS_NAMES.get(response.status, str(response.status))
