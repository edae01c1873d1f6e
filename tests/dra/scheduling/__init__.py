"""Tests of dra/scheduling/."""
