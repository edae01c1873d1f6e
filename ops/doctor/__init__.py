"""``gpu-dra doctor``: whether this node can run GPU containers with this driver, one check a line with the fix.

* ``checks``: the checks in order (NVML, the driver root, the CDI hook, a CDI spec, a container, the sharing
  tools), run with the plugin's own node actions (``dra.node``) and changing no GPU setting;
* ``container``: the container check itself, run as ``python -m ops.doctor.container`` in a private mount
  namespace of its own.
"""
