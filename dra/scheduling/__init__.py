"""The scheduler's allocator inputs as a pure replica, for the operator tools that must decide as kube-scheduler
does (``gpu-dra explain`` and ``gpu-dra status``, ops/): wire-format dicts in, records out, no API access.

* ``devicecel``: Kubernetes' device-selector CEL environment (the ``device`` variable, quantity and semver);
* ``devicefit``: whether a device fits a request apart from the selectors: taints against the request's
  tolerations (the rule itself is ``dra.model.tolerations``), consumable capacity with requestPolicy rounding;
* ``claimrequests``: a ResourceClaim's requests, firstAvailable alternatives and constraints, read and checked;
* ``poolview``: pools at their current generation, their devices, counters and what allocations already use;
* ``occupancy``: who holds which device and what is free or blocked, node by node (``gpu-dra status``).

Built on dra.model (device names, the catalog, the MIG placement rule); never imports dra.node or dra.sim.
"""
