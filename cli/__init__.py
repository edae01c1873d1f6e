"""The ``gpu-dra`` commands, one module each (``main`` dispatches and imports a command only when used):

* the driver's processes: ``kubeletplugin_cmd`` (the node plugin), ``controller_cmd`` (the cluster controller),
  ``webhook_cmd`` (the admission webhook);
* the operator tools (ops/): ``explain_cmd``, ``status_cmd`` (also ``kubectl_gpu``, the kubectl plugin),
  ``convert_cmd``, ``doctor_cmd``;
* node and fleet views: ``inventory_cmd`` (the GPUs discovery finds), ``slices_cmd`` (the ResourceSlices a node
  would publish), ``deviceclasses_cmd`` (this driver's DeviceClasses);
* simulated fleets and the local test bed: ``publish_cmd``, ``simulate_cmd``, ``demo_cmd``.
"""
