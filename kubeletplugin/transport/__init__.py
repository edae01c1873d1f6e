"""The kubelet transport: the two unix sockets the kubelet talks to, and nothing of how claims are prepared.

- ``nodedriver``: the seam. ``NodeDriver`` is what the transport asks of the driver; ``ClaimRef``,
  ``PrepareResult``, ``UnprepareResult`` and ``PreparedDevice`` are the plain types that cross it.
- ``registration``: the plugin-registration service on ``<registry dir>/<driver>-reg.sock``, and the probe of it.
- ``server``: the DRA node service (v1 and v1beta1, one handler) and the health stream on the DRA socket.
- ``health``: the board of device health the stream reports.
- ``grpcserver``: a grpcio server on one unix socket, with its limits and a bounded, pre-started pool.
- ``sockets``: where the sockets live, and how they are created and removed.
- ``endpoints``: both sockets served at process start, before the driver exists.

gRPC is grpcio's, with the generated ``*_pb2_grpc`` stubs. Besides those it needs only ``api.k8snames``; it imports
nothing else of kubeletplugin (the import-linter contract ``kubelet-transport`` in pyproject.toml): the rest hands
it a ``NodeDriver``.
"""
