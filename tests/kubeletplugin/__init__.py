"""Tests of kubeletplugin/."""
