"""``gpu-dra status`` and ``kubectl gpu``: who holds which GPU device and what is still free, node by node.

* ``reads``: what it reads from the API server (this driver's ResourceSlices, every ResourceClaim, and Pods
  only where an allocated claim is reserved for none), read-only.

The computation over those objects is pure and shared with ``explain``'s view of pools and counters:
``dra.scheduling.occupancy``. The table is drawn by ``cli.status_cmd``.
"""
