"""The cluster controller: DeviceClasses, slices of vanished nodes, metrics."""
