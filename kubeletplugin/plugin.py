"""The node plugin process: discovery, ResourceSlice publishing, health, the kubelet's two sockets.

Start order (``KubeletPlugin.start``): NVML and discovery → devices from the node policy → driver state
recovery (checkpoint, MIG cleanup, rollbacks) → slice publishing and health monitoring → DRA socket →
registration socket (last, so the kubelet never dials an endpoint that is not listening yet).

Stop (``stop``, on SIGTERM): the registration socket goes first (the kubelet deregisters the plugin), then the
DRA socket, the slice controller, the health monitor and the MPS supervision threads. Prepared claims stay
prepared: their CDI specs, MIG devices and MPS daemons belong to running pods, and the next plugin process
takes them over from the checkpoint. ResourceSlices stay too (the kubelet wipes them if the plugin does
not come back).
"""
from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import yaml

from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME
from dra.cdi import CdiSpecWriter, ToolkitSpecs
from dra.checkpoint import DEFAULT_BOOT_ID_PATH, CheckpointStore
from dra.devices import Device, DeviceModel, build_devices
from dra.driverroot import DriverRoot, DriverRootError
from dra.hardware_sharing import MpsSupervisor, TimeSlicing
from dra.hardware_tools import MpsDaemonSpec, NvidiaSmiSharingControl, SharingControl, SharingError, \
    SimulatedSharingControl
from dra.health import HealthDevice, HealthMonitor, TaintMap
from dra.inventory import discover
from dra.policy import DEFAULT_NODE_POLICY, NodePolicy, PolicyError, parse_node_policy
from dra.slices import ApiFeatures, apply_features, desired_pool_slices
from kubeletplugin.claims import ClaimSource, KubernetesClaimSource
from kubeletplugin.claimstatus import ClaimStatusWriter, KubernetesClaimStatusWriter
from kubeletplugin.driver import Driver, StartupReport
from kubeletplugin.health import HealthBoard, health_from_taints
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.registration import RegistrationServer, supported_services
from kubeletplugin.server import DRAServer
from kubeletplugin.simulated import SimulatedDriverRoot
from kubeletplugin.sockets import DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR, SocketPaths, socket_paths

log = structlog.get_logger("kubelet-plugin")

SIMULATED_STATE_FILE = "simulated-gpus.json"


class PluginConfigError(ValueError):
    """A flag or file the plugin cannot start with; the message names it."""


@dataclass
class PluginOptions:
    """Everything ``gpu-dra kubelet-plugin`` is told (flags / environment)."""

    node_name: str
    driver_name: str = DEFAULT_DRIVER_NAME
    kubeconfig: str | None = None
    registry_dir: str = DEFAULT_REGISTRY_DIR
    plugin_dir: str | None = None          # default <plugins dir>/<driver>
    cdi_root: str = "/var/run/cdi"
    driver_root: str = "/"
    host_driver_root: str | None = None    # the driver root as the host sees it (CDI hostPaths)
    dev_root: str = "/"
    proc_root: str = "/proc"
    state_dir: str | None = None           # default: the plugin directory
    pod_uid: str | None = None             # rolling-update mode
    node_policy: str | None = None         # YAML file
    fleet: str | None = None               # simulated node: fleet file
    sim_state: str | None = None           # simulated node: GPU state file (default <state dir>/simulated-gpus.json;
                                           # "none": in memory only, gone with the process)
    compat_nvidia: bool = False
    metrics_port: int = 0                  # 0: no metrics endpoint
    health_interval: float = 10.0          # re-send period of the health stream
    boot_id_path: str = DEFAULT_BOOT_ID_PATH
    mps_supervise_interval: float = 5.0
    health_wait_ms: int = 1000             # NVML event wait per monitor round (bounds shutdown time)
    health_quiet_period: float = 300.0     # XID/ECC taints go after this many seconds without a new event (0: never)
    max_parallel: int = 8

    @property
    def plugin_directory(self) -> Path:
        return Path(self.plugin_dir or f"{DEFAULT_PLUGINS_DIR}/{self.driver_name}")

    @property
    def state_directory(self) -> Path:
        return Path(self.state_dir) if self.state_dir else self.plugin_directory

    @property
    def simulated_state_file(self) -> Path | None:
        """Where a simulated node's GPUs keep their state across plugin restarts (None: not kept)."""
        if not self.fleet or self.sim_state == "none":
            return None
        return Path(self.sim_state) if self.sim_state else self.state_directory / SIMULATED_STATE_FILE


def load_node_policy(path: str | None, fleet_policy: dict[str, Any] | None = None) -> NodePolicy:
    """The node policy from a YAML file, else the fleet node's, else the default (whole GPUs)."""
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as err:
            raise PluginConfigError(f"--node-policy {path}: {err.strerror or err}") from None
        except yaml.YAMLError as err:
            raise PluginConfigError(f"--node-policy {path}: not valid YAML: {err}") from None
        try:
            return parse_node_policy(data, path)
        except PolicyError as err:
            raise PluginConfigError(str(err)) from None
    if fleet_policy is not None:
        try:
            return parse_node_policy(fleet_policy, "fleet node policy")
        except PolicyError as err:
            raise PluginConfigError(str(err)) from None
    return DEFAULT_NODE_POLICY


class UnavailableSharingControl(SharingControl):
    """Used when the driver's tools cannot be found: every sharing action fails with the reason, so claims
    that need time-slicing or MPS fail cleanly while whole GPUs and MIG keep working."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def _fail(self) -> Any:
        raise SharingError(f"GPU sharing is unavailable on this node: {self.reason}")

    def set_time_slice(self, gpu_uuid: str, interval: str) -> None:
        self._fail()

    def get_time_slice(self, gpu_uuid: str) -> str | None:
        return None

    def set_compute_mode(self, gpu_uuid: str, mode: str) -> None:
        self._fail()

    def start_mps_daemon(self, spec: MpsDaemonSpec) -> None:
        self._fail()

    def mps_daemon_running(self, pipe_dir: str) -> bool:
        return False

    def mps_command(self, pipe_dir: str, command: str) -> str:
        return self._fail()

    def stop_mps_daemon(self, pipe_dir: str) -> None:
        return None


class KubeletPlugin:
    """One node's plugin. The seams (NVML, API client, claim source, sharing control) can be injected;
    by default they come from the options: FakeNvml (its GPU state kept in the --sim-state file, so it outlives
    the process like hardware) and simulated tools for a fleet node, pynvml and the driver's programs otherwise."""

    def __init__(
        self,
        options: PluginOptions,
        *,
        nvml: Any = None,
        api_client: Any = None,
        claim_source: ClaimSource | None = None,
        sharing: SharingControl | None = None,
        features: ApiFeatures | None = None,
        publish: bool = True,
        metrics: PluginMetrics | None = None,
        status_writer: ClaimStatusWriter | None = None,
    ) -> None:
        if options.compat_nvidia and options.driver_name == DEFAULT_DRIVER_NAME:
            options.driver_name = NVIDIA_DRIVER_NAME
        if not options.node_name:
            raise PluginConfigError("--node-name (or NODE_NAME) is required")
        self.options = options
        self.pool = options.node_name
        self._nvml = nvml
        self._api_client = api_client
        self._claim_source = claim_source
        self._sharing = sharing
        self._features = features
        self._status_writer = status_writer
        self.publish = publish
        self.metrics = metrics or PluginMetrics()
        self.paths: SocketPaths = socket_paths(options.driver_name, options.registry_dir, options.plugin_directory,
                                               options.pod_uid)
        self.health_board = HealthBoard(resend_interval=options.health_interval)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._model_lock = threading.Lock()
        self._taints: TaintMap = {}
        self.model: DeviceModel | None = None
        self.published: list[Device] = []
        self.driver: Driver | None = None
        self.monitor: HealthMonitor | None = None
        self.slices: Any = None
        self.dra_server: DRAServer | None = None
        self.registration: RegistrationServer | None = None
        self.startup: StartupReport | None = None
        self.fleet_node: Any = None
        self.nvml: Any = None

    # ----- seams ---------------------------------------------------------------------------------------------
    def _open_nvml(self) -> Any:
        if self._nvml is not None:
            return self._nvml
        if self.options.fleet:
            from dra.fakenvml_state import SimulatedStateError
            from dra.fleet import FleetError, load_fleet, nvml_for_node

            try:
                fleet = load_fleet(self.options.fleet)
                self.fleet_node = fleet.node(self.options.node_name)
            except FleetError as err:
                raise PluginConfigError(f"--fleet: {err}") from None
            state_file = self.options.simulated_state_file
            try:
                nvml = nvml_for_node(self.fleet_node, state_file=state_file)
            except SimulatedStateError as err:
                raise PluginConfigError(f"--sim-state: {err}") from None
            log.info("simulated GPUs", state_file=str(state_file) if state_file else None,
                     restored=nvml.restored)
        else:
            import pynvml as nvml

            from dra.nvmlloader import NvmlLoadError, preload_nvml

            try:
                preload_nvml(DriverRoot(self.options.driver_root))
            except (NvmlLoadError, DriverRootError) as err:
                raise PluginConfigError(f"--driver-root: {err}") from None
        nvml.nvmlInit()
        return nvml

    def _claim_status_writer(self) -> ClaimStatusWriter | None:
        """Claims read from the API server get their status.devices entries written there too."""
        if self._status_writer is not None:
            return self._status_writer
        if self._claim_source is None and self._api_client is not None:
            return KubernetesClaimStatusWriter(self._api_client, self.options.driver_name, self.pool,
                                               node_name=self.options.node_name)
        return None

    def _driver_root(self, driver_version: str) -> DriverRoot:
        o = self.options
        kwargs = dict(host_root=o.host_driver_root, dev_root=o.dev_root, proc_root=o.proc_root)
        if o.fleet:
            return SimulatedDriverRoot(o.driver_root, driver_version=driver_version, **kwargs)
        return DriverRoot(o.driver_root, **kwargs)

    def _sharing_control(self, driver_root: DriverRoot) -> SharingControl:
        if self._sharing is not None:
            return self._sharing
        if self.options.fleet:
            return SimulatedSharingControl(nvml=self.nvml)
        try:
            return NvidiaSmiSharingControl.from_driver_root(driver_root, proc_root=self.options.proc_root)
        except Exception as err:  # noqa: BLE001 - sharing is optional; whole GPUs and MIG still work
            log.warning("GPU sharing tools unavailable; time-slicing and MPS claims will fail", error=str(err))
            return UnavailableSharingControl(str(err))

    # ----- devices -------------------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Device model and published slices from the inventory, policy and current taints."""
        with self._model_lock:
            model = build_devices(self.inventory, self.policy, driver=self.options.driver_name, taints=self._taints)
            published, _, notes = apply_features(model.devices, model.counter_sets, self.features)
            self.model = model
            self.published = list(published)
            taints = dict(self._taints)
        # Health comes from the full model's taints (the server may not accept taints in slices).
        self.health_board.set_from_taints(self.pool, [d.name for d in self.published],
                                          {d.name: list(d.taints) for d in model.devices})
        self._update_device_gauges()
        if self.slices is not None:
            from controller.resourceslices import DesiredPool

            specs = desired_pool_slices(self.inventory, self.policy, self.options.driver_name, self.options.node_name,
                                        self.features, taints)
            self.slices.update({self.pool: DesiredPool.from_slice_specs(specs, self.options.node_name)})

    def devices_by_name(self) -> dict[str, Device]:
        with self._model_lock:
            return self.model.by_name() if self.model else {}

    def _update_device_gauges(self) -> None:
        prepared = self.driver.prepared_device_names() if self.driver else set()
        unhealthy = {d.name for d in self.published if health_from_taints(d.taints)[0] == "Unhealthy"}
        names = {d.name for d in self.published}
        self.metrics.set_devices(available=len(names - prepared - unhealthy), prepared=len(names & prepared),
                                 unhealthy=len(unhealthy))

    def _on_taints(self, taints: TaintMap) -> None:
        with self._model_lock:
            self._taints = {k: v for k, v in taints.items() if v}
        log.info("device health changed", tainted={k: v for k, v in self._taints.items()})
        self._rebuild()

    # ----- lifecycle -----------------------------------------------------------------------------------------
    def start(self) -> None:
        o = self.options
        self.nvml = self._open_nvml()
        self.inventory = discover(self.nvml)
        fleet_policy = self.fleet_node.policy if self.fleet_node is not None else None
        self.policy = load_node_policy(o.node_policy, fleet_policy)
        if self._api_client is None and (self.publish or self._claim_source is None):
            from controller.connect import api_client_from

            self._api_client = api_client_from(o.kubeconfig)
        if self._features is None:
            if self._api_client is None:
                self._features = ApiFeatures.all()
            else:
                from controller.serverversion import api_features

                self._features = api_features(self._api_client)
        self.features = self._features
        with self._model_lock:
            self.model = build_devices(self.inventory, self.policy, driver=o.driver_name)
        for warning in self.model.warnings:
            log.warning("node policy", detail=warning)
        log.info("GPUs discovered", node=o.node_name, gpus=[g.uuid for g in self.inventory.gpus],
                 driver_version=self.inventory.driver_version, devices=len(self.model.devices),
                 simulated=bool(o.fleet))

        driver_root = self._driver_root(self.inventory.driver_version)
        sharing = self._sharing_control(driver_root)
        state = o.state_directory
        state.mkdir(parents=True, exist_ok=True)
        vendor = f"k8s.{o.driver_name}"
        toolkit = None if o.fleet else ToolkitSpecs(dirs=("/etc/cdi", o.cdi_root), ignore_vendor=vendor)
        self.monitor = HealthMonitor(self.nvml, o.driver_name, self._health_devices(), on_change=self._on_taints,
                                     wait_timeout_ms=o.health_wait_ms,
                                     quiet_period_s=o.health_quiet_period if o.health_quiet_period > 0 else None,
                                     # simulated GPUs: `gpu-dra simulate recover` declares a GPU healthy again
                                     recoveries=getattr(self.nvml, "take_recoveries", None))
        self.driver = Driver(
            driver_name=o.driver_name, pool_name=self.pool, devices=self.devices_by_name,
            claims=self._claim_source or KubernetesClaimSource(self._api_client),
            checkpoint=CheckpointStore(state / "checkpoint.json", boot_id_path=o.boot_id_path),
            cdi=CdiSpecWriter(o.cdi_root, driver_root, vendor=vendor, toolkit=toolkit),
            nvml=self.nvml, mps=MpsSupervisor(sharing, state), time_slicing=TimeSlicing(sharing),
            compat_nvidia=o.compat_nvidia, metrics=self.metrics, max_parallel=o.max_parallel,
            serialize_lock=(state / "serialize.lock") if o.pod_uid else None, mig_listener=self.monitor,
            on_change=self._update_device_gauges, status=self._claim_status_writer(),
        )
        self.startup = self.driver.start()

        if self.publish:
            from controller.resourceslices import Owner, ResourceSliceController

            self.slices = ResourceSliceController(self._api_client, o.driver_name, Owner.node(o.node_name)).start()
        self._rebuild()
        self.monitor.start()
        self._spawn(self._run_monitor, "health-monitor")
        self._spawn(self._run_mps_supervisor, "mps-supervisor")
        if o.metrics_port:
            self.metrics.serve(o.metrics_port)

        self.dra_server = DRAServer(self.paths.dra, self.driver, health=self.health_board, metrics=self.metrics,
                                    log=structlog.get_logger("dra-service"))
        self.dra_server.start()
        self.registration = RegistrationServer(
            o.driver_name, self.paths.registration, self.paths.dra, supported_services(),
            on_status=lambda ok, err: self.metrics.registered.set(1 if ok else 0),
            log=structlog.get_logger("registration"))
        self.registration.start()
        log.info("kubelet plugin serving", registration_socket=str(self.paths.registration),
                 dra_socket=str(self.paths.dra), driver=o.driver_name, pool=self.pool)

    def _health_devices(self) -> list[HealthDevice]:
        # Static MIG devices carry their GI/CI; dynamic ones get theirs when prepared (Driver → bind_mig).
        return [HealthDevice(d.name, d.gpu_uuid, d.mig_gi_id, d.mig_ci_id) for d in self.model.devices]

    def _spawn(self, target: Any, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _run_monitor(self) -> None:
        assert self.monitor is not None
        self.monitor.run(self._stop)

    def _run_mps_supervisor(self) -> None:
        assert self.driver is not None
        while not self._stop.wait(self.options.mps_supervise_interval):
            try:
                self.driver.supervise_mps()
            except Exception:  # noqa: BLE001 - supervision must outlive one bad round
                log.exception("MPS supervision round failed")

    def stop(self) -> None:
        """Clean shutdown; prepared claims are left prepared (see the module docstring)."""
        log.info("kubelet plugin stopping")
        if self.registration is not None:
            self.registration.stop()
        if self.dra_server is not None:
            self.dra_server.stop()
        self._stop.set()
        if self.slices is not None:
            self.slices.stop()
        for t in self._threads:
            t.join(timeout=10)
        self._threads.clear()
        if self.monitor is not None:
            self.monitor.close()
        if self.driver is not None:
            self.driver.close()
        try:
            if self.nvml is not None and self._nvml is None:
                self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass
        log.info("kubelet plugin stopped")

    def run(self) -> int:
        """Start, serve until SIGTERM/SIGINT, stop. Returns the exit code."""
        done = threading.Event()

        def on_signal(signum: int, _frame: Any) -> None:
            log.info("signal received", signal=signal.Signals(signum).name)
            done.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        try:
            self.start()
            done.wait()
        finally:
            self.stop()  # also after a failed start: no socket or thread is left behind
        return 0
