"""Tests of kube/."""
