"""Tests of testbed/."""
