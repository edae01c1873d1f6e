"""The node plugin process: discovery, ResourceSlice publishing, health, the kubelet's two sockets.

Start order (``KubeletPlugin.start``): NVML and discovery → node policy → /metrics and /healthz (when a port
is set) → the API server's version, waited for with back-off (``kubeletplugin.apiserver``; nothing is served
to the kubelet before it answers) → devices → driver state recovery (checkpoint, MIG cleanup, rollbacks) →
health monitoring (taints restored from the state directory) → DRA socket → registration socket (after the DRA
socket, so the kubelet never dials an endpoint that is not listening yet) → slice publishing (each pool checked
with ``dra.model.slices.validate_pool`` first), only once the kubelet has confirmed the registration
(NotifyRegistrationStatus): a pod scheduled onto our devices before the kubelet knows the driver fails its
prepare and waits for the kubelet's next pod resync, a minute by default. Until then /healthz says so.

Health over HTTP: /livez when both gRPC servers run and the registration socket answers GetInfo; /healthz and
/readyz also need the slice publisher not to be failing persistently.

Stop (``stop``, on SIGTERM): the registration socket goes first (the kubelet deregisters the plugin), then the
DRA socket, the slice controller, the health monitor and the MPS supervision threads. Prepared claims stay
prepared: their CDI specs, MIG devices and MPS daemons belong to running pods, and the next plugin process
takes them over from the checkpoint. ResourceSlices stay too (the kubelet wipes them if the plugin does
not come back).
"""
from __future__ import annotations

import signal
import threading
import time
from typing import Any, NoReturn

import grpc
import structlog

from api.names import DEFAULT_DRIVER_NAME, NVIDIA_DRIVER_NAME
from api.yamlfiles import load_yaml_file
from dra.model.devices import Device, DeviceModel, build_devices
from dra.model.policy import DEFAULT_NODE_POLICY, NodePolicy, PolicyError, parse_node_policy
from dra.model.slices import ApiFeatures, apply_features, desired_pool_slices, validate_pool
from dra.model.tenancy import tenancy_taint_key, tenancy_taints
from dra.node.checkpoint import CheckpointStore, CheckpointTooNew, CheckpointUnusable
from dra.node.driverroot import DriverRoot, DriverRootError, check_real_node
from dra.node.health import HealthDevice, HealthMonitor, TaintMap
from dra.node.inventory import discover
from dra.node.nodeobjects import GPU_NODES_ONLY, NodeObjects, NodePaths, NodeSetupError
from dra.node.processidentity import ProcessIdentity
from dra.node.sharing import MpsDaemons, TimeSlicing
from dra.node.sharingtools import MpsDaemonSpec, SharingControl, SharingError
from dra.node.taintstore import DEFAULT_FILE_NAME as TAINTS_FILE
from dra.node.taintstore import TaintStore
from kubeletplugin.apiserver import StoppedWaiting, wait_for_api_features
from kubeletplugin.claims import ClaimSource, KubernetesClaimSource
from kubeletplugin.claimstatus import ClaimStatusWriter, KubernetesClaimStatusWriter
from kubeletplugin.driver import Driver
from kubeletplugin.metrics import PluginMetrics
from kubeletplugin.options import PluginOptions
from kubeletplugin.recovery import StartupReport
from kubeletplugin.transport.endpoints import Endpoints
from kubeletplugin.transport.health import HealthBoard, health_from_taints
from kubeletplugin.transport.registration import RegistrationServer, get_info, supported_services
from kubeletplugin.transport.server import DRAServer
from kubeletplugin.transport.sockets import SocketPaths, socket_paths

log = structlog.get_logger("kubelet-plugin")

REGISTRATION_WARN_S = 30.0     # first warning that the kubelet has not registered the plugin (then doubling)
# With no MPS daemon in use the supervisor waits for a kubelet call; it also looks this often, for daemons a rolling
# update's other plugin process started (read from the shared checkpoint).
MPS_IDLE_RECHECK_S = 60.0
# After a re-registration, how long deletes of our slices (a starting kubelet wipes its node's) are undone at once.
KUBELET_WIPE_WINDOW_S = 60.0
# How long stop waits for the health monitor to leave its NVML event wait before leaving it to the process exit.
HEALTH_STOP_WAIT_S = 1.0


class PluginConfigError(ValueError):
    """A flag or file the plugin cannot start with; the message names it."""


def _is_nvml_error(err: BaseException) -> bool:
    """pynvml's errors, told apart without importing pynvml where it is not installed."""
    return any(cls.__name__ == "NVMLError" and cls.__module__ == "pynvml" for cls in type(err).__mro__)




def load_node_policy(path: str | None, fleet_policy: dict[str, Any] | None = None) -> NodePolicy:
    """The node policy from a YAML file, else the fleet node's, else the default (whole GPUs)."""
    if path:
        data = load_yaml_file(path, source=f"--node-policy {path}", error=PluginConfigError)
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

    def _fail(self) -> NoReturn:
        raise SharingError(f"GPU sharing is unavailable on this node: {self.reason}")

    def set_time_slice(self, gpu_uuid: str, interval: str) -> None:
        self._fail()

    def get_time_slice(self, gpu_uuid: str) -> str | None:
        return None

    def set_compute_mode(self, gpu_uuid: str, mode: str) -> None:
        # Without the tools no compute mode was ever changed, so going back to DEFAULT (an undo) has nothing
        # to do; failing it would leave the claim's rollback stuck for good.
        if mode != "DEFAULT":
            self._fail()

    def start_mps_daemon(self, spec: MpsDaemonSpec) -> ProcessIdentity:
        return self._fail()

    def mps_daemon(self, pipe_dir: str) -> ProcessIdentity | None:
        return None

    def mps_daemon_running(self, pipe_dir: str, daemon: ProcessIdentity) -> bool:
        return False

    def mps_command(self, pipe_dir: str, command: str) -> str:
        return self._fail()

    def stop_mps_daemon(self, pipe_dir: str, daemon: ProcessIdentity | None) -> None:
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
        endpoints: Endpoints | None = None,
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
        # Sockets already served by the command (kubeletplugin.transport.endpoints) are taken over, not opened again.
        self.endpoints = endpoints
        self.paths: SocketPaths = endpoints.paths if endpoints else socket_paths(
            options.driver_name, options.registry_dir, options.plugin_directory, options.pod_uid)
        self.health_board = endpoints.health if endpoints else HealthBoard(resend_interval=options.health_interval)
        self._stop = threading.Event()
        self._wake_publisher = threading.Event()   # the kubelet registered us, or we stop
        self._claims_changed = threading.Event()   # a kubelet call ended (the MPS supervisor looks again), or we stop
        self._threads: list[threading.Thread] = []
        self._model_lock = threading.Lock()
        self._taints: TaintMap = {}                # the health monitor's
        self._tenancy: TaintMap = {}               # MPS tenancy (dra.model.tenancy), from the prepared claims
        self.model: DeviceModel | None = None
        self.published: list[Device] = []
        self.driver: Driver | None = None
        self.monitor: HealthMonitor | None = None
        self.slices: Any = None
        self.dra_server: DRAServer | None = endpoints.dra if endpoints else None
        self.registration: RegistrationServer | None = endpoints.registration if endpoints else None
        self.startup: StartupReport | None = None
        self.fleet_node: Any = None
        self.node_objects: NodeObjects | None = None
        self.nvml: Any = None
        self.invalid_pool: tuple[str, ...] | None = None   # problems of the last pool not published, if any
        self.metrics_server: Any = None
        self._phase: str | None = "starting"               # why the plugin is not serving yet (None: serving)

    # ----- seams ---------------------------------------------------------------------------------------------
    def _node_objects(self) -> NodeObjects:
        """NVML, driver root, sharing control and CDI writer of this node (dra.node.nodeobjects): a fleet node's
        simulated ones, or the real ones from the driver root's files."""
        if self.node_objects is not None:
            return self.node_objects
        o = self.options
        paths = NodePaths(driver_root=o.driver_root, host_driver_root=o.host_driver_root, dev_root=o.dev_root,
                          proc_root=o.proc_root, cdi_hook_path=o.cdi_hook_path)
        if o.fleet:
            from dra.sim.nodeobjects import SimulatedNodeObjects

            try:
                simulated = SimulatedNodeObjects.from_fleet(o.fleet, o.node_name, paths,
                                                            state_file=o.simulated_state_file)
            except NodeSetupError as err:
                raise PluginConfigError(str(err)) from None
            self.fleet_node = simulated.node
            objects: NodeObjects = simulated
        else:
            objects = NodeObjects(paths)
        self.node_objects = objects
        return objects

    def _open_nvml(self) -> Any:
        if self._nvml is not None:
            return self._nvml
        objects = self._node_objects()
        try:
            nvml = objects.open_nvml()
        except NodeSetupError as err:
            raise PluginConfigError(str(err)) from None
        except Exception as err:
            # A node without a usable driver (no libnvidia-ml, no kernel module) is a configuration the plugin
            # cannot start with: one line and exit 2, not pynvml's traceback on every crash-loop restart.
            if objects.simulated or not _is_nvml_error(err):
                raise
            raise PluginConfigError(
                f"--driver-root {self.options.driver_root}: no usable NVIDIA driver: NVML does not load or "
                f"initialise ({err}); {GPU_NODES_ONLY} or point --driver-root at the driver's files") from None
        if objects.simulated:
            state_file = self.options.simulated_state_file
            log.info("simulated GPUs", state_file=str(state_file) if state_file else None, restored=nvml.restored)
        return nvml

    def _claim_status_writer(self) -> ClaimStatusWriter | None:
        """Claims read from the API server get their status.devices entries written there too."""
        if self._status_writer is not None:
            return self._status_writer
        if self._claim_source is None and self._api_client is not None:
            return KubernetesClaimStatusWriter(self._api_client, self.options.driver_name, self.pool,
                                               node_name=self.options.node_name)
        return None

    def _claim_events(self) -> Any:
        """Claims read from the API server get a Warning Event when their prepare fails (kube.events)."""
        if self._claim_source is not None or self._api_client is None:
            return None
        from kube.events import ClaimEventRecorder, KubernetesEventWriter

        return ClaimEventRecorder(KubernetesEventWriter(self._api_client), self.options.driver_name,
                                  self.options.node_name, log=log)

    def _sharing_control(self, driver_root: DriverRoot) -> SharingControl:
        if self._sharing is not None:
            return self._sharing
        try:
            return self._node_objects().sharing_control(driver_root, nvml=self.nvml,
                                                        state_dir=self.options.state_directory,
                                                        mps_options=self._mps_cgroup_options())
        except SharingError as err:   # sharing is optional; whole GPUs and MIG still work
            log.warning("GPU sharing tools unavailable; time-slicing and MPS claims will fail", error=str(err))
            return UnavailableSharingControl(str(err))

    def _mps_cgroup_options(self) -> dict[str, Any]:
        """Where MPS daemons are looked for (``proc_root``: their PID namespace's /proc, whose PID 1 gives the
        cgroup namespace to enter) and which cgroup they join, outside this container's (docs/mps.md)."""
        o = self.options
        return dict(proc_root=o.proc_root, cgroup=o.mps_cgroup, cgroup_root=o.mps_cgroup_root,
                    cgroup_procs=o.mps_cgroup_procs)

    # ----- devices -------------------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Device model and published slices from the inventory, policy and current taints."""
        with self._model_lock:
            taints = {name: self._taints.get(name, []) + self._tenancy.get(name, [])
                      for name in self._taints.keys() | self._tenancy.keys()}
            model = build_devices(self.inventory, self.policy, driver=self.options.driver_name, taints=taints)
            published, _, notes = apply_features(model.devices, model.counter_sets, self.features)
            self.model = model
            self.published = list(published)
        # Health comes from the full model's taints (the server may not accept taints in slices).
        self.health_board.set_from_taints(self.pool, [d.name for d in self.published],
                                          {d.name: self._health_taints(d) for d in model.devices})
        self._update_device_gauges()
        if self.slices is not None:
            self._publish(taints)

    def _publish(self, taints: TaintMap) -> None:
        """Hand the pool to the slice publisher, after checking it against the API server's ResourceSlice
        rules: an invalid pool is not sent (the server would refuse it on every retry), the slices published
        before stay, and the problems are logged once per distinct set."""
        from kube.resourceslices import DesiredPool, InvalidPoolError

        specs = desired_pool_slices(self.inventory, self.policy, self.options.driver_name, self.options.node_name,
                                    self.features, taints)
        problems = validate_pool(specs)
        if not problems:
            try:
                self.slices.update({self.pool: DesiredPool.from_slice_specs(specs, self.options.node_name)})
            except InvalidPoolError as err:
                problems = [str(err)]
        with self._model_lock:
            reported, self.invalid_pool = self.invalid_pool, tuple(problems) or None
        if problems and tuple(problems) != reported:
            log.error(f"not publishing ResourceSlices for pool {self.pool}: the pool built from this node's GPUs, "
                      f"policy and taints breaks {len(problems)} ResourceSlice rule(s); the slices published before "
                      "stay as they are", problems=problems)
        elif reported and not problems:
            log.info("ResourceSlices valid again; publishing", pool=self.pool)

    def devices_by_name(self) -> dict[str, Device]:
        with self._model_lock:
            return self.model.by_name() if self.model else {}

    def _health_taints(self, d: Device) -> list[dict[str, Any]]:
        """A device's taints that say something about its health: not the MPS tenancy one."""
        tenancy = tenancy_taint_key(self.options.driver_name)
        return [t for t in d.taints if t.get("key") != tenancy]

    def _update_device_gauges(self) -> None:
        prepared = self.driver.prepared_device_names() if self.driver else set()
        unhealthy = {d.name for d in self.published if health_from_taints(self._health_taints(d))[0] == "Unhealthy"}
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
            from kube.connect import api_client_from

            self._api_client = api_client_from(o.kubeconfig)
        if o.metrics_port:
            # Up before the wait for the API server: /healthz then says what the plugin waits for.
            try:
                self.metrics_server = self.metrics.serve(o.metrics_port, health=self.healthy, live=self.alive)
            except OSError as err:
                raise PluginConfigError(f"--metrics-port {o.metrics_port}: cannot listen: {err.strerror or err}") \
                    from None
        if self._features is None:
            if self._api_client is None:
                self._features = ApiFeatures.all()
            else:
                self._features = wait_for_api_features(self._api_client, self._stop, on_wait=self._set_phase)
        self._set_phase("starting")
        self.features = self._features
        with self._model_lock:
            self.model = build_devices(self.inventory, self.policy, driver=o.driver_name)
        for warning in self.model.warnings:
            log.warning("node policy", detail=warning)
        log.info("GPUs discovered", node=o.node_name, gpus=[g.uuid for g in self.inventory.gpus],
                 driver_version=self.inventory.driver_version, devices=len(self.model.devices),
                 simulated=bool(o.fleet))

        driver_root = self._node_objects().driver_root(self.inventory.driver_version)
        try:
            # Checked now, not at the first claim: a real node's specs need the driver's libraries and a CDI hook
            # (check_real_node); a given hook must run on any node.
            if o.fleet:
                driver_root.files()
            else:
                check_real_node(driver_root)
        except DriverRootError as err:
            raise PluginConfigError(str(err)) from None
        state = o.state_directory
        state.mkdir(parents=True, exist_ok=True)
        sharing = self._sharing_control(driver_root)
        self.monitor = HealthMonitor(self.nvml, o.driver_name, _health_devices(self.model), on_change=self._on_taints,
                                     wait_timeout_ms=o.health_wait_ms,
                                     quiet_period_s=o.health_quiet_period if o.health_quiet_period > 0 else None,
                                     # simulated GPUs: `gpu-dra simulate recover` declares a GPU healthy again
                                     recoveries=getattr(self.nvml, "take_recoveries", None),
                                     # XID/ECC taints outlive a restart: a broken GPU stays tainted
                                     store=TaintStore(state / TAINTS_FILE, boot_id_path=o.boot_id_path))
        with self._model_lock:
            # Restored taints are in the very first publish: a restart never offers a broken GPU untainted.
            self._taints = {k: v for k, v in self.monitor.taints().items() if v}
        self.driver = Driver(
            driver_name=o.driver_name, pool_name=self.pool, devices=self.devices_by_name,
            claims=self._claim_source or KubernetesClaimSource(self._api_client),
            checkpoint=CheckpointStore(state / "checkpoint.json", boot_id_path=o.boot_id_path),
            cdi=self._node_objects().cdi_writer(o.cdi_root, driver_root, vendor=f"k8s.{o.driver_name}",
                                                mps_tools=self.policy.mps.control_in_containers),
            nvml=self.nvml, mps=MpsDaemons(sharing, state, policy=self.policy.mps, mount_shm=o.mount_mps_shm),
            time_slicing=TimeSlicing(sharing),
            compat_nvidia=o.compat_nvidia, metrics=self.metrics, max_parallel=o.max_parallel,
            serialize_lock=(state / "serialize.lock") if o.pod_uid else None, mig_listener=self.monitor,
            on_change=self._after_call, status=self._claim_status_writer(),
            events=self._claim_events(),
        )
        try:
            self.startup = self.driver.start()
        except (CheckpointTooNew, CheckpointUnusable) as err:
            raise PluginConfigError(str(err)) from None

        self._start_claim_metrics()
        self._rebuild()   # the model and the health board; nothing is published before the kubelet knows us
        if self._update_tenancy():
            self._rebuild()   # the daemons' tenants, from the checkpoint: in the very first publish too
        if not self.features.device_taints and not self.policy.mps.share_across_namespaces:
            log.info("MPS tenancy is checked at prepare only: the API server has no device taints (Kubernetes "
                     "1.36+), so the scheduler cannot be told which namespace a GPU's MPS daemon serves")
        self.monitor.start()
        self._spawn(self._run_monitor, "health-monitor")
        self._spawn(self._run_mps_supervisor, "mps-supervisor")

        if self.endpoints is not None:
            assert self.dra_server is not None and self.registration is not None
            self.dra_server.attach(self.driver, self.metrics, structlog.get_logger("dra-service"))
            self.registration.servicer.on_status = self._on_registration_status
            if self.registration.state.registered:      # the kubelet registered us while we were starting
                self.metrics.registered.set(1)
        else:
            self.dra_server = DRAServer(self.paths.dra, self.driver, health=self.health_board, metrics=self.metrics,
                                        log=structlog.get_logger("dra-service"))
            self.registration = RegistrationServer(
                o.driver_name, self.paths.registration, self.paths.dra, supported_services(),
                on_status=self._on_registration_status,
                log=structlog.get_logger("registration"), server=self.dra_server.server)
            self.dra_server.start()             # both sockets: the DRA socket first
        self._set_phase(None)
        log.info("kubelet plugin serving", registration_socket=str(self.paths.registration),
                 dra_socket=str(self.paths.dra), driver=o.driver_name, pool=self.pool)
        if self.publish:
            self._spawn(self._publish_once_registered, "slice-publishing")

    def _start_claim_metrics(self) -> None:
        """Per-claim GPU metrics (kubeletplugin.claimmetrics) on the /metrics registry, when a PodResources socket
        is given."""
        o = self.options
        if not o.pod_resources_socket or self.driver is None:
            return
        from kube.podresources import PodResourcesClient
        from kubeletplugin.claimmetrics import ClaimMetricsCollector, claim_devices

        client = PodResourcesClient(o.pod_resources_socket)
        checkpoint = self.driver.checkpoint
        ClaimMetricsCollector(
            nvml=self.nvml, registry=self.metrics.registry, proc_root=o.proc_root,
            claim_devices=lambda: claim_devices(checkpoint.claims().values(), self.devices_by_name(), self.pool),
            pod_resources=lambda: client.list(o.driver_name), read_claim=self.driver.claims.get_claim,
            node_name=o.node_name)
        log.info("per-claim GPU metrics on", pod_resources_socket=o.pod_resources_socket)

    def _on_registration_status(self, registered: bool, error: str) -> None:
        self.metrics.registered.set(1 if registered else 0)
        if registered:
            self._wake_publisher.set()
        if registered and self.slices is not None:
            # A registration after the first comes from a restarted kubelet, which deletes its node's slices
            # when it starts, possibly after this call: publish again now, and for a while restore deleted
            # slices at once rather than after the publisher's repair delay (30 s).
            self.slices.resync(prompt_for=KUBELET_WIPE_WINDOW_S)

    def _publish_once_registered(self) -> None:
        """Starts the slice publisher once the kubelet has confirmed the registration: a pod the scheduler
        bound to a device of ours before that would have its prepare refused ("driver not registered") and
        wait for the kubelet's next pod resync, a minute by default."""
        from kube.resourceslices import Owner, ResourceSliceController

        assert self.registration is not None
        started, warn_at = time.monotonic(), REGISTRATION_WARN_S
        # Woken by the registration (_on_registration_status) or stop, not by polling.
        while True:
            self._wake_publisher.clear()
            if self.registration.state.registered or self._stop.is_set():
                break
            self._wake_publisher.wait(max(0.0, started + warn_at - time.monotonic()))
            waited = time.monotonic() - started
            if waited >= warn_at:
                log.warning("no ResourceSlices published yet: the kubelet has not registered the plugin",
                            waited_seconds=round(waited), registration_socket=str(self.paths.registration))
                warn_at *= 2
        if self._stop.is_set():
            return
        o = self.options
        self.slices = ResourceSliceController(self._api_client, o.driver_name, Owner.node(o.node_name)).start()
        self._rebuild()   # publishes, with the taints of now

    # ----- health --------------------------------------------------------------------------------------------
    def _set_phase(self, phase: str | None) -> None:
        self._phase = phase

    def alive(self) -> tuple[bool, str]:
        """/livez: both gRPC servers run and the registration socket answers GetInfo (what a restart cures)."""
        if self._phase is not None:
            return False, self._phase
        if self.dra_server is None or not self.dra_server.running:
            return False, "the DRA gRPC server is not running"
        if self.registration is None or not self.registration.running:
            return False, "the registration gRPC server is not running"
        path = self.paths.registration
        try:
            info = get_info(path, timeout=2)
        except grpc.RpcError as err:
            return False, f"registration socket {path} does not answer GetInfo: {err.code().name}: {err.details()}"
        if info.name != self.options.driver_name:
            return False, f"registration socket {path} answers for driver {info.name!r}"
        return True, "ok"

    def healthy(self) -> tuple[bool, str]:
        """/healthz and /readyz: alive, and the slice publisher is not failing persistently (a pool failing
        for ``publish_failure_grace`` seconds, or one too invalid to send)."""
        ok, reason = self.alive()
        if not ok:
            return ok, reason
        if self.publish and self.slices is None:
            return False, "ResourceSlices not published yet: waiting for the kubelet to register the plugin"
        with self._model_lock:
            invalid = self.invalid_pool
        if invalid:
            return False, f"ResourceSlices of pool {self.pool} not published: {len(invalid)} problem(s), see the log"
        if self.slices is not None:
            for pool, (seconds, error) in sorted(self.slices.failing().items()):
                if seconds >= self.options.publish_failure_grace:
                    return False, f"publishing ResourceSlices of pool {pool} has failed for {seconds:.0f} s: {error}"
        return True, "ok"

    def _spawn(self, target: Any, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _run_monitor(self) -> None:
        assert self.monitor is not None
        self.monitor.run(self._stop)

    def _after_call(self) -> None:
        if self._update_tenancy():
            self._rebuild()
        else:
            self._update_device_gauges()
        self._claims_changed.set()

    def _update_tenancy(self) -> bool:
        """The MPS tenancy taints of the prepared claims now; whether they changed. Servers without device
        taints (before 1.36) get none: the prepare-time refusal is then the only check (logged at start)."""
        if self.driver is None or self.model is None or not self.features.device_taints:
            return False
        tenants = self.driver.mps_tenants()
        tenancy = tenancy_taints(self.model.devices, tenants, self.options.driver_name)
        with self._model_lock:
            if tenancy == self._tenancy:
                return False
            self._tenancy = tenancy
        untolerated = sorted(f"{gpu} ({t.namespace})" for gpu, t in tenants.items() if not t.tolerated)
        log.info("MPS tenancy taints changed", tainted_devices=len(tenancy),
                 namespaces=sorted({t.namespace for t in tenants.values() if t.tolerated}),
                 untainted_gpus_claims_without_toleration=untolerated or None)
        return True

    def _run_mps_supervisor(self) -> None:
        """Every ``mps_supervise_interval`` while a claim uses an MPS daemon, restart the dead ones; with none in use,
        wait for a kubelet call (or ``MPS_IDLE_RECHECK_S``) instead of polling."""
        assert self.driver is not None
        while not self._stop.is_set():
            self._claims_changed.clear()      # before the look: a call ending after it wakes the wait below
            if self.driver.actions.mps_devices_in_use():
                if self._stop.wait(self.options.mps_supervise_interval):
                    return
            elif self._claims_changed.wait(MPS_IDLE_RECHECK_S):
                continue                      # a call changed the claims (or we stop): look again
            if self._stop.is_set():
                return
            try:
                self.driver.supervise_mps()
            except Exception:  # noqa: BLE001 - supervision must outlive one bad round
                log.exception("MPS supervision round failed")

    def stop(self) -> None:
        """Clean shutdown; prepared claims are left prepared (see the module docstring)."""
        # A start that failed before NVML opened had nothing running: its one-line error says it all.
        quiet = self.nvml is None and self.driver is None
        if not quiet:
            log.info("kubelet plugin stopping")
        self._set_phase("stopping")
        if self.registration is not None:
            self.registration.stop()
        if self.dra_server is not None:
            self.dra_server.stop()
        self._stop.set()
        self._wake_publisher.set()
        self._claims_changed.set()
        nvml_waiting = False
        for t in self._threads:
            # The health monitor may be inside an NVML event wait (up to options.health_wait_ms, not interruptible):
            # stopping does not wait for it, and its event set and NVML stay open for the process exit to free.
            t.join(timeout=HEALTH_STOP_WAIT_S if t.name == "health-monitor" else 10)
            nvml_waiting = nvml_waiting or (t.name == "health-monitor" and t.is_alive())
        self._threads.clear()
        # After the threads: the one that starts the publisher has finished by now.
        if self.slices is not None:
            self.slices.stop()
        if self.monitor is not None and not nvml_waiting:
            self.monitor.close()
        if self.driver is not None:
            self.driver.close()
        try:
            if self.nvml is not None and self._nvml is None and not nvml_waiting:
                self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None
        if not quiet:
            log.info("kubelet plugin stopped")

    def run(self) -> int:
        """Start, serve until SIGTERM/SIGINT, stop. Returns the exit code."""
        done = threading.Event()

        def on_signal(signum: int, _frame: Any) -> None:
            log.info("signal received", signal=signal.Signals(signum).name)
            done.set()
            self._stop.set()   # also ends a start that is still waiting for the API server
            self._wake_publisher.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        try:
            self.start()
            done.wait()
        except StoppedWaiting:
            log.info("stopped before the API server answered")
        finally:
            self.stop()  # also after a failed start: no socket or thread is left behind
        return 0


def _health_devices(model: DeviceModel) -> list[HealthDevice]:
    # Static MIG devices carry their GI/CI; dynamic ones get theirs when prepared (Driver → bind_mig).
    return [HealthDevice(d.name, d.gpu_uuid, d.mig_gi_id, d.mig_ci_id) for d in model.devices]
