"""The Kubernetes client layer, used by the driver's processes (kubeletplugin, controller), the operator tools
(ops) and the local test bed:

* ``client``: plain-JSON access to the API (``KubeApi``), its errors and the resource paths;
* ``connect``: an ApiClient from a kubeconfig, the in-cluster service account or the default kubeconfig;
* ``serverversion``: which slice features the API server accepts;
* ``backoff``: exponential back-off per work item;
* ``resourceslices``: the ResourceSlice publisher (desired pools vs. what is stored, minimal writes), with
  ``slicecompare`` (a desired spec against the stored one) and ``metrics`` (its Prometheus metrics);
* ``events``: Warning Events on claims and their pods;
* ``podresources``: the kubelet's PodResources API (which containers hold which claims' devices);
* ``httpserver``: bounded HTTP serving for /healthz, /metrics and the admission webhook, with ``boundedjson``
  (request bodies read with a bound on nesting).
"""
