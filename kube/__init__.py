"""Everything that talks to the Kubernetes API server, shared by both processes: the client, server
version detection, back-off, the ResourceSlice publisher, and the health/metrics endpoint."""
