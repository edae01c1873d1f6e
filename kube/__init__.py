"""The Kubernetes client layer, used by the driver's processes (kubeletplugin, controller), the operator tools
(ops) and the local test bed:

* ``client``: plain-JSON access to the API (``KubeApi``) over the urllib3 pool of a kubernetes ``ApiClient``, its
  errors, the resource paths and streamed watches, with ``pool`` (bounds on what an answer may cost);
* ``connect``: the ``ApiClient`` a command uses (kubeconfig, in-cluster, default kubeconfig), read by the
  kubernetes package as kubectl reads it, refusing what kubectl refuses (``kubeconfigcheck``), the namespace;
* ``serverversion``: which slice features the API server accepts;
* ``backoff``: exponential back-off per work item;
* ``resourceslices``: the ResourceSlice publisher (desired pools vs. what is stored, minimal writes), with
  ``slicecompare`` (a desired spec against the stored one) and ``metrics`` (its Prometheus metrics);
* ``events``: Warning Events on claims and their pods;
* ``podresources``: the kubelet's PodResources API (which containers hold which claims' devices);
* ``httpserver``: bounded HTTP serving for /healthz, /metrics and the admission webhook, with ``boundedjson``
  (request bodies read with a bound on nesting).
"""
