"""The kubelet transport: the two unix sockets the kubelet talks to, and nothing of how claims are prepared.

- ``nodedriver``: the seam. ``NodeDriver`` is what the transport asks of the driver; ``ClaimRef``,
  ``PrepareResult``, ``UnprepareResult`` and ``PreparedDevice`` are the plain types that cross it.
- ``registration``: the plugin-registration service on ``<registry dir>/<driver>-reg.sock``.
- ``server``: the DRA node service (v1 and v1beta1, one handler) and the health stream on the DRA socket.
- ``health``: the board of device health the stream reports.
- ``unixserver``: a gRPC server on one unix socket: an accepting thread, a thread per connection, a pool for calls.
- ``rpc``: gRPC on HTTP/2: method tables from the ``*_pb2`` descriptors, message framing, status trailers.
- ``http2``: the server side of an HTTP/2 connection (RFC 9113) on a blocking socket; ``hpack`` and ``huffman``
  its header compression (RFC 7541).
- ``client``: one unary gRPC call over a unix socket on the same code (the plugin's probe of its own socket).
- ``sockets``: where the sockets live, and how they are created and removed.
- ``endpoints``: both sockets served at process start, before the driver exists.

Besides the generated ``*_pb2`` messages (protobuf) it needs only ``api.k8snames``; it does not use grpcio (whose
``*_pb2_grpc`` modules it never imports). It imports nothing else of kubeletplugin
(the import-linter contract ``kubelet-transport`` in pyproject.toml): the rest hands it a ``NodeDriver``.
"""
