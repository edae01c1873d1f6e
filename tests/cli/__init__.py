"""Tests of cli/."""
