"""The Kubernetes client layer, used by the driver's processes (kubeletplugin, controller), the operator tools
(ops) and the local test bed:

* ``client``: plain-JSON access to the API (``KubeApi``), its errors and the resource paths;
* ``httpclient``: HTTP/1.1 to the API server (one kept-alive connection per thread, streamed watches);
* ``kubeconfig``: a ``ClusterAccess`` (server, TLS, credentials) from a kubeconfig or the service account;
* ``connect``: which of those a command uses (kubeconfig, in-cluster, default kubeconfig), the namespace;
* ``serverversion``: which slice features the API server accepts;
* ``backoff``: exponential back-off per work item;
* ``resourceslices``: the ResourceSlice publisher (desired pools vs. what is stored, minimal writes), with
  ``slicecompare`` (a desired spec against the stored one) and ``metrics`` (its Prometheus metrics);
* ``events``: Warning Events on claims and their pods;
* ``podresources``: the kubelet's PodResources API (which containers hold which claims' devices);
* ``httpserver``: bounded HTTP serving for /healthz, /metrics and the admission webhook, with ``boundedjson``
  (request bodies read with a bound on nesting).
"""
