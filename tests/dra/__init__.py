"""Tests of dra/."""
