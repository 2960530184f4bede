"""The name of the server's gRPC service, as grpc.health.v1 (readiness), reflection and probes know it."""

from retopk_proto.retopk.v1 import retopk_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ReTopKService"].full_name  # "retopk.v1.ReTopKService"
