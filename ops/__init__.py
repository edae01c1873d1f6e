"""The operator tools: what ``gpu-dra`` commands tell a person about a cluster or a node, none of it part of the
driver's two processes except the pending-claims pass, which judges claims with ``explain``'s verdict.

* ``explain``: why a claim is (not) allocatable, node by node, as kube-scheduler decides it (``gpu-dra explain``);
* ``status``: who holds which GPU device and what is free (``gpu-dra status``, ``kubectl gpu``);
* ``convert``: from NVIDIA's device plugin, GFD labels and mig-parted configs to this driver, pure (``gpu-dra
  convert``);
* ``doctor``: whether a node can run GPU containers with this driver (``gpu-dra doctor``).

Built on the Kubernetes client (``kube``), the scheduler replica (``dra.scheduling``), the node actions
(``dra.node``) and the driver's model; used by ``cli`` and ``controller.pendingclaims`` only.
"""
