"""The driver's pure model: what it publishes and the rules it keeps. No I/O, no NVML calls, no Kubernetes client.

* ``gpu``: what discovery learns about a node's GPUs (plain records); ``catalog``: real NVIDIA GPU models;
* ``mig``: the MIG placement rule (which GPU instances can live together);
* ``policy``: the node policy (what to publish for each GPU);
* ``devices``: from the GPUs found and the node policy to DRA devices with shared counters;
* ``slices``: those devices packed into ResourceSlice specs under the API limits, and the specs checked;
* ``tenancy``: the MPS tenancy taints and tolerations; ``tolerations``: Kubernetes toleration matching.

The operator tools' pure parts live elsewhere: the scheduler replica in ``dra.scheduling``, the tools in ``ops``.
"""
