"""Tests of controller/."""
