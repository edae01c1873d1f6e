"""Tests of dra/node/."""
