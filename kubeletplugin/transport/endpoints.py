"""The plugin's two sockets, served before anything slow is loaded or done.

The kubelet finds a starting plugin through its registration socket and then talks to its DRA socket; both
listen within a fraction of a second of the process starting, while discovery, the API server and start-up
recovery are still to come. Calls that arrive meanwhile wait for the driver (``server``); slices are published
only once the kubelet has confirmed the registration. Only the generated messages and modules of the
transport are imported here; what the command was told comes as plain arguments.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from kubeletplugin.transport.health import HealthBoard
from kubeletplugin.transport.registration import RegistrationServer, supported_services
from kubeletplugin.transport.server import DRAServer
from kubeletplugin.transport.sockets import SocketPaths, socket_paths


@dataclass
class Endpoints:
    paths: SocketPaths
    health: HealthBoard
    dra: DRAServer
    registration: RegistrationServer

    def stop(self) -> None:
        self.registration.stop()
        self.dra.stop()


def start_endpoints(driver_name: str, registry_dir: str | os.PathLike[str], plugin_dir: str | os.PathLike[str],
                    pod_uid: str | None, health_interval: float) -> Endpoints:
    """Listen on the DRA socket, then on the registration socket (the kubelet dials the DRA endpoint as soon as
    it registers the plugin), both from one grpcio server. The sockets are named as ``socket_paths`` says;
    ``health_interval`` is the health stream's re-send period."""
    paths = socket_paths(driver_name, registry_dir, plugin_dir, pod_uid)
    health = HealthBoard(resend_interval=health_interval)
    dra = DRAServer(paths.dra, None, health=health)
    registration = RegistrationServer(driver_name, paths.registration, paths.dra, supported_services(),
                                      server=dra.server)
    dra.start()
    return Endpoints(paths, health, dra, registration)
