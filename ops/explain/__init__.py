"""``gpu-dra explain``: why a claim is (not) allocatable, node by node, decided as kube-scheduler decides it.

* ``verdict``: the decision, pure: cluster state as wire-format dicts in, an ``Explanation`` per claim out,
  over the scheduler replica of ``dra.scheduling``;
* ``reads``: the API reads it needs (DeviceClasses, ResourceSlices, ResourceClaims, DeviceTaintRules, Nodes)
  and the claims to explain, found from a claim, a ResourceClaimTemplate or a pod.

The controller's pending-claims pass (``controller.pendingclaims``) judges pending claims with the same two.
"""
