"""A local Kubernetes test bed: a real control plane (etcd, kube-apiserver, kube-scheduler,
kube-controller-manager) and a real node (kubelet, containerd, runc) on this machine, the driver's kubelet plugin
for that node with simulated GPUs, and example pods made runnable there. The tests and ``gpu-dra demo`` use it;
it is not part of the driver that runs in a cluster."""
