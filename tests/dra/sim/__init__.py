"""Tests of dra/sim/."""
