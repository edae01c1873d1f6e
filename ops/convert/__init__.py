"""From NVIDIA's device plugin to this driver: pure conversions of what a cluster already has.

* ``deviceplugin``: device plugin config files (``version: v1``) -> a GPU policy per config (slots for
  time-slicing and MPS replicas) and what ``nvidia.com/gpu`` means there;
* ``migparted``: mig-parted configs -> static (or dynamic) MIG rules and the ``nvidia-smi mig`` state they imply;
* ``nodegroups``: both, per node group (the ``nvidia.com/device-plugin.config`` and ``nvidia.com/mig.config``
  labels) -> a node policy and the chart values that deploy it;
* ``gfdselectors``: GPU Feature Discovery labels in nodeSelectors and node affinity -> CEL device selectors;
* ``workloads``: pods and their controllers asking for ``nvidia.com/gpu``, ``nvidia.com/gpu.shared`` or
  ``nvidia.com/mig-<profile>`` -> the same workloads with a ResourceClaimTemplate.

Every input field ends up in ``findings.Findings``: converted (to what), kept as it is, changed in meaning (how),
or not convertible (why: refused, or left out of the output).
"""
