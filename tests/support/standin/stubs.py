"""The generated gRPC modules, keyed by the service names plugins advertise in ``supported_versions``."""
from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

from api.generated.dra.v1 import api_pb2 as dra_v1_pb2
from api.generated.dra.v1 import api_pb2_grpc as dra_v1_grpc
from api.generated.dra.v1beta1 import api_pb2 as dra_v1beta1_pb2
from api.generated.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from api.generated.dra_health.v1 import api_pb2 as health_v1_pb2
from api.generated.dra_health.v1 import api_pb2_grpc as health_v1_grpc
from api.generated.dra_health.v1alpha1 import api_pb2 as health_v1alpha1_pb2
from api.generated.dra_health.v1alpha1 import api_pb2_grpc as health_v1alpha1_grpc
from api.generated.pluginregistration.v1 import api_pb2 as registration_pb2
from api.generated.pluginregistration.v1 import api_pb2_grpc as registration_grpc


class Service(NamedTuple):
    messages: ModuleType
    grpc: ModuleType


DRA_SERVICES: dict[str, Service] = {
    "v1.DRAPlugin": Service(dra_v1_pb2, dra_v1_grpc),
    "v1beta1.DRAPlugin": Service(dra_v1beta1_pb2, dra_v1beta1_grpc),
}

HEALTH_SERVICES: dict[str, Service] = {
    "v1.DRAResourceHealth": Service(health_v1_pb2, health_v1_grpc),
    "v1alpha1.DRAResourceHealth": Service(health_v1alpha1_pb2, health_v1alpha1_grpc),
}

# What a 1.34+ kubelet speaks, in its own preference order.
KUBELET_DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
# Health services in the kubelet's preference order (1.37: v1 first, else v1alpha1).
KUBELET_HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")

REGISTRATION = Service(registration_pb2, registration_grpc)
DRA_PLUGIN_TYPE = "DRAPlugin"
