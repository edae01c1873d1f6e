"""Tests of dra/model/."""
