"""Tests of the Helm chart in deploy/."""
