# The two set-up commands of the README: `make demo` (main job) and `make test` (all tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
# K8S_VERSION (the target release), K8S_SKEW_VERSION (the oldest supported one), ETCD_VERSION.
include hack/versions.env

.PHONY: demo test lint unit e2e bench bench-peer peer-driver control-plane control-plane-target control-plane-skew node-binaries helm prometheus kueue cdi-tools cdi-hook cdi-hook-arm64 cdi-validate oci-tools crane registry image image-index image-lock release protos clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

# Builds (or reuses) etcd, kube-apiserver, kube-scheduler, kube-controller-manager and kubectl
# in ~/.cache/gpu-dra/k8s/<version>/bin: the target release, and the oldest supported release for the
# version-skew tests.
control-plane: control-plane-target control-plane-skew

control-plane-target:
	K8S_VERSION=$(K8S_VERSION) ETCD_VERSION=$(ETCD_VERSION) bash hack/build-control-plane.sh

control-plane-skew:
	K8S_VERSION=$(K8S_SKEW_VERSION) ETCD_VERSION=$(ETCD_VERSION) bash hack/build-control-plane.sh

# Builds (or reuses) what a real node runs: kubelet (next to the control plane of the target release, from
# its go.mod), containerd, ctr, containerd-shim-runc-v2 and runc (CONTAINERD_VERSION, RUNC_VERSION) and the
# pause and busybox test images as OCI archives, linked together in ~/.cache/gpu-dra/node/<versions>/.
node-binaries: control-plane-target
	K8S_VERSION=$(K8S_VERSION) CONTAINERD_VERSION=$(CONTAINERD_VERSION) RUNC_VERSION=$(RUNC_VERSION) bash hack/build-node.sh

# Builds (or reuses) Helm (HELM_VERSION) from its Go module into ~/.cache/gpu-dra/helm/<version>/bin: the chart
# tests run `helm lint` and `helm template` with it.
helm:
	HELM_VERSION=$(HELM_VERSION) bash hack/build-helm.sh

# Builds (or reuses) Prometheus and promtool (PROMETHEUS_VERSION) from Prometheus' Go module into
# ~/.cache/gpu-dra/prometheus/<version>/bin (about 5 minutes cold on 2 cores): the metrics tests scrape the kubelet
# plugin with it and run the Grafana dashboard's queries; promtool checks the scrape configs.
prometheus:
	PROMETHEUS_VERSION=$(PROMETHEUS_VERSION) bash hack/build-prometheus.sh

# Builds (or reuses) the Kueue manager (KUEUE_VERSION) from its Go module into ~/.cache/gpu-dra/kueue/<version>/bin,
# with its CRDs in .../crd (about 4 minutes cold on 2 cores): the quota tests run it against the local control
# plane with DRA device class mappings (docs/quota.md).
kueue:
	KUEUE_VERSION=$(KUEUE_VERSION) bash hack/build-kueue.sh

# Builds (or reuses) the CDI programs into ~/.cache/gpu-dra: nvidia-cdi-hook (NVIDIA_CTK_VERSION, from the NVIDIA
# Container Toolkit's Go module; the hook every CDI spec of the driver runs, shipped in the image) and cdi-validate
# (hack/cdi-validate: the CDI reference library's parser and validator, which the tests run on every spec).
cdi-tools: cdi-hook cdi-validate

cdi-hook:
	NVIDIA_CTK_VERSION=$(NVIDIA_CTK_VERSION) bash hack/build-cdi-tools.sh hook

# The arm64 image's nvidia-cdi-hook, cross-compiled (cgo, static) with Debian's aarch64 gcc, which
# hack/build-cross-cc.sh downloads and unpacks into the cache (never installed).
cdi-hook-arm64:
	HOOK_ARCH=arm64 NVIDIA_CTK_VERSION=$(NVIDIA_CTK_VERSION) bash hack/build-cdi-tools.sh hook

# Builds (or reuses) crane (CRANE_VERSION, from go-containerregistry's Go module: `make release` pushes the image
# with it) and the CNCF distribution registry (DISTRIBUTION_VERSION: the release test's registry) into
# ~/.cache/gpu-dra/crane/ and ~/.cache/gpu-dra/registry/.
oci-tools: crane registry

crane:
	bash hack/build-oci-tools.sh crane

registry:
	bash hack/build-oci-tools.sh registry

cdi-validate:
	bash hack/build-cdi-tools.sh validate

# The driver image as an OCI archive, without Docker or a registry: Debian packages and wheels pinned in
# deploy/image/*.lock, cached by input hash under ~/.cache/gpu-dra/image. Prints the image name and the archive's
# path (deploy/README.md: pushing it). IMAGE_REPOSITORY=... IMAGE_TAG=... name it otherwise.
image: $(STAMP) cdi-hook
	$(PY) hack/build-image.py build

# The image for linux/amd64 and linux/arm64 as one OCI image index, in an OCI layout directory under
# ~/.cache/gpu-dra/image/indexes (what `make release` pushes); the layers are the archive's, cached the same way.
image-index: $(STAMP) cdi-hook cdi-hook-arm64
	$(PY) hack/build-image.py index

# Re-resolves deploy/image/*.lock for amd64 and arm64: Debian packages with apt (a private state updated from this
# host's sources, Debian 12), wheels from PyPI.
image-lock: $(STAMP)
	$(PY) hack/build-image.py lock

# A release of the commit checked out (a clean tree): VERSION=X.Y.Z REGISTRY=host[:port]/path [DOWNLOAD_URL=...].
# Pushes the image index and the chart, writes the Python distribution and the krew archive into dist/
# (docs/releasing.md; hack/release.py).
release: $(STAMP) helm crane cdi-hook cdi-hook-arm64
	$(PY) hack/release.py --version "$(VERSION)" --registry "$(REGISTRY)" --download-url "$(DOWNLOAD_URL)"

# The demo runs on the target release only. Its real nodes (one per fleet node; --real-nodes N) are optional:
# not root, no cgroups or node binaries that cannot be built (no Go, gcc, libseccomp download), and the demo says
# why in one line and only schedules.
demo: $(STAMP) control-plane-target
	-@[ "$$(id -u)" != 0 ] || K8S_VERSION=$(K8S_VERSION) CONTAINERD_VERSION=$(CONTAINERD_VERSION) \
	  RUNC_VERSION=$(RUNC_VERSION) bash hack/build-node.sh >/dev/null
	-@[ "$$(id -u)" != 0 ] || NVIDIA_CTK_VERSION=$(NVIDIA_CTK_VERSION) bash hack/build-cdi-tools.sh hook >/dev/null
	$(VENV)/bin/gpu-dra demo

test: $(STAMP) control-plane node-binaries helm prometheus kueue cdi-tools image image-index oci-tools
	$(MAKE) --no-print-directory lint
	$(PY) -m pytest

# ruff (pyflakes, import order, the rules the noqa comments name) and mypy (strict; pyproject.toml says where not
# and why), both configured in pyproject.toml; and every noqa says why after " - ".
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	@! grep -rnP --include='*.py' --exclude-dir=.venv --exclude-dir=build --exclude-dir=generated \
	  '# noqa(?!: [A-Z]+[0-9]+(, [A-Z]+[0-9]+)* - \S)' . || { echo 'a noqa without its reason: # noqa: CODE - why'; exit 1; }

unit: $(STAMP) cdi-validate prometheus
	$(PY) -m pytest -m 'not e2e'

e2e: $(STAMP) control-plane node-binaries helm prometheus cdi-tools image image-index oci-tools
	$(PY) -m pytest -m e2e

# BENCH_ARGS goes to python -m bench, e.g. make bench BENCH_ARGS="--quick" or BENCH_ARGS="--peer-bin PATH".
bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)

# Side by side with the Go reference driver's kubelet plugin on the real node (root, make node-binaries): builds
# it (hack/build-peer-driver.sh, needs the Go module proxy; PEER_SOURCE: a local clone to build from) and runs
# python -m bench --peer-bin. Only on request: nothing else depends on it.
bench-peer: $(STAMP) node-binaries cdi-hook
	$(PY) -m bench --peer-bin "$$(bash hack/build-peer-driver.sh $(PEER_SOURCE) | tail -n 1)" $(BENCH_ARGS)

peer-driver:
	bash hack/build-peer-driver.sh $(PEER_SOURCE)

protos: $(STAMP)
	bash hack/gen-protos.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
