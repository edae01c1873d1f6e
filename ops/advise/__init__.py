"""``gpu-dra advise``: from what each workload used to what it should claim.

Pure (no API server, no Prometheus; the ``core-offline`` import contract holds them to it):

* ``usage``: the per-claim series' figures over a window (or one scrape), the plugins' gaps;
* ``offers``: what the cluster publishes per GPU model (whole GPUs, MIG profiles, MPS slots, memory shares);
* ``sizing``: the candidates of a model and the smallest that holds a need;
* ``owners``: a pod's workload and the template a claim came from, by the objects or by their names;
* ``groups`` and ``advice``: the series per workload, template and request, and the advice with its reason;
* ``templates``: the ResourceClaimTemplate (or claim) asking for the advised device.

Reads: ``prometheus`` (its HTTP API over urllib3) and ``history`` (the window's queries); ``reads`` (the API
server); ``report`` puts them together for ``cli.advise_cmd``.
"""
