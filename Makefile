# The two set-up commands of the README: `make demo` (main job) and `make test` (all tests).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test unit e2e bench control-plane protos clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

# Builds (or reuses) etcd, kube-apiserver, kube-scheduler, kube-controller-manager and kubectl
# in ~/.cache/gpu-dra/k8s/<version>/bin.
control-plane:
	bash hack/build-control-plane.sh

demo: $(STAMP) control-plane
	$(VENV)/bin/gpu-dra demo

test: $(STAMP) control-plane
	$(PY) -m pytest

unit: $(STAMP)
	$(PY) -m pytest -m 'not e2e'

e2e: $(STAMP) control-plane
	$(PY) -m pytest -m e2e

bench: $(STAMP)
	$(PY) -m bench

protos: $(STAMP)
	bash hack/gen-protos.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
