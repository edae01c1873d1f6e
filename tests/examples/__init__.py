"""Tests of the examples/."""
