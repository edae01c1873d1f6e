"""A kubelet stand-in for tests: plugin registration, NodePrepareResources / NodeUnprepareResources with the
kubelet's answer checks, the health stream, and pod-level prepare/unprepare with the kubelet's claim cache.
Also a CDI resolver that reads spec files the way a container runtime does."""
from standin.cdi import CdiError, ContainerEdits
from standin.cdi import resolve as resolve_cdi
from standin.dra_client import DraCallError, DraClient, HealthUpdate, HealthWatch
from standin.kubelet import (
    EXTENDED_RESOURCE_CLAIM,
    Call,
    DriverNotRegistered,
    KubeletStandin,
    PodNotReady,
    PodPrepareError,
    PodUnprepareError,
    PreparedPod,
)
from standin.registry import PluginWatcher, RegisteredPlugin, RegistrationError
from standin.rules import AllocatedDevice, ClaimOutcome, ClaimRef, PreparedDevice, ProtocolViolation

__all__ = [
    "EXTENDED_RESOURCE_CLAIM", "AllocatedDevice", "Call", "CdiError", "ClaimOutcome", "ClaimRef", "ContainerEdits",
    "DraCallError", "DraClient",
    "DriverNotRegistered", "HealthUpdate", "HealthWatch", "KubeletStandin", "PluginWatcher", "PodNotReady",
    "PodPrepareError", "PodUnprepareError", "PreparedDevice", "PreparedPod", "ProtocolViolation", "RegisteredPlugin",
    "RegistrationError", "resolve_cdi",
]
