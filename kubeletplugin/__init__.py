"""The node plugin (``gpu-dra kubelet-plugin``) in three parts.

The kubelet transport, ``transport/``: registration and DRA sockets, health stream; it knows the rest only
through ``transport.nodedriver.NodeDriver``.

The claim work, behind that seam:

- ``driver``: prepare and unprepare, serialized and checkpointed (the ``NodeDriver``).
- ``claims``: reading the claim from the API server and its allocation for this node.
- ``plan``: from the allocation to what each device must get.
- ``deviceactions``: MIG devices, time-slicing and MPS set up for a claim, and undone.
- ``claimstatus``: this driver's entries in the claim's ``status.devices``.
- ``recovery``: the node brought in line with the checkpoint at start.
- ``keyedlocks``: locks per claim UID and GPU.

The process around both:

- ``plugin``: discovery, ResourceSlice publishing, health, and the sockets, put together and run.
- ``options``: what the command is told.
- ``apiserver``: waiting for the API server at start.
- ``metrics``, ``claimmetrics``: Prometheus metrics, per-claim GPU use down to the container.
- ``logs``: structured logs.
"""
